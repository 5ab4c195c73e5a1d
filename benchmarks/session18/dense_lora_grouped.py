"""Prototype (not in the package): the dense multi-LoRA with rows grouped by adapter slot, against the engine's.

The engine's dense LoRA (kernels/lora_dense.py) tiles tokens in their batch order; a tile mixes slots, so each of
its programs walks the tile's slots (or one lane of them) and every token tile re-reads each slot's A and B tiles.
At decode B = 256 with 4 adapters the q|k|v LoRA costs twice its GEMM and ~3.5 µs more per distinct adapter
(BENCHMARKS.md, session 18). Here the rows are first grouped by slot (moe_align with the slots as the groups: one
launch, no host sync, static shapes), which the engine would do once per step for every layer; then each shrink and
expand program takes BLOCK_T rows of one slot: one A or B tile read per (block, tile), no masked lanes. Rows
without an adapter are in no block and stay bitwise untouched.

    PYTHONPATH=. python benchmarks/session18/dense_lora_grouped.py            # GPU: times it against the engine's
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/session18/dense_lora_grouped.py --check   # CPU: against the ref
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch
from moeserve.kernels.lora_dense import RANK_BLOCK, _dense_lora, dense_lora_ref, dense_lora_shrink
from moeserve.kernels.moe_align import moe_align

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["T", "STEPS_PER_SPLIT", "stride_sk", "stride_ss"])
def _grouped_shrink_kernel(
    x_ptr, a_ptr, ranks_ptr, sorted_ids_ptr, block_slots_ptr, scratch_ptr,
    T, IN, STEPS_PER_SPLIT, stride_xt, stride_al, stride_as, stride_ar, stride_sk, stride_ss,
    R_MAX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    EVEN_K: tl.constexpr, COMPUTE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """scratch[split, slice, row, :rank] = x[token of row] @ A[slot, slice, :rank, split cols]^T for the BLOCK_T rows
    of one block, all of one slot (row = position in sorted_ids; strides in rows of R_MAX)."""
    pdl_launch.enter(USE_PDL)
    blk = tl.program_id(0)
    sl = tl.program_id(1)
    ks = tl.program_id(2)
    slot = tl.load(block_slots_ptr + blk)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    tokens = tl.load(sorted_ids_ptr + rows)
    ok = tokens < T
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt
    a_slot = a_ptr + slot.to(tl.int64) * stride_al + sl * stride_as
    k_lo = ks * STEPS_PER_SPLIT * BLOCK_K
    k_hi = tl.minimum(k_lo + STEPS_PER_SPLIT * BLOCK_K, IN)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R_MAX
        acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = (k < k_hi) | EVEN_K
            xt = tl.load(x_rows + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0).to(COMPUTE)
            at = tl.load(a_slot + r[None, :] * stride_ar + k[:, None], mask=k_ok[:, None] & r_ok[None, :],
                         other=0.0).to(COMPUTE)
            acc = tl.dot(xt, at, acc)
        tl.store(scratch_ptr + ((ks * stride_sk + sl * stride_ss) + rows[:, None]) * R_MAX + r[None, :], acc,
                 mask=ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["T", "K_SPLITS", "stride_sk", "stride_ss"])
def _grouped_expand_kernel(
    scratch_ptr, b_ptr, ranks_ptr, sorted_ids_ptr, block_slots_ptr, out_ptr,
    T, K_SPLITS, stride_sk, stride_ss, stride_bl, stride_bn, stride_ot,
    SIZE0: tl.constexpr, SIZE1: tl.constexpr, SIZE2: tl.constexpr, SIZE3: tl.constexpr,
    TILE1: tl.constexpr, TILE2: tl.constexpr, TILE3: tl.constexpr,
    R_MAX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    COMPUTE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out[token of row, tile] += scratch[:, slice, row] summed over splits @ B[slot, tile, :rank]^T, one slot's
    BLOCK_T rows, one column tile (tiles laid out slice by slice, as the engine's expand)."""
    pdl_launch.enter(USE_PDL)
    blk = tl.program_id(0)
    nt = tl.program_id(1)
    slot = tl.load(block_slots_ptr + blk)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    sl = (nt >= TILE1).to(tl.int32) + (nt >= TILE2).to(tl.int32) + (nt >= TILE3).to(tl.int32)
    tile_base = tl.where(sl == 0, 0, tl.where(sl == 1, TILE1, tl.where(sl == 2, TILE2, TILE3)))
    col_base = tl.where(sl == 0, 0, tl.where(sl == 1, SIZE0, tl.where(sl == 2, SIZE0 + SIZE1, SIZE0 + SIZE1 + SIZE2)))
    size = tl.where(sl == 0, SIZE0, tl.where(sl == 1, SIZE1, tl.where(sl == 2, SIZE2, SIZE3)))
    c = (nt - tile_base) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = c < size
    n = col_base + c
    rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    tokens = tl.load(sorted_ids_ptr + rows)
    ok = tokens < T
    b_slot = b_ptr + slot.to(tl.int64) * stride_bl
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R_MAX
        s_ptrs = scratch_ptr + (sl * stride_ss + rows[:, None]) * R_MAX + r[None, :]
        s = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        for ks in range(K_SPLITS):
            s += tl.load(s_ptrs + ks * stride_sk * R_MAX, mask=ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_slot + n[None, :] * stride_bn + r[:, None], mask=r_ok[:, None] & n_ok[None, :],
                    other=0.0).to(COMPUTE)
        acc = tl.dot(s.to(COMPUTE), b, acc)
    o_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_ot + n[None, :]
    o_mask = ok[:, None] & n_ok[None, :]
    o = tl.load(o_ptrs, mask=o_mask, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


def slot_blocks(token_slots: torch.Tensor, num_slots: int, block_t: int, pdl: bool = False):
    """Rows grouped by slot in blocks of block_t (rows of slot -1 in none): once per step in an engine."""
    return moe_align(token_slots.view(-1, 1), num_slots, block_t, pdl=pdl)


def dense_lora_grouped(x, lora_a, lora_b, token_slots, slot_ranks, slice_sizes, out, aligned, *, block_t,
                       block_k=None, block_n=None, k_splits=1, pdl=False) -> None:
    """out[t] += the delta of token t's adapter, on rows grouped by slot (`aligned` = slot_blocks(...))."""
    T, in_features = x.shape
    num_slots, num_slices, max_rank, _ = lora_a.shape
    num_blocks = aligned.block_groups.numel()
    num_rows = aligned.sorted_ids.numel()
    if block_k is None:
        block_k = 32 if _INTERPRET else 256
    block_k = min(block_k, max(16, triton.next_power_of_2(in_features)))
    steps = triton.cdiv(triton.cdiv(in_features, k_splits), block_k)
    k_splits = triton.cdiv(in_features, steps * block_k)
    compute = tl.float32 if _INTERPRET or x.dtype == torch.float32 else tl.bfloat16
    scratch = torch.empty(k_splits, num_slices, num_rows, max_rank, dtype=torch.float32, device=x.device)
    _grouped_shrink_kernel[(num_blocks, num_slices, k_splits)](
        x, lora_a, slot_ranks, aligned.sorted_ids, aligned.block_groups, scratch,
        T, in_features, steps, x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        num_slices * num_rows, num_rows,
        R_MAX=max_rank, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_R=RANK_BLOCK, EVEN_K=in_features % block_k == 0,
        COMPUTE=compute, USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
    if block_n is None:
        block_n = 16 if _INTERPRET else 128
    sizes = tuple(slice_sizes) + (0,) * (4 - num_slices)
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + triton.cdiv(size, block_n))
    _grouped_expand_kernel[(num_blocks, starts[num_slices])](
        scratch, lora_b, slot_ranks, aligned.sorted_ids, aligned.block_groups, out,
        T, k_splits, num_slices * num_rows, num_rows, lora_b.stride(0), lora_b.stride(1), out.stride(0),
        SIZE0=sizes[0], SIZE1=sizes[1], SIZE2=sizes[2], SIZE3=sizes[3], TILE1=starts[1], TILE2=starts[2],
        TILE3=starts[3], R_MAX=max_rank, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=RANK_BLOCK, COMPUTE=compute,
        USE_PDL=pdl, launch_pdl=pdl, num_warps=4)


def check_cpu() -> None:
    """Under the interpreter: mixed slots, an inactive slot, rank-0 slot, rows without adapter, two K splits."""
    gen = torch.Generator().manual_seed(0)
    for slice_sizes, in_features, max_rank in (((24, 8, 8), 48, 32), ((20,), 40, 24)):
        T, num_slots = 21, 4
        ranks = torch.tensor([8, 0, max_rank, 4], dtype=torch.int32)
        a = torch.randn(num_slots, len(slice_sizes), max_rank, in_features, generator=gen) * 0.1
        b = torch.randn(num_slots, sum(slice_sizes), max_rank, generator=gen) * 0.1
        for s, r in enumerate(ranks.tolist()):
            a[s, :, r:] = 0
            b[s, :, r:] = 0
        x = torch.randn(T, in_features, generator=gen)
        slots = torch.randint(0, num_slots, (T,), generator=gen, dtype=torch.int32)
        slots[[2, 7, 18]] = -1
        slots[[5, 11]] = 1
        out = torch.randn(T, sum(slice_sizes), generator=gen)
        before = out.clone()
        want = out.clone()
        dense_lora_ref(x, a, b, slots, ranks, slice_sizes, want)
        for block_t, k_splits in ((16, 1), (8, 2)):
            got = before.clone()
            aligned = slot_blocks(slots, num_slots, block_t)
            dense_lora_grouped(x, a, b, slots, ranks, slice_sizes, got, aligned, block_t=block_t, k_splits=k_splits)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            untouched = (slots < 0) | (slots == 1)
            assert torch.equal(got[untouched], before[untouched])
    print("grouped dense LoRA matches dense_lora_ref (interpreter)")


def bench_gpu(batches, block_ts) -> None:
    from benchmarks.kernels import dense_lora as dl
    from moeserve.bench.common import graph_time_us

    gen = torch.Generator("cuda").manual_seed(0)
    for proj, (slice_sizes, in_features) in dl.PROJS.items():
        for T in batches:
            sets = dl.make_sets(T, slice_sizes, in_features, gen)
            for case in ("lora1_r16", "lora4_r16", "lora8_r16"):
                slots, ranks = dl.case_slots(T, case)
                modes = {"engine": None, "engine_shrink": None}  # the shrink alone: how the engine's cost splits
                for bt in block_ts:
                    modes[f"grouped_t{bt}"] = (bt, slot_blocks(slots, dl.NUM_SLOTS, bt, pdl=True))

                def fns(mode):
                    def one(s):
                        x, w, out, a, b = s
                        torch.mm(x, w.t(), out=out)
                        if mode == "base":
                            return
                        if mode == "engine":
                            _dense_lora(x, a, b, slots, ranks, slice_sizes, out, pdl=True)
                        elif mode == "engine_shrink":
                            dense_lora_shrink(x, a, slots, ranks, pdl=True)
                        else:
                            bt, aligned = modes[mode]
                            dense_lora_grouped(x, a, b, slots, ranks, slice_sizes, out, aligned, block_t=bt,
                                               pdl=True)
                    return [lambda s=s: one(s) for s in sets]

                names = ["base", *modes]
                times = {name: [] for name in names}
                for _ in range(3):
                    for name in names:
                        times[name].append(graph_time_us(fns(name)))
                med = {k: statistics.median(v) for k, v in times.items()}
                align = statistics.median(graph_time_us([lambda: slot_blocks(slots, dl.NUM_SLOTS, 32, pdl=True)])
                                          for _ in range(3))
                # correctness on the GPU against the fp32 reference (pool zeros past each rank)
                x, _, _, a, b = sets[0]
                a, b = a.clone(), b.clone()
                for slot, rank in enumerate(ranks.tolist()):
                    a[slot, :, rank:] = 0
                    b[slot, :, rank:] = 0
                want = torch.zeros(T, sum(slice_sizes), device="cuda")
                dense_lora_ref(x, a, b, slots, ranks, slice_sizes, want)
                got = torch.zeros(T, sum(slice_sizes), device="cuda", dtype=torch.bfloat16)
                bt, aligned = modes[f"grouped_t{block_ts[0]}"]
                dense_lora_grouped(x, a, b, slots, ranks, slice_sizes, got, aligned, block_t=bt)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                print(f"{proj:>3} T={T:4d} {case:>10}: base {med['base']:.1f} us, LoRA adds: " + ", ".join(
                          f"{k} {med[k] - med['base']:.1f}" for k in names[1:])
                      + f" (+ slot alignment once a step {align:.1f}); err {err:.1e}", flush=True)
            del sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU interpreter check against dense_lora_ref")
    ap.add_argument("--batches", default="64,256,512")
    ap.add_argument("--block-t", default="16,32,64")
    args = ap.parse_args(argv)
    if args.check:
        check_cpu()
        return 0
    bench_gpu([int(t) for t in args.batches.split(",")], [int(t) for t in args.block_t.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
