"""How engine and request errors become HTTP errors in the OpenAI shape."""
from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError

from moeserve.lora.adapter import LoRAAdapterError
from moeserve.runtime.core_client import (AdapterInUseError, EngineDeadError, EngineStepError, QueueFullError,
                                          UnknownAdapterError)
from moeserve.server.protocol import OpenAIError

logger = logging.getLogger("moeserve")

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop", "stop_token_ids")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


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
    if not isinstance(e, EngineStepError):  # already logged by the engine core
        logger.error("internal error", exc_info=e)
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error",
                       code="internal_error")


def lora_error(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, FileNotFoundError):
        return OpenAIError(404, str(e), param="lora_path", code="adapter_not_found")
    if isinstance(e, UnknownAdapterError):
        return OpenAIError(404, str(e), param="lora_name", code="adapter_not_found")
    if isinstance(e, AdapterInUseError):
        return OpenAIError(409, str(e), param="lora_name", code="adapter_in_use")
    if isinstance(e, (ValueError, OSError)):
        return OpenAIError(400, str(e), param="lora_path", code="invalid_adapter")
    return engine_error(e, "lora_path")


def validation_error(exc: RequestValidationError) -> OpenAIError:
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
