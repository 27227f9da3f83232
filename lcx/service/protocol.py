"""The OpenAI request bodies ``lcx serve`` accepts, and its error bodies.

Requests are validated here, at parsing, into one ``ApiError`` naming the field, the value and what is allowed,
answered as OpenAI answers: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status. Fields OpenAI
defines that lcx does not implement (``logprobs``, ``n`` > 1, penalties, tools, ...) are refused by name when they ask
for something, never silently ignored; unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4  # stop strings per request (OpenAI's limit)


class ApiError(Exception):
    """An error answered with ``status`` and OpenAI's error body; ``param``: the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints share: the model, sampling, stopping and streaming."""

    model_config = ConfigDict(extra="ignore", strict=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # an extension (vLLM's): -1 or None for no top-k
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    logprobs: Any = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"at most {MAX_STOP} non-empty stop strings")
        return stops

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value not in (None, False, 0):
            raise ValueError("logprobs are not supported by lcx serve; leave it unset")
        return None

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is one text or one list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = Field(default=False)
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"one prompt per request (got {len(value)}); send them as separate requests")
            value = value[0]
        if isinstance(value, (str, list)) and len(value) == 0:
            raise ValueError("must not be empty")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise ValueError("echo is not supported by lcx serve; leave it false")
        return value


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: text only
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[].content part of type {part.get('type')!r} is not supported: "
                                   "lcx serve takes text parts only", "messages")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def validation_error(errors: list[dict]) -> ApiError:
    """One ``ApiError`` (400) from pydantic's / FastAPI's validation errors: the first, naming its field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('msg')}", None)
    field = loc[0] if loc else None  # the request's field (a union's branch names are pydantic's, not the user's)
    value = first.get("input")
    shown = "" if first.get("type") == "missing" else f"={value!r:.80}"
    message = f"{field or 'body'}{shown} is invalid: {first.get('msg')}"
    return ApiError(400, message, field)


__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Message", "validation_error"]
