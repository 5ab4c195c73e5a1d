"""AsyncEngine: the synchronous Engine driven by one background thread, for asyncio callers.

The engine thread is the only one that touches the Engine. Callers send it commands through a
thread-safe queue (each with a concurrent Future for the result); it steps the engine while
any request is unfinished and sleeps on the command queue otherwise. Each request's outputs go
to that request's asyncio queue through `loop.call_soon_threadsafe`, so a slow consumer never
blocks the engine and nothing is shared between threads except the two queues.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from moeserve.runtime.engine import Engine, RequestError
from moeserve.runtime.sequence import RequestOutput, SeqStatus
from moeserve.sampling_params import SamplingParams

logger = logging.getLogger("moeserve")

_SHUTDOWN = object()


class QueueFullError(RequestError):
    """The engine's waiting queue holds max_queue_len requests; retry later."""


class EngineStepError(RuntimeError):
    """engine.step() raised while this request was running; the request was aborted."""


class EngineDeadError(RuntimeError):
    """The engine thread has shut down."""


@dataclass
class ChatPrompt:
    """A conversation to render with the model's chat template (on the engine thread)."""
    messages: list[dict]


class RequestStream:
    """Outputs of one request, in order; the last one has finish_reason set.

    Iterating raises the error the engine reported for this request (EngineStepError, ...).
    abort() stops the request unless it already finished; it never blocks.
    """

    def __init__(self, owner: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, RequestOutput) and item.finish_reason == "error":
            item = EngineStepError(f"request failed: {item.error}")  # e.g. its adapter could not be read
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner._post(self._owner._abort_on_thread, self.request_id)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        # adapter names, refreshed by the engine thread after every load/unload: the server reads
        # this to route `model` names without a round trip through the engine thread
        self.lora_names: tuple[str, ...] = tuple(engine.list_loras())
        self._alive = True
        self._stalled = False  # last step scheduled nothing and nothing runs: wait for a command
        # tokenizing and chat templating run here, not on the engine thread, so a huge prompt
        # cannot stall everybody else's generation
        self._prep = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeserve-tokenize")
        self._thread = threading.Thread(target=self._run, name="moeserve-engine", daemon=True)
        self._thread.start()

    # ---- public API (asyncio side) ------------------------------------------------------------
    async def submit(self, prompt: str | list[int] | ChatPrompt, params: SamplingParams | None = None,
                     lora: str | None = None, request_id: str | None = None) -> RequestStream:
        """Add a request; errors from Engine.add_request are raised here, before any output."""
        request_id = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        prompt_text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, (str, ChatPrompt)) and self.engine.tokenizer is not None:
            prompt = await loop.run_in_executor(self._prep, self._tokenize, prompt)
        stream = RequestStream(self, request_id, loop)
        try:
            await self._call(self._add_on_thread, prompt, params, lora, stream, prompt_text)
        except asyncio.CancelledError:
            stream.abort()  # the add may have happened after all: nobody will read it
            raise
        return stream

    async def generate(self, prompt: str | list[int] | ChatPrompt, params: SamplingParams | None = None,
                       lora: str | None = None, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.submit(prompt, params, lora, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()  # consumer stopped early (disconnect, cancellation): free the KV blocks

    async def abort(self, request_id: str) -> None:
        await self._call(self._abort_on_thread, request_id)

    async def load_lora(self, name: str, path: str, pinned: bool = False) -> None:
        await self._call(self._lora_on_thread, self.engine.load_lora, name, path, pinned)

    async def unload_lora(self, name: str) -> None:
        await self._call(self._lora_on_thread, self.engine.unload_lora, name)

    async def stats(self) -> dict:
        return await self._call(self.engine.stats)

    async def run_on_engine(self, fn: Callable[..., Any], *args) -> Any:
        """Run fn(*args) on the engine thread between steps (for reads that need a consistent engine)."""
        return await self._call(fn, *args)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        if self._alive:
            self._alive = False
            self._commands.put(_SHUTDOWN)
            self._prep.shutdown(wait=False)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._drain_after_shutdown()  # commands that raced with the shutdown

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_pending_commands(self) -> int:
        """Commands the engine thread has not taken yet (approximate: it may be taking one right now)."""
        return self._commands.qsize()

    # ---- plumbing ---------------------------------------------------------------------------------
    def _post(self, fn, *args, future: concurrent.futures.Future | None = None) -> None:
        self._commands.put((fn, args, future))

    async def _call(self, fn, *args):
        if not self._alive:
            raise EngineDeadError("the engine has shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(fn, *args, future=future)
        return await asyncio.wrap_future(future)

    # ---- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            # sleep on the queue when idle or stalled (waiting requests that nothing running will unblock);
            # otherwise take what is there and step
            stalled = self._stalled
            block = stalled or not self.engine.has_unfinished()
            try:
                cmd = self._commands.get(block=block, timeout=1.0 if stalled else None)
            except queue.Empty:
                cmd = None
            if cmd is not None:
                self._stalled = False
            while cmd is not None:
                if cmd is _SHUTDOWN:
                    self._fail_all(EngineDeadError("the engine has shut down"))
                    self._drain_after_shutdown()
                    return
                self._execute(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.has_unfinished():
                self._step()

    def _execute(self, cmd) -> None:
        fn, args, future = cmd
        if future is not None and not future.set_running_or_notify_cancel():
            return  # the caller gave up before we got to it
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - hand every error to the caller
            if future is not None:
                future.set_exception(e)
            else:
                logger.exception("engine command %s failed", getattr(fn, "__name__", fn))
            return
        if future is not None:
            future.set_result(result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - one bad step must not take the server down
            logger.exception("engine step failed; failing the running requests")
            self._fail_running(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        self._stalled = not outputs and not self.engine.scheduler.running
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile, or added directly to the Engine
            if out.finished:
                del self._streams[out.request_id]
            self._deliver(stream, out)

    def _deliver(self, stream: RequestStream, item) -> None:
        try:
            stream._put(item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            if self._streams.pop(stream.request_id, None) is not None:
                self.engine.abort(stream.request_id)

    def _tokenize(self, prompt: str | ChatPrompt) -> list[int]:
        """Prompt text or chat messages -> token ids (tokenizer thread)."""
        eng = self.engine
        if isinstance(prompt, str):
            return eng.tokenizer.encode(prompt)
        try:
            return eng.chat_prompt(prompt.messages)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a template that refuses the conversation
            raise RequestError(f"messages: the chat template failed: {type(e).__name__}: {e}") from e

    def _add_on_thread(self, prompt, params, lora, stream: RequestStream, prompt_text: str | None = None) -> str:
        eng = self.engine
        if len(eng.scheduler.waiting) >= eng.config.max_queue_len:
            eng.stats_counters["requests_rejected"] += 1
            raise QueueFullError(f"queue is full ({eng.config.max_queue_len} waiting requests); retry later")
        self._stalled = False  # a new request may be schedulable
        request_id = eng.add_request(prompt, params, lora=lora, request_id=stream.request_id, prompt_text=prompt_text)
        self._streams[request_id] = stream
        return request_id

    def _abort_on_thread(self, request_id: str) -> None:
        seq = self.engine.seqs.get(request_id)
        self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and seq is not None:  # someone still listens: tell them it ended
            self._deliver(stream, RequestOutput(
                request_id=request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
                token_ids=list(seq.output_token_ids), text=seq.text[:seq.stream_offset], delta_text="",
                delta_token_ids=[], logprobs=seq.logprobs, prompt_logprobs=seq.prompt_logprobs,
                finish_reason="abort", lora_name=seq.lora_name))

    def _lora_on_thread(self, fn, *args) -> None:
        try:
            fn(*args)
        finally:
            self.lora_names = tuple(self.engine.list_loras())

    def _fail_running(self, error: Exception) -> None:
        """Abort and fail the requests the failed step was working on; waiting ones stay queued."""
        for request_id, stream in list(self._streams.items()):
            seq = self.engine.seqs.get(request_id)
            if seq is not None and seq.status == SeqStatus.WAITING:
                continue
            del self._streams[request_id]
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s after a failed step failed", request_id)
            self._deliver(stream, error)

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s at shutdown failed", request_id)
            self._deliver(stream, error)
        self._streams.clear()

    def _drain_after_shutdown(self) -> None:
        while True:
            try:
                fn, args, future = self._commands.get_nowait()
            except queue.Empty:
                return
            except (TypeError, ValueError):
                continue
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine has shut down"))
