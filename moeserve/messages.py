"""The messages between the frontend and the engine-core process, one typed record each, and their codec.

Transport: msgpack over two ZeroMQ PUSH/PULL sockets (ipc://). A message travels as its type code and its fields
in order; records inside it (a StepOutputs holds CoreOutputs, which hold TokenLogprobs) as their fields, rebuilt
from the field's annotation. The receiver gets the same classes back and dispatches on the type, never on a
position or a string. An exception travels the same way, as (its class's tag, its message), and is
raised again as the same class on the other side (moeserve/errors.py; builtin exceptions keep their type too).
Both ends run the same package, so a type code is a message's position in RECORDS.

Frontend -> core: AddRequest, AbortRequests, Shutdown, and the calls (subclasses of Call: LoadLoRA, UnloadLoRA,
ListLoRAs, LoRAVersions, Stats, and the test hooks), each answered by a CallReply with its call_id (a Stats call by
a StatsReply, whose result is an EngineStats record).
Core -> frontend: CoreReady (with a CoreInfo) or StartupFailed (once, at start), StepOutputs (one per step),
CallReply.
"""
from __future__ import annotations

import builtins
from dataclasses import dataclass, field, fields
from operator import attrgetter
from types import UnionType
from typing import Union, get_args, get_origin, get_type_hints

import msgpack

from moeserve import errors
from moeserve.outputs import CoreOutput, TokenLogprobs
from moeserve.sampling_params import SamplingParams


class MessageDecodeError(ValueError):
    """Bytes that are not a message of this boundary (an unknown type code): the two ends do not match."""


# ---- frontend -> core -------------------------------------------------------------------------------------

@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: str | None = None


@dataclass
class AbortRequests:
    request_ids: list[str]
    counted: bool = True  # False: they ended by a stop string in the frontend, not an abort


@dataclass
class Shutdown:
    """Stop the core loop (the frontend reaps the process)."""


@dataclass
class Call:
    """A utility call, run between steps and answered by a CallReply with the same call_id (set by the client)."""
    call_id: int = field(default=-1, kw_only=True)


@dataclass
class ListLoRAs(Call):
    pass


@dataclass
class LoRAVersions(Call):
    pass


@dataclass
class Stats(Call):
    pass


@dataclass
class LoadLoRA(Call):
    """Answered in arrival order with UnloadLoRA (a load waits for its file to be read off the loop)."""
    name: str
    path: str
    pinned: bool = False
    replace: bool = False


@dataclass
class UnloadLoRA(Call):
    name: str


# test hooks: answered only when MOESERVE_TEST_HOOKS=1 in the core's environment
@dataclass
class Hold(Call):
    """Stop stepping while the file `flag` exists (it creates flag + '.held' first): requests pile up."""
    flag: str


@dataclass
class FailNextSteps(Call):
    """The next n launches raise RuntimeError(message), as a device fault would."""
    n: int
    message: str


@dataclass
class HoldLoRAReads(Call):
    """The next adapter read waits while the file `flag` exists (it creates flag + '.reading' when it starts)."""
    flag: str


# ---- core -> frontend -------------------------------------------------------------------------------------

@dataclass
class CoreInfo:
    """What a frontend needs to know about the engine core (EngineCore.info(), sent once in CoreReady)."""
    model: str
    tokenizer: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int  # usable blocks (the dummy block is not one)
    max_queue_len: int
    max_num_seqs: int
    lora_names: list[str]  # the adapters loaded at start
    device: str
    dtype: str
    tokenizer_class: str | None = None  # the class of the core's tokenizer, loaded as such by the frontend


@dataclass
class EngineStats:
    """The engine core's counters and gauges, the answer to a Stats call (EngineCore.stats()); /metrics exports
    each field under its name (server/metrics.py). The fields of a part that is off are None: the compile watch
    (off unless the core watches for compiles after start), the CUDA graphs, LoRA."""
    requests_total: int
    requests_rejected: int
    prompt_tokens_total: int
    generation_tokens_total: int
    steps_total: int
    decode_steps_total: int
    aborted_total: int
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    prefix_cache_hit_rate: float
    prefix_cache_blocks: int
    prefix_cache_evictions: int
    kernel_compiles_after_start_total: int | None = None
    graph_replays: dict[str, int] | None = None  # str(GraphKey) -> replays
    lora_loads_total: int | None = None
    lora_evictions_total: int | None = None
    lora_rereads_total: int | None = None
    lora_adapters_known: int | None = None
    lora_adapters_draining: int | None = None
    lora_slots_used: int | None = None
    lora_slots_total: int | None = None
    lora_versions: dict[str, int] | None = None  # live adapter -> its version


@dataclass
class CoreReady:
    info: CoreInfo


@dataclass
class StartupFailed:
    error: Exception


@dataclass
class StepOutputs:
    """Everything one step produced, and the adds handled since the last one."""
    outputs: list[CoreOutput]
    accepted: list[str]  # request ids queued
    rejected: dict[str, Exception]  # request id -> why it was refused
    num_running: int
    num_waiting: int


@dataclass
class CallReply:
    call_id: int
    result: object = None  # plain data (lists, dicts, numbers, strings); a record travels in a reply of its own
    error: Exception | None = None


@dataclass
class StatsReply(CallReply):
    """The answer to a Stats call: the stats as their record."""
    result: EngineStats | None = None


REPLY_OF = {Stats: StatsReply}  # the calls whose result is a record, and the reply that types it (else CallReply)


RECORDS = (AddRequest, AbortRequests, Shutdown, ListLoRAs, LoRAVersions, Stats, LoadLoRA, UnloadLoRA, Hold,
           FailNextSteps, HoldLoRAReads, CoreReady, StartupFailed, StepOutputs, CallReply, StatsReply,
           SamplingParams, CoreOutput, TokenLogprobs, CoreInfo, EngineStats)


# ---- errors -----------------------------------------------------------------------------------------------

def _carried_errors() -> dict[str, type[BaseException]]:
    """tag -> class of every error that crosses by type: moeserve's own and Python's builtin exceptions (those
    that can be built from a message alone)."""
    out = {}
    for cls in [*vars(builtins).values(), *vars(errors).values()]:
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                cls("probe")
            except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError needs five arguments
                continue
            out[cls.__name__] = cls
    return out


CARRIED_ERRORS = _carried_errors()


def error_to_wire(e: BaseException) -> tuple[str, str]:
    """(tag, message) of `e`. An error of a class that is not carried (defined below the floor, or a library's)
    travels as its nearest carried base class, its own class's name leading the message."""
    message = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)  # KeyError's str quotes
    for cls in type(e).__mro__:
        if CARRIED_ERRORS.get(cls.__name__) is cls:
            return cls.__name__, message if cls is type(e) else f"{type(e).__name__}: {message}"
    return "Exception", f"{type(e).__name__}: {message}"


def error_from_wire(tag: str, message: str) -> Exception:
    cls = CARRIED_ERRORS.get(tag)
    if cls is None:
        raise MessageDecodeError(f"unknown error type {tag!r} in a message from the other process")
    return cls(message)


# ---- codec ------------------------------------------------------------------------------------------------

def _fields_getter(names: tuple[str, ...]):
    """record -> the tuple of its fields (attrgetter: one C call)."""
    if len(names) > 1:
        return attrgetter(*names)
    return lambda obj: tuple(getattr(obj, name) for name in names)


class MsgpackCodec:
    """One codec for every record of a boundary. A message travels as [its type code, its fields...]; a record or
    exception inside it as its fields alone (its type is its field's annotation, so the step loop's many
    CoreOutputs cost a list each, not a tagged object each). An exception is [its tag, its message]."""

    def __init__(self, records: tuple[type, ...] = RECORDS):
        self.code_of = {cls: code for code, cls in enumerate(records)}
        self.cls_of = dict(enumerate(records))
        self.names = {cls: tuple(f.name for f in fields(cls)) for cls in records}
        self.fields_of = {cls: _fields_getter(names) for cls, names in self.names.items()}
        self.keyword_only = {cls for cls in records if any(f.kw_only for f in fields(cls))}
        # per record: (field position, how to rebuild its value) for the fields that hold records or exceptions
        self.nested = {}
        for cls in records:
            hints = get_type_hints(cls)
            rebuilders = [(i, self._rebuilder(hints[name])) for i, name in enumerate(self.names[cls])]
            self.nested[cls] = [(i, r) for i, r in rebuilders if r is not None]

    def encode(self, msg) -> bytes:
        cls = type(msg)
        code = self.code_of.get(cls)
        if code is None:
            raise TypeError(f"{cls.__name__} is not a message type of this boundary (moeserve/messages.py RECORDS)")
        return msgpack.packb((code, *self.fields_of[cls](msg)), default=self._default, use_bin_type=True)

    def decode(self, data: bytes):
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
        cls = self.cls_of.get(msg[0]) if isinstance(msg, list) and msg else None
        if cls is None:
            code = msg[0] if isinstance(msg, list) and msg else msg
            raise MessageDecodeError(f"not a message of this boundary (type code {code!r}) from the other process "
                                     "(the frontend and the engine core run different versions of moeserve?)")
        return self._build(cls, msg[1:])

    def _default(self, obj):
        get = self.fields_of.get(type(obj))
        if get is not None:
            return get(obj)
        if isinstance(obj, BaseException):
            return error_to_wire(obj)
        raise TypeError(f"{type(obj).__name__} cannot travel in a message (moeserve/messages.py)")

    def _build(self, cls, values: list):
        for i, rebuild in self.nested[cls]:
            if values[i] is not None:
                values[i] = rebuild(values[i])
        if cls in self.keyword_only:
            return cls(**dict(zip(self.names[cls], values)))
        return cls(*values)

    def _rebuilder(self, hint):
        """How to turn a field's decoded msgpack value back into what `hint` says (None: it is already)."""
        args = [a for a in get_args(hint) if a is not type(None)]
        if get_origin(hint) in (Union, UnionType):  # X | None: None stays None (checked by the caller)
            return self._rebuilder(args[0]) if len(args) == 1 else None
        if get_origin(hint) is list:
            inner = self._rebuilder(args[0])
            return None if inner is None else lambda v: [None if x is None else inner(x) for x in v]
        if get_origin(hint) is dict:
            inner = self._rebuilder(args[1])
            return None if inner is None else lambda v: {k: None if x is None else inner(x) for k, x in v.items()}
        if get_origin(hint) is tuple:  # msgpack has one array type: lists come back
            return tuple
        if isinstance(hint, type) and issubclass(hint, BaseException):
            return lambda v: error_from_wire(*v)
        if hint in self.names:
            return lambda v: self._build(hint, v)
        return None


CODEC = MsgpackCodec()  # the frontend <-> engine-core transport's codec (both ends build it from the same RECORDS)
