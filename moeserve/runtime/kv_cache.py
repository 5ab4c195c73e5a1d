"""Paged KV cache: the block allocator (host) and the cache tensors (device).

Block 0 is reserved as the dummy block: padded rows of a captured batch write their K/V
there, so they can never touch a live sequence's cache.
"""
from __future__ import annotations

from collections import deque

import torch

from moeserve.models.spec import ModelSpec


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"KV cache too small: {num_blocks} blocks (need at least 2)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(1, num_blocks))  # 0 = dummy block

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend block_table to hold num_tokens; False (and no change) if blocks are short."""
        need = self.blocks_needed(block_table, num_tokens)
        if need > len(self.free):
            return False
        block_table.extend(self.free.popleft() for _ in range(need))
        return True

    def release(self, block_table: list[int]) -> None:
        self.free.extend(block_table)
        block_table.clear()


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def allocate_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (2, spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    return [(cache[0, i], cache[1, i]) for i in range(spec.num_layers)]
