"""The typed messages of the process boundaries (moeserve/messages.py, worker/tp_messages.py): every message type
survives its codec, bytes that are no message are a clear error, and a failure raised in the engine core reaches
the frontend as the same class, carried by type."""
from __future__ import annotations

import asyncio
import dataclasses

import msgpack
import pytest

from moeserve import errors
from moeserve.config import EngineConfig
from moeserve.engine.core_process import CoreServer
from moeserve.frontend.core_client import EngineClient
from moeserve.frontend.output_processor import OutputProcessor
from moeserve.messages import (CARRIED_ERRORS, RECORDS, AbortRequests, AddRequest, CallReply, CoreInfo, CoreReady,
                               EngineStats, FailNextSteps, Hold, HoldLoRAReads, ListLoRAs, LoadLoRA, LoRAVersions,
                               MessageDecodeError, MsgpackCodec, Shutdown, StartupFailed, Stats, StatsReply,
                               StepOutputs, UnloadLoRA)
from moeserve.outputs import CoreOutput, TokenLogprobs
from moeserve.sampling_params import SamplingParams
from moeserve.worker import tp_messages
from moeserve.worker.graph_runner import GraphKey

CODEC = MsgpackCodec()  # a codec of its own: the test checks the schema, not a shared instance

LOGPROBS = TokenLogprobs(7, -0.25, [(7, -0.25), (3, -1.5)])
INFO = CoreInfo(model="m", tokenizer="m", vocab_size=256, max_model_len=128, block_size=16, num_kv_blocks=40,
                max_queue_len=64, max_num_seqs=8, lora_names=["a"], device="cpu", dtype="float32")
STATS = EngineStats(requests_total=5, requests_rejected=1, prompt_tokens_total=40, generation_tokens_total=30,
                    steps_total=12, decode_steps_total=10, aborted_total=1, num_running=2, num_waiting=0,
                    kv_blocks_total=40, kv_blocks_free=31, kv_usage=0.225, num_preemptions=0,
                    prefix_cache_queries=40, prefix_cache_hits=16, prefix_cache_hit_rate=0.4, prefix_cache_blocks=3,
                    prefix_cache_evictions=0, graph_replays={"GraphKey(batch_size=4, variant='lora')": 7},
                    lora_loads_total=2, lora_versions={"a": 1})
EXAMPLES = [
    AddRequest("req-1", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.5, stop=["\n"], logprobs=2), "ad"),
    AbortRequests(["req-1", "req-2"], counted=False),
    Shutdown(),
    ListLoRAs(call_id=1),
    LoRAVersions(call_id=2),
    Stats(call_id=3),
    LoadLoRA("ad", "/adapters/ad", pinned=True, replace=True, call_id=4),
    UnloadLoRA("ad", call_id=5),
    Hold("/tmp/flag", call_id=6),
    FailNextSteps(2, "simulated device fault", call_id=7),
    HoldLoRAReads("/tmp/flag", call_id=8),
    CoreReady(INFO),
    StartupFailed(errors.EngineStartError("no device")),
    StepOutputs([CoreOutput("req-1", [7], [LOGPROBS], [None, LOGPROBS], None, None, 16),
                 CoreOutput("req-2", [], finish_reason="error", error="engine step failed")],
                ["req-3"], {"req-4": errors.QueueFullError("queue is full (1 waiting requests); retry later")}, 2, 1),
    CallReply(9, {"a": 1, "b": 2}),
    CallReply(10, error=errors.UnknownAdapterError("unknown LoRA adapter 'x'")),
    StatsReply(11, STATS),
    INFO,
    STATS,
    SamplingParams(max_tokens=None, seed=5, stop_token_ids=[9]),
    CoreOutput("req-5", [1, 2]),
    LOGPROBS,
]


def _same(a, b) -> bool:
    """Equal, exceptions included (same class, same message)."""
    if isinstance(a, BaseException):
        return type(a) is type(b) and a.args == b.args
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_every_message_type_survives_the_codec():
    assert {type(m) for m in EXAMPLES} == set(RECORDS)
    for msg in EXAMPLES:
        back = CODEC.decode(CODEC.encode(msg))
        assert _same(msg, back), (msg, back)


def test_bytes_that_are_no_message_are_a_clear_error():
    with pytest.raises(MessageDecodeError, match="type code 999"):
        CODEC.decode(msgpack.packb([999, "x"]))
    with pytest.raises(MessageDecodeError, match="not a message of this boundary"):
        CODEC.decode(msgpack.packb("hello"))
    with pytest.raises(MessageDecodeError, match="unknown error type 'NoSuchError'"):
        CODEC.decode(msgpack.packb([RECORDS.index(StartupFailed), ["NoSuchError", "boom"]]))

    @dataclasses.dataclass
    class NotAMessage:
        x: int

    with pytest.raises(TypeError, match="NotAMessage is not a message type of this boundary"):
        CODEC.encode(NotAMessage(1))
    with pytest.raises(TypeError, match="NotAMessage cannot travel in a message"):
        CODEC.encode(CallReply(1, {"x": NotAMessage(1)}))


def test_errors_keep_their_class_and_message_across_the_codec():
    """moeserve's failures and Python's builtin exceptions arrive as their own class; one of a class that is not
    carried arrives as its nearest carried base, its own name leading the message."""
    mine = [cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, Exception)]
    assert len(mine) >= 10 and all(CARRIED_ERRORS[cls.__name__] is cls for cls in mine)
    for cls in [*mine, KeyError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError, MemoryError]:
        back = CODEC.decode(CODEC.encode(StartupFailed(cls("what went wrong"))))
        assert type(back.error) is cls and str(back.error) == str(cls("what went wrong"))

    class CheckpointLikeError(ValueError):
        pass

    back = CODEC.decode(CODEC.encode(CallReply(1, error=CheckpointLikeError("tensor x is float8"))))
    assert type(back.error) is ValueError and str(back.error) == "CheckpointLikeError: tensor x is float8"


def test_every_tensor_parallel_message_survives_its_codec():
    examples = [
        tp_messages.StepPlan({"batch": {"input_ids": [1, 2]}}, GraphKey(4, "lora"), True, [0, 1], [(0, 2)]),
        tp_messages.AllocateKVCache(None), tp_messages.ResizeKVCache(12),
        tp_messages.CreateLoRAPool(["q_proj", "experts"], 4, 8, False), tp_messages.LoadLoRASlot(1, {"a": 1}),
        tp_messages.ClearLoRASlot(1), tp_messages.CaptureGraphs(), tp_messages.GetReplayCounts(),
        tp_messages.GetLoRASlots(), tp_messages.GetAllReduceBackend(), tp_messages.StopWorker(),
        tp_messages.WorkerReply(3), tp_messages.WorkerReply.failed(RuntimeError("simulated device fault")),
    ]
    assert {type(m) for m in examples} == set(tp_messages.WORKER_MESSAGES)
    for msg in examples:
        assert tp_messages.decode(tp_messages.encode(msg)) == msg
    with pytest.raises(TypeError, match="tuple is not a tensor-parallel message"):
        tp_messages.encode(("step", None))
    with pytest.raises(tp_messages.WorkerMessageError, match="tuple on a tensor-parallel pipe"):
        tp_messages.decode(b"\x80\x05\x95\x0b\x00\x00\x00\x00\x00\x00\x00\x8c\x04step\x94N\x86\x94.")


# ---- a failure in the core arrives at the frontend as its class ---------------------------------------------

class CheckpointLikeError(ValueError):
    """An error class defined below the floor (not carried): it travels as ValueError."""


CORE_FAILURES = [
    errors.QueueFullError("queue is full (4 waiting requests); retry later"),
    errors.RequestError("prompt is empty"),
    errors.UnknownAdapterError("LoRA adapter 'x' is not loaded"),
    errors.LoRAAdapterError("adapter 'x': rank 64 exceeds max_lora_rank 16"),
    errors.InvalidAdapterNameError("invalid adapter name 'a:b' (non-empty, no ':')"),
    errors.AdapterInUseError("cannot pin 'x': it would take the last LoRA slot"),
    errors.EngineShutdownError("this engine has been shut down"),
    FileNotFoundError("/adapters/x"),
    NotADirectoryError("/adapters/x"),
    PermissionError("/adapters/x"),
    RuntimeError("device fault"),
]


class _Outbox:
    def __init__(self):
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


class _FailingCore:
    """An engine core whose every request and LoRA call fails with `error`."""

    def __init__(self, error: Exception):
        self.error = error
        self.lora_manager = None
        self.seqs = {}

    def add_request(self, *args):
        raise self.error

    def load_lora(self, *args):
        raise self.error

    unload_lora = list_loras = load_lora


def _frontend() -> EngineClient:
    client = EngineClient(EngineConfig(device="cpu"))
    client.output = OutputProcessor(None)
    return client


@pytest.mark.parametrize("error", CORE_FAILURES, ids=lambda e: type(e).__name__)
def test_a_core_side_failure_arrives_at_the_frontend_as_its_class(error):
    """The core's loop (CoreServer) refuses an add, a load, an unload and a call with `error`; what it sends, read
    by the frontend's client, fails the waiting request and calls with the same class and message."""
    outbox = _Outbox()
    server = CoreServer(_FailingCore(error), inbox=None, outbox=outbox)
    try:
        server.handle(CODEC.decode(CODEC.encode(AddRequest("r1", [1, 2], SamplingParams(), None))))
        server.send(StepOutputs([], server.accepted, server.rejected, 0, 0))
        for call in (LoadLoRA("x", "/adapters/x", call_id=1), UnloadLoRA("x", call_id=2), ListLoRAs(call_id=3)):
            server.handle(CODEC.decode(CODEC.encode(call)))
    finally:
        server.reader.shutdown()

    async def frontend_side():
        client = _frontend()
        loop = asyncio.get_running_loop()
        add = client.pending_adds["r1"] = loop.create_future()
        calls = [loop.create_future() for _ in range(3)]
        client.calls.update(zip((1, 2, 3), calls))
        for data in outbox.sent:
            client._dispatch(CODEC.decode(data))
        return await asyncio.gather(add, *calls, return_exceptions=True)

    assert len(outbox.sent) == 4  # one step message, three replies
    for got in asyncio.run(frontend_side()):
        assert type(got) is type(error) and str(got) == str(error)


def test_an_error_class_that_is_not_carried_arrives_as_its_base_with_its_name():
    outbox = _Outbox()
    server = CoreServer(_FailingCore(CheckpointLikeError("tensor x is float8")), inbox=None, outbox=outbox)
    try:
        server.handle(ListLoRAs(call_id=1))
    finally:
        server.reader.shutdown()
    reply = CODEC.decode(outbox.sent[0])
    assert type(reply.error) is ValueError and str(reply.error) == "CheckpointLikeError: tensor x is float8"


def test_a_stats_call_reaches_the_frontend_as_its_record():
    """The core answers a Stats call with a StatsReply: the client's call returns the EngineStats, every field as the
    core's (a record in CallReply's untyped result would arrive as a bare list)."""

    class _StatsCore(_FailingCore):
        def stats(self):
            return STATS

    outbox = _Outbox()
    server = CoreServer(_StatsCore(None), inbox=None, outbox=outbox)
    try:
        server.handle(CODEC.decode(CODEC.encode(Stats(call_id=1))))
    finally:
        server.reader.shutdown()

    async def frontend_side():
        client = _frontend()
        call = client.calls[1] = asyncio.get_running_loop().create_future()
        client._dispatch(CODEC.decode(outbox.sent[0]))
        return await call

    got = asyncio.run(frontend_side())
    assert type(got) is EngineStats and got == STATS and got.lora_evictions_total is None


# ---- failures raised below the floor are moeserve.errors' classes, and cross by type -------------------------

def _raised(fn) -> Exception:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the failure under test
        return e
    raise AssertionError("it did not fail")


def _checkpoint_error(tmp_path):
    from moeserve.models.loader import load_model
    from peft_fixtures import tiny_spec

    return _raised(lambda: load_model(tmp_path, tiny_spec("qwen3_moe")))  # a folder without weights


def _pattern_key_error(tmp_path):
    from moeserve.lora.pattern_keys import MAX_PATTERN_KEYS, PatternTable

    return _raised(lambda: PatternTable("rank_pattern", {f"k{i}": 4 for i in range(MAX_PATTERN_KEYS + 1)}))


def _insufficient_memory_error(tmp_path):
    from moeserve import Engine
    from peft_fixtures import save_base_checkpoint

    base = save_base_checkpoint("qwen3_moe", tmp_path / "base")
    return _raised(lambda: Engine(EngineConfig(model=str(base), device="cpu", dtype="float32",
                                               device_memory_bytes=1 << 20)))  # less than the weights


def _rank_failure(tmp_path):
    from moeserve.worker.parallel_runner import ParallelModelRunner

    runner = ParallelModelRunner.__new__(ParallelModelRunner)  # no ranks started: only its failure path
    runner.failure, runner.workers = None, []
    return _raised(lambda: runner._fail("tensor-parallel rank 1 (pid 7) exited with code 1"))


BELOW_THE_FLOOR = [
    pytest.param(_checkpoint_error, errors.CheckpointError, id="CheckpointError"),
    pytest.param(_pattern_key_error, errors.PatternKeyError, id="PatternKeyError"),
    pytest.param(_insufficient_memory_error, errors.InsufficientMemoryError, id="InsufficientMemoryError"),
    pytest.param(_rank_failure, errors.RankFailure, id="RankFailure"),
]


@pytest.mark.parametrize("fail, cls", BELOW_THE_FLOOR)
def test_a_failure_raised_below_the_floor_crosses_as_its_own_class(tmp_path, fail, cls):
    """The loader, the pattern tables, the memory plan and rank 0's watch raise moeserve.errors' classes: to the
    frontend, and from a tensor-parallel worker to rank 0, each arrives as its class with its message."""
    error = fail(tmp_path)
    assert type(error) is cls, repr(error)
    back = CODEC.decode(CODEC.encode(CallReply(1, error=error))).error
    assert type(back) is cls and str(back) == str(error)
    reply = tp_messages.decode(tp_messages.encode(tp_messages.WorkerReply.failed(error)))
    again = reply.raised_on(1, "loading its shard of the model")
    assert type(again) is cls and str(again) == f"tensor-parallel rank 1 failed loading its shard of the model: {error}"


def test_a_worker_failure_of_a_class_that_is_not_carried_arrives_at_rank_0_as_its_base_with_its_name():
    reply = tp_messages.decode(tp_messages.encode(tp_messages.WorkerReply.failed(CheckpointLikeError("bad x"))))
    again = reply.raised_on(2, "allocating its KV cache")
    assert type(again) is ValueError
    assert str(again) == "tensor-parallel rank 2 failed allocating its KV cache: CheckpointLikeError: bad x"
