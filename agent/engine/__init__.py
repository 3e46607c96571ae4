"""The engine: one generation path from a request to its tokens, shared by the service and the CLI.

`types` (torch-free vocabulary: SamplingParams, requests, the step contract, usage, phase events),
`scheduler` (which rows run next), `executor` (the model and sampling, torch), `output` (text deltas,
stop strings, usage, energy), `core` (`EngineCore.step()`: schedule -> phase event -> execute ->
update) and `loop` (the service's thread and inbox around a core). Nothing is imported here, so that
`import agent.engine.types` stays light.
"""
