"""What the engine core reports per step (CoreOutput, token level, crosses the process boundary)
and what callers receive (RequestOutput, with text)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # top-N (id, logprob), best first

    def to_wire(self) -> list:
        return [self.token_id, self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_wire(cls, w: list | None) -> "TokenLogprobs | None":
        return None if w is None else cls(w[0], w[1], [tuple(t) for t in w[2]])


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

    def to_wire(self) -> list:
        return [self.request_id, self.new_token_ids,
                None if self.new_logprobs is None else [lp.to_wire() for lp in self.new_logprobs],
                None if self.new_prompt_logprobs is None else [
                    None if lp is None else lp.to_wire() for lp in self.new_prompt_logprobs],
                self.finish_reason, self.error, self.num_cached_tokens]

    @classmethod
    def from_wire(cls, w: list) -> "CoreOutput":
        rid, ids, lps, plps, finish, error, cached = w
        return cls(rid, ids, None if lps is None else [TokenLogprobs.from_wire(x) for x in lps],
                   None if plps is None else [TokenLogprobs.from_wire(x) for x in plps], finish, error, cached)


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
