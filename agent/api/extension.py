"""This service's extension of the OpenAI request body: the `orin_agent` object, per request

    {"orin_agent": {"max_disagreement": 0.01}}   early exits, calibrated to this disagreement rate
    {"orin_agent": {"speculate": 4}}             lossless self-speculation, 4 draft tokens ("auto": the
                                                 server's choice from the exit record)

and the server's `ExitPolicy` (whether the exit heads are loaded, its defaults). A request that gives
either field decides its own mode; one that gives neither gets the server's default (`orin-agent serve
--max-disagreement X` or `--speculate K|auto`), except that a request asking for logprobs then runs at
full depth: exits and speculation return no logprobs, and full depth meets every disagreement target
(speculation's output is full depth's anyway). Asking for both a mode and logprobs is refused by the one
rule in `SamplingParams`. Ranges are in the schema (/openapi.json) and checked by pydantic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from agent.engine.types import MAX_SPECULATE, InvalidRequest


class OrinAgentOptions(BaseModel):
    """The `orin_agent` field of a completions or chat body (this service's own; OpenAI's clients pass
    it through `extra_body`)."""

    model_config = ConfigDict(extra="forbid")

    max_disagreement: Optional[Annotated[StrictFloat, Field(ge=0, lt=1)]] = \
        Field(None, description="Early exits: the largest rate of tokens allowed to differ from the full "
                                "model's (calibrated thresholds; needs a server started with exit heads).")
    speculate: Optional[Union[Annotated[StrictInt, Field(ge=0, le=MAX_SPECULATE)], Literal["auto"]]] = \
        Field(None, description="Lossless self-speculative decoding: draft tokens per round, or 'auto'.")


@dataclass(frozen=True)
class ExitPolicy:
    """What the server offers: exit heads loaded or not, and the defaults of requests that ask nothing."""

    available: bool = False
    auto_speculate: int = 0  # what "auto" resolves to for this model (0: plain decoding is fastest)
    default_speculate: int = 0
    default_max_disagreement: float | None = None
    speculation: bool = True  # False where the deep layers run on an edge server (it returns no logits)


def exit_mode(options: OrinAgentOptions | None, policy: ExitPolicy, wants_logprobs: bool) -> tuple[int, float | None]:
    """(speculate, max_disagreement) for a request; raises InvalidRequest when the request asks for a
    mode the server cannot run."""
    asked = options is not None and (options.speculate is not None or options.max_disagreement is not None)
    if not asked:
        if wants_logprobs:
            return 0, None
        return policy.default_speculate, policy.default_max_disagreement
    assert options is not None
    if not policy.available:
        field = "speculate" if options.speculate is not None else "max_disagreement"
        raise InvalidRequest(f"orin_agent.{field}: this server was started without exit heads; start it with "
                             "`orin-agent serve --exits` (or --max-disagreement / --speculate)", f"orin_agent.{field}",
                             "unsupported_parameter")
    k = options.speculate
    speculate = policy.auto_speculate if k == "auto" else int(k or 0)
    if speculate and not policy.speculation:
        raise InvalidRequest("orin_agent.speculate: this server runs the deep layers on an edge server, which "
                             "returns no logits to verify drafts with; ask for max_disagreement instead",
                             "orin_agent.speculate", "unsupported_parameter")
    md = None if options.max_disagreement is None else float(options.max_disagreement)
    return speculate, md
