"""FP8 KV cache (--kv-cache-dtype fp8): K and V stored float8_e4m3fn as value / scale (one scale per layer for K and one
for V), clamped to ±448 before the cast.

References, independent of the engine's FP8 code: the e4m3 bytes are torch's own cast of clamp(x / scale, ±448) of
the values the layer's torch code computes; attention is the fp32 reference on the caches dequantized (fp8 value x
scale, in fp32); the engine is compared with transformers in float32 whose attention quantizes and dequantizes K and
V the same way (an attention function registered with transformers, below).

CPU: tiny shapes, Triton's interpreter. GPU (@gpu): Qwen3-30B-A3B attention shapes in bf16, and an engine with CUDA
graphs against its eager run.
"""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported

from moeserve import Engine, EngineConfig, SamplingParams  # noqa: E402
from moeserve.kernels import norm_rotary  # noqa: E402
from moeserve.kernels.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from moeserve.layers.attention import TorchAttentionBackend  # noqa: E402
from moeserve.layers.batch import AttentionMetadata  # noqa: E402

from engine_probe import prompt_ids, prompt_logits, transformers_greedy  # noqa: E402
from peft_fixtures import INTERPRETED_LAYERS, make_peft_adapter, save_base_checkpoint, tiny_base_model  # noqa: E402
from test_kernels_attention_lora import QWEN3, make_cache, rel_err  # noqa: E402
from test_kernels_norm_rotary import CASES, _attention, _gen  # noqa: E402
from test_tensor_parallel import assert_same, tp_engine  # noqa: E402,F401 (a fixture)

FP8 = torch.float8_e4m3fn
GREEDY = dict(temperature=0.0, ignore_eos=True)
K_SCALE, V_SCALE = 0.013, 0.0071  # kernel tests: not powers of two, so a scale applied twice or not at all shows


def e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The stored bytes by definition: x / scale in fp32 (a tensor divisor: correctly rounded on CUDA too), clamped
    to e4m3's finite range, torch's round-to-nearest-even cast."""
    x = x.float()
    return (x / torch.tensor(scale, device=x.device)).clamp(-448.0, 448.0).to(FP8)


def dequantized(x8: torch.Tensor, scale: float) -> torch.Tensor:
    return x8.float() * scale


def unpoisoned(x8: torch.Tensor) -> torch.Tensor:
    """The cache with its NaN poison zeroed: the torch backend gathers whole blocks and masks the scores, as the
    engine's caches (never NaN) allow, so NaN values it does not attend to would still reach its sums."""
    return torch.where(x8.float().isnan(), 0.0, x8.float()).to(FP8)


def fp8_cache(lengths, block_size, n_kv, head_dim, device, gen):
    """make_cache's layout (NaN in the dummy block and past each length: a stray read poisons the result) with K ~
    N(0, 2) and V ~ N(0, 0.5) stored e4m3 under K_SCALE / V_SCALE (some K beyond 448 x K_SCALE: clamped)."""
    k, v, tables = make_cache(lengths, block_size, n_kv, head_dim, torch.float32, device, gen)
    return e4m3(2 * k, K_SCALE), e4m3(0.5 * v, V_SCALE), tables


# ------------------------------------------------------------------ kernels (CPU: the interpreter, fp32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_on_an_fp8_cache_is_fp32_attention_on_the_dequantized_cache(num_splits):
    gen = torch.Generator().manual_seed(num_splits)
    lengths = [5, 19, 0, 33]  # odd, several blocks, padded row, past a block multiple
    k8, v8, tables = fp8_cache(lengths, 8, 2, 16, "cpu", gen)
    q = torch.randn(len(lengths), 6, 16, generator=gen)  # GQA group of 3
    ctx = torch.tensor(lengths, dtype=torch.int32)
    want = paged_decode_attention_ref(q, dequantized(k8, K_SCALE), dequantized(v8, V_SCALE), tables, ctx, 0.25)
    got = paged_decode_attention(q, k8, v8, tables, ctx, 0.25, num_splits=num_splits, k_scale=K_SCALE,
                                 v_scale=V_SCALE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # padded row
    twin = paged_decode_attention_ref(q, k8, v8, tables, ctx, 0.25, K_SCALE, V_SCALE)
    torch.testing.assert_close(twin, want, rtol=1e-5, atol=1e-6)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lengths), dtype=torch.long), block_tables=tables,
                             context_lens=ctx, is_decode=True)
    torch_backend = TorchAttentionBackend().decode(q, unpoisoned(k8), unpoisoned(v8), meta, 0.25, K_SCALE, V_SCALE)
    torch.testing.assert_close(torch_backend, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_std", [1.0, 3e4])  # 3e4: some q past fp16's 65,504 (scaled by 2^-8 first, it fits)
def test_decode_attention_on_an_fp8_cache_in_fp16_as_the_gpu_runs_it(monkeypatch, q_std):
    """The GPU multiplies an fp8 cache's tiles in fp16 (exact e4m3 values; q scaled into fp16's range and back):
    forced here under the interpreter, against the fp32 reference, within the bf16 output's bound."""
    from moeserve.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "_INTERPRET", False)  # the GPU's compute dtype; the tiles stay the CPU's
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 19, 0, 33]
    k8, v8, tables = fp8_cache(lengths, 8, 2, 16, "cpu", gen)
    q = (torch.randn(len(lengths), 6, 16, generator=gen) * q_std).bfloat16()
    assert paged_attention.fp8_decode_compute(q.dtype, 1)[1] < 1 and (q.float().abs() > 65504).any() == (q_std > 1)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    want = paged_decode_attention_ref(q.float(), dequantized(k8, K_SCALE), dequantized(v8, V_SCALE), tables, ctx,
                                      0.25)
    for splits in (1, 3):
        got = paged_decode_attention(q, k8, v8, tables, ctx, 0.25, num_splits=splits, k_scale=K_SCALE,
                                     v_scale=V_SCALE)
        assert torch.isfinite(got).all() and rel_err(got, want) < 1e-2, splits
        assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_prefill_attention_on_an_fp8_cache_is_fp32_attention_on_the_dequantized_cache():
    gen = torch.Generator().manual_seed(7)
    q_lens, seq_lens = [5, 1, 7], [5, 9, 20]  # fresh prompt; one token after 8 cached; a chunk after 13 cached
    k8, v8, tables = fp8_cache(seq_lens, 8, 2, 16, "cpu", gen)
    qsl = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(sum(q_lens), 6, 16, generator=gen)
    want = paged_prefill_attention_ref(q, dequantized(k8, K_SCALE), dequantized(v8, V_SCALE), tables, qsl, sl, 0.25)
    got = paged_prefill_attention(q, k8, v8, tables, qsl, sl, 0.25, max(q_lens), k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    twin = paged_prefill_attention_ref(q, k8, v8, tables, qsl, sl, 0.25, K_SCALE, V_SCALE)
    torch.testing.assert_close(twin, want, rtol=1e-5, atol=1e-6)
    meta = AttentionMetadata(slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long), block_tables=tables,
                             context_lens=sl, is_decode=False, query_start_loc=qsl, query_start_loc_host=qsl.tolist(),
                             seq_lens_host=seq_lens, max_query_len=max(q_lens))
    torch_backend = TorchAttentionBackend().prefill(q, unpoisoned(k8), unpoisoned(v8), meta, 0.25, K_SCALE, V_SCALE)
    torch.testing.assert_close(torch_backend, want, rtol=1e-5, atol=1e-6)


def _write_kv_case(case, T, device="cpu"):
    """An attention layer with scales, a qkv whose K and V reach past ±448 x scale, and the slots to write."""
    qk_norm, nh, nkv, d, clip = case
    attn = _attention(qk_norm, nh, nkv, d, clip, seed=T).to(device)
    attn.k_scale, attn.v_scale = 0.004, 0.0031  # |k| up to ~3 under the norms, |v| up to ~9: both clamp
    gen = _gen(200 + T)
    qkv = (3 * torch.randn(T, (nh + 2 * nkv) * d, generator=gen)).to(device)
    positions = torch.randint(0, 512, (T,), generator=gen).to(device)
    block_size, num_blocks = 4, 2 + (T + 3) // 4
    slots = (torch.randperm((num_blocks - 1) * block_size, generator=gen)[:T] + block_size).to(device)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
                             context_lens=torch.zeros(1, dtype=torch.int32, device=device), is_decode=True)
    cache = torch.full((num_blocks, block_size, nkv, d), 0.5, device=device).to(FP8)  # untouched slots keep this
    return attn, qkv, positions, slots, meta, cache


def _stored(cache, slots):
    return cache.view(-1, *cache.shape[2:])[slots].view(torch.uint8)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]], ids=["qwen3", "mqa", "olmoe-clip"])
def test_kv_write_stores_the_scaled_clamped_e4m3_bits(case):
    """The fused prologue, its torch twin and the layer's torch write all store e4m3(K / k_scale) and e4m3(V /
    v_scale) bit for bit, values beyond ±448 x scale as ±448 (never NaN), and touch no other slot."""
    T = 5
    attn, qkv, positions, slots, meta, cache = _write_kv_case(case, T)
    _, nh, nkv, d, clip = case
    _, k, v = attn.qk_norm_rotary(qkv, positions)  # the layer's torch code: the values the cache should hold
    want_k, want_v = e4m3(k, attn.k_scale).view(torch.uint8), e4m3(v, attn.v_scale).view(torch.uint8)
    if clip is None:
        assert (k.abs() > 448 * attn.k_scale).any() and (v.abs() > 448 * attn.v_scale).any()  # the clamp is hit
    k_fused, v_fused, k_torch, v_torch, k_twin, v_twin = (cache.clone() for _ in range(6))
    attn.qk_norm_rotary_write_kv(qkv, positions, meta, k_fused, v_fused)
    attn.write_kv(k, v, meta, k_torch, v_torch)
    weights = [None if n is None else n.weight for n in (attn.q_norm, attn.k_norm)]
    norm_rotary.qk_norm_rotary_write_kv_ref(qkv, positions, attn.rotary.cos, attn.rotary.sin, nh, nkv, d, case[0],
                                            *weights, 1e-6, k_twin, v_twin, slots, clip, attn.k_scale, attn.v_scale)
    untouched = torch.ones(cache.view(-1, nkv, d).shape[0], dtype=torch.bool)
    untouched[slots] = False
    for got_k, got_v in ((k_fused, v_fused), (k_torch, v_torch), (k_twin, v_twin)):
        assert torch.equal(_stored(got_k, slots), want_k) and torch.equal(_stored(got_v, slots), want_v)
        assert not got_k.float().isnan().any() and not got_v.float().isnan().any()
        for got in (got_k, got_v):
            assert torch.equal(got.view(-1, nkv, d)[untouched].view(torch.uint8),
                               cache.view(-1, nkv, d)[untouched].view(torch.uint8))


# ------------------------------------------------------------------ the engine (CPU)

# per layer (k_scale, v_scale), as an FP8 checkpoint carries them: |k| / k_scale and |v| / v_scale near 300 at most
# on this model (|k| <= ~2.9 under the q/k norms, |v| <= ~0.6)
CKPT_SCALES = {0: (0.01, 0.002), 1: (0.0125, 0.0015)}
FAMILY = "qwen3_moe"
# logits: the engine and the reference quantize the same fp32 K and V with the same rule, so they differ by fp32
# summation order only (the plain fp32 parity bound, tests/test_engine.py), unless an engine value and the reference's
# one, ~1e-7 apart, straddle an e4m3 rounding boundary (one e4m3 step, 2^-4 relative): rare enough at these sizes
# (~1e-7 / 2^-4 per element, some 10^3 elements) that the fixed seeds below have none
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny two-layer model (a sparse layer, a dense one) with per-layer self_attn.k_scale / v_scale tensors."""
    path = save_base_checkpoint(FAMILY, tmp_path_factory.mktemp("fp8kv") / "base", **INTERPRETED_LAYERS)
    (weights,) = path.glob("*.safetensors")
    tensors = load_file(weights)
    for i, (ks, vs) in CKPT_SCALES.items():
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ks)  # float32 scalars, as llm-compressor's
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(vs)
    save_file(tensors, str(weights))
    return path


def engine_for(path, **kw) -> Engine:
    kw = {"block_size": 4, "dtype": "float32", **kw}
    return Engine(EngineConfig(model=str(path), device="cpu", **kw))


def qdq_attention(module, query, key, value, attention_mask, **kw):
    """transformers' eager attention on K and V quantized to e4m3 with the layer's scales and dequantized."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import eager_attention_forward

    ks, vs = CKPT_SCALES[module.layer_idx]
    ks, vs = torch.tensor(ks).item(), torch.tensor(vs).item()  # the float32 values the checkpoint holds
    return eager_attention_forward(module, query, dequantized(e4m3(key, ks), ks), dequantized(e4m3(value, vs), vs),
                                   attention_mask, **kw)


def reference(model):
    """`model` (transformers) attending through qdq_attention, with eager attention's causal mask."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register("fp8_kv_qdq", qdq_attention)
    AttentionMaskInterface.register("fp8_kv_qdq", ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # unregistered: no mask
    model.set_attn_implementation("fp8_kv_qdq")
    return model


def test_fp8_kv_engine_matches_transformers_with_quantized_kv(checkpoint):
    engine = engine_for(checkpoint, kv_cache_dtype="fp8")
    assert engine.config.kv_cache_dtype == "fp8_e4m3"  # "fp8" is its alias
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == FP8
    for i, (ks, vs) in CKPT_SCALES.items():  # the checkpoint's scales, as the float32 values it stores
        attn = engine.runner.model.layers[i].self_attn
        assert (attn.k_scale, attn.v_scale) == (torch.tensor(ks).item(), torch.tensor(vs).item())
    ref = reference(tiny_base_model(FAMILY, 0, **INTERPRETED_LAYERS))
    ids = prompt_ids(21, seed=1)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    got = prompt_logits(engine, ids)
    assert (got - theirs).abs().max().item() <= TOL
    # the test can see the quantization: the unquantized model is far outside the bound
    with torch.no_grad():
        plain = tiny_base_model(FAMILY, 0, **INTERPRETED_LAYERS)(torch.tensor([ids])).logits[0]
    assert (got - plain).abs().max().item() > 10 * TOL
    # greedy decode: each step's K/V written to the cache quantized, read back by the decode attention
    prompt = prompt_ids(9, seed=2)
    out = engine.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert out.token_ids == transformers_greedy(ref, prompt, 8)


def test_fp8_kv_triton_backend_matches_torch_backend(checkpoint):
    """The fused prologue and the paged kernels (Triton's interpreter) against the torch write and attention."""
    prompts = [prompt_ids(n, seed=n) for n in (7, 13)]
    sp = SamplingParams(max_tokens=3, logprobs=0, **GREEDY)
    tri, ref = (engine_for(checkpoint, kv_cache_dtype="fp8", attention_backend=b, block_size=8).generate(prompts, sp)
                for b in ("triton", "torch"))
    for got, want in zip(tri, ref):
        assert got.token_ids == want.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(got.logprobs, want.logprobs)) < 1e-4


def test_fp8_kv_holds_twice_the_blocks_of_bf16_in_the_same_budget(checkpoint, caplog):
    budget = 1 << 17  # 128 blocks of bf16 K and V (K and V x 2 layers x 4 tokens x 2 heads x 16 dims x 2 bytes)
    caplog.set_level("INFO", logger="moeserve")
    auto, fp8 = (engine_for(checkpoint, dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype=d)
                 for d in ("auto", "fp8"))
    assert auto.runner.kv_caches[0][0].dtype == torch.bfloat16 and fp8.runner.kv_caches[0][0].dtype == FP8
    assert auto.allocator.num_blocks == 128 + 1 and fp8.allocator.num_blocks == 2 * 128 + 1  # + the dummy block
    assert "257 blocks x 4 tokens in float8_e4m3fn (128.50 KiB)" in caplog.text


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "FP8"])
def test_bad_kv_cache_dtype_is_refused_naming_the_flag(checkpoint, value, capsys):
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\) must be one of auto, fp8, fp8_e4m3, "
                                         rf"got '{value}'"):
        EngineConfig(model=str(checkpoint), device="cpu", kv_cache_dtype=value).resolve()
    import argparse

    from moeserve.engine_args import add_engine_args

    with pytest.raises(SystemExit):
        add_engine_args(argparse.ArgumentParser()).parse_args(["--kv-cache-dtype", value])
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "fp8_e4m3" in err


def test_fp8_kv_is_refused_on_a_gpu_without_e4m3(checkpoint, monkeypatch):
    """An A100 (8.0) has no e4m3 conversions for the kernels: refused at start, naming the flag (the device is faked:
    the check runs before any CUDA call that would need one)."""
    import moeserve.config
    from moeserve.kernels import pdl

    monkeypatch.setattr(moeserve.config, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(pdl, "supported", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\) fp8_e4m3 needs a CUDA device of "
                                         r"compute capability 8.9 or later; 'cuda' has 8.0"):
        EngineConfig(model=str(checkpoint), device="cuda", kv_cache_dtype="fp8", pdl=False).resolve()


def test_lora_on_fp8_kv_matches_peft_and_leaves_rows_without_adapter_alone(checkpoint, tmp_path):
    path, pm = make_peft_adapter(FAMILY, tmp_path / "ad", kind="attn", rank=4, seed=1,
                                 config_overrides=INTERPRETED_LAYERS)
    engine = engine_for(checkpoint, kv_cache_dtype="fp8", lora_modules={"ad": str(path)}, max_lora_rank=4)
    prompt = prompt_ids(11, seed=3)
    reference(pm.base_model.model)
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor([prompt])).logits[0]
    assert (prompt_logits(engine, prompt, "ad") - theirs).abs().max().item() <= TOL
    plain = engine_for(checkpoint, kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=6, logprobs=2, **GREEDY)
    mixed = engine.generate([prompt, prompt], params, lora=["ad", None])
    alone = plain.generate([prompt], params)[0]
    assert mixed[1].token_ids == alone.token_ids
    assert [lp.logprob for lp in mixed[1].logprobs] == [lp.logprob for lp in alone.logprobs]
    assert [lp.logprob for lp in mixed[0].logprobs] != [lp.logprob for lp in alone.logprobs]


def test_tp2_fp8_kv_equals_tp1(checkpoint, tp_engine):
    """Each rank (the worker process too) stores its KV heads in fp8 under the checkpoint's scales, read whole by
    every rank: TP=2 decodes what TP=1 does."""
    kw = dict(kv_cache_dtype="fp8", num_kv_blocks=64, dist_timeout=60)
    ps = [prompt_ids(n, seed=n) for n in (6, 10)]
    sp = SamplingParams(max_tokens=3, logprobs=3, prompt_logprobs=2, **GREEDY)
    ref = engine_for(checkpoint, **kw).generate(ps, sp)
    two = tp_engine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", block_size=4,
                                 tensor_parallel_size=2, **kw))
    assert_same(two.generate(ps, sp), ref)


@pytest.mark.parametrize("value", [0.0, float("nan")])
def test_a_bad_checkpoint_scale_is_refused_by_name(checkpoint, tmp_path, value):
    import shutil

    from moeserve.errors import CheckpointError

    bad = shutil.copytree(checkpoint, tmp_path / "bad")
    (weights,) = bad.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(value)
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn.v_scale' is nan|is 0.0, expected a positive"):
        engine_for(bad, kv_cache_dtype="fp8")


# ------------------------------------------------------------------ GPU (bf16 activations, Hopper)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_gpu_decode_attention_on_an_fp8_cache(batch):
    gen = torch.Generator(device="cuda").manual_seed(batch)
    lengths = torch.randint(1, 2049, (batch,), generator=gen, device="cuda").tolist()
    if batch > 1:
        lengths[batch // 2] = 0  # padded row
    k8, v8, tables = fp8_cache(lengths, 16, QWEN3["n_kv"], QWEN3["head_dim"], "cuda", gen)
    q = torch.randn(batch, QWEN3["n_heads"], QWEN3["head_dim"], generator=gen, device="cuda").bfloat16()
    ctx = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    scale = QWEN3["head_dim"] ** -0.5
    want = paged_decode_attention_ref(q, dequantized(k8, K_SCALE), dequantized(v8, V_SCALE), tables, ctx, scale)
    for splits in (None, 1, 5):
        got = paged_decode_attention(q, k8, v8, tables, ctx, scale, num_splits=splits, k_scale=K_SCALE,
                                     v_scale=V_SCALE)
        assert got.dtype == torch.bfloat16
        assert rel_err(got, want) < 1e-2, splits  # the bf16 bound of the bf16-cache test: e4m3 values are exact
        if batch > 1:
            assert torch.equal(got[batch // 2], torch.zeros_like(got[0]))


@gpu
@needs_cuda
def test_gpu_prefill_attention_on_an_fp8_cache():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_lens, seq_lens = [512, 1, 300, 77], [512, 1024, 2048, 77]
    k8, v8, tables = fp8_cache(seq_lens, 16, QWEN3["n_kv"], QWEN3["head_dim"], "cuda", gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), QWEN3["n_heads"], QWEN3["head_dim"], generator=gen, device="cuda").bfloat16()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = QWEN3["head_dim"] ** -0.5
    got = paged_prefill_attention(q, k8, v8, tables, qsl, sl, scale, max(q_lens), k_scale=K_SCALE, v_scale=V_SCALE)
    want = paged_prefill_attention_ref(q, dequantized(k8, K_SCALE), dequantized(v8, V_SCALE), tables, qsl, sl, scale)
    assert rel_err(got, want) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kv_write_stores_the_scaled_clamped_e4m3_bits(dtype):
    """On the GPU too (its division and cast, not the interpreter's), the fused prologue stores torch's e4m3 bytes of
    the values it writes into a cache in the activation dtype (not of the torch layer's K: on the GPU the prologue's
    K differs from it by an ulp at times, tests/test_kernels_norm_rotary.py)."""
    T = 37
    attn, qkv, positions, slots, meta, cache = _write_kv_case(CASES[0], T, "cuda")
    attn, qkv = attn.to(dtype), qkv.to(dtype)
    k_plain, v_plain = (torch.zeros(cache.shape, dtype=dtype, device="cuda") for _ in range(2))
    attn.qk_norm_rotary_write_kv(qkv, positions, meta, k_plain, v_plain)  # scales ignored: the values themselves
    k_fused, v_fused = cache.clone(), cache.clone()
    attn.qk_norm_rotary_write_kv(qkv, positions, meta, k_fused, v_fused)
    k, v = (c.view(-1, *c.shape[2:])[slots] for c in (k_plain, v_plain))
    assert (k.float().abs() > 448 * attn.k_scale).any() and (v.float().abs() > 448 * attn.v_scale).any()
    assert torch.equal(_stored(k_fused, slots), e4m3(k, attn.k_scale).view(torch.uint8))
    assert torch.equal(_stored(v_fused, slots), e4m3(v, attn.v_scale).view(torch.uint8))


@gpu
@needs_cuda
def test_gpu_fp8_kv_engine_graphs_match_eager(tmp_path):
    """CUDA graphs (decode batches 1-8) replay the eager run of the same fp8-KV engine: same tokens, logprobs to
    bf16 noise; the checkpoint's scales are in use (a non-1 scale applied twice or not at all would change them)."""
    base = save_base_checkpoint(FAMILY, tmp_path / "base")
    (weights,) = base.glob("*.safetensors")
    tensors = load_file(weights)
    for i in range(3):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.002)
    save_file(tensors, str(weights))
    kw = dict(model=str(base), device="cuda", kv_cache_dtype="fp8", block_size=16, kv_cache_memory_bytes=64 << 20)
    graphs = Engine(EngineConfig(cuda_graph_bs=[1, 2, 4, 8], **kw))
    eager = Engine(EngineConfig(enforce_eager=True, **kw))
    assert graphs.runner.kv_caches[0][0].dtype == FP8 and graphs.runner.graph_runner is not None
    assert graphs.runner.model.layers[2].self_attn.v_scale == torch.tensor(0.002).item()
    ps = [prompt_ids(n, seed=n) for n in (7, 12, 4)]
    sp = SamplingParams(max_tokens=12, logprobs=0, **GREEDY)
    for got, want in zip(graphs.generate(ps, sp), eager.generate(ps, sp)):
        assert got.token_ids == want.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(got.logprobs, want.logprobs)) <= 0.05
