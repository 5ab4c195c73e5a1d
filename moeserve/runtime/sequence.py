"""A request's state inside the engine, and what the engine hands back."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from moeserve.sampling_params import SamplingParams


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # top-N (id, logprob), best first


_arrival = itertools.count()


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, lora_name: str | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.lora_name = lora_name
        self.lora_slot = -1  # device slot while scheduled with an adapter
        self.arrival = next(_arrival)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.generator: torch.Generator | None = None  # per-request seeded RNG (made on the sampling device)
        # incremental detokenization state
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stream_offset = 0  # chars of text already handed out (held back near stop strings)
        self.num_preemptions = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without copying the whole sequence (decode hot path)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
