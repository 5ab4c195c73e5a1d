"""ForwardBatch: everything a layer may read during one forward, passed explicitly.

Layers never read module-global state. Whether LoRA work is recorded is decided by
`batch.lora is None` — a host-side fact — so the no-LoRA graph variant is literally the
forward called with `lora=None`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the Triton kernels are imported only when a backend selects them
    from moeserve.kernels.lora_dense import SlotGroups


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 flat KV slot per token (padded rows -> dummy block 0)
    block_tables: torch.Tensor  # [S, max_blocks] int32
    # decode (every sequence contributes exactly one token): graph-capturable
    context_lens: torch.Tensor  # [S] int32, tokens in cache incl. this step's (0 for padded rows);
    # for prefill the sequence length after this chunk
    is_decode: bool
    # prefill / mixed (eager only): packed variable-length queries
    query_start_loc: torch.Tensor | None = None  # [S+1] int32
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    max_query_len: int = 1


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [T] int32 adapter slot per token; -1 = no adapter
    slot_ranks: torch.Tensor  # [max_loras] int32 (the pool's static buffer)
    # host-known slots present in an eager batch (lets the torch reference skip absent slots);
    # None in captured graphs, whose rows change between replays
    active_slots: tuple[int, ...] | None = None
    # the rows grouped by slot for the dense LoRA kernels: made by the model at the top of each forward (inside
    # the graph it captures), read by every projection of that forward; None on the torch backend
    dense_groups: "SlotGroups | None" = None
    # CUDA, triton LoRA backend: the stream a projection computed by cuBLAS (or the FP8 GEMM) runs its LoRA shrink on,
    # beside its base product (layers/linear.py); the model's own, None elsewhere
    side_stream: "torch.cuda.Stream | None" = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    lora: LoRABatch | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
