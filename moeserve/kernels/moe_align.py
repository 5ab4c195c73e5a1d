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
def _moe_align_kernel(
    ids_ptr, sorted_ids_ptr, block_groups_ptr, num_padded_ptr, scratch_ptr,
    num_pairs, num_groups, max_blocks,
    BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, LOG2_BINS: tl.constexpr,
    CHUNK: tl.constexpr, FILL: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_launch.enter(USE_PDL)
    # One program. Scratch (global, int32 [2 * NUM_BINS]) passes per-group values between
    # threads: [0, NB) next free row of each group, [NB, 2NB) group ends.
    bins = tl.arange(0, NUM_BINS)
    lane = tl.arange(0, CHUNK)

    # 1. rows per group, padded to BLOCK_M; group g owns rows [ends[g] - padded[g], ends[g])
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        groups = _pair_groups(ids_ptr, start + lane, num_pairs, num_groups)
        counts += tl.histogram(groups, NUM_BINS)
    counts = tl.where(bins < num_groups, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    tl.store(scratch_ptr + bins, ends - padded)
    tl.store(scratch_ptr + NUM_BINS + bins, ends)

    # 2. every row starts as padding (the sentinel pair index)
    num_rows = max_blocks * BLOCK_M
    for start in range(0, num_rows, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + offs, tl.zeros([FILL], dtype=tl.int32) + num_pairs,
                 mask=offs < num_rows)
    tl.debug_barrier()

    # 3. group of each block = number of groups ending at or before its first row
    #    (branchless upper bound in `ends`; the last bin is never a real group, so it ends at `total`)
    for start in range(0, max_blocks, BLOCK_B):
        blocks = start + tl.arange(0, BLOCK_B)
        first_row = blocks * BLOCK_M
        pos = tl.zeros([BLOCK_B], dtype=tl.int32)
        for i in tl.static_range(LOG2_BINS):
            step = NUM_BINS >> (i + 1)
            end = tl.load(scratch_ptr + NUM_BINS + pos + step - 1)
            pos = tl.where(end <= first_row, pos + step, pos)
        tl.store(block_groups_ptr + blocks, tl.where(first_row < total, pos, -1),
                 mask=blocks < max_blocks)

    # 4. each pair claims the next free row of its group. The order of pairs inside a group
    #    is not fixed (atomics), which changes nothing downstream: rows are independent.
    for start in range(0, num_pairs, CHUNK):
        groups = _pair_groups(ids_ptr, start + lane, num_pairs, num_groups)
        valid = groups < num_groups
        row = tl.atomic_add(scratch_ptr + groups, 1, mask=valid)
        tl.store(sorted_ids_ptr + row, start + lane, mask=valid)


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    chunk: int = 1024,
    pdl: bool = False,
) -> AlignedBlocks:
    """Align pairs of `topk_ids [T, K]` into expert groups. One Triton launch, no host sync; `pdl`: launched
    with programmatic dependent launch (kernels/pdl.py)."""
    num_pairs = topk_ids.numel()
    max_blocks = align_max_blocks(num_pairs, num_experts, block_m)
    num_bins = max(32, triton.next_power_of_2(num_experts + 1))
    chunk = min(chunk, max(16, triton.next_power_of_2(num_pairs)))
    dev = topk_ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_groups = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    scratch = torch.empty(2 * num_bins, dtype=torch.int32, device=dev)
    ids = topk_ids.contiguous()
    _moe_align_kernel[(1,)](
        ids, sorted_ids, block_groups, num_padded, scratch,
        num_pairs, num_experts, max_blocks,
        BLOCK_M=block_m, NUM_BINS=num_bins, LOG2_BINS=num_bins.bit_length() - 1,
        CHUNK=chunk, FILL=1024, BLOCK_B=128,
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

    sorted_groups, order = torch.sort(groups, stable=True)
    g = sorted_groups.clamp(max=num_experts - 1)
    rows = ends[g] - padded[g] + torch.arange(num_pairs, device=dev) - firsts[g]
    rows = torch.where(sorted_groups < num_experts, rows, num_rows)  # row num_rows is dropped
    sorted_ids = torch.full((num_rows + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, rows, order.to(torch.int32))

    first_rows = torch.arange(max_blocks, device=dev) * block_m
    block_groups = torch.searchsorted(ends, first_rows, right=True)
    block_groups = torch.where(first_rows < ends[-1], block_groups, -1).to(torch.int32)
    return AlignedBlocks(sorted_ids[:num_rows], block_groups, ends[-1:].to(torch.int32))
