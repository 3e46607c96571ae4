"""What the HTTP handlers share: `ApiState` (the engine loop, the tokenizer, the served model's name,
the limits, the metrics and the guard's settings), built once by agent.service."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from agent.api.guard import BODY_TIMEOUT_S
from agent.api.openai import Limits, PromptTokenizer
from agent.engine.loop import EngineLoop
from agent.metrics import ServiceMetrics


class ServiceTokenizer(PromptTokenizer, Protocol):
    """Parsing's needs and token texts (logprobs)."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class ApiState:
    engine: EngineLoop
    tokenizer: ServiceTokenizer
    model_name: str
    limits: Limits
    metrics: ServiceMetrics
    token: str | None = None
    max_body_bytes: int = 1 << 20
    chat_template: str | None = None
    eos_token: str = ""
    ready: Callable[[], tuple[bool, str]] = field(default=lambda: (True, "ready"))
    max_in_flight: int = 0  # HTTP requests answered at once; 0 = no limit
    host_names: tuple[str, ...] = ()  # Host header names accepted; () = any
    body_timeout_s: float = BODY_TIMEOUT_S  # from the headers to the body's last byte (then 408)
