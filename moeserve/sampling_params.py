"""Per-request sampling parameters (names follow the OpenAI / vLLM conventions)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.errors import RequestError

SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: as many as the context has room for
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 / 0 = off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N >= 0 = chosen token's logprob plus top-N
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep a matched stop string, and a stop token's text (vLLM's flag)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS  # dividing logits by a tinier temperature overflows

    def validate(self) -> None:
        """Raise RequestError (a ValueError) naming the offending field; the engine rejects only this request."""
        def bad(param, msg):
            raise RequestError(msg, param=param)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens <= 0):
            bad("max_tokens", "max_tokens must be a positive integer (or None: fill the context), got "
                f"{self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature <= 100.0) \
                or self.temperature != self.temperature:
            bad("temperature", f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not -1 <= self.top_k < 2**31:
            bad("top_k", f"top_k must be -1 (off) or an integer in [0, 2^31), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**64):
            bad("seed", f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 20):
                bad(name, f"{name} must be an integer in [0, 20], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"{name} must be true or false, got {getattr(self, name)!r}")
