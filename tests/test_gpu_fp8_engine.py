"""Whole engine on the GPU with FP8 base weights (bf16 activations and LoRA, Triton backends: kernels/fp8_linear and
kernels/fused_moe_fp8, CUDA graphs keyed by batch size and LoRA variant), modelled on tests/test_gpu_engine.py.

Marked `gpu`: skipped without CUDA; run on the device machine."""
import pytest
import torch

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.worker.graph_runner import LORA, NOLORA, GraphKey
from peft_fixtures import make_peft_adapter, save_base_checkpoint
from test_fp8_engine import fp8_copy

pytestmark = pytest.mark.gpu
GREEDY = dict(temperature=0.0, ignore_eos=True)
FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_fp8")
    base = save_base_checkpoint(FAMILY, root / "base")
    fp8 = fp8_copy(base, root / "fp8")
    adapters = {n: str(make_peft_adapter(FAMILY, root / n, rank=r, seed=s)[0]) for n, r, s in (("A", 4, 1), ("B", 8, 2))}
    return base, fp8, adapters


def make(model, **kw):
    kw.setdefault("max_lora_rank", 16)
    kw.setdefault("cuda_graph_bs", [1, 2, 4, 8])
    kw.setdefault("block_size", 16)
    kw.setdefault("kv_cache_memory_bytes", 256 << 20)
    return Engine(EngineConfig(model=str(model), device="cuda", **kw))


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def lp_close(a, b, tol):
    return max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= tol


@pytest.fixture(scope="module")
def engines(setup):
    base, fp8, ads = setup
    lora = {"A": ads["A"], "B": ads["B"]}
    return {
        "dual": make(fp8, lora_modules=lora, max_loras=2),
        "eager": make(fp8, lora_modules=lora, max_loras=2, enforce_eager=True),
        "plain": make(fp8),
        "at_load": make(base, quantization="fp8"),
        "torch": make(fp8, lora_modules=lora, max_loras=2, enforce_eager=True, moe_backend="torch",
                      attention_backend="torch"),
    }


def test_fp8_weights_and_dual_capture(engines):
    dual = engines["dual"]
    layer = dual.runner.model.layers[0]
    assert dual.config.quantization == "fp8" and dual.config.moe_backend == "triton"
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.w13.dtype == torch.float8_e4m3fn and layer.mlp.w13_scale_inv.dtype == torch.float32
    assert dual.runner.model.lm_head.dtype == torch.bfloat16  # lm_head, embeddings, norms, router as stored
    assert dual.runner.graph_runner.variants == [LORA, NOLORA]


def test_fp8_triton_kernels_match_the_dequantized_torch_path(engines):
    """Teacher-forced logprobs of the torch backend's tokens (dequantized weights) agree with the Triton FP8
    kernels', with and without adapters (bf16 rounding differs between the two: the same bound as the bf16 test)."""
    ps = prompts([9, 17, 5], seed=1)
    sp = SamplingParams(max_tokens=12, logprobs=0, **GREEDY)
    for loras in ([None, None, None], ["A", None, "B"]):
        forced = [p + r.token_ids for p, r in zip(ps, engines["torch"].generate(ps, sp, lora=loras))]
        score = SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY)
        tri = engines["eager"].generate(forced, score, lora=loras)
        ref = engines["torch"].generate(forced, score, lora=loras)
        for t, r in zip(tri, ref):
            diffs = [abs(a.logprob - b.logprob) for a, b in zip(t.prompt_logprobs[1:], r.prompt_logprobs[1:])]
            assert max(diffs) < 0.15 and sum(diffs) / len(diffs) < 0.03


def test_fp8_graphs_equal_eager_under_alternating_traffic(engines):
    """base -> lora -> mixed -> base, 3 rows on bucket 4 (one padded row)."""
    dual, eager = engines["dual"], engines["eager"]
    gr = dual.runner.graph_runner
    ps = prompts([7, 12, 4], seed=2)
    sp = SamplingParams(max_tokens=10, logprobs=0, **GREEDY)
    for loras in ([None] * 3, ["A", "B", "A"], [None, "B", None], [None] * 3):
        got = dual.generate(ps, sp, lora=loras)
        want = eager.generate(ps, sp, lora=loras)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            assert lp_close(g, w, 0.05)
    assert gr.replays[GraphKey(4, NOLORA)] > 0 and gr.replays[GraphKey(4, LORA)] > 0


def test_fp8_nolora_graph_is_bitwise_the_lora_disabled_engine(engines):
    dual, plain = engines["dual"], engines["plain"]
    ps = prompts([6, 10, 3], seed=3)
    sp = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    before = dual.runner.graph_runner.replays[GraphKey(4, NOLORA)]
    got = dual.generate(ps, sp)
    want = plain.generate(ps, sp)
    assert dual.runner.graph_runner.replays[GraphKey(4, NOLORA)] > before
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [(x.logprob, x.top) for x in g.logprobs] == [(x.logprob, x.top) for x in w.logprobs]
    nk_dual = dual.runner.graph_runner.graphs[GraphKey(4, NOLORA)].num_kernels()
    nk_plain = plain.runner.graph_runner.graphs[GraphKey(4, NOLORA)].num_kernels()
    nk_lora = dual.runner.graph_runner.graphs[GraphKey(4, LORA)].num_kernels()
    if nk_dual is None:
        pytest.skip("cuda-python not available to count graph nodes")
    assert nk_dual == nk_plain < nk_lora


def test_fp8_rows_without_adapter_in_a_lora_batch_are_the_lora_disabled_engine(engines):
    """A mixed batch replays the LoRA graph; its rows without an adapter are bitwise the LoRA-disabled FP8 engine's
    (the fused MoE keeps the LoRA-free result for them, the dense LoRA adds exact zeros)."""
    dual, plain = engines["dual"], engines["plain"]
    ps = prompts([6, 10, 3], seed=4)
    sp = SamplingParams(max_tokens=8, logprobs=2, **GREEDY)
    got = dual.generate(ps, sp, lora=[None, "A", None])
    want = plain.generate(ps, sp)
    for i in (0, 2):
        assert got[i].token_ids == want[i].token_ids
        assert [x.logprob for x in got[i].logprobs] == [x.logprob for x in want[i].logprobs]


def test_quantization_at_load_is_the_fp8_checkpoint(engines):
    ps = prompts([9, 4], seed=5)
    sp = SamplingParams(max_tokens=8, logprobs=2, **GREEDY)
    got = engines["at_load"].generate(ps, sp)
    want = engines["plain"].generate(ps, sp)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == [x.logprob for x in w.logprobs]



def test_fp8_activations_none_is_the_dequantized_path_and_dynamic_stays_close(setup):
    """--fp8-activations none (weight-only everywhere) scores prompts as the torch backend on the dequantized
    weights does, to bf16 rounding; dynamic (W8A8 everywhere, GEMVs included) within the activation quantization's
    error of it, and its greedy tokens within that error of the best under weight-only scores."""
    _, fp8, _ = setup
    ps = prompts([9, 14, 6, 11], seed=6)
    score = SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY)
    ref = make(fp8, moe_backend="torch", attention_backend="torch", enforce_eager=True).generate(ps, score)
    for setting, bound in (("none", 0.05), ("dynamic", 0.15)):
        got = make(fp8, fp8_activations=setting, enforce_eager=True).generate(ps, score)
        for g, w in zip(got, ref):
            diffs = [abs(a.logprob - b.logprob) for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:])]
            assert max(diffs) < bound, setting
    # Greedy tokens on a random tiny model: its logits are nearly flat, so two settings within the bound above may
    # pick different tokens at a near-tie (call 1 of session 14: the first token differed). What must hold: every
    # token dynamic's graphs pick is, under the weight-only engine's own scores, within the activation
    # quantization's error of that engine's best token at the same position: each setting's logprobs lie within its
    # bound of the reference's, so a token's two scores differ by at most 0.05 + 0.15, and a gap twice that.
    sp = SamplingParams(max_tokens=6, **GREEDY)
    dynamic = make(fp8, fp8_activations="dynamic").generate(ps, sp)
    rescore = SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY)
    scored = make(fp8, fp8_activations="none").generate([p + r.token_ids for p, r in zip(ps, dynamic)], rescore)
    for p, s in zip(ps, scored):
        for tok in s.prompt_logprobs[len(p):]:
            assert tok.top[0][1] - tok.logprob < 2 * (0.05 + 0.15), (tok.token_id, tok.top)


def test_fp8_lora_shrink_beside_the_gemm_is_bitwise_the_shrink_after_it(setup, engines):
    """By default, where the FP8 GEMM computes a projection (3 rows and more; prefill), its LoRA shrink runs on the
    model's LoRA stream beside the GEMM; --no-lora-side-stream runs it after the GEMM on the one stream. Same
    kernels, same arithmetic: tokens and logprobs bitwise equal, in graphs (3, 4 and 8 rows mixed with rows
    without an adapter) and in eager prefill."""
    _, fp8, ads = setup
    on = engines["dual"]
    off = make(fp8, lora_modules={"A": ads["A"], "B": ads["B"]}, max_loras=2, lora_side_stream=False)
    sp = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    for lengths, loras in (([7, 12, 4], ["A", "B", "A"]), ([9, 3, 30, 5], [None, "B", None, "A"]),
                           ([5, 8, 13, 21, 34, 6, 11, 40], ["A", None, "B", "B", None, "A", "A", None])):
        ps = prompts(lengths, seed=5 * len(lengths) + sum(lengths))
        for g, w in zip(on.generate(ps, sp, lora=loras), off.generate(ps, sp, lora=loras)):
            assert g.token_ids == w.token_ids
            assert [(x.logprob, x.top) for x in g.logprobs] == [(x.logprob, x.top) for x in w.logprobs]
    assert on.runner.model._lora_stream is not None and off.runner.model._lora_stream is None
