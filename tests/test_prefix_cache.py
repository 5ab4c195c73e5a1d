"""Adapter-aware prefix caching: the allocator's refcounts and LRU, and the engine with the cache on against
the same engine with it off (greedy tokens equal, logprobs within 1e-5), for base and adapter requests; a
prefix is never found across adapters, the base model, or versions of one name; accounting stays exact
under eviction, preemption and abort; cached_tokens reaches the OpenAI usage."""
from __future__ import annotations

import argparse

import pytest
import torch

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.engine_args import add_engine_args, engine_config_from_args
from moeserve.worker.kv_cache import BlockAllocator, prefix_hashes

from peft_fixtures import make_peft_adapter, save_base_checkpoint

BS = 4  # block size of the engine tests
FAMILY = "qwen3_moe"
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


# ---------------------------------------------------------------------------------------------
# the allocator on its own
# ---------------------------------------------------------------------------------------------

def check_accounting(alloc: BlockAllocator) -> None:
    """Every usable block is in exactly one place, refcounts agree with it, and the hash maps are inverse."""
    usable = set(range(1, alloc.num_blocks))
    free, evictable = list(alloc.free), list(alloc.evictable)
    in_use = {b for b in usable if alloc.refcount[b] > 0}
    assert len(set(free)) == len(free) and 0 not in free and 0 not in evictable
    assert set(free) | set(evictable) | in_use == usable
    assert len(free) + len(evictable) + len(in_use) == len(usable)
    assert all(alloc.refcount[b] == 0 for b in free + evictable) and min(alloc.refcount) >= 0
    assert not set(free) & set(alloc.hash_of) and set(evictable) <= set(alloc.hash_of)
    assert {b: h for h, b in alloc.block_of.items()} == alloc.hash_of


def check_idle(alloc: BlockAllocator) -> None:
    check_accounting(alloc)
    assert not any(alloc.refcount) and alloc.num_free == alloc.num_usable


def test_prefix_hashes_name_full_blocks_by_their_whole_prefix_and_the_adapter_version():
    tokens = list(range(10, 30))
    h = prefix_hashes(tokens, 4)
    assert len(h) == 5 and len(set(h)) == 5
    assert prefix_hashes(tokens[:11], 4) == h[:2]  # a partial block has no name
    changed = prefix_hashes(tokens[:6] + [999] + tokens[7:], 4)
    assert changed[0] == h[0] and all(a != b for a, b in zip(h[1:], changed[1:]))  # a change reaches every later block
    same_blocks = prefix_hashes([7] * 8, 4)
    assert same_blocks[0] != same_blocks[1]  # equal tokens at another position: another prefix
    keyed = [set(prefix_hashes(tokens, 4, key)) for key in (None, ("a", 1), ("a", 2), ("b", 1))]
    assert all(not keyed[i] & keyed[j] for i in range(4) for j in range(i + 1, 4))
    assert prefix_hashes(tokens, 4, ("a", 1)) == prefix_hashes(tokens, 4, ("a", 1))


def test_allocator_shares_cached_blocks_refcounts_them_and_evicts_lru_tail_first():
    alloc = BlockAllocator(7, 4)  # 6 usable blocks
    hashes = prefix_hashes(list(range(12)), 4)
    t1 = []
    assert alloc.grow(t1, 12) and len(t1) == 3
    for b, h in zip(t1, hashes):
        alloc.register(b, h)
    assert alloc.match(hashes) == t1 and alloc.num_cached == 3
    assert alloc.match(prefix_hashes([99] + list(range(1, 12)), 4) + hashes[1:]) == []  # the run stops at a miss
    t2 = []
    assert alloc.grow(t2, 14, cached=alloc.match(hashes[:2]))  # 2 shared + 2 fresh
    assert t2[:2] == t1[:2] and len(set(t2[2:]) & set(t1)) == 0
    assert [alloc.refcount[b] for b in t1] == [2, 2, 1] and alloc.num_free == 1
    check_accounting(alloc)
    t3 = []
    assert not alloc.grow(t3, 8) and t3 == [] and alloc.num_free == 1  # short: no change
    alloc.register(t2[2], hashes[2])  # another copy of a cached prefix stays private
    assert alloc.block_of[hashes[2]] == t1[2] and t2[2] not in alloc.hash_of
    alloc.release(t1)
    assert t1 == [] and alloc.num_free == 2 and alloc.num_cached == 3  # its last block: evictable, still found
    alloc.release(t2)  # t2's private blocks go free; its shared ones become evictable, tail first
    assert alloc.num_free == 6 and len(alloc.free) == 3
    assert list(alloc.evictable) == [alloc.block_of[h] for h in reversed(hashes)]
    check_idle(alloc)
    # reviving an evictable block counts against the free ones
    t4 = []
    assert not alloc.grow(t4, 4 * 7, cached=alloc.match(hashes[:1]))  # 1 revived + 6 fresh > 6 free or evictable
    assert t4 == [] and alloc.num_free == 6
    assert alloc.grow(t4, 4 * 4, cached=alloc.match(hashes[:1]))  # 1 revived + 3 fresh: every plain free block
    head, tail = t4[0], alloc.block_of[hashes[2]]
    assert alloc.refcount[head] == 1 and head not in alloc.evictable and alloc.num_evictions == 0
    t5 = []
    assert alloc.grow(t5, 4) and t5 == [tail]  # nothing free: the least recently used cached block, the tail
    assert alloc.num_evictions == 1 and alloc.match(hashes) == [head, alloc.block_of[hashes[1]]]
    check_accounting(alloc)
    alloc.release(t4)
    alloc.release(t5)
    check_idle(alloc)
    alloc.reset_prefix_cache()
    assert alloc.num_cached == 0 and alloc.match(hashes) == [] and len(alloc.free) == 6
    check_idle(alloc)


def test_allocator_with_caching_off_never_names_blocks():
    alloc = BlockAllocator(4, 4, enable_prefix_caching=False)
    t = []
    assert alloc.grow(t, 8)
    alloc.register(t[0], prefix_hashes([1, 2, 3, 4], 4)[0])
    assert alloc.num_cached == 0
    alloc.release(t)
    check_idle(alloc)


def test_cli_flag_spelling():
    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_config_from_args(parser.parse_args([])).enable_prefix_caching is True
    assert engine_config_from_args(parser.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert engine_config_from_args(parser.parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True


# ---------------------------------------------------------------------------------------------
# the engine: cache on == cache off
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    base = save_base_checkpoint(FAMILY, root / "base")
    ads = {n: str(make_peft_adapter(FAMILY, root / n, rank=4, seed=90 + i)[0]) for i, n in enumerate("ab")}
    return base, ads


def make_engine(setup, on: bool, **kw) -> Engine:
    base, ads = setup
    kw.setdefault("lora_modules", dict(ads))
    return Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", block_size=BS, max_loras=2,
                               max_lora_rank=8, enable_prefix_caching=on, **kw))


def rand(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, 500, (n,), generator=g).tolist()


def expected_cached(prompt: list[int], lora, earlier) -> int:
    """The spec, independently: full blocks of an earlier prompt under the same adapter that prompt starts
    with, leaving at least one token to compute."""
    best = 0
    for p, lo in earlier:
        if lo != lora:
            continue
        n = 0
        while n < min(len(p), len(prompt)) and p[n] == prompt[n]:
            n += 1
        best = max(best, min(n, len(p)) // BS)
    return min(best, (len(prompt) - 1) // BS) * BS


def assert_same(on, off) -> None:
    assert on.token_ids == off.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(on.logprobs, off.logprobs)) <= 1e-5


def test_outputs_equal_the_cache_off_engine_in_two_waves_for_base_and_adapters(setup):
    g = torch.Generator().manual_seed(1)
    shared = rand(24, g)  # 6 blocks
    distinct = rand(11, g)
    wave1 = [(shared + rand(5, g), None),  # registers shared's 6 blocks for base
             (shared[:4] + rand(10, g), None),  # shares 1 block
             (distinct, None),  # shares nothing
             (list(distinct), None),  # computed twice side by side: one copy is cached, the other freed
             (shared[:6] + rand(3, g), None),  # shares a block and a half
             (shared + rand(3, g), "a"),
             (shared[:9] + rand(6, g), "b")]
    wave2 = [(shared + rand(7, g), None),  # every shared block, registered by wave 1
             (shared + rand(2, g), "a"),
             (list(shared), None),  # all of it cached, but its last block is computed again (logits)
             (list(distinct), None),  # the same prompt again
             (shared[:10], "b"),  # 2 full blocks of b's wave-1 prompt
             (shared[:13], "a"),
             (rand(9, g), "b")]  # nothing
    engines = {on: make_engine(setup, on) for on in (True, False)}
    earlier = []
    for wave in (wave1, wave2):
        prompts, loras = [p for p, _ in wave], [lo for _, lo in wave]
        outs = {on: e.generate(prompts, SP, lora=loras) for on, e in engines.items()}
        want = [expected_cached(p, lo, earlier) for p, lo in wave]
        for on_out, off_out in zip(outs[True], outs[False]):
            assert_same(on_out, off_out)
        assert [o.num_cached_tokens for o in outs[True]] == want
        assert [o.num_cached_tokens for o in outs[False]] == [0] * len(wave)
        earlier += wave
    assert sum(want) == 24 + 24 + 20 + 8 + 8 + 12  # wave 2 hit what wave 1 registered
    on, off = engines[True].stats(), engines[False].stats()
    assert on.prefix_cache_hits == sum(want)
    assert on.prefix_cache_queries == sum(len(p) for p, _ in earlier)
    assert on.prefix_cache_hit_rate == pytest.approx(sum(want) / on.prefix_cache_queries)
    assert on.prefix_cache_blocks > 0 and off.prefix_cache_queries == off.prefix_cache_blocks == 0
    for e in engines.values():
        check_idle(e.allocator)


def test_never_reused_across_adapters_the_base_model_or_versions_of_a_name(setup):
    _, ads = setup
    x = rand(18, torch.Generator().manual_seed(2))
    ref = make_engine(setup, False)
    want = {lo: ref.generate([x], SP, lora=lo)[0] for lo in ("a", "b", None)}
    # the three really differ, so reusing one's blocks for another would show
    assert len({tuple(round(lp.logprob, 4) for lp in o.logprobs) for o in want.values()}) == 3
    engine = make_engine(setup, True)

    def run(lora):
        before = engine.stats().prefix_cache_hits
        out = engine.generate([x], SP, lora=lora)[0]
        assert engine.stats().prefix_cache_hits - before == out.num_cached_tokens
        return out

    first = run("a")
    assert first.num_cached_tokens == 0
    for lo in ("b", None):
        out = run(lo)
        assert out.num_cached_tokens == 0
        assert_same(out, want[lo])
    again = run("a")
    assert again.num_cached_tokens == 16  # (18 - 1) // 4 blocks
    assert_same(again, want["a"])
    # "a" reloaded under its name with b's weights: a new version, never the old version's blocks
    engine.core.load_lora("a", ads["b"], replace=True)
    reloaded = run("a")
    assert reloaded.num_cached_tokens == 0
    assert_same(reloaded, want["b"])
    assert run("a").num_cached_tokens == 16  # the new version's own blocks are found
    # unloaded and loaded again: another version; the old blocks are unreachable and get reclaimed
    engine.unload_lora("b")
    engine.load_lora("b", ads["b"])
    out = run("b")
    assert out.num_cached_tokens == 0
    assert_same(out, want["b"])
    check_idle(engine.allocator)


def test_eviction_preemption_and_abort_under_a_tiny_cache_keep_accounting_exact(setup, monkeypatch):
    """12 usable blocks (48 tokens), a 16-token step budget: prompts sharing prefixes run concurrently,
    are preempted and recomputed; recomputes find their cached blocks; some requests are aborted."""
    g = torch.Generator().manual_seed(3)
    shared = rand(16, g)
    jobs = [(shared + rand(6, g), None), (shared + rand(9, g), "a"), (shared[:8] + rand(5, g), None),
            (rand(14, g), "b"), (shared + rand(2, g), None), (shared[:12] + rand(7, g), "a"),
            (rand(10, g), None), (shared + rand(4, g), "b")]
    kw = dict(num_kv_blocks=13, max_num_batched_tokens=16, max_model_len=48)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)

    def run(engine, abort_at=None):
        ids = {}
        outs = {}
        for step in range(10_000):
            if step % 3 == 0 and len(ids) < len(jobs):  # staggered arrivals
                p, lo = jobs[len(ids)]
                ids[engine.add_request(p, sp, lora=lo)] = len(ids)
            if abort_at and step in abort_at:
                rid = [r for r, i in ids.items() if i == abort_at[step]][0]
                assert engine.abort(rid)
            for o in engine.step():
                if o.finished:
                    outs[ids[o.request_id]] = o
            if len(ids) == len(jobs) and not engine.has_unfinished():
                return outs
        raise AssertionError("did not finish")

    off = run(make_engine(setup, False, **kw))
    engine = make_engine(setup, True, **kw)
    found = []  # (preempted before?, cached blocks found) at each admission
    match = engine.scheduler._cached_prefix

    def spy(seq):
        blocks = match(seq)
        found.append((seq.num_preemptions, len(blocks)))
        return blocks

    monkeypatch.setattr(engine.scheduler, "_cached_prefix", spy)
    on = run(engine)
    for i in range(len(jobs)):
        assert_same(on[i], off[i])
    s = engine.stats()
    assert s.num_preemptions > 0 and s.prefix_cache_evictions > 0 and s.prefix_cache_hits > 0
    assert any(pre > 0 and n > 0 for pre, n in found)  # a recompute took its own cached blocks back
    check_idle(engine.allocator)
    # aborts mid-prefill and mid-decode, same arrivals
    engine = make_engine(setup, True, **kw)
    aborted = run(engine, abort_at={4: 1, 9: 0, 17: 5})
    for i in set(range(len(jobs))) - {0, 1, 5}:
        assert_same(aborted[i], off[i])
    assert engine.stats().aborted_total == 3
    check_idle(engine.allocator)


def test_chunked_prefill_starts_after_the_cached_blocks(setup):
    g = torch.Generator().manual_seed(4)
    shared = rand(20, g)
    first, second = shared + rand(3, g), shared + rand(15, g)
    outs = {}
    for on in (True, False):
        engine = make_engine(setup, on, max_num_batched_tokens=8)  # the 15 uncached tokens take two steps
        outs[on] = [engine.generate([p], SP, lora="a")[0] for p in (first, second)]
        check_idle(engine.allocator)
    assert [o.num_cached_tokens for o in outs[True]] == [0, 20]
    for a, b in zip(outs[True], outs[False]):
        assert_same(a, b)


def test_prefill_batching_counts_only_uncached_tokens(setup):
    """A waiting prompt that is mostly cached is little work: it waits for prefill_delay_steps like any small
    prompt instead of forcing a prefill step (which reads every weight) at once."""
    g = torch.Generator().manual_seed(8)
    p, other = rand(40, g), rand(5, g)
    waited = {}
    for on in (True, False):
        engine = make_engine(setup, on, max_num_batched_tokens=64, prefill_delay_steps=4)
        engine.generate([p], SP)  # p's blocks are cached (with the cache on)
        engine.add_request(other, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            engine.step()  # `other` decodes
        rid = engine.add_request(p + [7, 8], SP)  # 42 tokens: 40 of them cached
        steps = 0
        while rid not in {s.request_id for s in engine.scheduler.running}:
            engine.step()
            steps += 1
        waited[on] = steps
        while engine.has_unfinished():
            engine.step()
        check_idle(engine.allocator)
    assert waited[False] == 1 and waited[True] == 5  # 42 >= 64 / 2 tokens are due at once; 2 tokens wait 4 steps


def test_prompt_logprobs_requests_compute_their_whole_prompt(setup):
    g = torch.Generator().manual_seed(5)
    p = rand(14, g)
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outs = {}
    for on in (True, False):
        engine = make_engine(setup, on)
        engine.generate([p], SP)  # its blocks are cached (with the cache on)
        outs[on] = engine.generate([p], sp)[0]
    assert outs[True].num_cached_tokens == 0 and outs[True].token_ids == outs[False].token_ids
    assert len(outs[True].prompt_logprobs) == len(p)
    for a, b in zip(outs[True].prompt_logprobs[1:], outs[False].prompt_logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 1e-5


# ---------------------------------------------------------------------------------------------
# through the server
# ---------------------------------------------------------------------------------------------

def test_cached_tokens_in_openai_usage_and_metrics(tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from prometheus_client.parser import text_string_to_metric_families

    from moeserve.models.tiny import make_tiny
    from server_harness import RunningServer

    model_dir = make_tiny(FAMILY, tmp_path / "tiny")
    server = RunningServer(EngineConfig(model=str(model_dir), max_model_len=128, num_kv_blocks=64, block_size=16),
                           "tiny")

    def hits() -> float:
        fams = text_string_to_metric_families(server.http.get("/metrics").text)
        return {s.name: s.value for f in fams for s in f.samples}["moeserve_prefix_cache_hits_total"]

    try:
        prompt = rand(40, torch.Generator().manual_seed(6))
        h0 = hits()
        r1 = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
        r2 = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        assert r2.usage.prompt_tokens_details.cached_tokens == 32  # (40 - 1) // 16 blocks
        assert r2.choices[0].text == r1.choices[0].text
        chunks = list(server.client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
        messages = [{"role": "user", "content": "tell me about the weather in the mountains in early spring"}]
        c1 = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
        n = c1.usage.prompt_tokens
        assert n > 16 and c1.usage.prompt_tokens_details.cached_tokens == 0
        chunks = list(server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                                            temperature=0, stream=True,
                                                            stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
        assert hits() - h0 == 32 + 32 + (n - 1) // 16 * 16
        assert server.wait_idle().kv_blocks_free == server.stats().kv_blocks_total
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------
# on the GPU: Triton prefill over cached context, decode graphs unchanged
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_cache_on_equals_cache_off_with_triton_and_decode_graphs(setup):
    """fp32 so that the comparison is about the cache, not bf16 rounding of different prefill shapes."""
    from moeserve.worker.graph_runner import LORA, GraphKey

    base, ads = setup
    g = torch.Generator().manual_seed(7)
    shared = rand(40, g)  # 2 full blocks of 16
    waves = [[(shared + rand(5, g), None), (shared + rand(9, g), "a"), (rand(20, g), "b")],
             [(shared + rand(30, g), None), (shared + rand(3, g), "a"), (shared[:33], "b"), (shared[:20], None)]]
    outs = {}
    for on in (True, False):
        engine = Engine(EngineConfig(model=str(base), device="cuda", dtype="float32", block_size=16,
                                     kv_cache_memory_bytes=64 << 20, cuda_graph_bs=[1, 2, 4], max_loras=2,
                                     max_lora_rank=8, lora_modules=dict(ads), enable_prefix_caching=on))
        outs[on] = [engine.generate([p for p, _ in w], SP, lora=[lo for _, lo in w]) for w in waves]
        assert engine.runner.graph_runner.replays[GraphKey(4, LORA)] > 0  # decode ran in its graph
        check_idle(engine.allocator)
    assert [o.num_cached_tokens for o in outs[True][1]] == [32, 32, 0, 16]
    for wave_on, wave_off in zip(outs[True], outs[False]):
        for a, b in zip(wave_on, wave_off):
            assert a.token_ids == b.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-2
