"""The serving logic of ``lcx serve``, between the routes (``lcx.service.app``) and the engine thread
(``lcx.service.engine``): a request's prompt (text, ids or a chat rendered by ``lcx.lm.encode_chat``), its checks
against the model and the KV budget (a 4xx naming the field), its ``Generation``, and the answer - one JSON body,
or server-sent events in OpenAI's chunk format ending with ``data: [DONE]``. A client that goes away (streaming or
not) cancels its request: its pages return before the next decode segment.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from lcx.cache.base import CacheCapacityError
from lcx.config_base import ConfigError
from lcx.engine.sampling import SamplingConfig
from lcx.service.engine import Generation
from lcx.service.idempotency import IdempotencyKeys
from lcx.service.logprobs import chat_logprobs, completion_logprobs
from lcx.service.protocol import ApiError

if TYPE_CHECKING:
    from lcx.service.compose import Service

DISCONNECT_POLL = 0.05  # seconds between checks that a non-streaming client is still there


def encode_completion(service: Service, prompt) -> list[int]:
    from lcx.lm import encode_prompt

    if isinstance(prompt, str):
        return encode_prompt(service.lm.tokenizer, service.lm.config, prompt)
    return checked_ids(service, prompt, "prompt")


def checked_ids(service: Service, ids, field: str) -> list[int]:
    vocab = service.lm.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"{field} token id {bad[0]} is invalid: ids must lie in [0, {vocab})", field)
    return list(ids)


def encode_chat(service: Service, messages, add_generation_prompt: bool = True) -> list[int]:
    """The conversation rendered with the model's chat template (``lcx.lm.encode_chat``: transformers' rendering),
    reply opened; the template's BOS text becomes the BOS id."""
    from jinja2.exceptions import TemplateError

    from lcx.lm import encode_chat as render

    tok = service.lm.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, f"model {service.config.name!r} has no chat template: use /v1/completions", "messages")
    try:
        return render(tok, [{"role": m.role, "content": m.text()} for m in messages],
                      add_generation_prompt=add_generation_prompt)
    except TemplateError as err:
        raise ApiError(400, f"messages cannot be rendered by the model's chat template: {err}", "messages") from err


def check_model(service: Service, model: str | None, required: bool = True) -> None:
    config = service.config
    if (model is None and not required) or model in (config.name, config.model):
        return
    raise ApiError(404, f"model={model!r:.80} does not exist: this server serves {config.name!r}", "model",
                   code="model_not_found")


def _generation(service: Service, request, prompt: list[int], kind: str, index: int = 0,
                prompt_text: str = "") -> Generation:
    """Check ``request`` against the model and the budget (4xx naming the field) and make its ``Generation``."""
    config = service.config
    what = "messages" if kind == "chat" else "prompt"
    echo = bool(getattr(request, "echo", False))
    limit = request.limit
    if not prompt:
        raise ApiError(400, f"{what} encodes to no tokens: send some text", what)
    if len(prompt) >= config.max_model_len:
        raise ApiError(400, f"{what} of {len(prompt)} tokens is too long: --max-model-len is {config.max_model_len} "
                       "tokens (prompt + new tokens)", what, code="context_length_exceeded")
    room = config.max_model_len - len(prompt)
    field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    if limit is None:
        limit = min(room, config.default_max_tokens)
    elif limit == 0 and not echo:
        raise ApiError(400, f"{field}=0 is invalid without echo: ask for at least 1 new token (0 with echo=true "
                       "scores the prompt only)", field)
    elif limit > room:
        raise ApiError(400, f"{field}={limit} is too large: the prompt has {len(prompt)} tokens and "
                       f"--max-model-len is {config.max_model_len}, so at most {room} new tokens",
                       field, code="context_length_exceeded")
    if request.top is not None and request.stream:
        raise ApiError(400, "logprobs with stream=true is not supported by lcx serve: send stream=false (the "
                       "log-probabilities come with the finished answer)", "logprobs")
    try:
        service.server.check(len(prompt), max(limit, 1))
        top_k = None if request.top_k in (None, -1, 0) else request.top_k
        sampling = SamplingConfig(temperature=float(request.temperature), top_k=top_k,
                                  top_p=None if request.top_p >= 1 else float(request.top_p))
    except CacheCapacityError as err:
        raise ApiError(400, str(err), what, code="kv_budget_exceeded") from err
    except ConfigError as err:
        raise ApiError(400, str(err), None) from err
    return Generation(kind=kind, prompt=prompt, max_tokens=limit, sampling=sampling, seed=request.seed,
                      stops=request.stops, loop=asyncio.get_running_loop(), ignore_eos=request.ignore_eos,
                      salt=request.cache_salt, top=request.top, echo=echo, prompt_text=prompt_text if echo else "",
                      index=index)


# --------------------------------------------------------------------------------------------------- responses
def _logprobs(service: Service, gen: Generation):
    if gen.top is None or gen.scored is None:
        return None
    if gen.kind == "chat":
        return chat_logprobs(gen, service.lm.tokenizer, gen.top)
    return completion_logprobs(gen, service.lm.tokenizer, gen.top, gen.echo)


def _choice(gen: Generation, text: str, finish: str | None, delta: bool, first: bool = False,
            logprobs=None) -> dict:
    if gen.kind == "completion":
        return {"index": gen.index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    if delta:
        body = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
        return {"index": gen.index, "delta": body, "finish_reason": finish, "logprobs": logprobs}
    return {"index": gen.index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
            "logprobs": logprobs}


def _object(gen: Generation, chunk: bool) -> str:
    if gen.kind == "completion":
        return "text_completion"
    return "chat.completion.chunk" if chunk else "chat.completion"


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "abort"


def _usage(gens: list[Generation]) -> dict[str, Any]:
    usages = [g.usage() for g in gens]
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return total | {"prompt_tokens_details": {"cached_tokens": cached}}


def _release(service: Service, gens: list[Generation], queues: list) -> None:
    """Unsubscribe; cancel what nobody waits for any more (a client went away: its pages return)."""
    for gen, queue in zip(gens, queues):
        gen.unsubscribe(queue)
        if not gen.finished and not gen.subscribers:
            service.engine.cancel(gen)


async def await_done(service: Service, gens: list[Generation], request: Request) -> bool:
    """Wait for every generation to end; False (each cancelled) if the client went away meanwhile - checked every
    ``DISCONNECT_POLL`` seconds whether tokens flow or not."""
    queues = [g.subscribe() for g in gens]
    try:
        for gen, queue in zip(gens, queues):
            while not gen.ended.is_set():
                try:
                    await asyncio.wait_for(gen.ended.wait(), DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return False
        return True
    finally:
        _release(service, gens, queues)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _stream(service: Service, gens: list[Generation], include_usage: bool):
    queues = [g.subscribe() for g in gens]
    first = gens[0]
    head = {"id": first.id, "object": _object(first, True), "created": first.created, "model": service.config.name}
    try:
        for gen, queue in zip(gens, queues):  # one choice after the other (all run at once in the engine)
            opened = gen.kind == "chat"
            if opened:
                yield _sse(head | {"choices": [_choice(gen, "", None, True, first=True)]})
            if gen.echo and gen.prompt_text:
                yield _sse(head | {"choices": [_choice(gen, gen.prompt_text, None, True)]})
            while True:
                event = await queue.get()
                if event[0] == "text":
                    yield _sse(head | {"choices": [_choice(gen, event[1], None, True, not opened)]})
                    opened = True
                    continue
                if event[1] == "error":
                    yield _sse({"error": {"message": "the serving loop failed on this request",
                                          "type": "server_error", "param": None, "code": None}})
                    yield _sse("[DONE]")
                    return
                yield _sse(head | {"choices": [_choice(gen, "", _finish_reason(event[1]), True)]})
                break
        if include_usage:
            yield _sse(head | {"choices": [], "usage": _usage(gens)})
        yield _sse("[DONE]")
    finally:  # also when the client went away (the response task is cancelled)
        _release(service, gens, queues)


async def respond(service: Service, request: Request, body: dict, parsed, prompts: list[list[int]], kind: str,
                   texts: list[str]):
    key = request.headers.get("idempotency-key")
    digest = IdempotencyKeys.digest(request.url.path, body)
    gens = service.keys.get(key, digest) if key is not None else None
    if gens is None:
        gens = [_generation(service, parsed, p, kind, i, t) for i, (p, t) in enumerate(zip(prompts, texts))]
        if key is not None:
            service.keys.put(key, digest, gens)
        for gen in gens:
            service.engine.submit(gen)
    if parsed.stream:
        include = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return StreamingResponse(_stream(service, gens, include), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    if not await await_done(service, gens, request):
        return Response(status_code=499)  # nobody reads it: the client has gone
    if any(g.finish_reason == "error" for g in gens):
        raise ApiError(500, "the serving loop failed on this request", None, type="server_error")
    first = gens[0]
    choices = [_choice(g, (g.prompt_text if g.echo else "") + g.text, _finish_reason(g.finish_reason), False,
                       logprobs=_logprobs(service, g)) for g in gens]
    return {"id": first.id, "object": _object(first, False), "created": first.created,
            "model": service.config.name, "choices": choices, "usage": _usage(gens)}


__all__ = ["DISCONNECT_POLL", "await_done", "check_model", "checked_ids", "encode_chat", "encode_completion",
           "respond"]
