"""Triton GEMV for dense projections at decode sizes (T <= 8), with the dense multi-LoRA expand in its epilogue.

CPU: fp32 under the Triton interpreter, odd shapes, against F.linear and the LoRA references (dense_lora_ref,
the layer's torch path); rows without an adapter must be bitwise the no-LoRA gemv. GPU (@gpu): bf16 at the
preset shapes against fp32 torch, bitwise-untouched rows, and the layer inside a CUDA graph.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported

from moeserve.kernels.gemv import GEMV_MAX_TOKENS, GemvConfig, GemvLoRA, default_config, gemv, gemv_ref  # noqa: E402
from moeserve.kernels.lora_dense import RANK_BLOCK, dense_lora_ref, dense_lora_shrink  # noqa: E402
from moeserve.exec_options import ExecOptions  # noqa: E402
from moeserve.layers.batch import LoRABatch  # noqa: E402
from moeserve.layers.linear import LoRALinear, dense_lora_torch  # noqa: E402

gpu = pytest.mark.gpu

# tiny tiles: several programs over N and several K steps (K = 70 leaves a masked tail)
CONFIGS = {
    "wide": GemvConfig(block_n=16, block_k=32),
    "narrow": GemvConfig(block_n=4, block_k=16, num_warps=2),
}


def int_bits(t):
    return t.contiguous().view(torch.int32)


def make_pool(num_slots, slice_sizes, max_rank, in_features, ranks, gen, used):
    """Slot pool: zeros past each slot's rank, NaN past the rank block a kernel may read, and slots no row uses
    (or of rank 0) all NaN: any read the kernels should not make poisons the result."""
    a = torch.randn(num_slots, len(slice_sizes), max_rank, in_features, generator=gen) * 0.1
    b = torch.randn(num_slots, sum(slice_sizes), max_rank, generator=gen) * 0.1
    for s, r in enumerate(ranks):
        a[s, :, r:] = 0
        b[s, :, r:] = 0
        read = math.ceil(r / RANK_BLOCK) * RANK_BLOCK
        a[s, :, read:] = float("nan")
        b[s, :, read:] = float("nan")
        if s not in used or r == 0:
            a[s] = float("nan")
            b[s] = float("nan")
    return a, b, torch.tensor(ranks, dtype=torch.int32)


@pytest.mark.parametrize("mode", list(CONFIGS))
@pytest.mark.parametrize("T", range(1, GEMV_MAX_TOKENS + 1))
def test_gemv_matches_linear(mode, T):
    gen = torch.Generator().manual_seed(T)
    N, K = 37, 70  # neither a multiple of the tiles
    x = torch.randn(T, K, generator=gen)
    w = torch.randn(N, K, generator=gen)
    bias = torch.randn(N, generator=gen) if T % 2 else None
    got = gemv(x, w, bias, config=CONFIGS[mode])
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, gemv_ref(x, w, bias), rtol=1e-5, atol=1e-5)


def test_gemv_strided_rows_out_and_even_k():
    """x rows with a stride (a view), K a multiple of the tile (the unmasked loop), out given (fp32 out of fp16)."""
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(2, 80, generator=gen)
    x = big[:, 8:72]  # K = 64, row stride 80
    w = torch.randn(24, 64, generator=gen)
    for cfg in CONFIGS.values():
        out = torch.full((2, 24), float("nan"))
        assert gemv(x, w, out=out, config=cfg) is out
        torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    # fp16 in, one rounding from the fp32 accumulator
    x16, w16 = x.half(), w.half()
    torch.testing.assert_close(gemv(x16, w16, config=CONFIGS["wide"]), gemv_ref(x16, w16), rtol=1e-3, atol=1e-3)


def test_gemv_default_config_runs():
    gen = torch.Generator().manual_seed(4)
    for T in (1, 2):
        x, w = torch.randn(T, 48, generator=gen), torch.randn(20, 48, generator=gen)
        torch.testing.assert_close(gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_default_config_table():
    """H200 shapes: the sweep's 4-column tiles, running sums that fit in 64 registers a thread at two rows. The
    layers send one row, or two where K > N, here (gemv.serves), cuBLAS the rest."""
    shapes = [(5120, 2048), (2048, 4096), (151936, 2048), (6144, 2048), (11264, 2048), (2048, 5632)]
    for N, K in shapes:
        cfg = default_config(N, K)
        assert cfg.block_n == 4 and cfg.block_k <= K * 2, (N, K, cfg)  # the one-row sweep's tiles
        assert GEMV_MAX_TOKENS * cfg.block_n * cfg.block_k / (32 * cfg.num_warps) <= 64, (N, K, cfg)
    from moeserve.kernels.gemv import serves

    assert serves(1, 5120, 2048) and serves(2, 2048, 4096)
    assert not serves(2, 5120, 2048) and not serves(3, 2048, 4096) and not serves(9, 2048, 4096)


def test_gemv_rejects_bad_inputs():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="1..2"):
        gemv(torch.randn(3, 16), w)
    with pytest.raises(ValueError, match="features"):
        gemv(x, torch.randn(8, 12))
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(torch.randn(16, 2).t(), w)
    with pytest.raises(ValueError, match="share a float dtype"):
        gemv(x, w.double())
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.randn(7))
    with pytest.raises(ValueError, match="powers of two"):
        gemv(x, w, config=GemvConfig(block_n=12, block_k=16))


# ------------------------------------------------------------------ LoRA epilogue

RANKS = [8, 16, 64, 0, 16, 16]  # rank-64 pool; slot 3 loaded with rank 0; slot 5 used by no row
SIZES, IN = (24, 9, 9), 40  # unequal q|k|v slices, odd sizes; `in` not a multiple of the k tile


def lora_case(pattern, seed):
    """Rows on the slots of `pattern` (-1: none)."""
    gen = torch.Generator().manual_seed(seed)
    T = len(pattern)
    slots = torch.tensor(pattern, dtype=torch.int32)
    a, b, ranks = make_pool(len(RANKS), SIZES, 64, IN, RANKS, gen, used=set(slots.tolist()))
    x = torch.randn(T, IN, generator=gen)
    w = torch.randn(sum(SIZES), IN, generator=gen)
    bias = torch.randn(sum(SIZES), generator=gen)
    return x, w, bias, a, b, slots, ranks


@pytest.mark.parametrize("mode", list(CONFIGS))
@pytest.mark.parametrize("pattern", [(2,), (2, -1), (0, 3), (1, 4)], ids=["r64", "r64-none", "r8-r0", "r16-r16"])
def test_gemv_lora_epilogue_matches_references(mode, pattern):
    T = len(pattern)
    x, w, bias, a, b, slots, ranks = lora_case(pattern, seed=10 + sum(pattern))
    cfg = CONFIGS[mode]
    plain = gemv(x, w, bias, config=cfg)
    scratch = dense_lora_shrink(x, a, slots, ranks, k_splits=2)  # partial sums over `in` the epilogue adds
    got = gemv(x, w, bias, lora=GemvLoRA(scratch, b, slots, ranks, SIZES), config=cfg)

    want = F.linear(x, w, bias)
    dense_lora_ref(x, a, b, slots, ranks, SIZES, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want_torch = F.linear(x, w, bias)  # the layer's torch path reads every rank column: no NaN poison there
    dense_lora_torch(x, a.nan_to_num(0.0), b.nan_to_num(0.0), slots, ranks, SIZES, want_torch)
    torch.testing.assert_close(got, want_torch, rtol=1e-5, atol=1e-5)

    untouched = (slots < 0) | (ranks[slots.clamp_min(0).long()] == 0)
    assert (~untouched).any()  # every pattern has an adapter row; r64-none and r8-r0 also untouched ones
    assert torch.equal(int_bits(got[untouched]), int_bits(plain[untouched]))
    assert (got[~untouched] != plain[~untouched]).any(dim=1).all()  # every adapter row moved


def test_gemv_lora_single_slice_no_bias_all_inactive():
    """o_proj-like (one slice, no bias); a batch whose rows all lack an adapter is bitwise the plain gemv."""
    gen = torch.Generator().manual_seed(5)
    T, N = 2, 20
    a, b, ranks = make_pool(3, (N,), 16, IN, [16, 8, 0], gen, used={0, 1})
    x, w = torch.randn(T, IN, generator=gen), torch.randn(N, IN, generator=gen)
    for slots in ([0, 1], [-1, 2], [-1, -1]):
        slots = torch.tensor(slots, dtype=torch.int32)
        scratch = dense_lora_shrink(x, a, slots, ranks)
        got = gemv(x, w, lora=GemvLoRA(scratch, b, slots, ranks, (N,)), config=CONFIGS["wide"])
        want = F.linear(x, w)
        dense_lora_ref(x, a, b, slots, ranks, (N,), want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if (slots < 0).all() or (slots == 2).any():
            rows = (slots < 0) | (slots == 2)
            assert torch.equal(int_bits(got[rows]), int_bits(gemv(x, w, config=CONFIGS["wide"])[rows]))


def test_gemv_lora_rejects_mismatched_scratch():
    x, w, bias, a, b, slots, ranks = lora_case((2, -1), seed=1)
    scratch = dense_lora_shrink(x, a, slots, ranks)
    with pytest.raises(ValueError, match="slice sizes"):
        gemv(x, w, lora=GemvLoRA(scratch, b, slots, ranks, (24, 18)))
    with pytest.raises(ValueError, match="scratch"):
        gemv(x[:1], w, lora=GemvLoRA(scratch, b, slots[:1], ranks, SIZES))


# ------------------------------------------------------------------ the layer

def make_layer(lora_backend, gemv_on, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layer = LoRALinear(IN, SIZES, bias, ExecOptions(linear_backend="triton" if gemv_on else "torch",
                                                 lora_backend=lora_backend))
    layer.weight.data.copy_(torch.randn(sum(SIZES), IN, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(sum(SIZES), generator=gen))
    a, b, _ = make_pool(len(RANKS), SIZES, 64, IN, RANKS, gen, used=set(range(len(RANKS))))
    layer.lora_a, layer.lora_b = a.nan_to_num(0.0), b.nan_to_num(0.0)  # the pool's contract: zeros past rank
    return layer


@pytest.mark.parametrize("lora_backend", ["triton", "torch"])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_layer_gemv_path_equals_torch_path(lora_backend, T):
    """LoRALinear with the gemv switch against the plain layer (F.linear + dense_lora_torch), with and without
    LoRA; T = 1 takes the gemv, T = 2 (in < out here) and T = 9 F.linear (gemv.serves); the no-LoRA rows of a
    LoRA batch are bitwise the no-LoRA batch's."""
    on, ref = make_layer(lora_backend, True), make_layer("torch", False)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, IN, generator=gen)
    slots = torch.tensor([(0, -1, 2, 3, 1)[t % 5] for t in range(T)], dtype=torch.int32)
    ranks = torch.tensor(RANKS, dtype=torch.int32)
    lora = LoRABatch(slots, ranks)
    base = on(x, None)
    torch.testing.assert_close(base, ref(x, None), rtol=1e-5, atol=1e-5)
    got = on(x, lora)
    torch.testing.assert_close(got, ref(x, lora), rtol=1e-5, atol=1e-5)
    plain_rows = (slots < 0) | (ranks[slots.clamp_min(0).long()] == 0)
    assert torch.equal(int_bits(got[plain_rows]), int_bits(base[plain_rows]))
    on.lora_a = None  # a layer without LoRA slots ignores the batch's LoRA
    assert torch.equal(on(x, lora), base)


# ------------------------------------------------------------------ GPU, bf16, preset shapes

GPU_SHAPES = {  # name -> (slice sizes, in features, bias)
    "qwen3_qkv": ((4096, 512, 512), 2048, False),
    "qwen3_o": ((2048,), 4096, False),
    "qwen15_qkv": ((2048, 2048, 2048), 2048, True),
    "olmoe_o": ((2048,), 2048, False),
    "lm_head": ((151936,), 2048, False),
}


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


@gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("T", [1, 2])
def test_gpu_gemv_bf16(shape, T):
    sizes, K, has_bias = GPU_SHAPES[shape]
    N = sum(sizes)
    gen = torch.Generator("cuda").manual_seed(T)
    x = torch.randn(T, K, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(N, K, generator=gen, device="cuda") * 0.02).bfloat16()
    bias = torch.randn(N, generator=gen, device="cuda").bfloat16() if has_bias else None
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    configs = {"default": None, "n8k256": GemvConfig(8, 256), "n4k1024w2": GemvConfig(4, 1024, num_warps=2)}
    for name, cfg in configs.items():
        got = gemv(x, w, bias, config=cfg)
        assert got.dtype == torch.bfloat16
        assert rel_err(got, want) < 1e-2, (name, rel_err(got, want))
        assert torch.equal(gemv(x, w, bias, config=cfg), got), name  # deterministic


@gpu
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("shape", ["qwen3_qkv", "qwen3_o"])
def test_gpu_gemv_lora_bf16(shape, T):
    """4 rank-16 adapters, one rank-8, and rows without one, in an 8-slot rank-64 pool (NaN where never read)."""
    sizes, K, _ = GPU_SHAPES[shape]
    N = sum(sizes)
    gen = torch.Generator().manual_seed(T)
    ranks = [16, 16, 16, 16, 8, 0, 0, 0]
    slots = torch.tensor([(0, -1, 1, 2, 3, 4, 5, -1)[t] for t in range(T)], dtype=torch.int32)
    a, b, ranks_t = make_pool(8, sizes, 64, K, ranks, gen, used=set(slots.tolist()))
    a, b = (a * 0.2).cuda().bfloat16(), (b * 0.2).cuda().bfloat16()
    slots, ranks_t = slots.cuda(), ranks_t.cuda()
    x = torch.randn(T, K, generator=gen).cuda().bfloat16()
    w = (torch.randn(N, K, generator=gen) * 0.02).cuda().bfloat16()
    want = F.linear(x.float(), w.float())
    dense_lora_ref(x.float(), a.float(), b.float(), slots, ranks_t, sizes, want)
    plain = gemv(x, w)
    got = gemv(x, w, lora=GemvLoRA(dense_lora_shrink(x, a, slots, ranks_t), b, slots, ranks_t, sizes))
    assert rel_err(got, want) < 1e-2
    rows = (slots < 0) | (ranks_t[slots.clamp_min(0).long()] == 0)
    assert torch.equal(int_bits(got[rows].float()), int_bits(plain[rows].float()))


@gpu
@pytest.mark.parametrize("sizes,K,T", [((4096, 512, 512), 2048, 1), ((2048,), 4096, 2)], ids=["qkv-T1", "o-T2"])
def test_gpu_layer_gemv_in_cuda_graph(sizes, K, T):
    """The layer's gemv path (shrink + gemv with expand) captured in a graph, replayed with new slots."""
    from moeserve.kernels.gemv import serves

    assert serves(T, sum(sizes), K)  # the layer takes the gemv at this shape and row count
    layer = LoRALinear(K, sizes, False, ExecOptions(linear_backend="triton", lora_backend="triton")).cuda().bfloat16()
    ref = LoRALinear(K, sizes, False).cuda().bfloat16()
    gen = torch.Generator().manual_seed(0)
    layer.weight.data.copy_((torch.randn(sum(sizes), K, generator=gen) * 0.02).bfloat16())
    ref.weight.data.copy_(layer.weight.data)
    a, b, ranks = make_pool(4, sizes, 16, K, [16, 16, 8, 0], gen, used={0, 1, 2, 3})
    for m in (layer, ref):
        m.lora_a, m.lora_b = (a.nan_to_num(0.0) * 0.2).cuda().bfloat16(), (b.nan_to_num(0.0) * 0.2).cuda().bfloat16()
    x = torch.randn(T, K, generator=gen).cuda().bfloat16()
    slots = torch.zeros(T, dtype=torch.int32, device="cuda")
    lora = LoRABatch(slots, ranks.cuda())
    layer(x, lora)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x, lora)
    for pattern in ([1, 2], [2, -1], [-1, -1], [3, 0], [0, 1]):
        slots.copy_(torch.tensor(pattern[:T], dtype=torch.int32))
        graph.replay()
        want = ref(x, LoRABatch(slots, ranks.cuda()))
        assert rel_err(y, want) < 1e-2, pattern


# ------------------------------------------------------------------ wiring: config, model

def test_linear_backend_follows_attention_backend_and_is_checked():
    from moeserve import EngineConfig

    assert EngineConfig(device="cpu").resolve().linear_backend == "torch"
    assert EngineConfig(device="cpu", attention_backend="triton").resolve().linear_backend == "triton"
    cfg = EngineConfig(device="cpu", attention_backend="triton", linear_backend="torch").resolve()
    assert cfg.linear_backend == "torch"
    with pytest.raises(ValueError, match=r"linear_backend \(--linear-backend\) must be one of"):
        EngineConfig(device="cpu", linear_backend="cublas").resolve()


def test_model_takes_the_gemv_where_it_should(monkeypatch):
    """q/k/v/o, the shared expert and dense MLPs, and lm_head take the gemv; the router and the shared-expert
    gate keep their own paths; the logits equal F.linear's, through the gemv at one row only."""
    from moeserve.models.loader import random_model
    from moeserve.model_spec import ModelSpec

    spec = ModelSpec(family="qwen2_moe", num_layers=2, sparse_layers=(True, False), vocab_size=96, hidden_size=64,
                     num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=32,
                     intermediate_size=48, shared_expert_intermediate_size=40, qkv_bias=True,
                     norm_topk_prob=False, max_position_embeddings=64)
    model = random_model(spec, ExecOptions(linear_backend="triton"))
    on = {name for name, m in model.named_modules() if isinstance(m, LoRALinear) and m.gemv_kernels}
    off = {name for name, m in model.named_modules() if isinstance(m, LoRALinear) and not m.gemv_kernels}
    assert on == {"layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.shared_expert.gate_up_proj",
                  "layers.0.mlp.shared_expert.down_proj", "layers.1.self_attn.qkv_proj", "layers.1.self_attn.o_proj",
                  "layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"}
    assert off == {"layers.0.mlp.router", "layers.0.mlp.shared_expert_gate"}
    import moeserve.kernels.gemv as gemv_module

    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    w = model.embed_tokens if model.lm_head is None else model.lm_head
    for T in (1, 2):  # lm_head 96 x 64: one row takes the gemv, two rows (K < N) F.linear
        hidden = torch.randn(T, 64, generator=torch.Generator().manual_seed(T))
        torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, w), rtol=1e-5, atol=1e-5)
    assert calls == [1]
    assert all(m.gemv_kernels is None for m in random_model(spec).modules()
               if isinstance(m, LoRALinear))
