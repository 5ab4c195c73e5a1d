"""Start-up warm-up (engine/warmup.py): it runs every prefill shape with and without adapters, touches nothing
but the dummy KV block, and leaves the engine's results exactly as they were. On the GPU, no request compiles a
kernel after it (tests/test_gpu_first_request.py)."""
import torch

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.engine.warmup import (CompileWatch, decode_batches, decode_split_shapes, eager_decode_sizes, warm_up,
                                     warmup_batches, warmup_token_counts)

from moeserve.kernels.lora_dense import token_block
from moeserve.kernels.moe_align import align_constants
from moeserve.kernels.moe_plan import heuristic_plan, tile_table

from peft_fixtures import make_peft_adapter, save_base_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_token_counts_cover_both_specializations_and_stay_within_the_step_budget():
    counts = warmup_token_counts(300)
    assert counts[-1] == 300 and max(counts) <= 300
    assert any(c % 16 == 0 for c in counts) and any(c % 2 for c in counts)


def test_a_count_beyond_one_sequence_runs_over_several_prompts():
    """A step holds many prompts, so its token count may exceed the longest sequence (session 11: a served model
    with max_model_len 4,096 and 8,192-token steps compiled the 4,097..8,192 variants inside requests): every
    count runs, and no warm-up sequence is longer than the cap."""
    batches = warmup_batches([8192, 99, 150, 5], [-1, 0], block_size=16, max_seq_tokens=99)
    for b in batches:
        assert all(s.num_prompt_tokens <= 99 for s in b.seqs)
        assert all(s.num_computed_tokens + n == s.num_prompt_tokens for s, n in zip(b.seqs, b.num_new_tokens))
    assert {(sum(b.num_new_tokens), b.seqs[0].lora_slot) for b in batches} == {
        (n, slot) for n in (8192, 99, 150, 5) for slot in (-1, 0)}


def test_token_counts_reach_every_compile_time_variant_a_step_can_take():
    """Each token count a step can have decides some kernels' compile-time constants (the MoE alignment's chunk
    and chunk count, the MoE plan with and without adapters and its tuned-table row, the dense LoRA tiling) and
    Triton's integer specializations: the warm-up counts must take every combination any count takes."""
    tuned_edges = sorted({row[0] for rows in tile_table().values() for row in rows})

    def variant(t, top_k):
        pairs = t * top_k
        row = next((i for i, edge in enumerate(tuned_edges) if t <= edge), len(tuned_edges))
        return (align_constants(pairs), heuristic_plan(t, top_k, None, False), heuristic_plan(t, top_k, None, True),
                row, align_constants(t), token_block(t), t == 1, t % 16 == 0)  # slots grouped: t pairs

    assert tuned_edges  # the shipped table has rows
    for top_k, limit in ((8, 8192), (6, 8192), (2, 3000), (4, 700)):
        counts = warmup_token_counts(limit, top_k)
        missing = {variant(t, top_k) for t in range(1, limit + 1)} - {variant(t, top_k) for t in counts}
        assert not missing, (top_k, limit, missing)


def test_batches_cover_one_two_and_sixteen_sequences_with_and_without_lora():
    batches = warmup_batches([1, 33], [-1, 0], block_size=4)
    shapes = {(len(b.seqs), sum(b.num_new_tokens), b.seqs[0].lora_slot) for b in batches}
    assert shapes == {(1, 1, -1), (1, 33, -1), (2, 33, -1), (16, 33, -1), (1, 1, 0), (1, 33, 0), (2, 33, 0),
                      (16, 33, 0)}
    for b in batches:
        assert all(set(s.block_table) == {0} for s in b.seqs)  # the dummy block only
        assert all(s.num_computed_tokens + n == s.num_prompt_tokens for s, n in zip(b.seqs, b.num_new_tokens))


def test_warm_up_leaves_no_trace(tmp_path):
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    path, _ = make_peft_adapter(family, tmp_path / "ad", kind="attn+experts", rank=4, seed=1)

    def engine():
        return Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", block_size=4,
                                   lora_modules={"ad": str(path)}, max_lora_rank=8))

    cold, warm = engine(), engine()
    kv_before = [t.clone() for layer in warm.runner.kv_caches for t in layer]
    warm_up(warm.runner, [1, 5, 33], with_lora=True, block_size=4, decode_shapes=[(1, 1), (3, 2)])
    kv_after = [t for layer in warm.runner.kv_caches for t in layer]
    block0 = [torch.equal(a[1:], b[1:]) for a, b in zip(kv_before, kv_after)]  # blocks past the dummy one
    assert all(block0)
    assert any(not torch.equal(a[:1], b[:1]) for a, b in zip(kv_before, kv_after))  # it did write the dummy block
    prompts = [[5, 9, 30, 2, 7, 11, 4], [8, 1, 40]]
    for lora in (None, "ad"):
        ours = [o.token_ids for o in warm.generate(prompts, GREEDY, lora=lora)]
        assert ours == [o.token_ids for o in cold.generate(prompts, GREEDY, lora=lora)]


def test_eager_decode_sizes_are_those_no_graph_serves():
    assert eager_decode_sizes(256, 256) == []
    assert eager_decode_sizes(300, 256) == [257, 300]
    sizes = eager_decode_sizes(40, None)  # no graphs: every decode step is eager
    assert sizes[0] == 1 and sizes[-1] == 40 and any(b % 16 == 0 for b in sizes)
    batches = decode_batches([(3, 2)], [-1], block_size=4)
    assert [(len(b.seqs), b.is_decode, b.num_new_tokens) for b in batches] == [(3, True, [1, 1, 1])]
    assert [len(s.block_table) for s in batches[0].seqs] == [2, 2, 2]


def test_decode_split_shapes_cover_every_split_count():
    splits = lambda b, blocks: min(-(-12 // b), blocks)  # noqa: E731  (a split rule of batch and context)
    shapes = decode_split_shapes(range(1, 9), 6, splits)
    want = {splits(b, k) for b in range(1, 9) for k in range(1, 7)}
    assert sorted(splits(b, k) for b, k in shapes) == sorted(want)  # each count once, by its smallest shape


def test_configured_adapters_are_resident_before_the_first_request(tmp_path):
    """--lora-modules adapters are copied into free slots at start (in order, while slots are free), so the first
    requests on them load nothing; one more adapter than slots waits for its first use."""
    family = "olmoe"
    base = save_base_checkpoint(family, tmp_path / "base")
    paths = {name: str(make_peft_adapter(family, tmp_path / name, kind="attn+experts", rank=4, seed=i)[0])
             for i, name in enumerate(["a", "b", "c"])}
    engine = Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", block_size=4, max_loras=2,
                                 max_lora_rank=8, lora_modules=paths))
    assert engine.stats().lora_loads_total == 2
    engine.generate([[5, 9, 30], [8, 1, 40]], GREEDY, lora=["a", "b"])
    assert engine.stats().lora_loads_total == 2  # both were resident
    engine.generate([[5, 9, 30]], GREEDY, lora="c")
    assert engine.stats().lora_loads_total == 3


def test_compile_watch_counts_and_names_kernels_compiled_after_start(caplog, tmp_path):
    """Triton calls its cache hook before each compile (or disk-cache load) of a variant not in memory: the watch
    counts it, names the kernel in a warning, lets the compile go on, chains a hook installed before it and puts
    that one back on close. (On the GPU: tests/test_gpu_first_request.py.)"""
    from triton import knobs

    from moeserve.bench.protocol import compiled_after_start

    before = []
    knobs.runtime.jit_cache_hook = lambda *a, **kw: before.append(kw["key"])
    try:
        watch = CompileWatch()
        hook = knobs.runtime.jit_cache_hook
        with caplog.at_level("WARNING", logger="moeserve"):
            skip = hook(key="k1", repr="_moe_gate_up_kernel[num_warps=8, num_stages=4](x_ptr: *bf16)")
        assert not skip  # the compile goes on
        assert watch.count == 1 and before == ["k1"]
        assert "_moe_gate_up_kernel compiled on the request path" in caplog.text
        log = tmp_path / "server.log"  # what `bench protocol` reads back from a server's log
        log.write_text(caplog.text)
        assert compiled_after_start(str(log)) == ["_moe_gate_up_kernel"]
        watch.close()
        assert knobs.runtime.jit_cache_hook is not hook
        knobs.runtime.jit_cache_hook(key="k2")
        assert before == ["k1", "k2"] and watch.count == 1
    finally:
        knobs.runtime.jit_cache_hook = None
