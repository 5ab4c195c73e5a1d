"""Adapter churn (issue 15): 4 adapters over 2 slots on a real server (tiny model, CPU), reloaded and
unloaded/loaded while concurrent traffic runs (moeserve/bench/churn.py, a small run): no request fails, no answer
differs from the same request run alone, and those solo answers equal an offline engine's (independent of the
server) with every adapter loaded at start."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("uvicorn")

from moeserve import Engine, EngineConfig, SamplingParams  # noqa: E402
from moeserve.bench.churn import main as churn_main, run_churn  # noqa: E402
from moeserve.models.tiny import make_tiny  # noqa: E402
from server_harness import RunningServer  # noqa: E402

MODEL = "tiny-moe"
# max_cpu_loras = max_loras: adapters fall out of the host cache and are read again (off the step loop)
KW = dict(max_model_len=128, num_kv_blocks=256, max_num_seqs=16, block_size=16, enable_lora=True, max_loras=2,
          max_cpu_loras=2, max_lora_rank=8)
OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from peft_fixtures import make_peft_adapter

    root = tmp_path_factory.mktemp("churn")
    model = make_tiny("qwen3_moe", root / "model")
    kinds = ("attn+experts", "experts", "attn", "attn+experts")
    adapters = {f"ad{i}": str(make_peft_adapter("qwen3_moe", root / f"ad{i}", kind=kind, rank=4, seed=i + 1)[0])
                for i, kind in enumerate(kinds)}
    return str(model), adapters


def test_churn_under_traffic_loses_nothing_and_answers_right(setup):
    model, adapters = setup
    s = RunningServer(EngineConfig(model=model, enable_lora_runtime_loading=True, **KW), MODEL)
    try:
        res = asyncio.run(run_churn(s.url, adapters, num_requests=96, max_concurrency=8, num_prompts=4,
                                    input_words=6, output_len=OUTPUT_LEN, seed=1))
        stats = s.stats()
    finally:
        s.close()
    print(f"\nchurn: {res.completed} ok / {res.failed} failed, {res.wrong} wrong, {res.request_throughput:.1f} req/s, "
          f"p50 {res.p50_latency_ms:.0f} ms, p99 {res.p99_latency_ms:.0f} ms, {res.reloads} reloads, "
          f"{res.unload_loads} unload+load, lora loads {stats.lora_loads_total}, "
          f"re-reads {stats.lora_rereads_total}")
    assert res.failed == 0 and res.failed_churn_ops == 0, res.errors
    assert res.wrong == 0, [a for a in res.answers if a["text"] != a["solo"]][:3]
    assert res.completed == 96 and res.reloads >= 1 and res.unload_loads >= 1
    assert stats.lora_loads_total > len(adapters)  # slots really changed hands
    assert stats.lora_rereads_total > 0  # and adapters were read again (on the reader thread) after eviction
    # the solo answers themselves against an offline engine with all four adapters loaded at start
    ref = Engine(EngineConfig(model=model, lora_modules=adapters, **dict(KW, max_loras=4, max_cpu_loras=4)))
    pairs = sorted({(a["prompt"], a["model"]) for a in res.answers})
    want = ref.generate([p for p, _ in pairs], SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True),
                        lora=[None if m == MODEL else m for _, m in pairs])
    solo = {(a["prompt"], a["model"]): a["solo"] for a in res.answers}
    assert [solo[p] for p in pairs] == [w.text for w in want]
    assert {m for _, m in pairs} == {MODEL, *adapters}


def test_churn_cli_parses_adapters():
    with pytest.raises(ValueError, match="NAME=PATH"):
        churn_main(["--adapters", "noequals"])
