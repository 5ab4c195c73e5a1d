"""Group (token, k) pairs by expert for grouped MoE GEMMs.

A "pair" is one routed copy of a token: pair p = t * top_k + k. The grouped GEMM kernels
work on blocks of `block_m` rows that all belong to one expert (a group), so the pairs of
each group are laid out contiguously and each group is padded to a multiple of `block_m`:

    sorted_ids   [max_blocks * block_m] int32  pair index of each row; padding rows = num_pairs
    block_groups [max_blocks]           int32  expert of each block; -1 for blocks past the end
    num_padded   [1]                    int32  rows in use

Everything is sized from static maxima (num_pairs, number of groups, block_m), so the
result can be computed inside a CUDA graph with no host sync. The Triton kernel places the
pairs of a group in any order (atomics); the torch reference keeps pair order. Nothing
downstream depends on the order within a group: every row is computed independently.

Pairs with an expert id outside [0, num_experts) belong to no group. The expert-LoRA
kernels ride on these blocks (moe_lora); a (slot, expert) alignment for separate LoRA
kernels measured slower or equal on the H200 and was removed after cfefc5c.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch


class AlignedBlocks(NamedTuple):
    sorted_ids: torch.Tensor
    block_groups: torch.Tensor
    num_padded: torch.Tensor


def align_max_blocks(num_pairs: int, num_groups: int, block_m: int) -> int:
    """Most blocks any routing can need: each non-empty group wastes < block_m rows."""
    return (num_pairs + min(num_pairs, num_groups) * (block_m - 1)) // block_m


@triton.jit
def _pair_groups(ids_ptr, offs, num_pairs, num_groups):
    """Expert of each pair in `offs`; num_groups for pairs that belong to none."""
    in_range = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (expert >= 0) & (expert < num_groups)
    return tl.where(valid, expert, num_groups)


@triton.jit
def _chunk_histogram(ids_ptr, chunk, num_pairs, num_groups, CHUNK: tl.constexpr, NUM_BINS: tl.constexpr):
    groups = _pair_groups(ids_ptr, chunk * CHUNK + tl.arange(0, CHUNK), num_pairs, num_groups)
    return tl.histogram(groups, NUM_BINS)


@triton.jit(do_not_specialize=["num_pairs"])  # sizes that vary by step: one compile
def _align_count_kernel(ids_ptr, hist_ptr, num_pairs, num_groups,
                        CHUNK: tl.constexpr, NUM_BINS: tl.constexpr, USE_PDL: tl.constexpr):
    """hist[chunk, g] = pairs of group g in the chunk (one program per chunk of CHUNK pairs)."""
    pdl_launch.enter(USE_PDL)
    chunk = tl.program_id(0)
    counts = _chunk_histogram(ids_ptr, chunk, num_pairs, num_groups, CHUNK, NUM_BINS)
    tl.store(hist_ptr + chunk * NUM_BINS + tl.arange(0, NUM_BINS), counts)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])  # sizes that vary by step: one compile
def _align_place_kernel(
    ids_ptr, hist_ptr, sorted_ids_ptr, block_groups_ptr, num_padded_ptr, cursor_ptr,
    num_pairs, num_groups, num_chunks, max_blocks,
    BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, LOG2_BINS: tl.constexpr, CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr, ALL_P2: tl.constexpr = 0,
):
    """Programs [0, num_chunks) place their chunk's pairs; the rest fill padding rows and block groups
    of BLOCK_B blocks each. Both write disjoint rows of sorted_ids, so no ordering between them is needed.
    CHUNKS_P2 == 1: one chunk, whose histogram every program counts itself (no count kernel before).
    ALL_P2 > 0 (a power of two >= num_pairs): every program counts all pairs, and those before its chunk, itself
    (no count kernel before; a few KB of ids each, from L2).
    Scratch (`cursor_ptr`): a row of 3 * NUM_BINS int32 per program, its own."""
    pdl_launch.enter(USE_PDL)
    pid = tl.program_id(0)
    bins = tl.arange(0, NUM_BINS)
    # 1. every program: rows per group, padded to BLOCK_M; group g owns rows [starts[g], starts[g] + padded[g])
    if CHUNKS_P2 == 1:
        counts = _chunk_histogram(ids_ptr, 0, num_pairs, num_groups, CHUNK, NUM_BINS)
        before = tl.zeros([NUM_BINS], dtype=tl.int32)
    elif ALL_P2 > 0:
        every = tl.arange(0, ALL_P2)
        all_groups = _pair_groups(ids_ptr, every, num_pairs, num_groups)
        counts = tl.histogram(all_groups, NUM_BINS)
        # pairs of later chunks counted in the junk bin (num_groups), which is no group
        before = tl.histogram(tl.where(every < pid * CHUNK, all_groups, num_groups), NUM_BINS)
    else:
        chunks = tl.arange(0, CHUNKS_P2)
        hist = tl.load(hist_ptr + chunks[:, None] * NUM_BINS + bins[None, :],
                       mask=(chunks < num_chunks)[:, None], other=0)
        counts = tl.sum(hist, 0)
        before = tl.sum(tl.where((chunks < pid)[:, None], hist, 0), 0)  # this chunk's pairs come after these
    counts = tl.where(bins < num_groups, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    if pid < num_chunks:
        # 2. each pair of the chunk claims the next row of its group past the earlier chunks' pairs. The order
        #    inside a chunk's share of a group is not fixed (atomics): rows are independent downstream.
        cursor = cursor_ptr + pid * 3 * NUM_BINS
        tl.store(cursor + bins, starts + before)
        tl.debug_barrier()
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        groups = _pair_groups(ids_ptr, offs, num_pairs, num_groups)
        valid = groups < num_groups
        row = tl.atomic_add(cursor + groups, 1, mask=valid)
        tl.store(sorted_ids_ptr + row, offs, mask=valid)
    else:
        # 3. blocks [b0, b0 + BLOCK_B): group = groups ending at or before the block's first row (a binary search
        #    in this program's scratch row of group ends: the last bin is never a real group, so it ends at
        #    `total`); rows past the group's pairs, and every row of a block past the end, hold the sentinel
        q = pid - num_chunks
        if q == 0:
            tl.store(num_padded_ptr, total)
        row_ends = cursor_ptr + pid * 3 * NUM_BINS
        tl.store(row_ends + bins, ends)
        tl.store(row_ends + NUM_BINS + bins, starts)
        tl.store(row_ends + 2 * NUM_BINS + bins, counts)
        tl.debug_barrier()
        blocks = q * BLOCK_B + tl.arange(0, BLOCK_B)
        first_row = blocks * BLOCK_M
        group = tl.zeros([BLOCK_B], dtype=tl.int32)
        for i in tl.static_range(LOG2_BINS):
            step = NUM_BINS >> (i + 1)
            end = tl.load(row_ends + group + step - 1)
            group = tl.where(end <= first_row, group + step, group)
        in_use = first_row < total
        tl.store(block_groups_ptr + blocks, tl.where(in_use, group, -1), mask=blocks < max_blocks)
        g = tl.minimum(group, NUM_BINS - 1)
        g_start = tl.load(row_ends + NUM_BINS + g)
        g_count = tl.load(row_ends + 2 * NUM_BINS + g)
        rows = first_row[:, None] + tl.arange(0, BLOCK_M)[None, :]
        pad = (~in_use[:, None]) | (rows - g_start[:, None] >= g_count[:, None])
        tl.store(sorted_ids_ptr + rows, tl.zeros([BLOCK_B, BLOCK_M], dtype=tl.int32) + num_pairs,
                 mask=pad & (blocks < max_blocks)[:, None])


# Pairs per placing program past one chunk, and the pair counts at which every program counts the histogram itself
# (one launch) rather than a count kernel first (H200, 128 experts, top-8, µs per call, benchmarks/session24/
# align_sweep.py): T = 64 (512 pairs) 3.3 against 4.4 in one program; T = 128 3.7 against 8.3 in one program of
# 1,024 pairs, 4.3 with the count kernel; T = 256 / 512: 128-pair chunks with the count kernel 4.6-5.3 against 10.0
# for 1,024-pair chunks (the self-count's histogram of 2,048+ pairs per program costs more than the launch).
ALIGN_CHUNK = 128
ONE_CHUNK_MAX_PAIRS = 128  # T = 16: one program 2.6, self-counting 64-pair chunks 2.8
SELF_COUNT_MAX_PAIRS = 1024


def align_chunk(num_pairs: int, chunk: int | None = None) -> int:
    """Pairs per placing program: `chunk` (a power of two), or by size: one program up to ONE_CHUNK_MAX_PAIRS,
    else ALIGN_CHUNK, or more where that would make over 64 programs (their histograms are summed in registers)."""
    if chunk is not None:
        return chunk
    if num_pairs <= ONE_CHUNK_MAX_PAIRS:
        return max(16, triton.next_power_of_2(num_pairs))
    return max(ALIGN_CHUNK, triton.next_power_of_2(triton.cdiv(num_pairs, 64)))


def align_self_counts(num_pairs: int, self_count: bool | None = None) -> bool:
    """Whether the placing programs count the histogram themselves (`self_count`, or by size)."""
    return num_pairs <= SELF_COUNT_MAX_PAIRS if self_count is None else self_count


def align_constants(num_pairs: int, chunk: int | None = None,
                    self_count: bool | None = None) -> tuple[int, int, int]:
    """(pairs per program, chunk count rounded up to a power of two, pairs rounded up to one where every program
    counts them, else 0): the compile-time constants the pair count decides (the start-up warm-up must reach each
    combination real steps take)."""
    chunk = min(align_chunk(num_pairs, chunk), max(16, triton.next_power_of_2(num_pairs)))
    chunks_p2 = triton.next_power_of_2(triton.cdiv(num_pairs, chunk))
    all_p2 = triton.next_power_of_2(num_pairs) if chunks_p2 > 1 and align_self_counts(num_pairs, self_count) else 0
    return chunk, chunks_p2, all_p2


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    chunk: int | None = None,
    pdl: bool = False,
    self_count: bool | None = None,
) -> AlignedBlocks:
    """Align pairs of `topk_ids [T, K]` into expert groups, no host sync: one Triton launch when the pairs fit
    one chunk or every placing program counts them itself (`self_count`; default by size, align_self_counts),
    else two (per-chunk histograms, then placement); `chunk` overrides the pairs per program; `pdl`: launched
    with programmatic dependent launch (kernels/pdl.py)."""
    num_pairs = topk_ids.numel()
    max_blocks = align_max_blocks(num_pairs, num_experts, block_m)
    num_bins = max(32, triton.next_power_of_2(num_experts + 1))
    chunk, chunks_p2, all_p2 = align_constants(num_pairs, chunk, self_count)
    num_chunks = triton.cdiv(num_pairs, chunk)
    block_b = max(1, min(64, 4096 // block_m))  # blocks per padding program: a [4096] tile of rows
    dev = topk_ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_groups = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    grid = num_chunks + triton.cdiv(max_blocks, block_b)
    scratch = torch.empty(grid * 3 * num_bins, dtype=torch.int32, device=dev)
    ids = topk_ids.contiguous()
    hist = scratch  # one chunk, or every program counting itself: no histograms to pass
    if num_chunks > 1 and not all_p2:
        hist = torch.empty(num_chunks * num_bins, dtype=torch.int32, device=dev)
        _align_count_kernel[(num_chunks,)](ids, hist, num_pairs, num_experts, CHUNK=chunk, NUM_BINS=num_bins,
                                           USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
    _align_place_kernel[(grid,)](
        ids, hist, sorted_ids, block_groups, num_padded, scratch,
        num_pairs, num_experts, num_chunks, max_blocks,
        BLOCK_M=block_m, NUM_BINS=num_bins, LOG2_BINS=num_bins.bit_length() - 1, CHUNK=chunk,
        CHUNKS_P2=chunks_p2, BLOCK_B=block_b, ALL_P2=all_p2,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=4,
    )
    return AlignedBlocks(sorted_ids, block_groups, num_padded)


def moe_align_ref(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
) -> AlignedBlocks:
    """Same result with plain torch ops (sort / scatter / cumsum / searchsorted); also
    sync-free, so it can be captured too, at the cost of ~15 launches."""
    num_pairs = topk_ids.numel()
    dev = topk_ids.device
    max_blocks = align_max_blocks(num_pairs, num_experts, block_m)
    num_rows = max_blocks * block_m

    experts = topk_ids.reshape(-1).long()
    valid = (experts >= 0) & (experts < num_experts)
    groups = torch.where(valid, experts, num_experts)

    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, groups, torch.ones_like(groups))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    firsts = counts.cumsum(0) - counts  # sorted position of each group's first pair

    order = torch.sort(groups, stable=True).indices
    sorted_groups = groups[order]
    g = sorted_groups.clamp(max=num_experts - 1)
    rows = ends[g] - padded[g] + torch.arange(num_pairs, device=dev) - firsts[g]
    rows = torch.where(sorted_groups < num_experts, rows, num_rows)  # row num_rows is dropped
    sorted_ids = torch.full((num_rows + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, rows, order.to(torch.int32))

    first_rows = torch.arange(max_blocks, device=dev) * block_m
    block_groups = torch.searchsorted(ends, first_rows, right=True)
    block_groups = torch.where(first_rows < ends[-1], block_groups, -1).to(torch.int32)
    return AlignedBlocks(sorted_ids[:num_rows], block_groups, ends[-1:].to(torch.int32))
