"""OpenAI-compatible HTTP API on the AsyncEngine: completions, chat, models, LoRA hot-loading, metrics.

Every request is validated (pydantic, then SamplingParams, then Engine.add_request) before a
single byte of the response is sent, so each mistake is a 4xx in the OpenAI error shape and a
streaming response only ever starts for a request the engine accepted. A client that goes away
aborts its requests, which frees their KV blocks at the next step.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.lora.adapter import LoRAAdapterError
from moeserve.runtime.async_engine import (AsyncEngine, ChatPrompt, EngineDeadError, EngineStepError,
                                           QueueFullError, RequestStream)
from moeserve.runtime.sequence import RequestOutput, TokenLogprobs
from moeserve.sampling_params import SamplingParams
from moeserve.server.metrics import ServerMetrics
from moeserve.server.protocol import (INT64_MAX, INT64_MIN, ChatCompletionRequest, CompletionRequest,
                                      LoadLoRARequest, OpenAIError, UnloadLoRARequest)

logger = logging.getLogger("moeserve")

GENERATION_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop", "stop_token_ids")
_MIN_LOGPROB = -9999.0  # JSON has no -inf


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


# ---------------------------------------------------------------------------------------------
# Server state shared by the handlers
# ---------------------------------------------------------------------------------------------

class ServerState:
    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: str | None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        cfg = engine.engine.config  # read-only after the engine is built
        self.max_model_len = cfg.max_model_len
        self.model_root = cfg.model
        self.tokenizer = engine.engine.tokenizer
        self._token_strs: dict[int, str] = {}

    def resolve_model(self, name: str) -> str | None:
        """The adapter a request's `model` selects: None for the base model; 404 if unknown."""
        loras = self.engine.lora_names
        if name == self.served_model_name:
            return None
        if name in loras:
            return name
        base, sep, adapter = name.partition(":")
        if sep and base == self.served_model_name and adapter in loras:
            return adapter
        raise OpenAIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = (self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None
                 else f"token_id:{token_id}")
            self._token_strs[token_id] = s
        return s

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) if self.tokenizer else ""


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def engine_error(e: BaseException, prompt_param: str) -> OpenAIError:
    """Map an exception from the engine to the HTTP error the client sees."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, QueueFullError):
        return OpenAIError(503, str(e), type="server_error", code="queue_full")
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), type="server_error", code="engine_unavailable")
    if isinstance(e, LookupError) and not type(e) is KeyError:
        return OpenAIError(404, str(e), param="model", code="model_not_found")
    if isinstance(e, ValueError):
        msg = str(e)
        first = msg.split(" ", 1)[0]
        param = "model" if isinstance(e, LoRAAdapterError) else first if first in _SAMPLING_FIELDS else prompt_param
        return OpenAIError(400, msg, param=param, code="invalid_value")
    if not isinstance(e, EngineStepError):  # already logged by the engine thread
        logger.error("internal error", exc_info=e)
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error",
                       code="internal_error")


def lora_error(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, FileNotFoundError):
        return OpenAIError(404, str(e), param="lora_path", code="adapter_not_found")
    if isinstance(e, LookupError) and not type(e) is KeyError:
        return OpenAIError(404, str(e), param="lora_name", code="adapter_not_found")
    in_use = "inuse" in type(e).__name__.lower() or "busy" in type(e).__name__.lower() or "in use" in str(e)
    if in_use or (isinstance(e, RuntimeError) and not isinstance(e, EngineDeadError)):
        return OpenAIError(409, str(e), param="lora_name", code="adapter_in_use")
    if isinstance(e, (ValueError, OSError)):
        return OpenAIError(400, str(e), param="lora_path", code="invalid_adapter")
    return engine_error(e, "lora_path")


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return OpenAIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}",
                           code="invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # drop pydantic's union-branch names ("str", "list[int]", ...) from the parameter path
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool",
                                                                          "dict", "list")]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        msg = "field required"
    return OpenAIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


# ---------------------------------------------------------------------------------------------
# Request plumbing
# ---------------------------------------------------------------------------------------------

class MergedStreams:
    """(choice index, output) from several request streams, in arrival order."""

    def __init__(self, streams: list[RequestStream]):
        self.streams = streams
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._remaining = len(streams)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if len(self.streams) == 1:  # the common case needs no pump tasks
            return 0, await self.streams[0].__anext__()
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self.streams)]
        while self._remaining:
            i, item = await self._queue.get()
            if item is None:
                self._remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return i, item
        raise StopAsyncIteration

    async def _pump(self, i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            self._queue.put_nowait((i, e))
        self._queue.put_nowait((i, None))

    def close(self) -> None:
        """Stop everything still running (no-op for finished streams)."""
        for t in self._tasks:
            t.cancel()
        for s in self.streams:
            s.abort()


async def submit_all(state: ServerState, jobs: list[tuple], lora: str | None, request_id: str,
                     prompt_param: str) -> list[RequestStream]:
    """Submit every (prompt, params) job; on any refusal abort those already accepted."""
    limit = state.engine.engine.config.max_queue_len
    if len(jobs) > limit:  # could never be queued at once: not a "retry later"
        raise OpenAIError(400, f"this request asks for {len(jobs)} completions (prompts x n); at most {limit} "
                          "can be queued at once", param="n", code="invalid_value")
    streams: list[RequestStream] = []
    try:
        for k, (prompt, params) in enumerate(jobs):
            streams.append(await state.engine.submit(prompt, params, lora=lora, request_id=f"{request_id}-{k}"))
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, Exception):
            raise engine_error(e, prompt_param) from e
        raise
    return streams


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(state: ServerState, request: Request, streams: list[RequestStream], arrival: float):
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
                state.metrics.observe_choice(arrival, first[i], now, len(out.token_ids))
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


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def _delta_logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    """Logprobs of this output's new tokens (out.logprobs is the request's growing list)."""
    end = len(out.token_ids)
    return list(out.logprobs[end - len(out.delta_token_ids):end]) if out.logprobs is not None else []


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _seed(seed: int | None, i: int) -> int | None:
    if seed is None:
        return None
    s = seed + i
    return s if s <= INT64_MAX else s - INT64_MAX + INT64_MIN - 1  # wrap around int64


def _sampling_params(body, i: int, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None):
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            seed=_seed(body.seed, i), stop=body.stop, stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens)
    except ValueError as e:
        raise engine_error(e, "prompt") from e


# ---------------------------------------------------------------------------------------------
# Completions
# ---------------------------------------------------------------------------------------------

def _completion_prompts(prompt) -> list:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt is empty", param="prompt", code="invalid_value")
    return list(prompt)


def _completion_logprobs(state: ServerState, token_ids: list[int], lps: list, offset: int) -> tuple[dict, int]:
    """OpenAI legacy logprobs for `token_ids` (entries of lps may be None: the first prompt token)."""
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp in zip(token_ids, lps):
        s = state.token_str(tid)
        res["tokens"].append(s)
        res["text_offset"].append(offset)
        offset += len(s)
        if lp is None:
            res["token_logprobs"].append(None)
            res["top_logprobs"].append(None)
            continue
        top = {state.token_str(i): _finite(v) for i, v in lp.top}
        top.setdefault(s, _finite(lp.logprob))
        res["token_logprobs"].append(_finite(lp.logprob))
        res["top_logprobs"].append(top)
    return res, offset


def _echo_logprobs(state: ServerState, out: RequestOutput, offset: int) -> tuple[dict, int]:
    lps = list(out.prompt_logprobs or [])
    lps += [None] * (len(out.prompt_token_ids) - len(lps))
    return _completion_logprobs(state, out.prompt_token_ids, lps, offset)


def _merge_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


async def create_completion(state: ServerState, body: CompletionRequest, request: Request):
    arrival = time.perf_counter()
    if (err := body.unsupported()) is not None:
        raise err
    lora = state.resolve_model(body.model)
    prompts = _completion_prompts(body.prompt)
    want_prompt_lps = body.logprobs if body.echo else None
    jobs = [(p, _sampling_params(body, j, body.max_tokens or 16, body.logprobs, want_prompt_lps))
            for p in prompts for j in range(body.n)]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await submit_all(state, jobs, lora, request_id, "prompt")
    created = int(time.time())
    head = {"id": request_id, "object": "text_completion", "created": created, "model": body.model}
    if body.stream:
        return _sse_response(_completion_events(state, body, streams, head, arrival))

    finals = await collect(state, request, streams, arrival)
    choices = []
    for k, out in enumerate(finals):
        text, logprobs, offset = out.text, None, 0
        if body.echo:
            text = state.prompt_text(out) + text
            if body.logprobs is not None:
                logprobs, offset = _echo_logprobs(state, out, 0)
        if body.logprobs is not None:
            logprobs = _merge_logprobs(logprobs, _completion_logprobs(state, out.token_ids,
                                                                       list(out.logprobs or []), offset)[0])
        choices.append({"index": k, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason})
    prompt_tokens = sum(len(finals[p * body.n].prompt_token_ids) for p in range(len(prompts)))
    usage = _usage(prompt_tokens, sum(len(o.token_ids) for o in finals))
    state.metrics.count_request("completions", 200)
    return JSONResponse({**head, "choices": choices, "usage": usage})


async def _completion_events(state: ServerState, body: CompletionRequest, streams, head: dict, arrival: float):
    merged = MergedStreams(streams)
    n = len(streams)
    started, first = [False] * n, [None] * n
    offsets, completion_tokens, prompt_tokens = [0] * n, [0] * n, [0] * n
    extra = {"usage": None} if body.include_usage else {}
    status = 499  # until the stream completes
    try:
        async for i, out in merged:
            now = time.perf_counter()
            if first[i] is None and out.delta_token_ids:
                first[i] = now
            text, logprobs = out.delta_text, None
            if not started[i]:
                started[i] = True
                prompt_tokens[i] = len(out.prompt_token_ids)
                if body.echo:
                    text = state.prompt_text(out) + text
                    if body.logprobs is not None:
                        logprobs, offsets[i] = _echo_logprobs(state, out, 0)
            if body.logprobs is not None:
                lp, offsets[i] = _completion_logprobs(state, out.delta_token_ids, _delta_logprobs(out), offsets[i])
                logprobs = _merge_logprobs(logprobs, lp)
            completion_tokens[i] = len(out.token_ids)
            if out.finished:
                state.metrics.observe_choice(arrival, first[i], now, len(out.token_ids))
            if text or out.finished or (logprobs and logprobs["tokens"]):
                choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
                yield _sse({**head, "choices": [choice], **extra})
        if body.include_usage:
            p = sum(prompt_tokens[k] for k in range(0, n, body.n))
            yield _sse({**head, "choices": [], "usage": _usage(p, sum(completion_tokens))})
        yield "data: [DONE]\n\n"
        status = 200
    except Exception as e:  # noqa: BLE001 - the response has started: report in-band
        err = engine_error(e, "prompt")
        status = err.status
        yield _sse(err.body())
        yield "data: [DONE]\n\n"
    finally:
        merged.close()
        state.metrics.count_request("completions", status)


# ---------------------------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------------------------

def _chat_logprobs(state: ServerState, lps: list[TokenLogprobs]) -> list[dict]:
    def entry(tid: int, lp: float) -> dict:
        s = state.token_str(tid)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps]


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request):
    arrival = time.perf_counter()
    if (err := body.unsupported()) is not None:
        raise err
    lora = state.resolve_model(body.model)
    prompt = ChatPrompt(body.template_messages())
    max_tokens = body.max_completion_tokens or body.max_tokens or state.max_model_len  # engine clamps
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    jobs = [(prompt, _sampling_params(body, j, max_tokens, logprobs)) for j in range(body.n)]
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await submit_all(state, jobs, lora, request_id, "messages")
    head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": body.model}
    if body.stream:
        head["object"] = "chat.completion.chunk"
        return _sse_response(_chat_events(state, body, streams, head, arrival))

    finals = await collect(state, request, streams, arrival)
    choices = [{"index": k, "message": {"role": "assistant", "content": out.text},
                "logprobs": {"content": _chat_logprobs(state, out.logprobs or [])} if body.logprobs else None,
                "finish_reason": out.finish_reason} for k, out in enumerate(finals)]
    usage = _usage(len(finals[0].prompt_token_ids), sum(len(o.token_ids) for o in finals))
    state.metrics.count_request("chat_completions", 200)
    return JSONResponse({**head, "choices": choices, "usage": usage})


async def _chat_events(state: ServerState, body: ChatCompletionRequest, streams, head: dict, arrival: float):
    merged = MergedStreams(streams)
    n = len(streams)
    first = [None] * n
    completion_tokens, prompt_tokens = [0] * n, 0
    extra = {"usage": None} if body.include_usage else {}
    status = 499
    try:
        for i in range(n):  # the role first, as OpenAI does, before any token exists
            choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            yield _sse({**head, "choices": [choice], **extra})
        async for i, out in merged:
            now = time.perf_counter()
            if first[i] is None and out.delta_token_ids:
                first[i] = now
            prompt_tokens = len(out.prompt_token_ids)
            completion_tokens[i] = len(out.token_ids)
            logprobs = {"content": _chat_logprobs(state, _delta_logprobs(out))} if body.logprobs else None
            if out.finished:
                state.metrics.observe_choice(arrival, first[i], now, len(out.token_ids))
            if out.delta_text or out.finished or (logprobs and logprobs["content"]):
                delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
                choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": out.finish_reason}
                yield _sse({**head, "choices": [choice], **extra})
        if body.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, sum(completion_tokens))})
        yield "data: [DONE]\n\n"
        status = 200
    except Exception as e:  # noqa: BLE001 - the response has started: report in-band
        err = engine_error(e, "messages")
        status = err.status
        yield _sse(err.body())
        yield "data: [DONE]\n\n"
    finally:
        merged.close()
        state.metrics.count_request("chat_completions", status)


def _sse_response(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------

def create_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine` as model `served_model_name` (its adapters by their names)."""
    state = ServerState(async_engine, served_model_name, api_key)
    app = FastAPI(title="moeserve", version="0.1.0", summary="OpenAI-compatible MoE + multi-LoRA server")
    app.state.moeserve = state

    def error_response(request: Request, err: OpenAIError) -> JSONResponse:
        endpoint = GENERATION_ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            state.metrics.count_request(endpoint, err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(request, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request, OpenAIError(exc.status_code, str(exc.detail), code=kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(request, OpenAIError(500, f"internal error: {type(exc).__name__}",
                                                   type="server_error", code="internal_error"))

    async def check_api_key(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise OpenAIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                              type="authentication_error", code="invalid_api_key")

    auth = [Depends(check_api_key)]

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            raise OpenAIError(503, "engine thread is not running", type="server_error", code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=auth)
    async def list_models():
        base = {"id": served_model_name, "object": "model", "created": state.created, "owned_by": "moeserve",
                "root": state.model_root, "parent": None, "max_model_len": state.max_model_len}
        adapters = [{"id": name, "object": "model", "created": state.created, "owned_by": "moeserve",
                     "root": name, "parent": served_model_name, "max_model_len": state.max_model_len}
                    for name in async_engine.lora_names]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        try:
            return await create_completion(state, body, request)
        except ClientGone:
            state.metrics.count_request("completions", 499)
            return Response(status_code=499)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            return await create_chat_completion(state, body, request)
        except ClientGone:
            state.metrics.count_request("chat_completions", 499)
            return Response(status_code=499)

    @app.post("/v1/load_lora_adapter", dependencies=auth)
    async def load_lora_adapter(body: LoadLoRARequest):
        name = body.lora_name
        if name == served_model_name or name in async_engine.lora_names:
            raise OpenAIError(400, f"adapter {name!r} is already loaded", param="lora_name",
                              code="adapter_exists")
        if not os.path.exists(body.lora_path):
            raise OpenAIError(404, f"adapter path {body.lora_path!r} does not exist", param="lora_path",
                              code="adapter_not_found")
        try:
            await async_engine.load_lora(name, body.lora_path, pinned=body.pinned)
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx
            raise lora_error(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=auth)
    async def unload_lora_adapter(body: UnloadLoRARequest):
        name = body.lora_name
        if name not in async_engine.lora_names:
            raise OpenAIError(404, f"adapter {name!r} is not loaded", param="lora_name",
                              code="adapter_not_found")
        try:
            await async_engine.unload_lora(name)
        except Exception as e:  # noqa: BLE001
            raise lora_error(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/metrics")
    async def metrics():
        try:
            stats = await async_engine.stats()
        except EngineDeadError:
            stats = {}
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


# ---------------------------------------------------------------------------------------------
# `moeserve serve`
# ---------------------------------------------------------------------------------------------

def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from moeserve.engine_args import add_engine_args

    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model folder's name)")
    g.add_argument("--api-key", default=os.environ.get("MOESERVE_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1 endpoints (default: $MOESERVE_API_KEY)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level (default: %(default)s)")
    add_engine_args(parser)
    return parser


def serve_main(args: argparse.Namespace) -> int:
    import uvicorn

    from moeserve.engine_args import engine_config_from_args
    from moeserve.runtime.engine import Engine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = Engine(engine_config_from_args(args), progress=True)
    name = args.served_model_name or Path(engine.config.model).name
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, name, api_key=args.api_key)
    adapters = ", ".join(async_engine.lora_names) or "none"
    print(f"moeserve: serving model {name!r} (adapters: {adapters}) at http://{args.host}:{args.port}/v1",
          flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.shutdown()
    return 0
