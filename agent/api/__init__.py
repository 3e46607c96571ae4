"""The HTTP API: `routes` (the FastAPI app and its handlers), `guard` (bearer token, body limit,
status counts) and `openai` (the OpenAI wire format: parsing into the engine's types, responses).
Nothing is imported here, so that `import agent.api.openai` stays free of the web stack and torch.
"""
