"""EngineClient: the frontend's handle on an engine-core process (asyncio).

It starts the core process, tokenizes prompts (off the event loop), checks requests against the
core's limits before sending them, and turns each step's message into per-request outputs (text,
stop strings) delivered to that request's stream. A core that dies fails every open request with
EngineDeadError and is logged once; nothing waits forever on a dead core.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import zmq
import zmq.asyncio

from moeserve.config import EngineConfig
from moeserve.engine.core_process import ABANDON_SIGNAL, config_to_wire, run_core
from moeserve.engine.request_limits import RequestLimits
from moeserve.errors import (USER_ERRORS, AdapterPathError, EngineDeadError, EngineStartError, EngineStepError,
                             InvalidAdapterNameError, QueueFullError, RequestError, UnknownAdapterError)
from moeserve.frontend.output_processor import OutputProcessor, RequestState
from moeserve.lora.names import CONFIG_FILE, validate_adapter_name
from moeserve.messages import (CODEC, AbortRequests, AddRequest, Call, CallReply, CoreInfo, EngineStats, LoadLoRA,
                               LoRAVersions, Shutdown, StartupFailed, Stats, StatsReply, StepOutputs, UnloadLoRA)
from moeserve.models.tokenizer import load_tokenizer
from moeserve.outputs import RequestOutput
from moeserve.sampling_params import SamplingParams

logger = logging.getLogger("moeserve")


def resolve_adapter_path(name: str, given: str | None, lora_dir: str | None) -> str:
    """The real path a load request may read, or an error that reveals nothing about the filesystem: a path that is
    missing, not a folder, unreadable or has no adapter config gets one answer (FileNotFoundError -> 404).
    Blocking (stat calls): run it off the event loop."""
    if lora_dir is None:
        if given is None:
            raise AdapterPathError("lora_path: field required (this server has no --lora-dir to find adapters by "
                                   "name)")
        path = os.path.realpath(given)
    else:
        root = os.path.realpath(lora_dir)
        path = os.path.realpath(os.path.join(root, given if given is not None else name))  # an absolute given wins
        if os.path.commonpath([root, path]) != root:
            raise AdapterPathError("lora_path must name an adapter inside the server's --lora-dir (symlinks "
                                   "resolved)")
    config = os.path.join(path, CONFIG_FILE)
    if not (os.path.isdir(path) and os.path.isfile(config) and os.access(config, os.R_OK)):
        raise FileNotFoundError(path)
    return path


@dataclass
class ChatPrompt:
    """A conversation to render with the model's chat template."""
    messages: list[dict]


@dataclass
class PreparedPrompt:
    """A prompt already tokenized (EngineClient.prepare): n choices of one prompt tokenize it once."""
    token_ids: list[int]
    text: str | None = None  # the plain-text prompt, for echo


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for: its vocabulary string's UTF-8 length
    (byte-level vocabularies spell a byte with a character of up to two bytes; a byte-fallback token such as
    <0x41> is longer than its byte), so a text of more characters than max_model_len times this cannot fit."""
    tok = getattr(tokenizer, "tok", tokenizer)
    try:
        pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
        return max(len(p.encode("utf-8", "surrogatepass")) for p in pieces if isinstance(p, str))
    except Exception:  # noqa: BLE001 - an unusual tokenizer: a generous fixed bound
        return 256


class _Unread:
    """Outputs of one request that arrived while its reader was busy, folded into one: the latest output with
    the deltas of all of them (so a client that stops reading holds one output, not one per token, each with
    a copy of everything generated so far)."""
    __slots__ = ("last", "ids", "texts")

    def __init__(self, out: RequestOutput):
        self.last, self.ids, self.texts = out, list(out.delta_token_ids), [out.delta_text]

    def add(self, out: RequestOutput) -> None:
        self.last = out
        self.ids.extend(out.delta_token_ids)
        self.texts.append(out.delta_text)

    def output(self) -> RequestOutput:
        if len(self.texts) == 1:
            return self.last
        return dataclasses.replace(self.last, delta_token_ids=self.ids, delta_text="".join(self.texts))


class RequestStream:
    """Outputs of one request, in order; the last one has finish_reason set. Iterating raises the error
    the engine reported for it. Outputs not yet read are folded into one (their deltas joined). abort()
    stops the request unless it already finished; it never blocks. `notify`, when set, is called on each
    arrival (MergedStreams waits on several streams with it)."""

    def __init__(self, client: "EngineClient", request_id: str):
        self.request_id = request_id
        self.finished = False
        self.notify = None
        self._client = client
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        tail = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput):
            # an error output is not folded: it becomes the error the reader raises, after the tokens before it
            if isinstance(tail, _Unread) and not tail.last.finished and item.finish_reason != "error":
                tail.add(item)
            else:
                self._items.append(_Unread(item))
        else:
            self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self.notify is not None:
            self.notify()

    def ready(self) -> bool:
        """An output (or the error) can be taken without waiting."""
        return bool(self._items) and not self.finished

    def take(self) -> RequestOutput:
        """The next output; only when ready()."""
        item = self._items.popleft()
        if isinstance(item, _Unread):
            item = item.output()
            if item.finish_reason == "error":
                item = EngineStepError(f"request failed: {item.error}")
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.ready():
            if self.finished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self.take()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._client.abort(self.request_id)


class QueueReservation:
    """Queue places held for requests being prepared (EngineClient.reserve)."""

    def __init__(self, client: "EngineClient", n: int):
        self._client = client
        self.left = n

    def use(self) -> None:
        if self.left <= 0:
            raise RuntimeError("queue reservation already used up")
        self.left -= 1
        self._client.reserved -= 1

    def release(self) -> None:
        self._client.reserved -= self.left
        self.left = 0

    def __enter__(self) -> "QueueReservation":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class OnDemandAdapters:
    """The adapters a client serves, by name, and their loading from --lora-dir at a name's first request. Shared by
    EngineClient and DataParallelClient, which provide `config`, `lora_versions` (name -> version), `_on_demand`
    (name -> its load in progress) and `load_lora`."""

    @property
    def lora_names(self) -> tuple[str, ...]:
        return tuple(self.lora_versions)

    def check_model(self, lora: str | None) -> None:
        if lora is not None and lora not in self.lora_names:
            raise UnknownAdapterError(f"unknown LoRA adapter {lora!r}; loaded adapters: "
                                      f"{sorted(self.lora_names) or 'none'}")

    @property
    def loads_on_demand(self) -> bool:
        """Adapters not loaded are looked for in --lora-dir at first use (runtime loading on, a --lora-dir)."""
        return bool(self.config.enable_lora and self.config.enable_lora_runtime_loading and self.config.lora_dir)

    async def ensure_adapter(self, name: str) -> None:
        """Make `name` servable: loaded already, or loaded now from --lora-dir/<name> (loads_on_demand). Concurrent
        first requests for one name share one load. Raises UnknownAdapterError when the name is not loaded and
        cannot be loaded from there; the answer is the same whether the folder is missing or unreadable or holds
        an adapter that fails to load (the server's log says which)."""
        if name in self.lora_versions:
            return
        if not self.loads_on_demand:
            self.check_model(name)
        load = self._on_demand.get(name)
        if load is None:
            load = asyncio.ensure_future(self._load_on_demand(name))
            self._on_demand[name] = load
            load.add_done_callback(lambda _: self._on_demand.pop(name, None))
        await asyncio.shield(load)  # one waiter giving up (a client gone) does not cancel the others' load

    async def _load_on_demand(self, name: str) -> None:
        try:
            validate_adapter_name(name)
            path = await asyncio.get_running_loop().run_in_executor(None, resolve_adapter_path, name, None,
                                                                    self.config.lora_dir)
            await self.load_lora(name, path)
            logger.info("loaded LoRA adapter %r from --lora-dir at its first request", name)
            return
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - one answer to the client, the reason in the server's log
            if name in self.lora_versions:  # loaded meanwhile by a load request
                return
            if not isinstance(e, (FileNotFoundError, InvalidAdapterNameError)):  # not a client's typo
                logger.warning("could not load LoRA adapter %r from --lora-dir at its first request: %s", name, e)
        raise UnknownAdapterError(f"unknown LoRA adapter {name!r}: it is not loaded, and no adapter by that name "
                                  "could be loaded from the server's --lora-dir")


@contextlib.contextmanager
def child_environ(env: dict[str, str] | None):
    """os.environ with `env` set, for a process started inside the block (a spawned process copies it then)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class EngineClient(OnDemandAdapters):
    def __init__(self, config: EngineConfig, log_level: str = "INFO", env: dict[str, str] | None = None,
                 tokenizer_lock: asyncio.Lock | None = None, name: str = "core"):
        self.config = config
        self.log_level = log_level
        self.name = name  # the core's name in its log lines ("core 0", "core 1" under data parallelism)
        self.env = env  # set in the core's environment (data parallelism: CUDA_VISIBLE_DEVICES, its own GPUs)
        # held while the tokenizer loads: clients starting together load one at a time (transformers' lazy imports
        # are not thread-safe: two at once failed with "cannot import name 'AutoTokenizer'")
        self.tokenizer_lock = tokenizer_lock or contextlib.nullcontext()
        self.info: CoreInfo | None = None  # the core's, once it is ready
        self.tokenizer = None
        self.limits: RequestLimits | None = None
        self.max_prompt_chars: int | None = None  # longer texts are refused without tokenizing
        self.lora_versions: dict[str, int] = {}  # adapters new requests may use -> their version
        self._on_demand: dict[str, asyncio.Future] = {}  # name -> its load from --lora-dir at first use
        self.output: OutputProcessor | None = None
        self.streams: dict[str, RequestStream] = {}
        self.pending_adds: dict[str, asyncio.Future] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self.counts = {"num_running": 0, "num_waiting": 0}
        self.reserved = 0  # queue places held by requests still being tokenized (see reserve())
        self.dead: str | None = None  # why the core is not running
        self._closed = False  # the core reaped, sockets closed
        self._call_ids = itertools.count()
        # tokenizing and chat templating run here, off the event loop
        self._prep = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeserve-tokenize")

    # ---- lifecycle ----------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig, log_level: str = "INFO",
                    env: dict[str, str] | None = None) -> "EngineClient":
        client = cls(config, log_level, env)
        await client._start()
        return client

    async def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="moeserve-")
        inbox, outbox = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.bind(inbox)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.bind(outbox)
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=run_core, name="moeserve-engine-core", daemon=True,
                               args=(config_to_wire(self.config), inbox, outbox, os.getpid(), self.log_level, self.name))
        with child_environ(self.env):
            self.proc.start()
        atexit.register(self._kill_at_exit)
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self.proc.sentinel, lambda: exited.done() or exited.set_result(None))
        first = asyncio.ensure_future(self._from_core.recv())
        try:
            await asyncio.wait({first, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                raise EngineStartError(f"the engine core process exited while starting (exit code "
                                       f"{self.proc.exitcode})")
            msg = CODEC.decode(first.result())
            if isinstance(msg, StartupFailed):  # the core's error, of its own type
                if isinstance(msg.error, USER_ERRORS):
                    raise msg.error
                raise EngineStartError(str(msg.error)) from msg.error
            self.info = msg.info
            self.limits = RequestLimits(self.info.vocab_size, self.info.max_model_len, self.info.block_size,
                                        self.info.num_kv_blocks)
            self.lora_versions = {name: 1 for name in self.info.lora_names}  # loaded at start: first versions
            async with self.tokenizer_lock:
                self.tokenizer = await loop.run_in_executor(self._prep, load_tokenizer, self.info.tokenizer,
                                                            self.info.vocab_size, self.info.tokenizer_class)
            if self.tokenizer is not None:
                per_token = await loop.run_in_executor(self._prep, max_token_bytes, self.tokenizer)
                self.max_prompt_chars = self.info.max_model_len * max(per_token, 1)
        except BaseException:  # a failed start, or one abandoned (the server was told to stop)
            first.cancel()
            self.dead = "the engine core failed to start"
            self._stop_core()
            await self._close(loop, timeout=10)
            raise
        self.output = OutputProcessor(self.tokenizer)
        self._reader = asyncio.ensure_future(self._read())
        exited.add_done_callback(lambda _: self._on_exit())

    def _kill_at_exit(self) -> None:
        """A core still running as the interpreter exits (this client never shut down) is killed. It ignores
        SIGTERM, which multiprocessing would stop it with before waiting for it to end: forever."""
        if self.proc.is_alive():
            self.dead = self.dead or "the interpreter is exiting"
            self.proc.kill()
            self.proc.join(5)

    def _stop_core(self) -> None:
        """Stop a core in any state: ABANDON_SIGNAL ends a start, the message a core already serving."""
        try:
            self._to_core.send(CODEC.encode(Shutdown()))
        except zmq.ZMQError:
            pass
        if self.proc.is_alive():
            os.kill(self.proc.pid, ABANDON_SIGNAL)

    @property
    def is_running(self) -> bool:
        return self.dead is None

    def where(self) -> str:
        """Where the engine runs, for the server's first line."""
        return f"engine core pid {self.proc.pid}, {self.info.device}, {self.info.dtype}"

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (requests still open end with EngineDeadError) and reap it; a second call does nothing."""
        if self._closed:
            return
        if self.dead is None:
            self.dead = "the engine has shut down"
            try:
                await self._to_core.send(CODEC.encode(Shutdown()))
            except zmq.ZMQError:
                pass
        self._fail_all(EngineDeadError(self.dead))
        self._reader.cancel()
        await self._close(asyncio.get_running_loop(), timeout)

    def abort_all(self) -> int:
        """Abort every open request (their streams end with finish_reason 'abort'); returns how many."""
        ids = list(self.streams)
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    async def _close(self, loop, timeout: float) -> None:
        """Reap the core process and release sockets, reader and threads."""
        self._closed = True
        atexit.unregister(self._kill_at_exit)
        await loop.run_in_executor(None, self.proc.join, timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        loop.remove_reader(self.proc.sentinel)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._ctx.term()
        self._prep.shutdown(wait=False)

    def _on_exit(self) -> None:
        if self.dead is None:
            self.dead = f"the engine core process died (exit code {self.proc.exitcode})"
            logger.error("%s; failing its open requests", self.dead)  # what the server answers next is its own
        self._fail_all(EngineDeadError(self.dead))

    def _fail_all(self, error: Exception) -> None:
        for fut in [*self.pending_adds.values(), *self.calls.values()]:
            if not fut.done():
                fut.set_exception(error)
        self.pending_adds.clear()
        self.calls.clear()
        for stream in self.streams.values():
            stream.put(error)
        self.streams.clear()

    # ---- messages from the core ---------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            try:
                msg = CODEC.decode(await self._from_core.recv())
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                self._dispatch(msg)
            except Exception:  # noqa: BLE001 - a frontend bug must not stop every stream
                logger.exception("failed to process a message from the engine core")

    def _dispatch(self, msg) -> None:
        handler = {StepOutputs: self._on_step, CallReply: self._on_reply, StatsReply: self._on_reply}.get(type(msg))
        if handler is None:
            raise TypeError(f"unexpected {type(msg).__name__} message from the engine core")
        handler(msg)

    def _on_reply(self, msg: CallReply) -> None:
        fut = self.calls.pop(msg.call_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg.result) if msg.error is None else fut.set_exception(msg.error)

    def _on_step(self, msg: StepOutputs) -> None:
        self.counts = {"num_running": msg.num_running, "num_waiting": msg.num_waiting}
        for request_id in msg.accepted:
            fut = self.pending_adds.pop(request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        for request_id, error in msg.rejected.items():
            fut = self.pending_adds.pop(request_id, None)
            self.output.abort(request_id)
            self.streams.pop(request_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(error)
        results, stopped = self.output.process(msg.outputs)
        if stopped:  # ended by a stop string here: the core stops computing them (not counted as aborts)
            self._send(AbortRequests(stopped, counted=False))
        for out in results:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self.streams[out.request_id]
            stream.put(out)

    # ---- requests -----------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._to_core.send(CODEC.encode(msg))  # PUSH to a live peer queues at once; the returned future needs no await

    def _tokenize(self, prompt: str | ChatPrompt) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: give the prompt as token ids")
        if isinstance(prompt, str):
            try:
                return self.tokenizer.encode(prompt)
            except Exception as e:  # noqa: BLE001 - e.g. a lone surrogate: the prompt's fault, not ours
                raise RequestError(f"prompt could not be tokenized: {type(e).__name__}: {e}") from e
        try:
            return self.tokenizer.chat_ids(prompt.messages)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a template that refuses the conversation
            raise RequestError(f"messages: the chat template failed: {type(e).__name__}: {e}") from e

    def queue_room(self) -> int:
        """How many more requests may wait: those sent but not yet running count as waiting, and so do places
        reserved by requests still being tokenized (else a burst would all tokenize before any was refused)."""
        return self.info.max_queue_len - (len(self.streams) - self.counts["num_running"]) - self.reserved

    def queue_full_error(self) -> QueueFullError:
        return QueueFullError(f"queue is full ({self.info.max_queue_len} waiting requests); retry later")

    def reserve(self, n: int = 1) -> "QueueReservation":
        """Hold n queue places for requests about to be prepared and submitted (QueueFullError if there is no
        room): each submit() given the reservation turns one place into its queued request; leaving the `with`
        block frees the places not used."""
        if self.queue_room() < n:
            raise self.queue_full_error()
        self.reserved += n
        return QueueReservation(self, n)

    def check_prompt_size(self, prompt) -> None:
        """Refuse, without tokenizing, a prompt too long to ever fit max_model_len (RequestError)."""
        limit = self.info.max_model_len
        if isinstance(prompt, str):
            chars = len(prompt)
        elif isinstance(prompt, ChatPrompt):
            chars = sum(len(m.get("content") or "") for m in prompt.messages)
        else:
            if isinstance(prompt, (list, tuple)) and len(prompt) >= limit:
                raise RequestError(f"prompt has {len(prompt)} tokens; max_model_len is {limit} (the prompt plus at "
                                   "least one generated token must fit)")
            return
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise RequestError(f"prompt has {chars} characters, more than max_model_len ({limit}) tokens can "
                               f"hold; at most {self.max_prompt_chars} characters are accepted")

    async def prepare(self, prompt: str | list[int] | ChatPrompt | PreparedPrompt) -> PreparedPrompt:
        """Size-check, then tokenize (off the event loop) or check the token ids."""
        if isinstance(prompt, PreparedPrompt):
            return prompt
        self.check_prompt_size(prompt)
        if isinstance(prompt, (str, ChatPrompt)):
            ids = await asyncio.get_running_loop().run_in_executor(self._prep, self._tokenize, prompt)
            return PreparedPrompt(ids, prompt if isinstance(prompt, str) else None)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return PreparedPrompt(list(prompt))
        raise RequestError("prompt must be a string or a list of token ids")

    async def submit(self, prompt: str | list[int] | ChatPrompt | PreparedPrompt, params: SamplingParams | None = None,
                     lora: str | None = None, request_id: str | None = None,
                     reservation: "QueueReservation | None" = None) -> RequestStream:
        """Add a request; refusals (RequestError, QueueFullError, UnknownAdapterError, ...) are raised here,
        before any output. `reservation`: a queue place held by reserve(); without one, a place is taken here,
        before tokenizing, so overload is refused in microseconds."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if reservation is None:
            with self.reserve(1) as own:
                return await self.submit(prompt, params, lora, request_id, own)
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        prepared = await self.prepare(prompt)
        ids, prompt_text = prepared.token_ids, prepared.text
        params = self.limits.check(ids, params)
        if lora is not None:
            await self.ensure_adapter(lora)
        if request_id in self.streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        reservation.use()  # the place passes to the stream
        stream = RequestStream(self, request_id)
        accepted = asyncio.get_running_loop().create_future()
        self.streams[request_id] = stream
        self.pending_adds[request_id] = accepted
        self.output.add(RequestState(request_id, prompt_text, ids, params, lora))
        try:
            self._send(AddRequest(request_id, ids, params, lora))
        except BaseException:  # e.g. a value msgpack cannot carry: a stream left behind would hold its place forever
            self.streams.pop(request_id, None)
            self.pending_adds.pop(request_id, None)
            self.output.abort(request_id)
            raise
        try:
            await accepted
        except asyncio.CancelledError:
            stream.abort()  # the add may have happened after all: nobody will read it
            raise
        return stream

    async def generate(self, prompt, params: SamplingParams | None = None, lora: str | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.submit(prompt, params, lora, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()  # consumer stopped early (disconnect, cancellation): free the KV blocks

    def abort(self, request_id: str) -> None:
        """Stop a request (never blocks); its stream ends with finish_reason 'abort'."""
        out = self.output.abort(request_id) if self.output else None
        stream = self.streams.pop(request_id, None)
        if stream is not None and out is not None:
            stream.put(out)
        if self.dead is None:
            self._send(AbortRequests([request_id]))

    async def call(self, call: Call):
        """A utility call on the core (between steps, moeserve/messages.py); raises the core's error as its class."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        call = dataclasses.replace(call, call_id=next(self._call_ids))
        self._send(call)  # the reply is read on this loop, so it cannot arrive before the future is registered
        fut = self.calls[call.call_id] = asyncio.get_running_loop().create_future()
        return await fut

    async def load_lora(self, name: str, path: str, pinned: bool = False, replace: bool = False) -> None:
        """Load an adapter (the core reads it off its step loop). `replace=True` reloads a loaded name as a new
        version: requests already started finish on the old one, every later request gets the new one."""
        try:
            await self.call(LoadLoRA(name, path, pinned, replace))
        finally:
            await self._refresh_loras()

    async def unload_lora(self, name: str) -> None:
        try:
            await self.call(UnloadLoRA(name))
        finally:
            await self._refresh_loras()

    async def _refresh_loras(self) -> None:
        if self.dead is None:
            self.lora_versions = dict(await self.call(LoRAVersions()))

    async def stats(self) -> EngineStats:
        return await self.call(Stats())

    async def stats_per_core(self) -> list[EngineStats]:
        return [await self.stats()]
