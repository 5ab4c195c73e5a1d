"""Dense FP8 linear (moeserve/kernels/fp8_linear.py) against its fp32 twin on the dequantized weight.

Weight-only with fp32 activations multiplies exactly the twin's dequantized weight (<= 1e-5 relative); W8A8
against the twin that quantizes x the same way (bitwise quantizer): <= 1e-5; against unquantized x: each
element within |W| @ (2^-4 |x| + 2^-10 s_x) (half an ulp of each quantized activation, as in
test_kernels_moe_fp8.py)."""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any module with @triton.jit is imported

import pytest  # noqa: E402

from moeserve.kernels.fp8 import dequantize_block_fp8, quantize_block_fp8, quantize_groups_fp8  # noqa: E402
from moeserve.kernels import fp8_linear as fp8_linear_module  # noqa: E402
from moeserve.kernels.fp8_linear import (  # noqa: E402
    AUTO_W8A8_MIN_ROWS,
    GemvTile,
    fp8_linear,
    fp8_linear_ref,
    fuses_lora,
    gemv_serves,
    input_quant,
    linear_split,
    split_counter_slots,
    split_counters,
)
from moeserve.kernels.moe_plan import GemmTile  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _problem(m, n, k, seed=0, dtype=torch.float32, device=DEV, bias=True):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = torch.randn(n, k, generator=gen, device=device) * k**-0.5
    q, s = quantize_block_fp8(w)
    b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
    return x, q, s, b


def _bound(x, q, s):
    xs = x.double()
    k = xs.shape[1]
    sx = torch.nn.functional.pad(xs.abs(), (0, -k % 128)).view(xs.shape[0], -1, 128).amax(-1) / 448
    sx = sx.repeat_interleave(128, 1)[:, :k]
    return (2.0**-4 * xs.abs() + 2.0**-10 * sx) @ dequantize_block_fp8(q, s).double().abs().T


@pytest.mark.parametrize("m,n,k", [(5, 256, 256), (37, 200, 192)])
def test_weight_only_and_w8a8_against_twins(m, n, k):
    x, q, s, b = _problem(m, n, k)
    out = fp8_linear(x, q, s, b, act_quant=False)
    ref = fp8_linear_ref(x, q, s, b, act_quant=False)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert _rel(out, ref) < 1e-5
    assert _rel(out, x @ dequantize_block_fp8(q, s).T + b) < 1e-5
    assert _rel(fp8_linear(x, q, s, b, act_quant=False, weight_scale="product"), ref) < 1e-5
    out = fp8_linear(x, q, s, b, act_quant=True, tile=GemmTile(block_m=16, block_n=32, block_k=64))
    assert _rel(out, fp8_linear_ref(x, q, s, b, act_quant=True)) < 1e-5
    assert ((out.double() - ref.double()).abs() <= _bound(x, q, s) * (1 + 1e-5) + 1e-5).all()
    assert 1e-3 < _rel(out, ref) < 0.05


@pytest.mark.parametrize("m", [1, 2])
def test_decode_rows_take_the_gemv_against_twins(m):
    """Up to GEMV_MAX_ROWS rows the CUDA-core GEMV (every weight row read once for all rows; forced by a launch
    where gemv_serves would not), with a ragged K (320: a K step past K, a partial last scale group) and N (37: a
    partial last program), weight-only and W8A8, against the twins and against the tensor-core kernel forced by a
    tile."""
    x, q, s, b = _problem(m, 37, 320, seed=4)
    tile = GemmTile(block_m=16, block_n=32, block_k=64)
    for act_quant in (False, True):
        out = fp8_linear(x, q, s, b, act_quant=act_quant, gemv_tile=GemvTile())
        assert out.shape == (m, 37)
        assert _rel(out, fp8_linear_ref(x, q, s, b, act_quant=act_quant)) < 1e-5
        assert _rel(out, fp8_linear(x, q, s, b, act_quant=act_quant, tile=tile)) < 1e-5
    # each row its own: a row alone gives the same result as in the batch
    assert _rel(fp8_linear(x[-1:], q, s, b, act_quant=False), fp8_linear(x, q, s, b, act_quant=False)[-1:]) < 1e-6


def test_gemv_serves_one_row_where_k_exceeds_n(monkeypatch):
    """The engine's pick at decode sizes: one row of a projection with K > N (o_proj's shape) runs the GEMV; one row
    with K < N (q|k|v's) and two rows of either run the tensor-core kernel (H200: gemv_serves' numbers)."""
    launched = []
    monkeypatch.setattr(fp8_linear_module, "_gemv_linear", lambda *a, **k: launched.append("gemv") or
                        torch.zeros(a[0].shape[0], a[1].shape[0]))
    # (1, 64, 2048): a K walk long enough to split (linear_split) runs the split tensor-core kernel instead
    for m, n, k, want in ((1, 64, 256, ["gemv"]), (2, 64, 256, []), (1, 256, 64, []), (1, 128, 128, []),
                          (1, 64, 2048, [])):
        launched.clear()
        x, q, s, _ = _problem(m, n, k, seed=2, bias=False)
        fp8_linear(x, q, s, act_quant=False)
        assert launched == want, (m, n, k)
        assert gemv_serves(m, n, k) == bool(want)


@pytest.mark.parametrize("m,sizes,k,pattern", [
    (1, (48, 16, 16), 64, (1,)),  # K < N: the tensor-core tile's epilogue, three q|k|v slices
    (1, (40,), 320, (2,)),  # K > N: the GEMV's epilogue (o_proj's shape), one slice, a ragged K
    (2, (48, 16, 16), 64, (0, -1)),  # two rows: the tile, one row without an adapter
    (2, (40,), 320, (3, 1)),  # a rank-0 slot and a rank-16 one
    (2, (40,), 2048, (1, 0)),  # a K walk split in two (linear_split): the expand in the last program's epilogue
], ids=["tile-qkv", "gemv-o", "tile-2rows", "tile-rank0", "split-k"])
def test_lora_expand_in_the_fp8_epilogue_against_references(m, sizes, k, pattern):
    """Weight-only decode rows (fuses_lora) add each adapter row's expand in the FP8 product's epilogue, from the
    dense shrink's split partials: against the fp32 references (the dequantized product plus dense_lora_ref), and
    rows without an adapter (slot -1, rank 0) bitwise the call without LoRA."""
    from moeserve.kernels.gemv import GemvLoRA
    from moeserve.kernels.lora_dense import dense_lora_ref, dense_lora_shrink

    n = sum(sizes)
    x, q, s, b = _problem(m, n, k, seed=11 + m + k)
    gen = torch.Generator(device=DEV).manual_seed(5)
    ranks = torch.tensor([8, 16, 4, 0], dtype=torch.int32, device=DEV)
    a_pool = torch.randn(4, len(sizes), 16, k, generator=gen, device=DEV) * 0.1
    b_pool = torch.randn(4, n, 16, generator=gen, device=DEV) * 0.1
    for slot, r in enumerate(ranks.tolist()):  # the pool's contract: zeros past each slot's rank
        a_pool[slot, :, r:] = 0
        b_pool[slot, :, r:] = 0
    slots = torch.tensor(pattern, dtype=torch.int32, device=DEV)
    assert fuses_lora(m, None) and not fuses_lora(m, True) and not fuses_lora(3, None)
    plain = fp8_linear(x, q, s, b, act_quant=None)
    scratch = dense_lora_shrink(x, a_pool, slots, ranks, k_splits=2)
    got = fp8_linear(x, q, s, b, act_quant=None, lora=GemvLoRA(scratch, b_pool, slots, ranks, sizes))
    want = fp8_linear_ref(x, q, s, b, act_quant=False)
    dense_lora_ref(x, a_pool, b_pool, slots, ranks, sizes, want)
    assert _rel(got, want) < 1e-5
    untouched = (slots < 0) | (ranks[slots.clamp_min(0).long()] == 0)
    assert torch.equal(got[untouched], plain[untouched])
    assert (got[~untouched] != plain[~untouched]).any(dim=1).all()
    with pytest.raises(ValueError, match="LoRA epilogue"):  # W8A8 quantizes x in the launch the shrink needs
        fp8_linear(x, q, s, b, act_quant=True, lora=GemvLoRA(scratch, b_pool, slots, ranks, sizes))


def test_a_producers_fp8_copy_is_read_in_place_of_quantizing(monkeypatch):
    """input_quant says where a call reads x quantized (W8A8; on the CPU the Triton kernel's row-major scales; the
    weight-only rows read x itself); a copy in that layout is read instead of a quantization launch, bitwise the
    call that quantizes; a copy in another layout, or for a weight-only call, is refused by name."""
    x, q, s, b = _problem(AUTO_W8A8_MIN_ROWS, 64, 256, seed=9)
    assert input_quant(x[:AUTO_W8A8_MIN_ROWS - 1], q, None) is None and input_quant(x[:2], q, True) == (128, False)
    assert input_quant(x, q, None) == (128, False) and input_quant(x, q, False) is None
    want, want_two = fp8_linear(x, q, s, b, act_quant=None), fp8_linear(x[:2], q, s, b, act_quant=True)
    x_fp8, two_fp8 = quantize_groups_fp8(x, 128), quantize_groups_fp8(x[:2], 128)
    launches = []
    monkeypatch.setattr(fp8_linear_module, "quantize_groups_fp8", lambda *a, **k: launches.append(1))
    assert torch.equal(fp8_linear(x, q, s, b, act_quant=None, x_fp8=x_fp8), want)
    assert torch.equal(fp8_linear(x[:2], q, s, b, act_quant=True, x_fp8=two_fp8), want_two)
    assert not launches
    with pytest.raises(ValueError, match="x_fp8"):
        fp8_linear(x, q, s, b, act_quant=False, x_fp8=x_fp8)
    with pytest.raises(ValueError, match="x_fp8"):
        fp8_linear(x, q, s, b, act_quant=None, x_fp8=(x_fp8[0], x_fp8[1].t().contiguous().t()))


def test_auto_multiplication_by_row_count():
    """act_quant=None (what the engine runs): weight-only below AUTO_W8A8_MIN_ROWS rows (bitwise the weight-only
    call: the GEMV at 2 rows, the tensor-core kernel at 3), W8A8 from there (bitwise the W8A8 call; on CUDA that is
    scaled_mm, checked in the GPU test below). Each differs from the other multiplication on these inputs."""
    x, q, s, b = _problem(AUTO_W8A8_MIN_ROWS, 64, 256, seed=7)
    for m, same in ((2, False), (3, False), (AUTO_W8A8_MIN_ROWS - 1, False), (AUTO_W8A8_MIN_ROWS, True)):
        auto = fp8_linear(x[:m], q, s, b, act_quant=None)
        assert torch.equal(auto, fp8_linear(x[:m], q, s, b, act_quant=same)), m
        assert not torch.equal(auto, fp8_linear(x[:m], q, s, b, act_quant=not same)), m


def test_leading_dims_no_bias_and_the_torch_backend():
    x, q, s, _ = _problem(6, 128, 256, seed=1, bias=False)
    x3 = x.view(2, 3, 256)
    out = fp8_linear(x3, q, s, act_quant=False)
    assert out.shape == (2, 3, 128)
    ref = fp8_linear_ref(x3, q, s, act_quant=False)
    assert _rel(out, ref) < 1e-5
    assert _rel(fp8_linear(x3, q, s, act_quant=True, backend="torch"), fp8_linear_ref(x3, q, s, act_quant=True)) == 0


def test_bad_inputs_are_named():
    x, q, s, b = _problem(4, 256, 256)
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_linear(x, q, s[:1], act_quant=False)
    with pytest.raises(ValueError, match="features"):
        fp8_linear(x[:, :128], q, s, act_quant=False)
    with pytest.raises(ValueError, match="backend"):
        fp8_linear(x, q, s, act_quant=False, backend="cutlass")
    with pytest.raises(ValueError, match="act_quant"):
        fp8_linear(x, q, s, act_quant=False, backend="scaled_mm")
    with pytest.raises(ValueError, match="K a multiple of 512, got blocks \\(128, 128\\), K 256"):
        fp8_linear(x, q, s, act_quant=True, backend="scaled_mm")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 8, 64, 512, 4096])
def test_gpu_projection_shapes_against_twins(m):
    # Qwen3-30B-A3B attention: qkv 2048 -> 4096 + 2 * 512, o 4096 -> 2048
    for n, k in ((5120, 2048), (2048, 4096)):
        x, q, s, b = _problem(m, n, k, seed=2, dtype=torch.bfloat16, device="cuda", bias=False)
        ref = fp8_linear_ref(x, q, s, act_quant=False)
        assert _rel(fp8_linear(x, q, s, act_quant=False), ref) < 1e-2
        assert _rel(fp8_linear(x, q, s, act_quant=False, weight_scale="product"), ref) < 1e-2
        qref = fp8_linear_ref(x, q, s, act_quant=True)
        assert _rel(fp8_linear(x, q, s, act_quant=True), qref) < 1e-2
        scaled = fp8_linear(x, q, s, act_quant=True, backend="scaled_mm")
        assert _rel(scaled, qref) < 1e-2
        assert _rel(qref, ref) < 0.05
        # the engine's pick: weight-only (split-K, GEMV or Triton) below AUTO_W8A8_MIN_ROWS, from there W8A8 on
        # the split Triton kernel where linear_split takes the K walk (o_proj's), else scaled_mm
        split = linear_split(m, n, k)
        if m < AUTO_W8A8_MIN_ROWS:
            want = fp8_linear(x, q, s, act_quant=False)
        elif split is not None:
            want = fp8_linear(x, q, s, act_quant=True, tile=split[0], split_k=split[1])
            assert _rel(want, qref) < 1e-2
        else:
            want = scaled
        assert torch.equal(fp8_linear(x, q, s, act_quant=None, backend="triton"), want)
        # a producer's fp8 copy in the layout input_quant asks (scaled_mm's M-major scales, the Triton kernel's
        # row-major ones): bitwise the same
        quant = input_quant(x, q, None)
        if m >= AUTO_W8A8_MIN_ROWS and (m % 4 == 0 or split is not None):
            assert quant == (128, split is None)
            x_fp8 = quantize_groups_fp8(x, 128, scale_m_major=split is None)
            assert torch.equal(fp8_linear(x, q, s, act_quant=None, x_fp8=x_fp8), want)
        else:
            assert quant is None or m % 4


@pytest.mark.parametrize("m,n,k,split,act_quant", [(5, 96, 384, 2, False), (20, 64, 512, 4, True),
                                                     (3, 40, 320, 4, False), (33, 64, 256, 3, True)])
def test_split_k_against_twins_and_counters_left_zero(m, n, k, split, act_quant):
    # more splits than some tiles have K steps (320 / 128 -> 3 steps in 4 splits: one walks none), a partial K
    # step, row and column tails; the counters the caller owns are zero again after each launch
    x, q, s, b = _problem(m, n, k, seed=4)
    tile = GemmTile(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=2)
    counters = torch.zeros(split_counters(m, n, tile), dtype=torch.int32, device=DEV)
    ref = fp8_linear_ref(x, q, s, b, act_quant=act_quant)
    for _ in range(2):  # the second launch finds the counters the first left
        out = fp8_linear(x, q, s, b, act_quant=act_quant, tile=tile, split_k=split, counters=counters)
        assert _rel(out, ref) < 1e-5
        assert not counters.any()
    assert _rel(fp8_linear(x, q, s, b, act_quant=act_quant, tile=tile, split_k=split), ref) < 1e-5
    with pytest.raises(ValueError, match="counters: need >= "):
        fp8_linear(x, q, s, b, act_quant=act_quant, tile=tile, split_k=split, counters=counters[:1])
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        fp8_linear(x, q, s, b, act_quant=act_quant, split_k=0)
    with pytest.raises(ValueError, match="split_k 2 splits the Triton GEMM; this call runs torch"):
        fp8_linear(x, q, s, b, act_quant=act_quant, split_k=2, backend="torch")


def test_default_split_by_rows_and_k():
    """linear_split: decode rows split a K walk of >= 2 x SPLIT_MIN_STEPS steps; a long K (o_proj's) up to
    SPLIT_MAX_ROWS rows, on the Triton W8A8 kernel rather than scaled_mm there; the default launch takes it."""
    from moeserve.kernels.fp8_linear import SPLIT_MAX_ROWS
    assert linear_split(1, 5120, 2048)[1] == 2 and linear_split(16, 2048, 4096)[1] == 4
    assert linear_split(1, 2048, 8192 * 4)[1] == 8
    assert linear_split(1, 5120, 1024) is None and linear_split(17, 5120, 2048) is None
    assert linear_split(64, 2048, 4096)[1] == 4 and linear_split(SPLIT_MAX_ROWS + 1, 2048, 4096) is None
    # a wide projection's tiles fill the GPU unsplit (SPLIT_MAX_PROGRAMS), or in fewer splits
    assert linear_split(1, 2 * 11008, 2048) is None and linear_split(1, 8192, 4096)[1] == 2
    x, q, s, _ = _problem(2, 40, 2048, seed=6, bias=False)
    out = fp8_linear(x, q, s, act_quant=False)
    tile, split = linear_split(2, 40, 2048)
    assert torch.equal(out, fp8_linear(x, q, s, act_quant=False, tile=tile, split_k=split))
    assert _rel(out, fp8_linear_ref(x, q, s, act_quant=False)) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [8, 64, 256])
def test_gpu_split_k_is_deterministic_against_twins(m):
    # programs of one tile finish in any order on a GPU: the last adds the partials in split order, so every
    # launch gives the same bits, within the twins' bounds, and leaves the counters zero
    for n, k in ((5120, 2048), (2048, 4096)):
        x, q, s, b = _problem(m, n, k, seed=5, dtype=torch.bfloat16, device="cuda", bias=False)
        for act_quant, want in ((False, fp8_linear_ref(x, q, s, act_quant=False)),
                                (True, fp8_linear_ref(x, q, s, act_quant=True))):
            for tile, split in ((GemmTile(16, 32, 128, 4, 4), 4), (GemmTile(64, 64, 128, 4, 4), 8)):
                counters = torch.zeros(split_counters(m, n, tile), dtype=torch.int32, device="cuda")
                first = fp8_linear(x, q, s, act_quant=act_quant, tile=tile, split_k=split, counters=counters)
                assert _rel(first, want) < 1e-2
                for _ in range(20):
                    assert torch.equal(fp8_linear(x, q, s, act_quant=act_quant, tile=tile, split_k=split,
                                                  counters=counters), first)
                torch.cuda.synchronize()
                assert not counters.any()


def test_an_fp8_module_passes_its_own_split_counters(monkeypatch):
    """A dense FP8 module (layers/linear.py through the weight format) hands its own arrival counters to a split
    launch (no memset a call), sized for every default split of its shard, and they are zero after it."""
    from moeserve.exec_options import ExecOptions, WeightFormat
    from moeserve.layers.linear import LoRALinear

    module = LoRALinear(2048, (40, 24), False, ExecOptions(linear_backend="triton"),
                        weights=WeightFormat(method="fp8"))
    assert module.weight_split_counters.numel() == split_counter_slots(64) and not module.weight_split_counters.any()
    gen = torch.Generator().manual_seed(12)
    module.weights.load(module, "weight", [(torch.randn(40, 2048, generator=gen) * 0.02, None),
                                           (torch.randn(24, 2048, generator=gen) * 0.02, None)])
    passed = []
    real = fp8_linear_module.fp8_linear
    monkeypatch.setattr(fp8_linear_module, "fp8_linear", lambda *a, **k: passed.append(k.get("counters"))
                        or real(*a, **k))
    x = torch.randn(2, 2048, generator=gen)
    out = module(x, None)
    assert passed and passed[-1] is module.weight_split_counters and linear_split(2, 64, 2048) is not None
    assert not module.weight_split_counters.any()
    ref = fp8_linear_ref(x, module.weight, module.weight_scale_inv, act_quant=False, block=module.weight_block)
    assert _rel(out, ref) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_split_k_under_pdl_lora_and_graph_replays(m):
    """The engine's way at decode rows: PDL launches, the LoRA expand in the epilogue of a tile's last program (its
    K walk under the shrink, late wait), the module's counters, a CUDA graph replayed: the replays give the eager
    call's bits, against the fp32 references, and leave the counters zero."""
    from moeserve.kernels.gemv import GemvLoRA
    from moeserve.kernels.lora_dense import dense_lora_ref, dense_lora_shrink
    from moeserve.kernels.pdl import supported

    n, k = 2048, 4096  # o_proj: split in 4 (linear_split)
    assert linear_split(m, n, k)[1] == 4
    x, q, s, _ = _problem(m, n, k, seed=9, dtype=torch.bfloat16, device="cuda", bias=False)
    gen = torch.Generator(device="cuda").manual_seed(9)
    a_pool = (torch.randn(2, 1, 16, k, generator=gen, device="cuda") * 0.05).bfloat16()
    b_pool = (torch.randn(2, n, 16, generator=gen, device="cuda") * 0.05).bfloat16()
    ranks = torch.tensor([16, 8], dtype=torch.int32, device="cuda")
    a_pool[1, :, 8:] = 0  # the pool's contract: zeros past each slot's rank (the expand reads whole rank blocks)
    b_pool[1, :, 8:] = 0
    slots = torch.tensor([1, -1][:m], dtype=torch.int32, device="cuda")
    counters = torch.zeros(split_counter_slots(n), dtype=torch.int32, device="cuda")
    pdl = supported(torch.device("cuda"))

    def step():
        scratch = dense_lora_shrink(x, a_pool, slots, ranks, k_splits=2, pdl=pdl)
        return fp8_linear(x, q, s, act_quant=None, pdl=pdl, counters=counters,
                          lora=GemvLoRA(scratch, b_pool, slots, ranks, (n,)))
    eager = step()
    want = fp8_linear_ref(x, q, s, act_quant=False)
    dense_lora_ref(x, a_pool, b_pool, slots, ranks, (n,), want)
    assert _rel(eager, want) < 1e-2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert not counters.any()


def test_fp16_activations():
    # the interpreter's bf16 dot is broken (Triton 3.9): fp16 stands in for a 16-bit dtype on CPU; output rounded
    # to fp16, weight-only "tile" rounds the dequantized weight to fp16 too (unit roundoff 2^-11)
    x, q, s, b = _problem(37, 200, 192, seed=3, dtype=torch.float16)
    ref = fp8_linear_ref(x, q, s, b, act_quant=False)
    for weight_scale in ("tile", "product"):
        out = fp8_linear(x, q, s, b, act_quant=False, weight_scale=weight_scale)
        assert out.dtype == torch.float16 and _rel(out, ref) < 2e-3
    assert _rel(fp8_linear(x, q, s, b, act_quant=True), fp8_linear_ref(x, q, s, b, act_quant=True)) < 2e-3
