"""GraphRunner logic on CPU: buckets, padding, keys, variant choice, flag handling, per-key state.

The graph object sits behind a small interface; on CPU a stand-in 'replays' by re-running the
forward on the static buffers, so the buffer plumbing is checked against eager execution too."""
import pytest
import torch

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.worker.graph_runner import (LORA, NOLORA, EagerGraph, GraphKey, GraphRunner, dual_capture_plan,
                                           graph_batch_sizes, pick_bucket, resolve_variant)
from peft_fixtures import make_peft_adapter, save_base_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_bucket_sizes_and_choice():
    sizes = graph_batch_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert graph_batch_sizes(100)[-1] == 100
    assert graph_batch_sizes(512, [8, 1, 4, 8]) == [1, 4, 8]
    assert pick_bucket([1, 2, 4, 8], 3) == 4
    assert pick_bucket([1, 2, 4, 8], 8) == 8
    assert pick_bucket([1, 2, 4, 8], 9) is None


def test_graph_key_is_small_frozen_and_ordered():
    k = GraphKey(4, LORA)
    with pytest.raises(Exception):
        k.batch_size = 8
    assert {GraphKey(4, LORA): 1}[GraphKey(4, LORA)] == 1
    assert GraphKey(4, LORA) != GraphKey(4, NOLORA)
    assert str(k) == "bs4-lora"


def test_variant_is_resolved_on_the_host_from_request_slots():
    dual = [LORA, NOLORA]
    assert resolve_variant([-1, -1, -1], dual) == NOLORA
    assert resolve_variant([-1, 3, -1], dual) == LORA
    assert resolve_variant([-1, -1], [LORA]) == LORA  # single-graph baseline replays the LoRA graph
    assert resolve_variant([-1], [NOLORA]) == NOLORA


def test_record_nolora_flag_plan_and_warning():
    def cfg(**kw):
        c = EngineConfig(model="x", device="cpu", **kw).resolve()
        c.enforce_eager = False  # as on a CUDA device
        return c

    assert dual_capture_plan(cfg()) == ([NOLORA], None)  # LoRA off: one graph per size, no warning
    eager = EngineConfig(model="x", device="cpu", enable_lora=True, moe_backend="triton")
    assert dual_capture_plan(eager.resolve()) == ([LORA], None)  # the default where it cannot apply: no note
    eager = EngineConfig(model="x", device="cpu", enable_lora=True, moe_backend="triton", record_nolora_graph=True)
    assert "CUDA graphs are disabled" in dual_capture_plan(eager.resolve())[1]  # asked for: warned
    c = cfg(enable_lora=True, moe_backend="triton")
    assert dual_capture_plan(c) == ([LORA, NOLORA], None)
    assert dual_capture_plan(cfg(enable_lora=True, moe_backend="torch")) == ([LORA], None)
    variants, warning = dual_capture_plan(cfg(enable_lora=True, moe_backend="torch", record_nolora_graph=True))
    assert variants == [LORA] and "moe_backend='torch'" in warning
    assert dual_capture_plan(cfg(enable_lora=True, moe_backend="triton", record_nolora_graph=False)) == ([LORA], None)


class _CountingForward:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, batch):
        self.calls.append((batch.num_tokens, batch.lora is not None))
        return self.fn(batch)


def test_capture_order_and_per_key_state():
    fwd = _CountingForward(lambda b: b.input_ids.float().unsqueeze(-1) * 2)
    gr = GraphRunner(fwd, [1, 2, 4], [LORA, NOLORA], max_blocks=3, device="cpu",
                     slot_ranks=torch.zeros(2, dtype=torch.int32), graph_factory=EagerGraph)
    gr.capture_all()
    # largest size first, both variants per size
    assert fwd.calls == [(4, True), (4, False), (2, True), (2, False), (1, True), (1, False)]
    keys = set(gr.graphs)
    assert keys == {GraphKey(b, v) for b in (1, 2, 4) for v in (LORA, NOLORA)}
    assert set(gr.batches) == keys and set(gr.outputs) == keys
    # per-key state is distinct objects; the lora variant alone carries the slot buffer
    assert gr.batches[GraphKey(4, LORA)] is not gr.batches[GraphKey(4, NOLORA)]
    assert gr.batches[GraphKey(4, NOLORA)].lora is None
    assert gr.batches[GraphKey(4, LORA)].lora.token_slots.data_ptr() == gr.buffers.token_slots.data_ptr()
    assert gr.outputs[GraphKey(4, LORA)] is not gr.outputs[GraphKey(4, NOLORA)]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    base = save_base_checkpoint("qwen3_moe", root / "base")
    a, _ = make_peft_adapter("qwen3_moe", root / "a", rank=4, seed=1)
    b, _ = make_peft_adapter("qwen3_moe", root / "b", rank=8, seed=2)
    return base, {"A": str(a), "B": str(b)}


def _engine(base, loras, **kw):
    return Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", block_size=4, max_lora_rank=16,
                               lora_modules=loras, **kw))


def test_padded_replay_equals_eager_for_mixed_traffic(lora_setup):
    """batch 3 on bucket 4, alternating base -> lora -> mixed -> base under the stand-in graphs."""
    base, loras = lora_setup
    eager = _engine(base, loras)
    graphed = _engine(base, loras, cuda_graph_bs=[1, 2, 4])
    graphed.config.enforce_eager = False  # as on a CUDA device; the stand-in graph replays on CPU
    assert dual_capture_plan(graphed.config) == ([LORA], None)  # single-graph baseline (torch MoE backend)
    graphed.runner.graph_runner = GraphRunner.for_engine(graphed.runner, graphed.config)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 7)]
    sp = SamplingParams(max_tokens=6, logprobs=1, **GREEDY)
    for loras_row in ([None] * 3, ["A", "B", "A"], [None, "B", None], [None] * 3):
        want = eager.generate(prompts, sp, lora=loras_row)
        got = graphed.generate(prompts, sp, lora=loras_row)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(w.logprobs, g.logprobs)) < 1e-4
    counts = graphed.runner.graph_runner.replay_counts()
    assert counts["bs4-lora"] > 0 and counts["bs1-lora"] == 0
    assert graphed.stats().graph_replays is not None


def test_dual_variant_routing_with_fake_triton_flag(lora_setup, monkeypatch):
    """With dual capture (forced here on the torch backend), no-adapter batches replay `nolora`,
    batches with an adapter replay `lora`, and both equal eager."""
    base, loras = lora_setup
    import moeserve.worker.graph_runner as grm

    monkeypatch.setattr(grm, "dual_capture_plan", lambda cfg: ([LORA, NOLORA], None))
    eager = _engine(base, loras)
    graphed = _engine(base, loras, cuda_graph_bs=[2, 4])
    graphed.runner.graph_runner = GraphRunner.for_engine(graphed.runner, graphed.config)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(10 + n)).tolist() for n in (4, 6, 8)]
    sp = SamplingParams(max_tokens=5, **GREEDY)
    gr = graphed.runner.graph_runner
    assert graphed.generate(prompts, sp)[0].token_ids == eager.generate(prompts, sp)[0].token_ids
    after_base = dict(gr.replays)
    assert after_base[GraphKey(4, NOLORA)] > 0 and after_base[GraphKey(4, LORA)] == 0
    got = graphed.generate(prompts, sp, lora=[None, "A", None])
    want = eager.generate(prompts, sp, lora=[None, "A", None])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert gr.replays[GraphKey(4, LORA)] > 0
    assert gr.replays[GraphKey(4, NOLORA)] == after_base[GraphKey(4, NOLORA)]
    # hot-loaded after capture: same buffers, no re-capture, output equals eager
    graphed.load_lora("late", loras["B"])
    eager.load_lora("late", loras["B"])
    graphs_before = dict(gr.graphs)
    got = graphed.generate(prompts, sp, lora=["late", None, "late"])
    want = eager.generate(prompts, sp, lora=["late", None, "late"])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert gr.graphs == graphs_before


def test_engine_warns_once_when_the_flag_cannot_take_effect(lora_setup, caplog):
    """Only when the user asked for it (the default says nothing: see test_config_errors)."""
    base, loras = lora_setup
    with caplog.at_level("INFO", logger="moeserve"):
        _engine(base, loras, record_nolora_graph=True)
    assert caplog.text.count("--record-nolora-graph has no effect") == 1
    assert "CUDA graphs are disabled" in caplog.text
