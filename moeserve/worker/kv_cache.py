"""Paged KV cache: the block allocator with its prefix cache (host) and the cache tensors (device).

Block 0 is reserved as the dummy block: padded rows of a captured batch write their K/V
there, so they can never touch a live sequence's cache.

Prefix caching: a full block of prompt tokens is named by a hash chain over (parent hash, the block's
token ids), seeded by the adapter version the sequence runs with (`prefix_hashes`), so a block computed
under one adapter, or under an older version of the same name, is never found for another (docs/architecture.md, invariant 9).
Blocks are refcounted; a hashed block nobody uses stays cached ("evictable") until the allocator needs
room, least recently used first. A block is only ever shared read-only: a sequence that finds cached
blocks starts computing at the first uncached one, which it owns.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from typing import Hashable, Sequence as Seq

import torch

from moeserve.model_spec import ModelSpec

BlockHash = bytes


def prefix_hashes(token_ids: Seq[int], block_size: int, adapter_key: Hashable = None) -> list[BlockHash]:
    """Hash chain over the full blocks of token_ids: block i's hash covers blocks 0..i and the adapter key
    (None for the base model; (name, version) for an adapter). SHA-256, not Python's hash: a client who
    could craft a collision would read another request's KV."""
    parent = hashlib.sha256(repr(("moeserve-prefix", adapter_key)).encode()).digest()
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}I", *block)).digest()
        out.append(parent)
    return out


class BlockAllocator:
    """Refcounted KV blocks. A block is in exactly one of: in use (refcount > 0), `free` (no hash), or
    `evictable` (hashed, refcount 0, kept for a later prefix hit, LRU order). `num_free` counts both of the
    latter: an evictable block is handed out (and forgotten) when no plain free block is left."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"KV cache too small: {num_blocks} blocks (need at least 2)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free: deque[int] = deque(range(1, num_blocks))  # 0 = dummy block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.refcount = [0] * num_blocks
        self.block_of: dict[BlockHash, int] = {}
        self.hash_of: dict[int, BlockHash] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        """Blocks that a prefix lookup can find (in use or evictable)."""
        return len(self.block_of)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def match(self, hashes: Seq[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the start (nothing changes)."""
        blocks = []
        for h in hashes:
            b = self.block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def grow(self, block_table: list[int], num_tokens: int, cached: Seq[int] = ()) -> bool:
        """Extend block_table with the `cached` blocks (from `match`, shared) and then fresh ones, to hold
        num_tokens; False (and no change) if blocks are short."""
        need = max(0, -(-num_tokens // self.block_size) - len(block_table) - len(cached))
        reviving = sum(self.refcount[b] == 0 for b in cached)  # evictable blocks taken back into use
        if need + reviving > self.num_free:
            return False
        for b in cached:
            if self.refcount[b] == 0:
                del self.evictable[b]
            self.refcount[b] += 1
        block_table.extend(cached)
        for _ in range(need):
            block_table.append(self._take())
        return True

    def _take(self) -> int:
        if self.free:
            b = self.free.popleft()
        else:  # the least recently used cached block: forget its hash
            b, _ = self.evictable.popitem(last=False)
            del self.block_of[self.hash_of.pop(b)]
            self.num_evictions += 1
        self.refcount[b] = 1
        return b

    def register(self, block: int, h: BlockHash) -> None:
        """block (in use, full, its K/V written or being written by the step in flight) holds the prefix `h`.
        If another block already holds it (two requests computed it side by side), that one stays the cached
        copy and this block stays private."""
        if self.enable_prefix_caching and h not in self.block_of and block not in self.hash_of:
            self.block_of[h] = block
            self.hash_of[block] = h

    def release(self, block_table: list[int]) -> None:
        # last block first: a chain's tail is evicted before its head, which more prefixes share
        for b in reversed(block_table):
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = None
                else:
                    self.free.append(b)
        block_table.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after a failed step, whose blocks may hold garbage); blocks in
        use stay with their sequences."""
        self.free.extend(self.evictable)
        self.evictable.clear()
        self.block_of.clear()
        self.hash_of.clear()


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def allocate_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (2, spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    return [(cache[0, i], cache[1, i]) for i in range(spec.num_layers)]
