"""Whole engine on the GPU (bf16, Triton backends, CUDA graphs keyed by batch size and LoRA variant).

Marked `gpu`: skipped without CUDA; run on the device machine."""
import pytest
import torch

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.worker.graph_runner import LORA, NOLORA, GraphKey, GraphRunner
from moeserve.worker.sequence import ScheduledBatch
from moeserve.worker.sequence import Sequence
from peft_fixtures import make_peft_adapter, save_base_checkpoint

pytestmark = pytest.mark.gpu
GREEDY = dict(temperature=0.0, ignore_eos=True)
FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    base = save_base_checkpoint(FAMILY, root / "base")
    adapters = {n: str(make_peft_adapter(FAMILY, root / n, rank=r, seed=s)[0])
                for n, r, s in (("A", 4, 1), ("B", 8, 2), ("C", 4, 3))}
    return base, adapters


def make(base, **kw):
    kw.setdefault("max_lora_rank", 16)
    kw.setdefault("cuda_graph_bs", [1, 2, 4, 8])
    kw.setdefault("block_size", 16)
    kw.setdefault("kv_cache_memory_bytes", 256 << 20)
    return Engine(EngineConfig(model=str(base), device="cuda", **kw))


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def lp_close(a, b, tol):
    return max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= tol


@pytest.fixture(scope="module")
def engines(setup):
    base, ads = setup
    lora = {"A": ads["A"], "B": ads["B"]}
    return {
        "dual": make(base, lora_modules=lora, max_loras=2),
        "eager": make(base, lora_modules=lora, max_loras=2, enforce_eager=True),
        "plain": make(base),
        "torch": make(base, lora_modules=lora, max_loras=2, enforce_eager=True, moe_backend="torch",
                      attention_backend="torch"),
        "eager32": make(base, lora_modules=lora, max_loras=2, enforce_eager=True, dtype="float32"),
        "torch32": make(base, lora_modules=lora, max_loras=2, enforce_eager=True, dtype="float32",
                        moe_backend="torch", attention_backend="torch"),
    }


def test_config_resolves_triton_and_dual_capture(engines):
    dual = engines["dual"]
    assert dual.config.moe_backend == "triton" and dual.config.attention_backend == "triton"
    assert dual.runner.graph_runner.variants == [LORA, NOLORA]
    assert engines["plain"].runner.graph_runner.variants == [NOLORA]


def test_triton_backends_match_torch_backends(engines):
    """fp32: identical greedy tokens. bf16: teacher-forced logprobs of the torch backend's tokens agree."""
    ps = prompts([9, 17, 5], seed=1)
    sp = SamplingParams(max_tokens=12, logprobs=0, **GREEDY)
    for loras in ([None, None, None], ["A", None, "B"]):
        tri = engines["eager32"].generate(ps, sp, lora=loras)
        ref = engines["torch32"].generate(ps, sp, lora=loras)
        for t, r in zip(tri, ref):
            assert t.token_ids == r.token_ids
            assert lp_close(t, r, 1e-2)
        forced = [p + r.token_ids for p, r in zip(ps, engines["torch"].generate(ps, sp, lora=loras))]
        score = SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY)
        tri = engines["eager"].generate(forced, score, lora=loras)
        ref = engines["torch"].generate(forced, score, lora=loras)
        for t, r in zip(tri, ref):
            diffs = [abs(a.logprob - b.logprob) for a, b in zip(t.prompt_logprobs[1:], r.prompt_logprobs[1:])]
            assert max(diffs) < 0.15 and sum(diffs) / len(diffs) < 0.03


def test_graphs_equal_eager_under_alternating_traffic(engines):
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
    assert gr.replays[GraphKey(8, LORA)] == 0


def test_nolora_graph_is_bitwise_the_lora_disabled_engine(engines):
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
    # the recorded nolora graph holds exactly the kernels of the LoRA-disabled engine's graph
    nk_dual = dual.runner.graph_runner.graphs[GraphKey(4, NOLORA)].num_kernels()
    nk_plain = plain.runner.graph_runner.graphs[GraphKey(4, NOLORA)].num_kernels()
    nk_lora = dual.runner.graph_runner.graphs[GraphKey(4, LORA)].num_kernels()
    if nk_dual is None:
        pytest.skip("cuda-python not available to count graph nodes")
    assert nk_dual == nk_plain < nk_lora


def test_pdl_is_bitwise_the_serially_launched_engine(setup, engines):
    """Programmatic dependent launch overlaps each kernel's start with the previous one's tail; every kernel
    waits for its predecessor before touching memory, so tokens and logprobs are bitwise those of the same
    engine launching serially: graphs (LoRA, no-LoRA, mixed; padded bucket), eager prefill, a batch of 8."""
    base, ads = setup
    on = engines["dual"]
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    assert on.config.pdl is True
    off = make(base, lora_modules={"A": ads["A"], "B": ads["B"]}, max_loras=2, pdl=False)
    sp = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    for lengths, loras in (([7, 12, 4], [None] * 3), ([7, 12, 4], ["A", "B", "A"]), ([9, 3, 30], [None, "B", None]),
                           ([5, 8, 13, 21, 34, 6, 11, 40], ["A", None, "B", "B", None, "A", "A", None])):
        ps = prompts(lengths, seed=len(lengths) + sum(lengths))
        for g, w in zip(on.generate(ps, sp, lora=loras), off.generate(ps, sp, lora=loras)):
            assert g.token_ids == w.token_ids
            assert [(x.logprob, x.top) for x in g.logprobs] == [(x.logprob, x.top) for x in w.logprobs]


def test_lora_shrink_beside_cublas_is_bitwise_the_shrink_after_it(setup, engines):
    """With --lora-side-stream, where cuBLAS computes a projection (3 rows and more; prefill) its LoRA shrink runs on
    the model's LoRA stream beside the GEMM (layers/linear.py); the default bf16 engine runs it after the GEMM on the
    one stream. Same kernels, same arithmetic: tokens and logprobs bitwise equal, in graphs (batches of 3, 4 and 8,
    mixed with rows without an adapter, one padded bucket) and in eager prefill; the graphs hold the fork."""
    base, ads = setup
    off = engines["dual"]
    assert off.config.lora_side_stream is None  # the default: beside the FP8 GEMM only
    on = make(base, lora_modules={"A": ads["A"], "B": ads["B"]}, max_loras=2, lora_side_stream=True)
    sp = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    for lengths, loras in (([7, 12, 4], ["A", "B", "A"]), ([9, 3, 30, 5], [None, "B", None, "A"]),
                           ([5, 8, 13, 21, 34, 6, 11, 40], ["A", None, "B", "B", None, "A", "A", None])):
        ps = prompts(lengths, seed=3 * len(lengths) + sum(lengths))
        for g, w in zip(on.generate(ps, sp, lora=loras), off.generate(ps, sp, lora=loras)):
            assert g.token_ids == w.token_ids
            assert [(x.logprob, x.top) for x in g.logprobs] == [(x.logprob, x.top) for x in w.logprobs]
    assert on.runner.model._lora_stream is not None and off.runner.model._lora_stream is None


def _decode_batch(engine, lengths, loras, seed):
    """A decode batch (prompt in cache, one new token) built through the engine's own batch code."""
    seqs = []
    for i, (n, lo) in enumerate(zip(lengths, loras)):
        ids = prompts([n], seed=seed + i)[0]
        seq = Sequence(f"s{i}", ids, SamplingParams(max_tokens=4), lo)
        if lo is not None:
            assert engine.lora_manager.acquire(seq)
        assert engine.allocator.grow(seq.block_table, n)
        seq.num_computed_tokens = n - 1
        seqs.append(seq)
    # fill the cache for the first n-1 tokens with a prefill
    pre = ScheduledBatch(seqs, [s.num_prompt_tokens - 1 for s in seqs], is_decode=False)
    for s in seqs:
        s.num_computed_tokens = 0
    with torch.inference_mode():
        engine.runner.model(engine.runner.prepare(pre))
    for s in seqs:
        s.num_computed_tokens = s.num_prompt_tokens - 1
    sb = ScheduledBatch(seqs, [1] * len(seqs), is_decode=True)
    return sb, engine.runner.prepare(sb), seqs


def test_capturing_the_second_variant_does_not_disturb_the_first(engines):
    dual = engines["dual"]
    runner = dual.runner
    gr = GraphRunner(runner.model, [4], [LORA, NOLORA], runner.max_blocks_per_seq, runner.device,
                     runner.lora_pool.slot_ranks, graph_factory=type(dual.runner.graph_runner.graphs[GraphKey(4, LORA)]),
                     pool=torch.cuda.graph_pool_handle())
    sb, batch, seqs = _decode_batch(dual, [9, 5, 14], ["A", None, "B"], seed=40)
    try:
        gr.capture(GraphKey(4, LORA))
        first = gr.run(sb, batch).clone()
        state = {k: v.data_ptr() for k, v in vars(gr.batches[GraphKey(4, LORA)].attn).items() if torch.is_tensor(v)}
        gr.capture(GraphKey(4, NOLORA))  # second variant of the same size
        again = gr.run(sb, batch)
        assert torch.equal(first, again)
        assert state == {k: v.data_ptr() for k, v in vars(gr.batches[GraphKey(4, LORA)].attn).items()
                         if torch.is_tensor(v)}
        with torch.inference_mode():
            eager = runner.model(batch)
        assert (again.float() - eager.float()).abs().max().item() < 0.05 * eager.float().abs().max().item()
    finally:
        for s in seqs:
            dual.allocator.release(s.block_table)
            dual.lora_manager.release(s)


def test_hot_loaded_and_evicted_adapters_after_capture(setup, engines):
    base, ads = setup
    dual, eager = engines["dual"], engines["eager"]
    for e in (dual, eager):
        if "C" not in e.list_loras():
            e.load_lora("C", ads["C"])
    graphs_before = dict(dual.runner.graph_runner.graphs)
    ps = prompts([8, 11], seed=5)
    sp = SamplingParams(max_tokens=8, logprobs=0, **GREEDY)
    # two slots, three adapters: C evicts one, then the evicted one is reloaded
    for loras in (["C", "A"], ["B", "C"], ["A", "B"], ["C", None]):
        got = dual.generate(ps, sp, lora=loras)
        want = eager.generate(ps, sp, lora=loras)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
    assert dual.stats().lora_evictions_total > 0
    assert dual.runner.graph_runner.graphs == graphs_before  # no re-capture
