"""The OpenAI request bodies ``lcx serve`` accepts, and its error bodies.

Requests are validated here, at parsing, into one ``ApiError`` naming the field, the value and what is allowed,
answered as OpenAI answers: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status. Fields OpenAI
defines that lcx does not implement (``UNSUPPORTED``: ``n`` > 1, penalties, tools, ``logit_bias``, ...) are refused by
name when they ask for something, never silently ignored; unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lcx.engine.scheduler import MAX_SALT

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters per stop string: each is searched at every token
MAX_PROMPTS = 64  # prompts of one /v1/completions request (each a choice)
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's limit)
INT64 = 2 ** 63

# Fields OpenAI (or vLLM) defines that lcx serve does not implement: refused by name unless they ask for nothing
# (their neutral value), never silently ignored. field -> (is it neutral?, what to send instead)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "n": (lambda v: v in (None, 1), "one choice per prompt: leave n unset or 1"),
    "best_of": (lambda v: v in (None, 1), "leave best_of unset or 1"),
    "presence_penalty": (lambda v: v in (None, 0), "no penalties: leave it unset or 0"),
    "frequency_penalty": (lambda v: v in (None, 0), "no penalties: leave it unset or 0"),
    "repetition_penalty": (lambda v: v in (None, 1), "no penalties: leave it unset or 1"),
    "logit_bias": (lambda v: not v, "leave logit_bias unset or empty"),
    "tools": (lambda v: not v, "no tool calls: leave tools unset or empty"),
    "tool_choice": (lambda v: v in (None, "none"), "no tool calls: leave tool_choice unset or 'none'"),
    "functions": (lambda v: not v, "no function calls: leave functions unset"),
    "function_call": (lambda v: v in (None, "none"), "no function calls: leave function_call unset"),
    "response_format": (lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
                        "no structured output: leave response_format unset or {'type': 'text'}"),
    "suffix": (lambda v: not v, "no insertion: leave suffix unset"),
    "min_p": (lambda v: v in (None, 0), "leave min_p unset or 0"),
    "min_tokens": (lambda v: v in (None, 0), "leave min_tokens unset or 0"),
    "stop_token_ids": (lambda v: not v, "use stop strings, or leave stop_token_ids unset"),
    "prompt_logprobs": (lambda v: v is None, "use echo with logprobs for the prompt's log-probabilities"),
    "include_stop_str_in_output": (lambda v: not v, "the text ends before the stop string: leave it unset"),
    "guided_json": (lambda v: v is None, "no structured output: leave it unset"),
    "guided_regex": (lambda v: v is None, "no structured output: leave it unset"),
    "guided_choice": (lambda v: v is None, "no structured output: leave it unset"),
    "guided_grammar": (lambda v: v is None, "no structured output: leave it unset"),
    "structured_outputs": (lambda v: v is None, "no structured output: leave it unset"),
    "audio": (lambda v: v is None, "text only: leave audio unset"),
    "modalities": (lambda v: v in (None, ["text"]), "text only: leave modalities unset or ['text']"),
    "prediction": (lambda v: v is None, "no predicted outputs: leave prediction unset"),
}


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
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # an extension (vLLM's): -1 or None for no top-k
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension (vLLM's): generate the limit's tokens, EOS or not
    user: str | None = None
    # an extension (vLLM's): a tenant's salt - its prompt pages are shared only with requests of the same salt
    cache_salt: str | None = Field(default=None, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, body):
        if isinstance(body, dict):
            for field, (neutral, instead) in UNSUPPORTED.items():
                if field in body and not neutral(body[field]):
                    raise ApiError(400, f"{field}={body[field]!r:.80} is not supported by lcx serve: {instead}",
                                   field)
        return body

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOP} non-empty stop strings of at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, value):
        if value is not None and not 0 < len(value) <= MAX_SALT:
            raise ValueError(f"must be a non-empty string of at most {MAX_SALT} characters (or left unset: the "
                             "pages every unsalted request shares)")
        return value

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def limit(self) -> int | None:
        """The most new tokens asked for (``max_completion_tokens``, OpenAI's newer name, over ``max_tokens``)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top(self) -> int | None:
        """Alternatives per generated token to report (None: no log-probabilities)."""
        return None


Prompt = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a text, token ids, or a list of either (a choice per prompt).
    ``echo``: the prompt's text (and with ``logprobs``, its tokens' log-probabilities, the first null) before the
    answer's; ``max_tokens`` 0 with ``echo`` scores the prompt only. ``logprobs`` 0 - 20: the sampled token's
    log-probability and that many alternatives per token."""

    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions; 0 with echo: score only
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _no_top_logprobs(cls, body):
        if isinstance(body, dict) and body.get("top_logprobs") is not None:
            raise ApiError(400, "top_logprobs is a chat field: on /v1/completions send logprobs=N (0 - "
                           f"{MAX_LOGPROBS}), the alternatives per token", "top_logprobs")
        return body

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        if isinstance(value, (str, list)) and len(value) == 0:
            raise ValueError("must not be empty")
        return value

    @property
    def prompts(self) -> list:
        """One text or id list per choice."""
        value = self.prompt
        many = isinstance(value, list) and isinstance(value[0], (str, list))
        return list(value) if many else [value]

    @property
    def top(self) -> int | None:
        return self.logprobs


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: text only
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ApiError(400, f"messages[].content part of type {part.get('type')!r:.40} is not "
                                   "supported: lcx serve takes text parts only", "messages")
                if not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[].content text part has text={part.get('text')!r:.40}: it must "
                                   "be a string", "messages")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template. ``logprobs``: the
    answer's tokens with their log-probabilities; ``top_logprobs`` (0 - 20) alternatives for each."""

    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, f"top_logprobs={self.top_logprobs} needs logprobs=true", "top_logprobs")
        return self

    @property
    def top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``; ``model`` optional."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "send exactly one of prompt (a text) and messages (a chat)", "prompt")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


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


__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "DetokenizeRequest", "MAX_LOGPROBS", "MAX_PROMPTS",
           "Message", "TokenizeRequest", "UNSUPPORTED", "validation_error"]
