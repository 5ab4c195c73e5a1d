"""Request bodies of the OpenAI-compatible API (pydantic v2) and the OpenAI error shape.

Models are strict (no "5" -> 5, no true -> 1): a wrong type is a 400 naming the parameter,
never a silent reinterpretation. Unknown fields are ignored, as OpenAI clients send extras.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Size limits checked while parsing, before anything is tokenized: each bounds work done per request or per step
MAX_N = 128  # choices per request
MAX_STOP = 64  # stop strings, each searched for in every step's new text
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096  # chat messages rendered by the template
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _GenerationRequest(_Request):
    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM): -1 = off
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None  # extension
    ignore_eos: bool = False  # extension
    skip_special_tokens: bool = True  # extension
    include_stop_str_in_output: bool = False  # extension (vLLM)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted for compatibility; only their neutral values are supported (checked in unsupported())
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters")
        return v

    def unsupported(self) -> OpenAIError | None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return OpenAIError(400, f"{name} is not supported (only 0)", param=name)
        if self.logit_bias:
            return OpenAIError(400, "logit_bias is not supported", param="logit_bias")
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> OpenAIError | None:
        if self.best_of is not None and self.best_of != self.n:
            return OpenAIError(400, "best_of is not supported (give n instead)", param="best_of")
        if self.suffix:
            return OpenAIError(400, "suffix is not supported", param="suffix")
        return super().unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None
    response_format: dict | None = None

    def unsupported(self) -> OpenAIError | None:
        if self.top_logprobs is not None and not self.logprobs:
            return OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.tools:
            return OpenAIError(400, "tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            return OpenAIError(400, "only response_format type 'text' is supported", param="response_format")
        return super().unsupported()

    def template_messages(self) -> list[dict]:
        """Messages as the chat template wants them: role + plain-text content."""
        out = []
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise OpenAIError(400, f"messages[{i}]: only text content parts are supported, "
                                               f"got type {part.type!r}", param=f"messages.{i}.content")
                    texts.append(part.text)
                content = "".join(texts)
            else:
                content = m.content or ""
            out.append({"role": m.role, "content": content})
        return out


class LoadLoRARequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_path: str | None = Field(None, min_length=1)  # may be left out when the server has a --lora-dir
    pinned: bool = False
    load_inplace: bool = False  # vLLM's field: reload a loaded name as a new version (weight sync)


class UnloadLoRARequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM sends it; unused
