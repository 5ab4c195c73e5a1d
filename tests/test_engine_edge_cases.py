"""Edge cases found in review: each used to hang, crash a batch, or lose text."""
import random
import shutil

import pytest
import torch

from moeserve import Engine, EngineConfig, RequestError, SamplingParams
from moeserve.layers.sampler import _filter_top_k_top_p, request_key, row_key
from moeserve.lora.adapter import LoRAAdapterError
from moeserve.frontend.output_processor import find_stop
from peft_fixtures import make_peft_adapter, save_base_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run_all(engine, max_steps=500):
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    raise AssertionError("engine did not finish its requests")


def test_prompt_longer_than_the_step_budget_without_chunked_prefill(tiny_models):
    path = tiny_models["qwen3_moe"]
    prompt = list(range(10, 30))
    want = Engine(EngineConfig(model=str(path), device="cpu", block_size=4)).generate(
        [prompt], SamplingParams(max_tokens=3, **GREEDY))[0].token_ids
    engine = Engine(EngineConfig(model=str(path), device="cpu", block_size=4, max_num_batched_tokens=8,
                                 enable_chunked_prefill=False))
    rid = engine.add_request(prompt, SamplingParams(max_tokens=3, **GREEDY))
    assert run_all(engine)[rid].token_ids == want


def test_recompute_after_preemption_larger_than_the_budget(tiny_models):
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3_moe"]), device="cpu", block_size=4,
                                 max_num_batched_tokens=8, enable_chunked_prefill=False, num_kv_blocks=8))
    ids = [engine.add_request([5 + i] * 6, SamplingParams(max_tokens=20, **GREEDY)) for i in range(2)]
    outs = run_all(engine)
    assert engine.stats().num_preemptions > 0
    assert all(len(outs[i].token_ids) == 20 for i in ids)


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("edge")
    base = save_base_checkpoint("qwen3_moe", root / "base")
    return base, {n: make_peft_adapter("qwen3_moe", root / n, rank=2, seed=i)[0] for i, n in enumerate("abc")}


def test_request_for_an_unpinned_adapter_when_every_slot_is_pinned(lora_base):
    base, ads = lora_base
    engine = Engine(EngineConfig(model=str(base), device="cpu", block_size=4, enable_lora=True, max_loras=1,
                                 max_lora_rank=8))
    engine.load_lora("a", str(ads["a"]), pinned=True)
    engine.load_lora("b", str(ads["b"]))
    with pytest.raises(LoRAAdapterError, match="pinned"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), lora="b")
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, **GREEDY), lora="a")
    assert len(run_all(engine)[rid].token_ids) == 2


def test_adapter_whose_files_vanish_fails_only_its_request(lora_base, tmp_path):
    base, ads = lora_base
    engine = Engine(EngineConfig(model=str(base), device="cpu", block_size=4, enable_lora=True, max_loras=2,
                                 max_cpu_loras=2, max_lora_rank=8))
    gone = tmp_path / "c"
    shutil.copytree(ads["c"], gone)
    engine.load_lora("c", str(gone))
    engine.load_lora("a", str(ads["a"]))
    engine.load_lora("b", str(ads["b"]))  # host cache holds 2: c's parsed copy is dropped
    shutil.rmtree(gone)
    other = engine.add_request([9, 8, 7, 6], SamplingParams(max_tokens=4, **GREEDY))
    doomed = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, **GREEDY), lora="c")
    outs = run_all(engine)
    assert outs[doomed].finish_reason == "error" and "c" in outs[doomed].error
    assert len(outs[other].token_ids) == 4 and outs[other].finish_reason == "length"
    engine.unload_lora("c")  # nothing holds it any more
    assert engine.allocator.num_free == engine.allocator.num_usable


def test_out_of_range_sampling_values(tiny_models):
    engine = Engine(EngineConfig(model=str(tiny_models["mixtral"]), device="cpu", block_size=4))
    for bad in (dict(seed=2**64), dict(seed=-2**63 - 1), dict(top_k=2**63)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(max_tokens=2, **bad)
    big_k = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=3, temperature=1.0, top_k=10**9, seed=1,
                                                        ignore_eos=True))[0]
    assert len(big_k.token_ids) == 3
    tiny_t = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=3, temperature=1e-30, ignore_eos=True))[0]
    assert tiny_t.token_ids == engine.generate([[4, 5, 6]], SamplingParams(max_tokens=3, **GREEDY))[0].token_ids


def test_rows_without_top_p_keep_their_whole_distribution():
    logits = torch.randn(2, 151936, generator=torch.Generator().manual_seed(0)) * 4
    out = _filter_top_k_top_p(logits, torch.tensor([-1, -1]), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out[0]).all()
    assert not torch.isfinite(out[1]).all()


def test_stop_string_found_inside_a_long_new_piece_of_text():
    text = "Hello world" + "." * 32  # one token that decodes to a long run
    assert find_stop(text, ["."], text_before=len("Hello world")) == len("Hello world")
    assert find_stop(text, ["xyz", "d."], text_before=len("Hello world")) == len("Hello worl")
    assert find_stop("Hello world", ["."], text_before=5) == -1


def test_generate_is_all_or_nothing_and_auto_ids_avoid_caller_ids(tiny_models):
    engine = Engine(EngineConfig(model=str(tiny_models["olmoe"]), device="cpu", block_size=4))
    with pytest.raises(RequestError, match="empty"):
        engine.generate([[4, 5], []], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()  # the valid first prompt was withdrawn too
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=2), request_id="req-0")
    auto = engine.add_request([4, 5, 6], SamplingParams(max_tokens=2))
    assert auto != "req-0"
    assert set(run_all(engine)) == {"req-0", auto}


def test_distinct_seeds_draw_distinct_noise():
    """Row keys of distinct seeds differ beyond chance: no family of seeds shares its keys (the halves of a
    seed are mixed in turn; hashed apart and XORed, seeds (hi, lo) and (lo - c, hi + c) shared every key, and
    2^32 seeds had keys of the position alone)."""
    c, m = 0x9E3779B9, 2**32

    def seed(hi, lo):
        return (hi % m) << 32 | (lo % m)

    swapped = [(seed(hi, lo), seed(lo - c, hi + c)) for hi, lo in ((0, 42), (5, 7), (123456, 0))]
    cancelled = [(seed(hi, hi + c), seed(hi + 1, hi + 1 + c)) for hi in (0, 1, 99999)]
    structured = swapped + cancelled + [(1, 1 << 32), (2**64 - 1, 2**63 - 1)]
    for a, b in structured:
        ka, kb = request_key(a), request_key(b)
        assert [row_key(ka, p) for p in range(64)] != [row_key(kb, p) for p in range(64)], (a, b)
        assert sum(row_key(ka, p) == row_key(kb, p) for p in range(64)) <= 1, (a, b)
    rng = random.Random(0)
    seeds = [rng.getrandbits(64) for _ in range(5000)] + list(range(5000)) + [i << 32 for i in range(1, 5000)]
    for position in (0, 1, 777):
        keys = {row_key(request_key(s), position) for s in seeds}
        assert len(seeds) - len(keys) <= 2  # 15k keys of 32 bits: ~0.03 collisions expected by chance
    assert request_key(-1) == request_key(2**64 - 1)  # int64 and uint64 spellings of one seed
