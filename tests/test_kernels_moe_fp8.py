"""FP8 routed-expert GEMMs (moeserve/kernels/fused_moe_fp8.py) against plain-torch references.

CPU: tiny fp32 and fp16 shapes under the Triton interpreter (which runs fp8 x fp8 tl.dot; its bf16 x bf16 tl.dot
returns garbage in Triton 3.9, so fp16 stands in for a 16-bit activation dtype there). GPU (marked `gpu`): bf16 at
Qwen3-30B-A3B expert shapes.

Bounds:
- weight-only, fp32 activations: the kernel multiplies exactly the dequantized weights of the reference
  (fp8 * scale_inv rounded once to fp32 in both), so only fp32 summation order differs: <= 1e-5 relative.
- W8A8 against the reference that quantizes the activations the same way (twins, bitwise for x; h may differ in
  the last fp32 bit before its quantization): <= 1e-5 relative.
- fp16 activations (gu, h and the output rounded to fp16, unit roundoff 2^-11; weight-only "tile" rounds the
  dequantized weight once more): weight-only <= 2e-3; W8A8 against its twin (which keeps gu and h in fp32, so a
  few h elements land one e4m3 step apart) <= 1e-2.
- W8A8 against the unquantized reference, element-wise (`w8a8_bound`): each quantized activation a' of a has
  |a' - a| <= 2^-4 |a| + 2^-10 s (s = its group's scale: half an ulp of its binade, or of the subnormal step);
  through gate_up: |dgu| <= |W13| (2^-4 |x| + 2^-10 s_x) =: D; through h = silu(g) u with |silu'| <= 1.1:
  |dh| <= 1.1 Dg (|u| + Du) + |silu(g)| Du =: Dh; h quantized: + 2^-4 (|h| + Dh) + 2^-10 s_h with s_h <= (group
  amax of |h| + Dh) / 448; through down: |dy| <= sum_k w |W2| (that). Measured: a relative error (norm) of 4-5 %
  against the unquantized output, each element at most 0.6 % of its bound (the bound is worst-case).
"""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any module with @triton.jit is imported

import itertools  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moeserve.kernels.fp8 import dequantize_block_fp8, quantize_block_fp8  # noqa: E402
from moeserve.kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from moeserve.kernels.fused_moe_fp8 import (  # noqa: E402
    dequantize_w13_fp8,
    fp8_plan,
    fused_moe_fp8,
    fused_moe_fp8_ref,
    quantize_w13_fp8,
)
from moeserve.kernels import fused_moe_fp8 as fused_moe_fp8_module  # noqa: E402
from moeserve.kernels import moe_plan  # noqa: E402
from moeserve.kernels.moe_plan import GemmTile, MoEPlan, MoEProblem  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _problem(num_tokens, num_experts, hidden, inter, top_k, seed=0, dtype=torch.float32, device=DEV):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=device) * inter**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    q13, s13 = quantize_w13_fp8(w13)
    q2, s2 = quantize_block_fp8(w2)
    return x, q13, s13, q2, s2, weights, ids.to(torch.int32)


def _small_plan(block_m=16, block_n=64, block_k=128, fused_act=True, y_fp32=True):
    tile = GemmTile(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4, num_stages=2)
    return MoEPlan(False, tile, tile, fused_act=fused_act, y_fp32=y_fp32)


def w8a8_bound(x, q13, s13, q2, s2, weights, ids):
    """Element-wise bound on |W8A8 - unquantized| (module docstring), fp32 rounding slack included."""
    w13 = dequantize_w13_fp8(q13, s13).double()
    w2 = dequantize_block_fp8(q2, s2).double()
    inter = w2.shape[2]
    xs = x.double()
    gx = F.pad(xs.abs(), (0, -xs.shape[1] % 128)).view(xs.shape[0], -1, 128).amax(-1) / 448
    sx = gx.repeat_interleave(128, 1)[:, :xs.shape[1]]
    eps = 2.0**-4
    out = torch.zeros_like(xs)
    for t in range(xs.shape[0]):
        for k, e in enumerate(ids[t].tolist()):
            gu = w13[e] @ xs[t]
            d = w13[e].abs() @ (eps * xs[t].abs() + 2.0**-10 * sx[t])
            g, u, dg, du = gu[:inter], gu[inter:], d[:inter], d[inter:]
            h = F.silu(g) * u
            dh = 1.1 * dg * (u.abs() + du) + F.silu(g).abs() * du
            hmax = F.pad(h.abs() + dh, (0, -inter % 128)).view(-1, 128).amax(-1) / 448
            sh = hmax.repeat_interleave(128)[:inter]
            dq = dh + eps * (h.abs() + dh) + 2.0**-10 * sh
            out[t] += weights[t, k].double() * (w2[e].abs() @ dq)
    slack = 1e-5 * out.abs().max()
    return out + slack


def test_reference_routed_and_dense_agree():
    """The twin's two schedules (routed pairs on the CPU; every row weighted, sync-free, elsewhere) give the same
    sums, with an expert id outside [0, E) (another rank's) skipped by both."""
    x, q13, s13, q2, s2, weights, ids = _problem(9, 4, 256, 128, 2, seed=13)
    ids[0, 1] = 7
    for act_quant in (False, True):
        routed = fused_moe_fp8_ref(x, q13, s13, q2, s2, weights, ids, act_quant=act_quant, routed=True)
        dense = fused_moe_fp8_ref(x, q13, s13, q2, s2, weights, ids, act_quant=act_quant, routed=False)
        assert _rel(dense, routed) < 1e-6 and routed.abs().sum() > 0


@pytest.mark.parametrize("hidden,inter", [(256, 128), (192, 192)])
def test_weight_only_matches_dequantized_fp32(hidden, inter):
    problem = _problem(9, 4, hidden, inter, 2)
    x, q13, s13, q2, s2, weights, ids = problem
    out = fused_moe_fp8(*problem, act_quant=False, plan=_small_plan())
    ref = fused_moe_ref(x, dequantize_w13_fp8(q13, s13), dequantize_block_fp8(q2, s2), weights, ids)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert _rel(out, ref) < 1e-5
    assert _rel(out, fused_moe_fp8_ref(*problem, act_quant=False)) < 1e-5


def test_fp16_activations():
    """16-bit activations on every path (gu, h and the output rounded to fp16; "tile" rounds the dequantized weight
    too). At H 256, I 128: the partial scale groups of H or I 192 are masks that do not depend on the dtype, run at
    192 x 192 in fp32 on the same paths (weight-only both scalings, W8A8, the GEMV: the tests above and below)."""
    problem = _problem(9, 4, 256, 128, 2, seed=2, dtype=torch.float16)
    unquantized = fused_moe_fp8_ref(*problem, act_quant=False).float()
    quantized = fused_moe_fp8_ref(*problem, act_quant=True).float()
    for weight_scale in ("tile", "product"):
        out = fused_moe_fp8(*problem, act_quant=False, plan=_small_plan(), weight_scale=weight_scale)
        assert out.dtype == torch.float16 and _rel(out, unquantized) < 2e-3
    assert _rel(fused_moe_fp8(*problem, act_quant=False, decode=True), unquantized) < 2e-3
    assert _rel(fused_moe_fp8(*problem, act_quant=True, plan=_small_plan()), quantized) < 1e-2
    assert _rel(fused_moe_fp8(*problem, act_quant=True, decode=True), quantized) < 1e-2


def test_weight_only_options_and_a_k_step_of_64():
    problem = _problem(7, 4, 192, 192, 2, seed=1)
    ref = fused_moe_fp8_ref(*problem, act_quant=False)
    for plan in (_small_plan(fused_act=False, y_fp32=False), _small_plan(block_m=32, block_n=32, block_k=64)):
        for weight_scale in ("tile", "product"):
            out = fused_moe_fp8(*problem, act_quant=False, plan=plan, weight_scale=weight_scale)
            assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("hidden,inter", [(256, 128), (192, 192)])
def test_w8a8_matches_activation_quantized_reference(hidden, inter):
    problem = _problem(9, 4, hidden, inter, 2, seed=2)
    out = fused_moe_fp8(*problem, act_quant=True, plan=_small_plan(block_k=64))
    assert _rel(out, fused_moe_fp8_ref(*problem, act_quant=True)) < 1e-5
    unquantized = fused_moe_fp8_ref(*problem, act_quant=False)
    err = (out.double() - unquantized.double()).abs()
    assert (err <= w8a8_bound(*problem)).all()
    assert 1e-3 < _rel(out, unquantized) < 0.08  # quantized activations do move the output, by a few percent


# a tile inside one scale block along N reads one scale per K step; one that spans two (256 columns) or straddles
# the up half (w13's N 384, up from column 192: the 128-column tile at 128) a scale per column; the down tile at 128
# of N 192 wraps past N
@pytest.mark.parametrize("hidden,inter,block_n", [(256, 128, 64), (256, 128, 256), (192, 192, 128)])
def test_scale_per_tile_or_per_column_and_weights_by_tma(hidden, inter, block_n):
    problem = _problem(9, 4, hidden, inter, 2, seed=3)
    for act_quant in (False, True):
        plan = _small_plan(block_n=block_n, block_k=64, fused_act=not act_quant)
        out = fused_moe_fp8(*problem, act_quant=act_quant, plan=plan)
        assert _rel(out, fused_moe_fp8_ref(*problem, act_quant=act_quant)) < 1e-5
        # weight tiles through TMA descriptors: the same tiles, bitwise
        assert torch.equal(fused_moe_fp8(*problem, act_quant=act_quant, plan=replace(plan, weights_tma=True)), out)


# GEMV K steps inside one scale group, and spanning two or four (the last one partial where H or I is 192)
@pytest.mark.parametrize("hidden,inter,block_ks", [(256, 128, (256,)), (192, 192, (64, 512))])
def test_decode_path_matches_twins_and_the_sorted_path(hidden, inter, block_ks):
    problem = _problem(3, 4, hidden, inter, 2, seed=4)
    for act_quant in (False, True):
        ref = fused_moe_fp8_ref(*problem, act_quant=act_quant)
        sorted_out = fused_moe_fp8(*problem, act_quant=act_quant, decode=False)
        assert _rel(sorted_out, ref) < 1e-5
        for block_k in block_ks:
            gemv = GemmTile(block_n=32, block_k=block_k, num_warps=4, num_stages=1)
            out = fused_moe_fp8(*problem, act_quant=act_quant, plan=MoEPlan(True, gemv, gemv))
            assert _rel(out, ref) < 1e-5
            assert _rel(out, sorted_out) < 1e-5
    assert fp8_plan(3, 2, MoEProblem(4, hidden, inter, 2, torch.float32, torch.device(DEV)), False).decode


# gu rows of an unrouted pair are never written (torch.empty) but W8A8 quantizes whole rows: the interpreter's numpy
# may overflow in exp on that garbage, rows no output reads
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_empty_experts_unrouted_pairs_and_zero_tokens():
    x, q13, s13, q2, s2, weights, ids = _problem(6, 4, 256, 128, 2, seed=3)
    ids[:, :] = torch.where(ids == 3, 0, ids)  # expert 3 gets no pair
    ids[2, 1] = -1  # a pair routed nowhere contributes nothing
    for act_quant in (False, True):
        ref = fused_moe_fp8_ref(x, q13, s13, q2, s2, weights, ids, act_quant=act_quant)
        gemv = GemmTile(block_n=64, block_k=128, num_warps=4, num_stages=1)
        for plan in (_small_plan(), MoEPlan(True, gemv, gemv)):
            out = fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, act_quant=act_quant, plan=plan)
            assert _rel(out, ref) < 1e-5
    assert fused_moe_fp8(x[:0], q13, s13, q2, s2, weights[:0], ids[:0], act_quant=True).shape == (0, 256)


def test_bad_inputs_are_named():
    x, q13, s13, q2, s2, weights, ids = _problem(4, 4, 256, 128, 2)
    with pytest.raises(ValueError, match="w13_scale_inv"):
        fused_moe_fp8(x, q13, s13[:, :1], q2, s2, weights, ids, act_quant=False)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_moe_fp8(x, q13.float(), s13, q2, s2, weights, ids, act_quant=False)
    with pytest.raises(ValueError, match="block_k"):
        fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, act_quant=True, plan=_small_plan(block_k=256))
    with pytest.raises(ValueError, match="block_k"):
        fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, act_quant=False,
                      plan=replace(_small_plan(block_k=96), decode=True))
    with pytest.raises(ValueError, match="weight_scale"):
        fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, act_quant=False, weight_scale="row")
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe_fp8(x, q13, s13, q2.transpose(1, 2).contiguous().transpose(1, 2), s2, weights, ids,
                      act_quant=False)


@pytest.mark.parametrize("device_name", [None, "NVIDIA H200"])  # the heuristic; the shipped H200 table
def test_default_plan_keeps_k_steps_inside_scale_groups(monkeypatch, device_name):
    monkeypatch.setattr(moe_plan, "gpu_name", lambda device: device_name)
    monkeypatch.setattr(fused_moe_fp8_module, "gpu_name", lambda device: device_name)
    moe_plan.default_plan.cache_clear()
    fp8_plan.cache_clear()
    problem = MoEProblem(128, 2048, 768, 8, torch.bfloat16, torch.device("cpu"))
    try:
        for tokens in (1, 64, 512, 8192):
            for act_quant in (False, True, None):
                plan = fp8_plan(tokens, 8, problem, act_quant)
                assert plan.decode == (tokens == 1)  # the bf16 path choice
                if plan.decode:  # GEMV: twice the bf16 K step (same bytes), whole scale groups
                    assert plan.gate_up.block_k % 128 == 0 and plan.down.block_k % 128 == 0
                    continue
                assert 128 % plan.gate_up.block_k == 0 and 128 % plan.down.block_k == 0
                assert plan.gate_up.block_m == plan.down.block_m
                assert not (act_quant is not False and plan.fused_act)
                if act_quant is not False:
                    assert all(t.block_m * t.block_n <= 128 * 128 for t in (plan.gate_up, plan.down))
    finally:
        moe_plan.default_plan.cache_clear()  # no plan of the fake device left for later tests
        fp8_plan.cache_clear()


def test_fp8_plan_takes_the_tuned_fp8_rows_and_its_own_path_threshold(monkeypatch):
    """On the H200 the FP8 sorted path runs the table's FP8 rows of its multiplication (dtype "fp8_w8a8" / "fp8_w",
    which differ at T = 512), not bf16's refitted; the GEMV path serves up to FP8_DECODE_MAX_PAIRS pairs; None runs
    W8A8's plan on the sorted path."""
    monkeypatch.setattr(moe_plan, "gpu_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(fused_moe_fp8_module, "gpu_name", lambda device: "NVIDIA H200")
    moe_plan.default_plan.cache_clear()
    fp8_plan.cache_clear()
    problem = MoEProblem(128, 2048, 768, 8, torch.bfloat16, torch.device("cpu"))
    last_gemv = fused_moe_fp8_module.FP8_DECODE_MAX_PAIRS // 8
    try:
        assert fp8_plan(last_gemv, 8, problem, None).decode and not fp8_plan(last_gemv + 1, 8, problem, None).decode
        tiles = {}
        for tokens in (last_gemv + 1, 512, 8192):
            for act_quant, label in ((True, "fp8_w8a8"), (False, "fp8_w")):
                plan = fp8_plan(tokens, 8, problem, act_quant)
                tuned = moe_plan.tuned_tiles(tokens, problem, "NVIDIA H200", dtype_label=label)
                assert tuned is not None and (plan.gate_up, plan.down) == tuned[:2], (tokens, label)
                assert not plan.fused_act
                tiles[tokens, act_quant] = plan.gate_up
            assert fp8_plan(tokens, 8, problem, None) == fp8_plan(tokens, 8, problem, True)
        assert tiles[512, True] != tiles[512, False]
    finally:
        moe_plan.default_plan.cache_clear()
        fp8_plan.cache_clear()


def test_auto_multiplication_is_w8a8_sorted_and_weight_only_on_the_gemv_path():
    """act_quant=None (what the engine runs) is bitwise the W8A8 call on the sorted path and the weight-only call on
    the GEMV path (and not the other one: the two differ on these inputs)."""
    problem = _problem(9, 4, 256, 128, 2, seed=3)
    for decode, same in ((False, True), (True, False)):
        auto = fused_moe_fp8(*problem, act_quant=None, decode=decode)
        assert torch.equal(auto, fused_moe_fp8(*problem, act_quant=same, decode=decode)), decode
        assert not torch.equal(auto, fused_moe_fp8(*problem, act_quant=not same, decode=decode)), decode


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at Qwen3-30B-A3B expert shapes


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 16, 256, 2048])  # GEMV path at 1 and 8
def test_gpu_qwen3_shapes_against_twins(num_tokens):
    problem = _problem(num_tokens, 128, 2048, 768, 8, seed=5, dtype=torch.bfloat16, device="cuda")
    x, q13, s13, q2, s2, weights, ids = problem
    n = min(64, num_tokens)  # the per-pair references run on the first tokens
    sub = (x[:n], q13, s13, q2, s2, weights[:n], ids[:n])
    unquantized = fused_moe_fp8_ref(*sub, act_quant=False).float()
    out = fused_moe_fp8(*problem, act_quant=False)
    assert out.dtype == torch.bfloat16
    assert _rel(out[:n], unquantized) < 1e-2  # bf16 activations, gu and h, as the bf16 path's bound
    # the bf16 kernel on the bf16-rounded dequantized weights agrees as closely
    bf16 = fused_moe(x, dequantize_w13_fp8(q13, s13, dtype=torch.bfloat16),
                     dequantize_block_fp8(q2, s2, dtype=torch.bfloat16), weights, ids)
    assert _rel(out, bf16) < 1e-2
    assert _rel(fused_moe_fp8(*problem, act_quant=False, weight_scale="product")[:n], unquantized) < 1e-2
    out = fused_moe_fp8(*problem, act_quant=True)
    # the sorted path rounds gu and h to bf16 before h is quantized, the twin does not: a few % of the h elements
    # land one e4m3 step apart (a torch simulation at these shapes: 1.5 % relative); the GEMV path keeps gu fp32
    assert _rel(out[:n], fused_moe_fp8_ref(*sub, act_quant=True)) < 2.5e-2
    assert _rel(out[:n], unquantized) < 0.08
    err = (out[:n].double() - unquantized.double()).abs()
    assert (err <= w8a8_bound(*sub) + 2e-2 * unquantized.abs().max()).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [256, 4096])
def test_gpu_weights_by_tma_are_bitwise_the_pointer_loads(num_tokens):
    problem = _problem(num_tokens, 128, 2048, 768, 8, seed=9, dtype=torch.bfloat16, device="cuda")
    limit = moe_plan.smem_limit(torch.device("cuda"))
    # one scale per tile (N 128), a scale per column (N 256)
    for (block_m, block_n, warps), act_quant in itertools.product(((64, 128, 4), (128, 128, 8), (64, 256, 8)),
                                                                 (False, True)):
        tile = GemmTile(block_m=block_m, block_n=block_n, block_k=128, num_warps=warps, num_stages=3)
        a_bytes = 1 if act_quant else 2
        plan = MoEPlan(False, moe_plan.fit_tile(tile, a_bytes, 1, limit),
                       moe_plan.fit_tile(tile, a_bytes, 1 if act_quant else 2, limit), fused_act=not act_quant)
        out = fused_moe_fp8(*problem, act_quant=act_quant, plan=plan)
        assert torch.equal(fused_moe_fp8(*problem, act_quant=act_quant, plan=replace(plan, weights_tma=True)), out)


@pytest.mark.gpu
@gpu
def test_gpu_graph_replay_is_eager():
    x, q13, s13, q2, s2, weights, ids = _problem(64, 128, 2048, 768, 8, seed=6, dtype=torch.bfloat16, device="cuda")
    for act_quant in (False, True):
        def run():
            return fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, act_quant=act_quant)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # compile and warm up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        # new routing and activations in the captured buffers: the replay computes them, as eager does
        x2, *_, weights2, ids2 = _problem(64, 128, 2048, 768, 8, seed=7, dtype=torch.bfloat16, device="cuda")
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run())


@pytest.mark.gpu
@gpu
def test_gpu_pdl_launches_are_bitwise_the_plain_ones():
    from moeserve.kernels.pdl import supported

    if not supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    for num_tokens in (4, 512):  # the GEMV and the sorted path
        problem = _problem(num_tokens, 128, 2048, 768, 8, seed=8, dtype=torch.bfloat16, device="cuda")
        for act_quant in (False, True):
            plain = fused_moe_fp8(*problem, act_quant=act_quant)
            assert torch.equal(fused_moe_fp8(*problem, act_quant=act_quant, pdl=True), plain)


# ---------------------------------------------------------------------------------------------
# LoRA on an FP8 base: the expands in the FP8 GEMMs' epilogues, every shrink on the unquantized activations


def _lora_args(num_tokens, num_experts, hidden, inter, gen, device=DEV, dtype=torch.float32):
    from moeserve.kernels.fused_moe import MoELoRAArgs

    ranks = [8, 0, 4]  # slot 1 is empty
    pool = [torch.randn(3, num_experts, *shape, generator=gen, device=device) * 0.1
            for shape in ((8, hidden), (2 * inter, 8), (8, inter), (hidden, 8))]
    for s, r in enumerate(ranks):  # columns >= a slot's rank are zero, as the LoRA manager keeps them
        pool[0][s, :, r:] = pool[1][s, ..., r:] = pool[2][s, :, r:] = pool[3][s, ..., r:] = 0
    slots = torch.tensor([0, -1, 2, 1][:num_tokens] * (num_tokens // 4 + 1), dtype=torch.int32, device=device)
    return MoELoRAArgs(slots[:num_tokens], torch.tensor(ranks, dtype=torch.int32, device=device),
                       *[p.to(dtype) for p in pool])


def _check_lora_on_fp8(num_tokens, num_experts, hidden, inter, top_k, dtype, device, plan):
    """fused_moe_fp8(lora=...) on `plan`'s sorted path, weight-only and W8A8: against fused_moe's fp32 reference with
    LoRA on the dequantized weights; the rows without an adapter (no slot, or the rank-0 slot 1) bitwise the LoRA-free
    FP8 call on the same plan."""
    problem = _problem(num_tokens, num_experts, hidden, inter, top_k, seed=9, dtype=dtype, device=device)
    x, q13, s13, q2, s2, weights, ids = problem
    lora = _lora_args(num_tokens, num_experts, hidden, inter, torch.Generator(device=device).manual_seed(10),
                      device, dtype)
    n = min(num_tokens, 32)  # the per-pair references run on the first tokens
    sub = (x[:n], q13, s13, q2, s2, weights[:n], ids[:n])
    w13, w2 = dequantize_w13_fp8(q13, s13), dequantize_block_fp8(q2, s2)
    sub_lora = replace(lora, token_slots=lora.token_slots[:n])
    ref = fused_moe_ref(x[:n].float(), w13, w2, weights[:n], ids[:n], sub_lora).float()
    ref_base = fused_moe_ref(x[:n].float(), w13, w2, weights[:n], ids[:n]).float()
    no_adapter = (lora.token_slots < 0) | (lora.token_slots == 1)  # no slot, or a slot of rank 0
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    # weight-only: fused_moe's fp32 reference with LoRA on the dequantized weights; the rows without an adapter
    # bitwise the LoRA-free FP8 call on the same tiles (they add exact zeros to the GEMMs' accumulators)
    out = fused_moe_fp8(*problem, act_quant=False, plan=plan, lora=lora)
    assert _rel(out[:n], ref) < tol
    assert _rel(out[:n].float() - ref_base, ref - ref_base) < 10 * tol
    base = fused_moe_fp8(*problem, act_quant=False, plan=plan)
    assert torch.equal(out[no_adapter], base[no_adapter])
    # W8A8: the rows without an adapter bitwise the LoRA-free W8A8 call (the activation kernel quantizes the same h
    # with LoRA or without); the adapter deltas within the activation-quantization error of the reference's, since
    # the shrinks read the unquantized x and h
    out = fused_moe_fp8(*problem, act_quant=True, plan=plan, lora=lora)
    base = fused_moe_fp8(*problem, act_quant=True, plan=plan)
    assert torch.equal(out[no_adapter], base[no_adapter])
    assert _rel(out[:n], ref) < 0.08
    assert _rel(out[:n].float() - base[:n].float(), ref - ref_base) < 0.08


def test_lora_on_fp8_gemms_matches_the_dequantized_reference():
    _check_lora_on_fp8(9, 4, 256, 128, 2, torch.float32, DEV, _small_plan())


def test_lora_on_fp8_gemms_fp16_rows_without_adapter_bitwise():
    # 16-bit activations: gu, h and y rounded to fp16, with LoRA and without alike
    _check_lora_on_fp8(9, 4, 256, 128, 2, torch.float16, DEV, _small_plan(fused_act=False, y_fp32=False))


@pytest.mark.gpu
@gpu
def test_gpu_lora_on_fp8_gemms_bf16():
    tile = GemmTile(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
    _check_lora_on_fp8(256, 128, 2048, 768, 8, torch.bfloat16, "cuda",
                       MoEPlan(False, tile, tile, fused_act=False, y_fp32=False))


@pytest.mark.parametrize("num_tokens,own_act", [(3, False), (40, False), (40, True)])
def test_fused_moe_fp8_with_lora_rows_without_adapter_are_the_lora_free_call(num_tokens, own_act):
    """fused_moe_fp8(lora=...): the adapter rows as fused_moe's fp32 reference with LoRA on the dequantized weights,
    the others bitwise the call without LoRA, on either path; with one A per slot, then with slot 0's own up A (a
    pool with lora_separate_gate_up). The LoRA-free calls they are compared with are the same for both pools.
    6 pairs: the GEMV path; 80: the sorted path (its expands in the GEMM epilogues, the heuristic's LoRA options),
    with the heuristic's plan (SiLU*up in the down GEMM) or, `own_act`, a plan with SiLU*up by its own kernel."""
    problem = _problem(num_tokens, 4, 256, 128, 2, seed=11)
    x, q13, s13, q2, s2, weights, ids = problem
    w13, w2 = dequantize_w13_fp8(q13, s13), dequantize_block_fp8(q2, s2)
    plan = dict(plan=_small_plan(fused_act=False)) if own_act else {}
    if num_tokens == 3:  # the GEMV path in 128-column programs: its arithmetic per column, a quarter of the programs
        wide = GemmTile(block_n=128, block_k=256, num_warps=4, num_stages=1)
        plan = dict(plan=MoEPlan(True, wide, wide))
    base = {act_quant: fused_moe_fp8(*problem, act_quant=act_quant, **plan) for act_quant in (False, True)}
    ref_base = fused_moe_ref(x.float(), w13, w2, weights, ids).float()
    for separate_up in (False, True):
        gen = torch.Generator(device=DEV).manual_seed(12)
        lora = _lora_args(num_tokens, 4, 256, 128, gen)
        if separate_up:
            up_a = torch.randn(lora.gate_up_a.shape, generator=gen, device=DEV) * 0.1
            up_a[0, :, 8:] = up_a[2, :, 4:] = 0
            lora = replace(lora, up_a=up_a, gate_up_separate=torch.tensor([1, 0, 0], dtype=torch.int32, device=DEV))
        ref = fused_moe_ref(x.float(), w13, w2, weights, ids, lora).float()
        out = fused_moe_fp8(*problem, act_quant=False, lora=lora, **plan)
        no_adapter = lora.token_slots < 0
        assert no_adapter.any() and torch.equal(out[no_adapter], base[False][no_adapter]), separate_up
        assert _rel(out, ref) < 1e-5, separate_up
        assert _rel(out - base[False], ref - ref_base) < 1e-4, separate_up  # the deltas
        # W8A8: the same for the rows without an adapter; the others within the activation-quantization error
        out = fused_moe_fp8(*problem, act_quant=True, lora=lora, **plan)
        assert torch.equal(out[no_adapter], base[True][no_adapter]), separate_up
        assert _rel(out, ref) < 0.08, separate_up


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [4, 256])  # 32 pairs: the GEMV path; 2,048: the sorted path
def test_gpu_fused_moe_fp8_with_lora_bf16_qwen3_shapes(num_tokens):
    """bf16 activations at Qwen3-30B-A3B expert shapes: the rows without an adapter bitwise the LoRA-free call, the
    adapter deltas against fused_moe's fp32 reference on the dequantized weights; and the call replayed from a
    CUDA graph equals eager."""
    problem = _problem(num_tokens, 128, 2048, 768, 8, seed=21, dtype=torch.bfloat16, device="cuda")
    x, q13, s13, q2, s2, weights, ids = problem
    lora = _lora_args(num_tokens, 128, 2048, 768, torch.Generator(device="cuda").manual_seed(22), "cuda",
                      torch.bfloat16)
    out = fused_moe_fp8(*problem, act_quant=False, lora=lora)
    base = fused_moe_fp8(*problem, act_quant=False)
    no_adapter = lora.token_slots < 0
    assert torch.equal(out[no_adapter], base[no_adapter])
    n = min(num_tokens, 16)
    w13, w2 = dequantize_w13_fp8(q13, s13), dequantize_block_fp8(q2, s2)
    sub_lora = replace(lora, token_slots=lora.token_slots[:n])
    ref = fused_moe_ref(x[:n].float(), w13, w2, weights[:n], ids[:n], sub_lora).float()
    ref_base = fused_moe_ref(x[:n].float(), w13, w2, weights[:n], ids[:n]).float()
    assert _rel(out[:n].float() - base[:n].float(), ref - ref_base) < 0.05
    graph = torch.cuda.CUDAGraph()
    fused_moe_fp8(*problem, act_quant=False, lora=lora)  # compiled outside the capture
    with torch.cuda.graph(graph):
        replayed = fused_moe_fp8(*problem, act_quant=False, lora=lora)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
