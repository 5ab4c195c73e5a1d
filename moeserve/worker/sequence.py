"""A request's token-level state inside the engine core (text lives in the output processor)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum, auto

import torch

from moeserve.layers.sampler import request_key
from moeserve.sampling_params import SamplingParams

# An output token sampled by the step in flight and not yet read back to the host. On the host it
# is written as -(row + 1), `row` being its row in that step's sampled tokens; the device fills it in
# (resolve_pending), so the next step can be launched before the previous one is read back.
PENDING = -1


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_arrival = itertools.count()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 lora_name: str | None = None, seed: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.lora_name = lora_name
        # keys this request's sampling noise (sampler.row_key), hashed from its seed once
        self.noise_key = request_key(params.seed if params.seed is not None else seed)
        self.lora_slot = -1  # device slot while scheduled with an adapter
        self.arrival = next(_arrival)
        self.output_token_ids: list[int] = []  # the last num_pending of them are PENDING
        self.num_pending = 0
        self.pending_row = -1  # row of the newest PENDING token in the last launched step
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (or being written by the step in flight)
        self.block_table: list[int] = []
        # prefix cache (kv_cache.py): names of its full prompt blocks, set once its adapter version is bound;
        # how many leading blocks of block_table the cache knows; prompt tokens found cached when it started
        self.block_hashes: list[bytes] | None = None
        self.num_hashed_blocks = 0
        self.num_cached_tokens: int | None = None
        self.reported_cached_tokens = False  # num_cached_tokens went out with its first output
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        # prompt tokens scored so far (the first has no logprob); None when not asked for
        self.num_prompt_logprobs: int | None = 1 if params.prompt_logprobs is not None else None
        self.num_preemptions = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_sampled(self) -> int:
        """Output tokens sampled so far, including those still in flight."""
        return len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.num_prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens

    def tokens_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output (a PENDING one as -(row + 1)), without copying the
        whole sequence (decode hot path)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        out = self.output_token_ids[max(start - n, 0):end - n]
        if self.num_pending and end == self.num_tokens:
            out[-1] = -(self.pending_row + 1)
        return self.prompt_token_ids[start:] + out if start < n else out

    def token_at(self, position: int) -> int:
        """Token id at `position` of prompt + output, as tokens_slice(position, position + 1) gives it (a
        decode row's one input token)."""
        n = len(self.prompt_token_ids)
        if position < n:
            return self.prompt_token_ids[position]
        if self.num_pending and position == self.num_tokens - 1:
            return -(self.pending_row + 1)
        return self.output_token_ids[position - n]

    def fill_pending(self, token: int) -> int:
        """Its step was read back: the oldest PENDING output token becomes `token`; returns that token's index
        in output_token_ids."""
        idx = len(self.output_token_ids) - self.num_pending
        self.output_token_ids[idx] = token
        self.num_pending -= 1
        return idx

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED


def resolve_pending(input_ids: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """In place, on the device: ids written as -(row + 1) take the previous step's sampled token `row`."""
    rows = (-input_ids - 1).clamp(0, prev_tokens.shape[0] - 1)
    input_ids.copy_(torch.where(input_ids >= 0, input_ids, prev_tokens[rows]))


@dataclass
class ScheduledBatch:
    """One step's work, from the scheduler to the model runner."""
    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_decode: bool  # one row per sequence, each computing its next token (graph-eligible)


def mark_launched(sb: ScheduledBatch, sampling_seqs: list[Sequence]) -> None:
    """A step was launched and its results are not read yet: its tokens count as computed (their K/V are being
    written), and each sequence it samples for gets a PENDING output token, row `row` of the step's sampled tokens,
    which the next step takes as its input on the device (resolve_pending)."""
    for seq, n in zip(sb.seqs, sb.num_new_tokens):
        seq.num_computed_tokens += n
    for row, seq in enumerate(sampling_seqs):
        seq.output_token_ids.append(PENDING)
        seq.num_pending += 1
        seq.pending_row = row
