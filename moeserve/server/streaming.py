"""Request plumbing shared by the endpoints: submitting a request's choices, merging their streams,
waiting for final outputs while watching for the client leaving, and SSE framing."""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from moeserve.frontend.core_client import EngineClient, RequestStream
from moeserve.outputs import RequestOutput
from moeserve.server.errors import ClientGone, engine_error
from moeserve.server.metrics import ServerMetrics
from moeserve.server.protocol import OpenAIError


class MergedStreams:
    """(choice index, output) from several request streams, taking from them in turn."""

    def __init__(self, streams: list[RequestStream]):
        self.streams = streams
        self._arrived: asyncio.Event | None = None
        self._next = 0  # where the next look starts, so one busy stream cannot starve the others

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if len(self.streams) == 1:  # the common case needs no event
            return 0, await self.streams[0].__anext__()
        if self._arrived is None:
            self._arrived = asyncio.Event()
            for s in self.streams:
                s.notify = self._arrived.set
        n = len(self.streams)
        while True:
            self._arrived.clear()
            for k in range(n):
                i = (self._next + k) % n
                if self.streams[i].ready():
                    self._next = i + 1
                    return i, self.streams[i].take()
            if all(s.finished for s in self.streams):
                raise StopAsyncIteration
            await self._arrived.wait()

    def close(self) -> None:
        """Stop everything still running (no-op for finished streams)."""
        for s in self.streams:
            s.abort()


async def submit_all(engine: EngineClient, jobs: list[tuple], lora: str | None, request_id: str,
                     prompt_param: str) -> list[RequestStream]:
    """Submit every (prompt, params) job at once (one engine step takes them all); on any refusal abort those
    already accepted. Each distinct prompt is tokenized once, however many choices share it."""
    limit = engine.info.max_queue_len
    if len(jobs) > limit:  # could never be queued at once: not a "retry later"
        raise OpenAIError(400, f"this request asks for {len(jobs)} completions (prompts x n); at most {limit} "
                          "can be queued at once", param="n", code="invalid_value")
    try:
        reservation = engine.reserve(len(jobs))  # before any tokenizing: a burst is refused at once
    except Exception as e:  # noqa: BLE001 - QueueFullError: 503
        raise engine_error(e, prompt_param) from e
    with reservation:
        try:
            for prompt, _ in jobs:  # every size check before any tokenizing
                engine.check_prompt_size(prompt)
            prepared = {}
            for prompt, _ in jobs:
                if id(prompt) not in prepared:
                    prepared[id(prompt)] = await engine.prepare(prompt)
        except Exception as e:  # noqa: BLE001 - mapped to the HTTP error
            raise engine_error(e, prompt_param) from e
        results = await asyncio.gather(*(engine.submit(prepared[id(prompt)], params, lora=lora,
                                                       request_id=f"{request_id}-{k}", reservation=reservation)
                                         for k, (prompt, params) in enumerate(jobs)), return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for s in streams:
            s.abort()
        e = next((f for f in failed if not isinstance(f, Exception)), failed[0])
        if isinstance(e, Exception):
            raise engine_error(e, prompt_param) from e
        raise e
    return streams


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(metrics: ServerMetrics, request: Request, streams: list[RequestStream], arrival: float):
    """Final output of every stream (non-streaming responses); ClientGone if the client leaves first."""
    merged = MergedStreams(streams)

    async def run():
        finals: list[RequestOutput | None] = [None] * len(streams)
        first: list[float | None] = [None] * len(streams)
        async for i, out in merged:
            now = time.perf_counter()
            if first[i] is None and out.delta_token_ids:
                first[i] = now
            if out.finished:
                finals[i] = out
                metrics.observe_choice(arrival, first[i], now, len(out.token_ids))
        return finals

    work = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        merged.close()
    if work not in done:
        raise ClientGone()
    try:
        return work.result()
    except Exception as e:  # noqa: BLE001 - e.g. EngineStepError: answered as a 500 in the OpenAI shape
        raise engine_error(e, "prompt") from e


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(chunks, merged: MergedStreams, metrics: ServerMetrics, endpoint: str,
                 prompt_param: str) -> StreamingResponse:
    """A streaming response of `chunks` (an async generator of chunk dicts read from `merged`)."""
    return StreamingResponse(_sse_body(chunks, merged, metrics, endpoint, prompt_param),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse_body(chunks, merged: MergedStreams, metrics: ServerMetrics, endpoint: str, prompt_param: str):
    """SSE framing shared by completions and chat: `[DONE]` at the end; an error once the response has started is
    reported in-band; the request is counted with its final status (499 when the client left first)."""
    status = 499
    try:
        async for chunk in chunks:
            yield sse(chunk)
        yield "data: [DONE]\n\n"
        status = 200
    except Exception as e:  # noqa: BLE001 - the response has started: report in-band
        err = engine_error(e, prompt_param)
        status = err.status
        yield sse(err.body())
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()
        merged.close()
        metrics.count_request(endpoint, status)
