"""AsyncEngine: one engine thread, asyncio callers; checked against the synchronous Engine."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from moeserve import Engine, EngineConfig, RequestError, SamplingParams
from moeserve.models.tiny import make_tiny
from moeserve.runtime.async_engine import AsyncEngine, EngineDeadError, EngineStepError, QueueFullError

ENGINE_KW = dict(max_model_len=128, num_kv_blocks=128, max_num_seqs=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_async"))


@pytest.fixture(scope="module")
def ref(model_dir):
    return Engine(EngineConfig(model=str(model_dir), **ENGINE_KW))


@pytest.fixture
def aengine(model_dir):
    a = AsyncEngine(Engine(EngineConfig(model=str(model_dir), **ENGINE_KW)))
    yield a
    a.shutdown()


async def _final(agen):
    outs = [o async for o in agen]
    return outs


def test_concurrent_generate_matches_engine(aengine, ref):
    prompts = ["hello world", "the quick brown fox", "a b c", "moe"]
    params = [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=6, temperature=0.7, seed=5),
              SamplingParams(max_tokens=8, temperature=0, logprobs=2), SamplingParams(max_tokens=3, temperature=0)]
    want = ref.generate(prompts, params)

    async def main():
        return await asyncio.gather(*(_final(aengine.generate(p, sp)) for p, sp in zip(prompts, params)))

    got = asyncio.run(main())
    for outs, w in zip(got, want):
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert outs[-1].token_ids == w.token_ids and outs[-1].text == w.text
        assert [t for o in outs for t in o.delta_token_ids] == w.token_ids  # deltas add up to the whole
        assert "".join(o.delta_text for o in outs) == w.text
    assert [x.logprob for x in got[2][-1].logprobs] == pytest.approx([x.logprob for x in want[2].logprobs], abs=1e-5)


def test_add_request_errors_propagate_unchanged(aengine):
    async def main():
        with pytest.raises(RequestError, match="max_model_len"):
            await aengine.submit("word " * 300, SamplingParams(max_tokens=4))
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await aengine.submit([10**6], SamplingParams(max_tokens=4))
        bad = SamplingParams(max_tokens=4)
        bad.temperature = -1.0
        with pytest.raises(ValueError, match="temperature"):
            async for _ in aengine.generate("hi", bad):
                pass
        with pytest.raises(RequestError, match="LoRA is not enabled"):
            await aengine.load_lora("a", "/nowhere")
        stream = await aengine.submit("hi", SamplingParams(max_tokens=2), request_id="dup")
        with pytest.raises(RequestError, match="already in use"):
            await aengine.submit("hi", SamplingParams(max_tokens=2), request_id="dup")
        return [o async for o in stream]

    outs = asyncio.run(main())
    assert outs[-1].finished and aengine.is_running


def test_idle_thread_sleeps(aengine):
    calls = {"has_unfinished": 0, "step": 0}
    eng = aengine.engine
    orig_has, orig_step = eng.has_unfinished, eng.step

    def has_unfinished():
        calls["has_unfinished"] += 1
        return orig_has()

    def step():
        calls["step"] += 1
        return orig_step()

    asyncio.run(aengine.stats())  # the thread has processed a command and is idle again
    eng.has_unfinished, eng.step = has_unfinished, step
    time.sleep(0.3)
    assert calls == {"has_unfinished": 0, "step": 0}  # blocked on the queue, not polling
    asyncio.run(aengine.stats())
    assert calls["step"] == 0 and calls["has_unfinished"] <= 3


def test_consumer_that_stops_aborts_and_frees_kv(aengine):
    async def main():
        n = 0
        async for out in aengine.generate("hello world", SamplingParams(max_tokens=100, ignore_eos=True)):
            n += 1
            if n == 3:
                assert not out.finished
                break  # the async generator is closed here: its request must be aborted
        await asyncio.sleep(0.05)
        # cancellation of a task that is waiting for tokens aborts too
        task = asyncio.create_task(_final(aengine.generate("the quick", SamplingParams(max_tokens=100,
                                                                                       ignore_eos=True))))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            s = await aengine.stats()
            if s["num_running"] == 0 and s["num_waiting"] == 0:
                return s
            await asyncio.sleep(0.01)
        return s

    s = asyncio.run(main())
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert s["aborted_total"] == 2
    assert s["generation_tokens_total"] < 200


def test_abort_by_id_ends_the_stream(aengine):
    async def main():
        stream = await aengine.submit("hello", SamplingParams(max_tokens=100, ignore_eos=True), request_id="r1")
        first = await stream.__anext__()
        await aengine.abort("r1")
        rest = [o async for o in stream]
        return first, rest

    first, rest = asyncio.run(main())
    assert not first.finished
    assert rest[-1].finish_reason == "abort" and len(rest[-1].token_ids) < 100


def test_step_exception_fails_running_requests_and_keeps_serving(aengine, ref):
    runner = aengine.engine.runner
    orig_run = runner.run
    state = {"calls": 0}

    def flaky_run(batch):
        state["calls"] += 1
        if state["calls"] == 3:
            raise RuntimeError("simulated device fault")
        return orig_run(batch)

    runner.run = flaky_run
    try:
        async def main():
            with pytest.raises(EngineStepError, match="simulated device fault"):
                await _final(aengine.generate("hello world", SamplingParams(max_tokens=20, ignore_eos=True)))
            return await _final(aengine.generate("hello world", SamplingParams(max_tokens=8, temperature=0)))

        outs = asyncio.run(main())
    finally:
        runner.run = orig_run
    assert aengine.is_running
    assert outs[-1].token_ids == ref.generate("hello world", SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    s = asyncio.run(aengine.stats())
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == 0


def test_queue_full(aengine):
    aengine.engine.config.max_queue_len = 2
    release = threading.Event()

    async def main():
        hold = asyncio.ensure_future(aengine.run_on_engine(release.wait, 10))
        await asyncio.sleep(0.05)
        # three adds queue up behind the held command and run back to back, without a step between
        subs = [asyncio.ensure_future(aengine.submit("hi", SamplingParams(max_tokens=2))) for _ in range(3)]
        await asyncio.sleep(0.05)
        release.set()
        await hold
        results = await asyncio.gather(*subs, return_exceptions=True)
        for r in results:
            if not isinstance(r, BaseException):
                await _final(r)
        return results

    results = asyncio.run(main())
    assert [type(r).__name__ for r in results] == ["RequestStream", "RequestStream", "QueueFullError"]
    assert isinstance(results[2], RequestError)  # a 4xx-style refusal, not a crash
    assert QueueFullError is type(results[2])


def test_shutdown_fails_pending_and_later_calls(model_dir):
    a = AsyncEngine(Engine(EngineConfig(model=str(model_dir), **ENGINE_KW)))

    async def main():
        stream = await a.submit("hello", SamplingParams(max_tokens=100, ignore_eos=True))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, a.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await a.stats()

    asyncio.run(main())
    assert not a.is_running
