"""Prototype (not in the package): the dense multi-LoRA in one launch on rows grouped by slot, against the engine's two.

The engine's dense LoRA (kernels/lora_dense.py) is a shrink launch and an expand launch per projection. At decode
sizes both are latency-bound: q|k|v at T = 512 adds 11.7 µs for ~2.4 µs of bytes (BENCHMARKS.md, session 19). Here
one program takes BLOCK_T rows of one slot and one column tile, computes those rows' shrink for its slice itself (x
rows and the slot's A slice, both from L2 after the first tile of the block) and adds the expand into its tile: no
scratch, one launch, the shrink repeated once per column tile. (Session 4's one-launch variant walked each token
tile's slots and lost at every T; on grouped rows the walk is gone.) Rows without an adapter are in no block and
stay bitwise untouched.

    PYTHONPATH=. python benchmarks/session19/dense_lora_fused.py            # GPU: times it against the engine's
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/session19/dense_lora_fused.py --check   # CPU: against the ref
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
from moeserve.kernels.lora_dense import (RANK_BLOCK, _block_rows, _dense_lora, column_tile, dense_lora_ref,
                                         group_rows)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _store_block_rows(sorted_ids_ptr, block_slots_ptr, ranks_ptr, blk, T, NUM_SLOTS, BLOCK_T: tl.constexpr):
    """As _block_rows, where group NUM_SLOTS holds the rows without an adapter (rank 0); slot -1 past the end."""
    slot = tl.load(block_slots_ptr + blk)
    rank = tl.load(ranks_ptr + tl.minimum(tl.maximum(slot, 0), NUM_SLOTS - 1))
    rank = tl.where((slot >= 0) & (slot < NUM_SLOTS), rank, 0)
    tokens = tl.load(sorted_ids_ptr + blk * BLOCK_T + tl.arange(0, BLOCK_T))
    return tl.minimum(slot, NUM_SLOTS - 1), rank, tokens, tokens < T, slot >= 0


@triton.jit(do_not_specialize=["T"])
def _fused_kernel(
    x_ptr, a_ptr, b_ptr, sorted_ids_ptr, block_slots_ptr, ranks_ptr, out_ptr,
    T, IN, R_MAX, NUM_SLOTS, stride_xt, stride_al, stride_as, stride_ar, stride_bl, stride_bn, stride_ot,
    SIZE0: tl.constexpr, SIZE1: tl.constexpr, SIZE2: tl.constexpr, SIZE3: tl.constexpr,
    TILE1: tl.constexpr, TILE2: tl.constexpr, TILE3: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    EVEN_K: tl.constexpr, COMPUTE: tl.constexpr, USE_PDL: tl.constexpr, STORE: tl.constexpr = False,
):
    """out[token, tile] += (x[token] @ A[slot, slice]^T) @ B[slot, tile]^T for one block's rows (one slot).
    STORE: out[token, tile] = that delta, for every row (the rows without an adapter, grouped as slot NUM_SLOTS,
    and those of rank-0 slots get zeros), for a base GEMM to accumulate onto afterwards (addmm, beta 1)."""
    pdl_launch.enter(USE_PDL)
    if STORE:
        slot, rank, tokens, rows, live = _store_block_rows(sorted_ids_ptr, block_slots_ptr, ranks_ptr,
                                                           tl.program_id(0), T, NUM_SLOTS, BLOCK_T)
        if not live:
            return
    else:
        slot, rank, tokens, rows = _block_rows(sorted_ids_ptr, block_slots_ptr, ranks_ptr, tl.program_id(0), T,
                                               BLOCK_T)
        if rank == 0:
            return
    sl, n, n_ok = column_tile(tl.program_id(1), SIZE0, SIZE1, SIZE2, SIZE3, TILE1, TILE2, TILE3, BLOCK_N)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt
    a_slot = a_ptr + slot.to(tl.int64) * stride_al + sl * stride_as
    b_slot = b_ptr + slot.to(tl.int64) * stride_bl
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R_MAX
        s = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = (k < IN) | EVEN_K
            xt = tl.load(x_rows + k[None, :], mask=rows[:, None] & k_ok[None, :], other=0.0).to(COMPUTE)
            at = tl.load(a_slot + r[None, :] * stride_ar + k[:, None], mask=k_ok[:, None] & r_ok[None, :],
                         other=0.0).to(COMPUTE)
            s = tl.dot(xt, at, s)
        b = tl.load(b_slot + n[None, :] * stride_bn + r[:, None], mask=r_ok[:, None] & n_ok[None, :],
                    other=0.0).to(COMPUTE)
        acc = tl.dot(s.to(COMPUTE), b, acc)
    o_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_ot + n[None, :]
    o_mask = rows[:, None] & n_ok[None, :]
    if not STORE:
        acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def group_all_rows(token_slots, num_slots, block_t=None, pdl=False):
    """The STORE mode's grouping: rows without an adapter as one more group (num_slots)."""
    return group_rows(torch.where(token_slots < 0, num_slots, token_slots), num_slots + 1, block_t, pdl=pdl)


def dense_lora_fused(x, lora_a, lora_b, token_slots, slot_ranks, slice_sizes, out, groups, *, block_n=None,
                     block_k=None, num_warps=4, num_stages=3, store=False, pdl=False) -> None:
    """out += the delta (store: out = the delta, every row; `groups` from group_all_rows then)."""
    T, in_features = x.shape
    num_slots, num_slices, max_rank, _ = lora_a.shape
    if block_n is None:
        block_n = 16 if _INTERPRET else 256
    if block_k is None:
        block_k = 32 if _INTERPRET else 256
    block_k = min(block_k, max(16, triton.next_power_of_2(in_features)))
    sizes = tuple(slice_sizes) + (0,) * (4 - num_slices)
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + triton.cdiv(size, block_n))
    compute = tl.float32 if _INTERPRET or x.dtype == torch.float32 else tl.bfloat16
    _fused_kernel[(groups.aligned.block_groups.numel(), starts[num_slices])](
        x, lora_a, lora_b, groups.aligned.sorted_ids, groups.aligned.block_groups, slot_ranks, out,
        T, in_features, max_rank, num_slots, x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), out.stride(0),
        SIZE0=sizes[0], SIZE1=sizes[1], SIZE2=sizes[2], SIZE3=sizes[3], TILE1=starts[1], TILE2=starts[2],
        TILE3=starts[3], BLOCK_T=groups.block_t, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=RANK_BLOCK,
        EVEN_K=in_features % block_k == 0, COMPUTE=compute, USE_PDL=pdl, STORE=store, launch_pdl=pdl,
        num_warps=num_warps, num_stages=num_stages)


def check_cpu() -> None:
    """Under the interpreter: mixed slots, a rank-0 slot, rows without adapter, a pool rank off the 16 steps."""
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
        before = torch.randn(T, sum(slice_sizes), generator=gen)
        want = before.clone()
        dense_lora_ref(x, a, b, slots, ranks, slice_sizes, want)
        for block_t in (8, 16):
            got = before.clone()
            dense_lora_fused(x, a, b, slots, ranks, slice_sizes, got, group_rows(slots, num_slots, block_t))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            untouched = (slots < 0) | (slots == 1)
            assert torch.equal(got[untouched], before[untouched])
            delta = torch.full_like(before, float("nan"))  # store mode: every row written, zeros without adapter
            dense_lora_fused(x, a, b, slots, ranks, slice_sizes, delta, group_all_rows(slots, num_slots, block_t),
                             store=True)
            torch.testing.assert_close(delta, want - before, rtol=1e-5, atol=1e-5)
            assert (delta[untouched] == 0).all()
    print("one-launch dense LoRA matches dense_lora_ref, adding and storing (interpreter)")


def bench_gpu(batches, block_ns) -> None:
    from benchmarks.kernels import dense_lora as dl
    from moeserve.bench.common import graph_time_us

    gen = torch.Generator("cuda").manual_seed(0)
    for proj, (slice_sizes, in_features) in dl.PROJS.items():
        for T in batches:
            sets = dl.make_sets(T, slice_sizes, in_features, gen)
            for case in ("lora1_r16", "lora4_r16", "lora8_r16"):
                slots, ranks = dl.case_slots(T, case)
                groups = group_rows(slots, dl.NUM_SLOTS, pdl=True)  # once a forward in the engine: outside
                every_row = group_all_rows(slots, dl.NUM_SLOTS, pdl=True)

                def fns(mode):
                    def one(s):
                        x, w, out, a, b = s
                        if mode[0] == "store+addmm":  # the delta first, then the base GEMM accumulating onto it
                            dense_lora_fused(x, a, b, slots, ranks, slice_sizes, out, every_row, block_n=mode[1],
                                             store=True, pdl=True)
                            out.addmm_(x, w.t())
                            return
                        torch.mm(x, w.t(), out=out)
                        if mode[0] == "engine":
                            _dense_lora(x, a, b, slots, ranks, slice_sizes, out, groups=groups, pdl=True)
                        elif mode[0] == "fused":
                            dense_lora_fused(x, a, b, slots, ranks, slice_sizes, out, groups, block_n=mode[1],
                                             num_warps=mode[2], pdl=True)
                    return [lambda s=s: one(s) for s in sets]

                modes = [("base",), ("engine",)] + [("fused", bn, w) for bn in block_ns for w in (4, 8)] + [
                    ("store+addmm", bn) for bn in block_ns]
                times = {m: [] for m in modes}
                for _ in range(3):
                    for m in modes:
                        times[m].append(graph_time_us(fns(m)))
                med = {"_".join(map(str, m)): statistics.median(v) for m, v in times.items()}
                x, _, _, a, b = sets[0]
                a, b = a.clone(), b.clone()
                for slot, rank in enumerate(ranks.tolist()):
                    a[slot, :, rank:] = 0
                    b[slot, :, rank:] = 0
                want = torch.zeros(T, sum(slice_sizes), device="cuda")
                dense_lora_ref(x, a, b, slots, ranks, slice_sizes, want)
                got = torch.zeros(T, sum(slice_sizes), device="cuda", dtype=torch.bfloat16)
                dense_lora_fused(x, a, b, slots, ranks, slice_sizes, got, groups)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                # rows without an adapter must stay bitwise the LoRA-free GEMM's: mm against addmm onto zeros
                x, w = sets[0][0], sets[0][1]
                same = torch.equal(torch.mm(x, w.t()).view(torch.int16),
                                   torch.zeros(T, w.shape[0], device="cuda", dtype=x.dtype).addmm_(x, w.t())
                                   .view(torch.int16))
                print(f"{proj:>3} T={T:4d} {case:>10}: addmm onto zeros bitwise mm: {same}; base {med['base']:.1f} us, "
                      "LoRA adds: "
                      + ", ".join(f"{k} {v - med['base']:.1f}" for k, v in med.items() if k != "base")
                      + f"; err {err:.1e}", flush=True)
            del sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU interpreter check against dense_lora_ref")
    ap.add_argument("--batches", default="8,64,256,512,2048,8192")
    ap.add_argument("--block-n", default="128,256,512")
    args = ap.parse_args(argv)
    if args.check:
        check_cpu()
        return 0
    bench_gpu([int(t) for t in args.batches.split(",")], [int(n) for n in args.block_n.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
