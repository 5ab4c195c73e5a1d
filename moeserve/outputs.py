"""What the engine core reports per step (CoreOutput, token level, crosses the process boundary in a StepOutputs
message, moeserve/messages.py) and what callers receive (RequestOutput, with text)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # top-N (id, logprob), best first


@dataclass
class CoreOutput:
    """One request's news from one engine step."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # aligned with new_token_ids, when asked for
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None  # prompt tokens scored this step
    finish_reason: str | None = None  # "stop" (eos / stop id) | "length" | "abort" | "error"
    error: str | None = None
    num_cached_tokens: int | None = None  # on a request's first output: prompt tokens found in the prefix cache


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    prompt_logprobs: list[TokenLogprobs | None] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    lora_name: str | None = None
    error: str | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (None until it started)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
