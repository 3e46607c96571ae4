"""The API's /openapi.json beyond what FastAPI infers: the generate endpoints read their raw body
themselves (agent.api.openai parses it), so their request schema (the pydantic body models), their
JSON-or-event-stream answer and their error answers are declared here, and the body models' nested
schemas are added to the document's components."""
from __future__ import annotations

from typing import Sequence

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ERROR = {"description": "An OpenAI-style error", "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
# the generate endpoints answer JSON, or server-sent events when the body asks for "stream": true
_GENERATE_RESPONSES = {
    "200": {"description": "The completion (JSON), or its chunks as server-sent events",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {  # schemathesis checks each event as {data, event}
                            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}}},
    "4XX": _ERROR, "5XX": _ERROR}


def body_schema(model: type[BaseModel]) -> dict[str, object]:
    """A generate endpoint's `openapi_extra`: its request body's JSON schema and its answers (the
    nested schemas the body refers to are added by `add_body_components`)."""
    schema = model.model_json_schema(ref_template=_REF)
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": _GENERATE_RESPONSES}


def add_body_components(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Make the app's /openapi.json carry the nested schemas of the body models in its components."""
    defs: dict[str, object] = {}
    for model in models:
        defs.update(model.model_json_schema(ref_template=_REF).get("$defs", {}))
    base_openapi = app.openapi

    def openapi() -> dict[str, object]:
        doc = base_openapi()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs)  # type: ignore[union-attr]
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
