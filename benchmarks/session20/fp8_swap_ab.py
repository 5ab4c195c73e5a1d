"""Prototype (not wired into the engine): the W8A8 routed-expert GEMMs of kernels/fused_moe_fp8.py with the
operands swapped, for decode batch sizes (a few dozen pairs per expert).

The shipped sorted path puts the pairs on the MMA's M side: at T = 256-512 (16-32 pairs per expert of 128,
top-8) its tuned 64-row blocks are mostly padding, and each K step holds a second fp32 [64, 128] register set for
the scaled product (168 registers, 3 CTAs/SM). Here the weights take the M side:

    program = (one moe_align block of BLOCK_P pairs of one expert, BLOCK_W weight rows)
    per K step (BLOCK_K <= 128 columns, inside one 128-column scale group):
        w  [BLOCK_W, BLOCK_K] fp8   (pointers, or a TMA descriptor over [E * N, K])
        a  [BLOCK_P, BLOCK_K] fp8   (gathered rows: tokens for gate_up, pairs for down) with a_scale [BLOCK_P]
        acc[BLOCK_W, BLOCK_P] += tl.dot(w, tl.trans(a)) * (w_scale * a_scale[None, :])
    out[pairs, cols] = acc^T (times the routing weight in the down GEMM)

BLOCK_W divides the 128-row weight-scale block (and w13's up half starts on a BLOCK_W boundary), so the weight
scale is one scalar per K step; the scaled product is a [BLOCK_W, BLOCK_P] = 128 x 16 (or 32) fp32 set. Both
GEMMs of the MoE (gate_up: x [T, H] -> gu [pairs, 2I]; down: h [pairs, I] -> y [pairs, H] x routing weight), no
LoRA; everything else is the package's by import (moe_align, quantize_groups_fp8, silu_mul_quant_fp8, the top-k
sum), and the result is fused_moe_fp8(..., act_quant=True, decode=False)'s.

    # CPU (Triton interpreter), small shapes against fused_moe_fp8_ref (W8A8 twin) and fused_moe_fp8 (sorted, W8A8):
    TRITON_INTERPRET=1 PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/session20/fp8_swap_ab.py --check
    # sm_90 registers / spills / instruction mix, no GPU (Triton 3.6 as on the H200: benchmarks/kernels/sass.py):
    PYTHONPATH=/tmp/triton36:. python benchmarks/session20/fp8_swap_ab.py --sass
    # GPU (H200, < 120 s): Qwen3-30B-A3B experts, the prototype's variants against the shipped W8A8 sorted path:
    PYTHONPATH=. python benchmarks/session20/fp8_swap_ab.py --out DIR [--tokens 256,...] [--block-p 16,32] \
        [--configs quick|default|full]
    (per T: each variant checked against the shipped call, then CUDA graphs rotating 4 weight sets, interleaved
    rounds, medians: the whole call and, --gemms, the two GEMMs alone; the bytes floor is the touched experts' FP8
    weights / 4.3 TB/s; DIR/fp8_swap_ab.json is rewritten after every T. `--device cpu --shape 4,256,128,2
    --tokens 5,33` under TRITON_INTERPRET runs this mode's bookkeeping on the CPU with a wall-clock timer.)

Check bounds (CPU): against the twin reference, fp32 activations: both multiply the same fp8 values with the same
scales and quantize x by the same (bitwise) kernel; only the fp32 summation order differs (~1e-7 relative), which
can move an element of h across an e4m3 rounding boundary (one step: 2^-4 relative of that element, rarely) —
tests/test_kernels_moe_fp8.py's W8A8-twin bound, 1e-5 relative (norm). fp16 activations: gu and h rounded to fp16
in the kernels, kept fp32 in the reference (a few h elements one e4m3 step apart): 1e-2, as that test. Against
fused_moe_fp8 (the same gu and y dtypes, quantizers and top-k sum; only the GEMMs' tiling and summation order
differ): the same bounds. Measured (E 4, H 256, I 128, top-2, T 5 / 33): against the twin 2.3e-7 / 3.3e-7 (fp32),
7.6e-4 / 4.1e-3 (fp16) — the shipped path's own distance from the twin, to the digits printed; against the shipped
path 1.3e-8 / 1.6e-8 (fp32) and bitwise equal (fp16). A mutated kernel (every K step reading k-group 0's scales)
fails every case (0.25 relative).

sm_90 (Triton 3.6, `--sass`; BLOCK_W = BLOCK_K = 128, bf16 out, PDL): registers / shared memory per CTA, no spills
in any: BLOCK_P 16: w4s3 80 / 54 KB, w4s4 80 / 72 KB, w8s3 59, TMA w4s3 63, TMA w8s3 48; BLOCK_P 32: w4s3 168 /
60 KB, w4s4 168 / 80 KB, w8s3 106, TMA w4s3 127, TMA w8s3 86. The main loop: 8 QGMMA.64xBPx32 (4 warps) from shared
memory, a_scale loaded straight into the accumulator's column layout (no conversion), BLOCK_W x BLOCK_P / threads
FFMAs for the scaled product, one wait on the MMA per K step (WARPGROUP.DEPBAR right after the last QGMMA: the scale
needs the product, as in the shipped kernel). The transposed store goes through shared memory (STSM, LDS.128,
STG.128).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from moeserve.kernels import pdl as pdl_launch  # noqa: E402
from moeserve.kernels.fp8 import (  # noqa: E402
    WEIGHT_BLOCK,
    quantize_block_fp8,
    quantize_groups_fp8,
    silu_mul_quant_fp8,
)
from moeserve.kernels.fused_moe import _topk_sum, tma_readable  # noqa: E402
from moeserve.kernels.fused_moe_fp8 import (  # noqa: E402
    _check_weights,
    fp8_plan,
    fused_moe_fp8,
    fused_moe_fp8_ref,
    quantize_w13_fp8,
)
from moeserve.kernels.moe_align import moe_align  # noqa: E402
from moeserve.kernels.moe_plan import MoEProblem  # noqa: E402

# ---------------------------------------------------------------------------------------------
# kernel


@triton.jit(do_not_specialize=["num_pairs"])  # sizes that vary by step: one compile
def _swap_ab_fp8_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, block_groups_ptr,
    num_pairs, num_blocks, pairs_per_row, N, K, up_col0, up_scale_row0,
    stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out, w_desc,
    BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, ROUTE_WEIGHT: tl.constexpr, USE_PDL: tl.constexpr, W_TMA: tl.constexpr = False,
):
    """out[pair, cols] = (w[pair] *) (dequant(W_e)[cols] @ dequant(a[pair // pairs_per_row])) for the BLOCK_P pairs
    of one aligned block and BLOCK_W weight rows `cols`, weights on the MMA's M side. a: fp8 [rows, K] with scales
    a_scale[row, k-group]; W: fp8 [E, N, K] with scale_inv [E, N-blocks, K-groups]; rows >= up_col0 read scale row
    up_scale_row0 + (row - up_col0) // SCALE_N (w13's separately blocked up half). Needs (launcher-checked) N and
    K multiples of BLOCK_W and BLOCK_K, BLOCK_W dividing SCALE_N and up_col0 (the tile's rows share one scale
    row: a scalar per K step), BLOCK_K dividing SCALE_K. Programs walk every block for one weight tile before the
    next tile, so an expert's blocks (adjacent in the alignment) read its weight tile together (once from HBM)."""
    pdl_launch.enter(USE_PDL)
    pid = tl.program_id(0)
    pid_p = pid % num_blocks
    pid_w = pid // num_blocks
    expert = tl.load(block_groups_ptr + pid_p)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_p * BLOCK_P + tl.arange(0, BLOCK_P))
    pair_ok = pairs < num_pairs
    rows = (pairs // pairs_per_row).to(tl.int64)
    row0 = pid_w * BLOCK_W
    offs_w = row0 + tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_w.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    scale_row = tl.where(row0 < up_col0, row0 // SCALE_N, up_scale_row0 + (row0 - up_col0) // SCALE_N)
    w_scale_ptr = w_scale_ptr + expert.to(tl.int64) * stride_wse + scale_row * stride_wsn
    a_scale_ptrs = a_scale_ptr + rows * stride_as
    acc = tl.zeros((BLOCK_W, BLOCK_P), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if W_TMA:
            w = w_desc.load([expert * N + row0, k0])
        else:
            w = tl.load(w_ptrs)
        a = tl.load(a_ptrs, mask=pair_ok[:, None], other=0.0)
        group = k0 // SCALE_K
        w_scale = tl.load(w_scale_ptr + group)
        a_scale = tl.load(a_scale_ptrs + group, mask=pair_ok, other=0.0)
        acc += tl.dot(w, tl.trans(a)) * (a_scale * w_scale)[None, :]
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    if ROUTE_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + pairs.to(tl.int64)[None, :] * stride_out + offs_w[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[None, :])


# ---------------------------------------------------------------------------------------------
# launcher


def _launch_swap_ab(a, a_scale, w, w_scale, out, topk_weights, aligned, num_pairs, pairs_per_row, n, k, up_col0,
                    up_scale_row0, block_p, block_w, block_k, block, route_weight, num_warps, num_stages, pdl,
                    w_tma):
    if n % block_w or k % block_k or block[0] % block_w or up_col0 % block_w or block[1] % block_k:
        raise ValueError(f"swap-AB prototype: N {n} and up_col0 {up_col0} must be multiples of block_w {block_w}, "
                         f"K {k} of block_k {block_k}; block_w / block_k must divide the scale block {block}")
    num_blocks = aligned.block_groups.numel()
    w_desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [block_w, block_k]) if w_tma else w
    _swap_ab_fp8_kernel[(num_blocks * (n // block_w),)](
        a, a_scale, w, w_scale, out, topk_weights, aligned.sorted_ids, aligned.block_groups,
        num_pairs, num_blocks, pairs_per_row, n, k, up_col0, up_scale_row0,
        a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), w_desc,
        BLOCK_P=block_p, BLOCK_W=block_w, BLOCK_K=block_k, SCALE_N=block[0], SCALE_K=block[1],
        ROUTE_WEIGHT=route_weight, USE_PDL=pdl, W_TMA=w_tma, launch_pdl=pdl, num_warps=num_warps,
        num_stages=num_stages)


def fused_moe_fp8_swap_ab(x, w13_fp8, s13, w2_fp8, s2, topk_weights, topk_ids, block_p=16, *, block_w=128,
                          block_k=128, num_warps=4, num_stages=3, w_tma=False, y_fp32=False, pdl=False,
                          block=WEIGHT_BLOCK):
    """fused_moe_fp8(x, ..., act_quant=True, decode=False) with both GEMMs swapped (weights on the MMA's M side):
    x [T, H], w13_fp8 [E, 2I, H] / w2_fp8 [E, H, I] float8_e4m3fn with their scale_inv blocks, topk [T, K] ->
    [T, H] in x.dtype. `block_p`: pairs per aligned block (moe_align's block_m); `block_w` weight rows and
    `block_k` columns per program step; `w_tma`: weight tiles by TMA descriptor; `y_fp32`: the down GEMM's
    per-pair output in fp32 (else x's dtype)."""
    _check_weights(x, w13_fp8, s13, w2_fp8, s2, block)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    num_experts = w13_fp8.shape[0]
    inter = w2_fp8.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    x, topk_weights, topk_ids = x.contiguous(), topk_weights.contiguous(), topk_ids.contiguous()
    w_tma = w_tma and tma_readable(w13_fp8) and tma_readable(w2_fp8)
    aligned = moe_align(topk_ids, num_experts, block_p, pdl=pdl)
    a, a_scale = quantize_groups_fp8(x, block[1], pdl=pdl)
    gu = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    opts = dict(block_p=block_p, block_w=block_w, block_k=block_k, block=block, num_warps=num_warps,
                num_stages=num_stages, pdl=pdl, w_tma=w_tma)
    _launch_swap_ab(a, a_scale, w13_fp8, s13, gu, topk_weights, aligned, num_pairs, top_k, 2 * inter, hidden,
                    inter, triton.cdiv(inter, block[0]), route_weight=False, **opts)
    h, h_scale = silu_mul_quant_fp8(gu, block[1], pdl=pdl)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32 if y_fp32 else x.dtype, device=x.device)
    _launch_swap_ab(h, h_scale, w2_fp8, s2, y, topk_weights, aligned, num_pairs, 1, hidden, inter, hidden, 0,
                    route_weight=True, **opts)
    return _topk_sum(y, topk_ids, num_experts, x.dtype, pdl)


# ---------------------------------------------------------------------------------------------
# CPU check


def _fp8_weights(num_experts, hidden, inter, gen, device):
    """(w13 fp8, its scales, w2 fp8, its scales) of random experts, quantized block-wise as a checkpoint stores them."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) * hidden**-0.5
    q13, s13 = quantize_w13_fp8(w13)
    del w13
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=device) * inter**-0.5
    return (q13, s13, *quantize_block_fp8(w2))


def _routed_inputs(num_tokens, num_experts, hidden, top_k, gen, device, dtype):
    """(x, routing weights, expert ids) of a random batch."""
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return x, weights, ids.to(torch.int32)


def _errs(out, ref):
    d = (out.float() - ref.float())
    ref = ref.float()
    return (d.norm() / ref.norm()).item(), d.abs().max().item(), (d.abs().max() / ref.abs().max()).item()


def run_check() -> int:
    bounds = {torch.float32: 1e-5, torch.float16: 1e-2}  # norm-relative: see the module docstring
    failed = 0
    cases = [(dtype, t, bp, tma) for dtype in (torch.float32, torch.float16) for t in (5, 33)
             for bp, tma in ((16, False), (32, False), (16, True))]
    print(f"{'dtype':>8} {'T':>3} {'bp':>3} {'tma':>4} | vs ref: {'rel':>8} {'maxabs':>8} {'maxrel':>8} | "
          f"vs fused_moe_fp8: {'rel':>8} {'maxabs':>8} {'maxrel':>8} | fused_moe_fp8 vs ref {'rel':>8} | bound")
    for dtype, t, bp, tma in cases:
        gen = torch.Generator().manual_seed(t)
        x, w, ids = _routed_inputs(t, 4, 256, 2, gen, "cpu", dtype)
        q13, s13, q2, s2 = _fp8_weights(4, 256, 128, gen, "cpu")
        # y (the down GEMM's per-pair output) in the shipped plan's dtype, so only the GEMMs' tiling differs
        y_fp32 = fp8_plan(t, 2, MoEProblem(4, 256, 128, 2, dtype, x.device), True, decode=False).y_fp32
        out = fused_moe_fp8_swap_ab(x, q13, s13, q2, s2, w, ids, block_p=bp, w_tma=tma, num_stages=2, y_fp32=y_fp32)
        ref = fused_moe_fp8_ref(x, q13, s13, q2, s2, w, ids, act_quant=True)
        base = fused_moe_fp8(x, q13, s13, q2, s2, w, ids, act_quant=True, decode=False)
        e_ref, e_base, e_shipped = _errs(out, ref), _errs(out, base), _errs(base, ref)
        ok = out.dtype == x.dtype and out.shape == x.shape and e_ref[0] <= bounds[dtype] and e_base[0] <= bounds[dtype]
        failed += not ok
        print(f"{str(dtype)[6:]:>8} {t:>3} {bp:>3} {str(tma):>4} | {e_ref[0]:16.2e} {e_ref[1]:8.2e} {e_ref[2]:8.2e} | "
              f"{e_base[0]:26.2e} {e_base[1]:8.2e} {e_base[2]:8.2e} | {e_shipped[0]:29.2e} | "
              f"{bounds[dtype]:.0e} {'ok' if ok else 'FAIL'}",
              flush=True)
    print("check passed" if not failed else f"check FAILED ({failed} cases)")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# sm_90 registers (offline, Triton 3.6)


def run_sass(out_dir: str | None) -> int:
    from benchmarks.kernels.sass import compile_sm90, report

    for block_p in (16, 32):
        for tma in (False, True):
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                types = dict(a_ptr="*fp8e4nv", a_scale_ptr="*fp32", w_ptr="*fp8e4nv", w_scale_ptr="*fp32",
                             out_ptr="*bf16", topk_weights_ptr="*fp32", sorted_ids_ptr="*i32",
                             block_groups_ptr="*i32",
                             w_desc="tensordesc<fp8e4nv[128, 128]>" if tma else "*fp8e4nv")
                constexprs = dict(BLOCK_P=block_p, BLOCK_W=128, BLOCK_K=128, SCALE_N=128, SCALE_K=128,
                                  ROUTE_WEIGHT=True, USE_PDL=True, W_TMA=tma)
                compiled = compile_sm90(_swap_ab_fp8_kernel, types, constexprs, warps, stages,
                                        unspecialized=("w_desc", "num_blocks"))
                label = f"swap_ab bp{block_p} w{warps}s{stages}{' tma' if tma else ''} (Triton {triton.__version__})"
                sass = report(compiled, label)
                if out_dir:
                    Path(out_dir).mkdir(parents=True, exist_ok=True)
                    name = f"swap_ab_bp{block_p}_w{warps}s{stages}{'_tma' if tma else ''}.sass"
                    (Path(out_dir) / name).write_text(sass)
    return 0


# ---------------------------------------------------------------------------------------------
# GPU benchmark

SHAPE = "128,2048,768,8"  # Qwen3-30B-A3B experts: E, H, I, top-k
NUM_SETS = 4  # weight sets per timed graph (0.6 GB of fp8 each: >> L2, the weights come from HBM)
HBM_BPS = 4.3e12


def _wall_time_us(fns, reps: int = 3) -> float:
    """CPU stand-in for graph_time_us (the --device cpu smoke run of this mode's bookkeeping, not a measurement)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for fn in fns:
            fn()
        times.append((time.perf_counter() - t) * 1e6 / len(fns))
    return statistics.median(times)


def _gemm_only_fns(weights, inputs, plan, variants, pdl, block=WEIGHT_BLOCK) -> dict:
    """name -> [fn per (weights, inputs) set] that run only the two GEMMs (gate_up, then down: the shipped
    _moe_fp8_gemm_kernel at its plan, or the prototype at its options), on alignments, quantized activations and
    output buffers prepared here (align, quantize, SiLU*up and the top-k sum are left out)."""
    from moeserve.kernels import fused_moe_fp8 as shipped
    from moeserve.kernels.fused_moe import weight_descs

    num_experts, two_i, hidden = weights[0][0].shape
    inter = two_i // 2
    prepared = []
    for (q13, s13, q2, s2), (x, tw, ids) in zip(weights, inputs):
        a, a_scale = quantize_groups_fp8(x, block[1])
        num_pairs = ids.numel()
        gu = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
        y = torch.empty(num_pairs, hidden, dtype=torch.float32 if plan.y_fp32 else x.dtype, device=x.device)
        prepared.append((q13, s13, q2, s2, tw, ids, a, a_scale, gu, y, num_pairs))
    fns = {}
    aligned = [moe_align(p[5], num_experts, plan.gate_up.block_m) for p in prepared]
    hs = []
    for p, al in zip(prepared, aligned):  # h from a real gu (the shipped gate_up), quantized once
        q13, s13, q2, s2, tw, ids, a, a_scale, gu, y, num_pairs = p
        d13, d2, w_tma = weight_descs(q13, q2, plan)
        shipped._launch(a, a_scale, q13, s13, gu, tw, al, num_pairs, ids.shape[1], two_i, hidden, inter,
                        triton.cdiv(inter, block[0]), plan.gate_up, block, True, False, False, False, pdl, d13, w_tma)
        hs.append(silu_mul_quant_fp8(gu, block[1]))

    def shipped_fn(p, al, h, d13, d2, w_tma):
        q13, s13, q2, s2, tw, ids, a, a_scale, gu, y, num_pairs = p
        shipped._launch(a, a_scale, q13, s13, gu, tw, al, num_pairs, ids.shape[1], two_i, hidden, inter,
                        triton.cdiv(inter, block[0]), plan.gate_up, block, True, False, False, False, pdl, d13, w_tma)
        shipped._launch(h[0], h[1], q2, s2, y, tw, al, num_pairs, 1, hidden, inter, hidden, 0, plan.down, block,
                        True, False, True, False, pdl, d2, w_tma)

    fns["shipped"] = [lambda p=p, al=al, h=h, d=weight_descs(p[0], p[2], plan): shipped_fn(p, al, h, *d)
                      for p, al, h in zip(prepared, aligned, hs)]
    by_block = {}
    for name, o in variants.items():
        bp = o["block_p"]
        if bp not in by_block:
            by_block[bp] = [moe_align(p[5], num_experts, bp) for p in prepared]

        def swap_fn(p, al, h, o=o):
            q13, s13, q2, s2, tw, ids, a, a_scale, gu, y, num_pairs = p
            opts = dict(block_p=o["block_p"], block_w=128, block_k=128, block=block, num_warps=o["num_warps"],
                        num_stages=o["num_stages"], pdl=pdl, w_tma=o["w_tma"])
            _launch_swap_ab(a, a_scale, q13, s13, gu, tw, al, num_pairs, ids.shape[1], two_i, hidden, inter,
                            triton.cdiv(inter, block[0]), route_weight=False, **opts)
            _launch_swap_ab(h[0], h[1], q2, s2, y, tw, al, num_pairs, 1, hidden, inter, hidden, 0,
                            route_weight=True, **opts)

        fns[name] = [lambda p=p, al=al, h=h, f=swap_fn: f(p, al, h) for p, al, h in zip(prepared, by_block[bp], hs)]
    return fns


def run_gpu(args) -> int:
    from moeserve.bench.common import graph_time_us
    from moeserve.kernels.pdl import supported as pdl_supported

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("GPU mode needs a CUDA device (use --check or --sass on the CPU)")
        return 1
    timer = graph_time_us if dev == "cuda" else _wall_time_us
    act_dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # the interpreter's bf16 dots are unreliable
    NUM_EXPERTS, HIDDEN, INTER, TOP_K = (int(v) for v in args.shape.split(","))  # noqa: N806
    t0 = time.time()
    pdl = pdl_supported(torch.device(dev)) if args.pdl is None else args.pdl
    gen = torch.Generator(dev).manual_seed(0)
    weights = [_fp8_weights(NUM_EXPERTS, HIDDEN, INTER, gen, dev) for _ in range(NUM_SETS)]
    torch.cuda.empty_cache()
    block_ps = [int(v) for v in args.block_p.split(",")]
    configs = {"quick": [(4, 3, False), (4, 3, True)],  # (num_warps, num_stages, weights by TMA)
               "default": [(4, 3, False), (4, 3, True), (4, 4, True), (8, 3, True)],
               "full": [(4, 3, False), (4, 4, False), (8, 3, False), (4, 3, True), (4, 4, True), (8, 3, True)]
               }[args.configs]
    variants = {f"swap_bp{bp}_w{wa}s{st}{'_tma' if tma else ''}": dict(block_p=bp, num_warps=wa, num_stages=st,
                                                                      w_tma=tma)
                for bp in block_ps for wa, st, tma in configs}
    report_ = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev, "pdl": pdl, "hbm_bps": HBM_BPS,
               "rounds": args.rounds,
               "shape": dict(experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTER, top_k=TOP_K), "rows": []}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    problem = MoEProblem(NUM_EXPERTS, HIDDEN, INTER, TOP_K, act_dtype, torch.device(dev))
    for batch in [int(v) for v in args.tokens.split(",")]:
        if time.time() - t0 > args.budget_s:
            print(f"T={batch}: skipped, {time.time() - t0:.0f} s spent (--budget-s {args.budget_s})")
            continue
        inputs = [_routed_inputs(batch, NUM_EXPERTS, HIDDEN, TOP_K, gen, dev, act_dtype) for _ in weights]
        experts = statistics.mean(len(torch.unique(i[2])) for i in inputs)
        floor_us = experts * 3 * HIDDEN * INTER / HBM_BPS * 1e6
        plan = fp8_plan(batch, TOP_K, problem, True, decode=False)
        fns = {"shipped": lambda w, i: fused_moe_fp8(i[0], *w, i[1], i[2], act_quant=True, decode=False, pdl=pdl)}
        for name, opts in variants.items():  # y in the shipped plan's dtype (bf16 in the H200 table)
            fns[name] = lambda w, i, o=opts: fused_moe_fp8_swap_ab(i[0], *w, i[1], i[2], pdl=pdl, y_fp32=plan.y_fp32,
                                                                   **o)
        row = {"tokens": batch, "experts_touched": experts, "floor_us": floor_us,
               "shipped_plan": [plan.gate_up.as_list(), plan.down.as_list(), plan.weights_tma],
               "max_rel_err": {}, "norm_rel_err": {}, "us": {}}
        ref = fns["shipped"](weights[0], inputs[0]).float()
        for name in variants:  # the prototype against the shipped path, before timing
            try:
                d = fns[name](weights[0], inputs[0]).float() - ref
                row["max_rel_err"][name] = (d.abs().max() / ref.abs().max()).item()
                row["norm_rel_err"][name] = (d.norm() / ref.norm()).item()
            except Exception as exc:
                traceback.print_exc()
                row["max_rel_err"][name] = f"{type(exc).__name__}: {exc}"[:300]
        sets = {name: [lambda w=w, i=i, fn=fn: fn(w, i) for w, i in zip(weights, inputs)]
                for name, fn in fns.items() if not isinstance(row["max_rel_err"].get(name), str)}
        if args.gemms:  # the two GEMMs alone (align, quantize, SiLU*up and the top-k sum left out)
            try:
                for name, g in _gemm_only_fns(weights, inputs, plan, variants, pdl).items():
                    if name in sets:
                        sets[name + "@gemms"] = g
            except Exception:
                traceback.print_exc()
        times = {name: [] for name in sets}
        for _ in range(args.rounds):  # interleaved: A, B, ..., A, B, ...
            for name, s in sets.items():
                try:
                    times[name].append(timer(s))
                except Exception as exc:
                    traceback.print_exc()
                    row["max_rel_err"][name] = f"{type(exc).__name__}: {exc}"[:300]
        row["us"] = {name: statistics.median(t) for name, t in times.items() if t}
        report_["rows"].append(row)
        (out_dir / "fp8_swap_ab.json").write_text(json.dumps(report_, indent=1))
        base = row["us"].get("shipped", float("nan"))
        print(f"\nT={batch} experts {experts:.1f} floor {floor_us:.1f} us; shipped {base:.1f} us "
              f"({floor_us / base:.0%} of floor) plan gate_up {row['shipped_plan'][0]} tma {row['shipped_plan'][2]}"
              f" [{time.time() - t0:.0f} s]")
        gb = row["us"].get("shipped@gemms", float("nan"))
        print(f"  shipped GEMMs alone {gb:.1f} us ({floor_us / gb:.0%} of floor)")
        print(f"  {'variant':<22} {'us':>8} {'floor%':>7} {'vs shipped':>10} {'max rel':>9} {'norm rel':>9} "
              f"{'GEMMs us':>9} {'floor%':>7} {'vs shipped':>10}")
        for name in variants:
            us, err = row["us"].get(name), row["max_rel_err"].get(name)
            if us is None or isinstance(err, str):
                print(f"  {name:<22} error: {err}")
                continue
            print(f"  {name:<22} {us:8.1f} {floor_us / us:7.0%} {base / us:10.2f} {err:9.1e} "
                  f"{row['norm_rel_err'][name]:9.1e} {row['us'].get(name + '@gemms', float('nan')):9.1f} "
                  f"{floor_us / row['us'].get(name + '@gemms', float('nan')):7.0%} "
                  f"{gb / row['us'].get(name + '@gemms', float('nan')):10.2f}"
                  f"{'  <- error above 2e-2' if err > 2e-2 else ''}", flush=True)
    print(f"\nwrote {out_dir / 'fp8_swap_ab.json'} ({time.time() - t0:.0f} s)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU interpreter check against the references")
    ap.add_argument("--sass", action="store_true", help="offline sm_90 compile: registers / spills (Triton 3.6)")
    ap.add_argument("--sass-out", help="--sass: write each disassembly into this folder")
    ap.add_argument("--out", default="bench_out/", help="GPU mode: folder for fp8_swap_ab.json")
    ap.add_argument("--tokens", default="256,512,128,64,1024", help="GPU mode: token counts, in this order")
    ap.add_argument("--block-p", default="16,32")
    ap.add_argument("--configs", default="default", choices=("quick", "default", "full"),
                    help="GPU mode: (warps, stages, TMA) per block_p: quick w4s3 pointer/TMA; default + TMA w4s4, "
                         "w8s3; full: w4s3, w4s4, w8s3 each pointer and TMA")
    ap.add_argument("--gemms", action=argparse.BooleanOptionalAction, default=True,
                    help="GPU mode: also time the two GEMMs alone (shipped kernel at its plan against the prototype)")
    ap.add_argument("--budget-s", type=float, default=100.0, help="GPU mode: start no new T past this many s")
    ap.add_argument("--rounds", type=int, default=3, help="GPU mode: interleaved rounds (median)")
    ap.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--shape", default=SHAPE, help="GPU mode: experts,hidden,inter,top_k")
    ap.add_argument("--device", default="cuda", help="GPU mode: 'cpu' (under TRITON_INTERPRET, small --shape) "
                    "runs its bookkeeping with a wall-clock timer, as a smoke test")
    args = ap.parse_args(argv)
    if args.check:
        return run_check()
    if args.sass:
        return run_sass(args.sass_out)
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
