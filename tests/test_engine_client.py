"""EngineClient against an engine core in its own process, checked against the in-process Engine:
outputs (token ids, logprobs, text) equal across the boundary for base, adapter and mixed traffic;
refusals, aborts, faults, a dying core and shutdown cross it cleanly."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading

import pytest

from moeserve import Engine, EngineConfig, RequestError, SamplingParams
from moeserve.errors import EngineDeadError, EngineStepError, LoRAAdapterError, QueueFullError, UnknownAdapterError
from moeserve.frontend.core_client import EngineClient, RequestStream
from moeserve.messages import AddRequest, Call, FailNextSteps, Hold
from moeserve.models.tiny import make_tiny
from moeserve.outputs import RequestOutput

os.environ["MOESERVE_TEST_HOOKS"] = "1"  # the core's fault hook, inherited by the processes started here
ENGINE_KW = dict(max_model_len=128, num_kv_blocks=128, max_num_seqs=16, enable_lora=True, max_loras=2,
                 max_lora_rank=8)


class LoopThread:
    """An event loop in a thread, so synchronous tests can drive one long-lived client."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_client"))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from peft_fixtures import make_peft_adapter

    root = tmp_path_factory.mktemp("client_adapters")
    return {name: str(make_peft_adapter("qwen3_moe", root / name, kind=kind, rank=4, seed=i + 1)[0])
            for i, (name, kind) in enumerate({"a": "attn+experts", "b": "experts"}.items())}


@pytest.fixture(scope="module")
def config(model_dir, adapters):
    return EngineConfig(model=str(model_dir), lora_modules=dict(adapters), **ENGINE_KW)


@pytest.fixture(scope="module")
def ref(config):
    return Engine(config)


@pytest.fixture(scope="module")
def client(config):
    lt = LoopThread()
    c = lt.run(EngineClient.start(config, "WARNING"))
    c.lt = lt
    yield c
    lt.run(c.shutdown())
    lt.close()


async def _collect(client, prompt, params, lora=None):
    return [o async for o in client.generate(prompt, params, lora)]


def test_outputs_equal_the_in_process_engine_for_base_adapter_and_mixed_traffic(client, ref):
    prompts = ["hello world", "the quick brown fox", "a b c", "moe", "stop here. and there", [5, 6, 7, 8]]
    loras = [None, "a", "b", None, "a", "b"]
    params = [SamplingParams(max_tokens=8, temperature=0, logprobs=2), SamplingParams(max_tokens=6, temperature=0),
              SamplingParams(max_tokens=7, temperature=0.8, seed=5, logprobs=0),
              SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1),
              SamplingParams(max_tokens=12, temperature=0, stop=["e"], ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=20, seed=11)]
    want = ref.generate(prompts, params, lora=loras)

    async def main():
        return await asyncio.gather(*(_collect(client, p, sp, lo) for p, sp, lo in zip(prompts, params, loras)))

    got = client.lt.run(main())
    for outs, w in zip(got, want):
        last = outs[-1]
        assert last.finished and all(not o.finished for o in outs[:-1])
        assert last.token_ids == w.token_ids and last.text == w.text and last.finish_reason == w.finish_reason
        assert [t for o in outs for t in o.delta_token_ids] == w.token_ids  # deltas add up to the whole
        assert "".join(o.delta_text for o in outs) == w.text
        if w.logprobs is not None:
            assert [x.token_id for x in last.logprobs] == [x.token_id for x in w.logprobs]
            assert [x.logprob for x in last.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-5)
            assert [[t for t, _ in x.top] for x in last.logprobs] == [[t for t, _ in x.top] for x in w.logprobs]
        if w.prompt_logprobs is not None:
            assert [x and x.logprob for x in last.prompt_logprobs] == pytest.approx(
                [x and x.logprob for x in w.prompt_logprobs], abs=1e-5)


def test_the_frontend_loads_the_tokenizer_class_the_core_chose(client, ref):
    """The frontend loads by name the class AutoTokenizer chose in the core (importing AutoTokenizer imports torch):
    the in-process engine's class, ids and chat template."""
    want = ref.tokenizer
    assert client.info.tokenizer_class == type(want.tok).__name__
    assert type(client.tokenizer.tok) is type(want.tok)
    text = "the quick brown fox<|im_end|> jumps"
    assert client.tokenizer.encode(text) == want.encode(text)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert client.tokenizer.chat_ids(messages) == want.chat_ids(messages)


def test_refusals_are_raised_before_any_output(client):
    async def main():
        with pytest.raises(RequestError, match="max_model_len"):
            await client.submit("word " * 300, SamplingParams(max_tokens=4))
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await client.submit([10**6], SamplingParams(max_tokens=4))
        with pytest.raises(UnknownAdapterError, match="nope"):
            await client.submit("hi", SamplingParams(max_tokens=4), lora="nope")
        vocab = client.info.vocab_size
        for stop_id in (vocab, 2**64):  # never generated; 2^64 would not even cross the boundary
            with pytest.raises(RequestError, match=rf"^stop_token_ids {stop_id} is outside the vocabulary"):
                await client.submit("hi", SamplingParams(max_tokens=4, stop_token_ids=[stop_id]))
        bad = SamplingParams(max_tokens=4)
        bad.temperature = -1.0
        with pytest.raises(ValueError, match="temperature"):
            await client.submit("hi", bad)
        # the core is held so the first "dup" is surely still running when the second arrives
        flag = os.path.join(client._dir, "hold-dup")
        open(flag, "w").close()
        hold = asyncio.ensure_future(client.call(Hold(flag)))
        while not os.path.exists(flag + ".held"):
            await asyncio.sleep(0.01)
        # the first add waits for the held core's answer; its id is taken from the moment it is sent
        first = asyncio.ensure_future(client.submit("hi", SamplingParams(max_tokens=2), request_id="dup"))
        while "dup" not in client.streams:
            await asyncio.sleep(0.01)
        with pytest.raises(RequestError, match="already in use"):
            await client.submit("hi", SamplingParams(max_tokens=2), request_id="dup")
        os.remove(flag)
        await hold
        return [o async for o in await first]

    assert client.lt.run(main())[-1].finished and client.is_running


def _idle_stats(client):
    async def main():
        for _ in range(500):
            s = await client.stats()
            if s.num_running == 0 and s.num_waiting == 0:
                return s
            await asyncio.sleep(0.01)
        return s

    return client.lt.run(main())


def test_consumer_that_stops_and_abort_by_id_free_kv(client):
    before = _idle_stats(client)

    async def main():
        n = 0
        async for out in client.generate("hello world", SamplingParams(max_tokens=100, ignore_eos=True)):
            n += 1
            if n == 3:
                assert not out.finished
                break  # the async generator is closed here: its request must be aborted
        stream = await client.submit("hello", SamplingParams(max_tokens=100, ignore_eos=True), request_id="r1")
        first = await stream.__anext__()
        client.abort("r1")
        rest = [o async for o in stream]
        return first, rest

    first, rest = client.lt.run(main())
    assert not first.finished and rest[-1].finish_reason == "abort"
    s = _idle_stats(client)
    assert s.kv_blocks_free == s.kv_blocks_total
    assert s.aborted_total == before.aborted_total + 2
    assert s.generation_tokens_total - before.generation_tokens_total < 200


def test_a_failed_step_fails_running_requests_and_the_core_keeps_serving(client, ref):
    async def main():
        await client.call(FailNextSteps(1, "simulated device fault"))
        with pytest.raises(EngineStepError, match="simulated device fault"):
            await _collect(client, "hello world", SamplingParams(max_tokens=20, ignore_eos=True))
        return await _collect(client, "hello world", SamplingParams(max_tokens=8, temperature=0))

    outs = client.lt.run(main())
    assert outs[-1].token_ids == ref.generate("hello world", SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    s = _idle_stats(client)
    assert s.kv_blocks_free == s.kv_blocks_total and client.is_running


def test_outputs_a_reader_has_not_read_are_folded_into_one(client, ref):
    """A reader that falls behind (a client that stops reading its stream) holds one output per stream, the
    latest with the deltas of all it missed, not one per token each with a copy of the whole text; read
    late, one stream or several merged, the deltas still add up to the in-process engine's output."""
    from moeserve.server.streaming import MergedStreams

    prompts = ["hello world", "the quick brown fox", "a b c"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    want = ref.generate(prompts, params)

    async def main():
        streams = [await client.submit(p, params) for p in prompts]
        while (s := await client.stats()).num_running or s.num_waiting:
            await asyncio.sleep(0.01)  # nobody reads while the engine generates every token
        alone = [o async for o in streams[0]]
        merged = [io async for io in MergedStreams(streams[1:])]
        return alone, merged

    alone, merged = client.lt.run(main())
    outs = [alone] + [[o for i, o in merged if i == k] for k in (0, 1)]
    for got, w in zip(outs, want):
        assert len(got) == 1 and got[0].finished
        assert got[0].delta_token_ids == got[0].token_ids == w.token_ids and got[0].delta_text == got[0].text == w.text
        assert [x.token_id for x in got[0].logprobs] == w.token_ids


def test_an_error_after_unread_outputs_comes_after_their_tokens():
    """Folding stops at an error: a reader behind the engine gets the tokens generated before the failure, then
    the error."""
    def out(ids, delta, finish=None, error=None):
        return RequestOutput("r", None, [1], ids, "", "", delta, None, None, finish, error=error)

    stream = RequestStream(None, "r")
    for o in (out([5], [5]), out([5, 6], [6]), out([5, 6], [], "error", "boom")):
        stream.put(o)

    async def main():
        got = []
        with pytest.raises(EngineStepError, match="boom"):
            async for o in stream:
                got.append(o)
        return got

    assert [t for o in asyncio.run(main()) for t in o.delta_token_ids] == [5, 6]


def test_a_request_that_cannot_be_sent_leaves_nothing_behind(client, monkeypatch):
    """A failed send (whatever the reason) raises to the caller and leaves no stream holding a queue place."""
    real_send = client._send

    def send(msg):
        if isinstance(msg, AddRequest):
            raise OverflowError("Integer value out of range")
        return real_send(msg)

    async def main():
        room = client.queue_room()
        monkeypatch.setattr(client, "_send", send)
        for _ in range(3):
            with pytest.raises(OverflowError):
                await client.submit("hi", SamplingParams(max_tokens=2), request_id="unsent")
        monkeypatch.setattr(client, "_send", real_send)
        assert "unsent" not in client.streams and "unsent" not in client.pending_adds
        assert "unsent" not in client.output and client.queue_room() == room
        return [o async for o in await client.submit("hi", SamplingParams(max_tokens=2), request_id="unsent")]

    assert client.lt.run(main())[-1].finished


def test_queue_full_is_refused_by_the_frontend_at_once(client):
    async def main():
        old = client.info.max_queue_len
        client.info.max_queue_len = 1
        try:
            flag = os.path.join(client._dir, "hold")
            open(flag, "w").close()
            hold = asyncio.ensure_future(client.call(Hold(flag)))
            while not os.path.exists(flag + ".held"):
                await asyncio.sleep(0.01)
            first = asyncio.ensure_future(client.submit("hi", SamplingParams(max_tokens=2)))
            await asyncio.sleep(0.05)
            with pytest.raises(QueueFullError):  # no round trip to the held core
                await asyncio.wait_for(client.submit("hi", SamplingParams(max_tokens=2)), 1.0)
            os.remove(flag)
            await hold
            return [o async for o in await first]
        finally:
            client.info.max_queue_len = old

    assert client.lt.run(main())[-1].finished


def test_unknown_calls_and_lora_errors_cross_the_boundary(client, adapters):
    @dataclasses.dataclass
    class NoSuchCall(Call):
        pass

    async def main():
        with pytest.raises(TypeError, match="NoSuchCall is not a message type of this boundary"):
            await client.call(NoSuchCall())
        assert not client.calls
        with pytest.raises(LoRAAdapterError, match="not a directory"):
            await client.load_lora("x", "/does/not/exist")
        await client.load_lora("c", adapters["a"])
        assert "c" in client.lora_names
        out = await _collect(client, "hi", SamplingParams(max_tokens=3, temperature=0), lora="c")
        await client.unload_lora("c")
        return out

    assert client.lt.run(main())[-1].finished and "c" not in client.lora_names


def test_a_core_that_dies_fails_open_requests_and_later_calls(config):
    lt = LoopThread()
    client = lt.run(EngineClient.start(config, "WARNING"))

    async def main():
        stream = await client.submit("hello", SamplingParams(max_tokens=None, ignore_eos=True))
        await stream.__anext__()
        os.kill(client.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await client.submit("hi", SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            await client.stats()
        await client.shutdown()

    try:
        lt.run(main(), timeout=60)
        assert not client.is_running
    finally:
        lt.close()


def test_shutdown_fails_pending_requests(client):
    """The last test on the module's client: it shuts it down (the fixture's own shutdown then does nothing)."""
    async def main():
        stream = await client.submit("hello", SamplingParams(max_tokens=None, ignore_eos=True))
        await stream.__anext__()
        await client.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await client.stats()

    client.lt.run(main(), timeout=60)
    assert not client.proc.is_alive()


def test_startup_errors_name_the_problem(model_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(EngineClient.start(EngineConfig(model=str(model_dir), max_model_len=10**7), "WARNING"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        asyncio.run(EngineClient.start(EngineConfig(model="/no/such/model"), "WARNING"))
