"""The OpenAI-compatible HTTP API of ``lcx serve`` (FastAPI): ``POST /v1/completions``, ``POST /v1/chat/completions``
(streamed as server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``, or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics``.

    service = build_service(ServeConfig(model="runs/models/SmolLM2-135M-Instruct"))
    app = create_app(service)          # uvicorn.run(app) - what `lcx serve` does, draining on SIGTERM

Every bad request is a 4xx with OpenAI's error body naming the field (``lcx.service.protocol``); a request that can
never fit the KV budget is a 400 naming its tokens, the bytes it needs, the budget and a policy that would serve it.
A client that goes away (streaming or not) cancels its request: its pages return before the next decode segment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lcx.cache.base import CacheCapacityError
from lcx.config_base import ConfigError
from lcx.engine.sampling import SamplingConfig
from lcx.service.config import ServeConfig, store_namespace
from lcx.service.engine import Engine, Generation
from lcx.service.idempotency import IdempotencyKeys
from lcx.service.metrics import Metrics
from lcx.service.logprobs import chat_logprobs, completion_logprobs
from lcx.service.protocol import (MAX_PROMPTS, ApiError, ChatRequest, CompletionRequest, DetokenizeRequest,
                                  TokenizeRequest, validation_error)

DISCONNECT_POLL = 0.05  # seconds between checks that a non-streaming client is still there
MAX_DEPTH = 32  # nesting levels of a request body (OpenAI's bodies need 5)
PUBLIC = ("/health", "/metrics")  # paths served without the API key


@dataclasses.dataclass
class Service:
    """What an app serves: the model (``lcx.lm.LM``), the serving loop and its engine thread, the metrics, the
    pool's plan, the idempotency keys and what the warm-up ran (``lcx.service.warmup.WarmupReport``, or None)."""

    config: ServeConfig
    lm: Any
    server: Any
    engine: Engine
    metrics: Metrics
    plan: Any
    keys: IdempotencyKeys
    warmup: Any = None

    def close(self) -> None:
        self.engine.close()


def build_service(config: ServeConfig, lm=None) -> Service:
    """Load the model (or take ``lm``), size the pool (``lcx.plan.serving``), start the engine thread."""
    import lcx
    from lcx.engine.kv_store import PageStore
    from lcx.engine.scoring import Scorer
    from lcx.engine.server import Server
    from lcx.kernels.names import LOWBIT_DTYPES
    from lcx.parallel.device_memory import free_bytes
    from lcx.plan.inference import weight_bytes
    from lcx.plan.serving import serve_plan
    from lcx.service.warmup import chat_head, parse_warmup, warm_up

    cache = config.cache()
    lm = lm or lcx.load(config.model, dtype=config.dtype)
    plan = serve_plan(lm.config, cache, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                      kv_memory=config.kv_memory, free_bytes=free_bytes(),
                      utilization=config.gpu_memory_utilization if config.gpu_memory_utilization else None,
                      weight_bytes=weight_bytes(lm.config, lm.config.param_dtype))
    store = None
    lowbit = cache.kv_dtype in LOWBIT_DTYPES
    if lowbit and config.kv_store is not None:
        raise ConfigError(f"--kv-store with --kv-dtype {cache.kv_dtype}: a bit-packed cache keeps each request's "
                          "most recent tokens in a float window beside its pages, so pages alone are not a prefix "
                          "(allowed: --kv-dtype int8, fp8 or none with --kv-store)")
    policy = cache.make_policy()
    if policy.observes.reconstructs and config.kv_store is not None:
        raise ConfigError(f"--kv-store with --cache-policy={cache.policy!r}: its reconstruction passes score a fresh "
                          "prompt, not a stored compressed state (allowed: --cache-policy full or a policy without "
                          "reconstruction, e.g. snapkv)")
    # pages (full: the same keys and values whoever computed them) or, asked for, compressed states (a session's
    # state gives its next turn other tokens than a fresh compression: only with --kv-store)
    if not lowbit and (not policy.evicts or (config.kv_store is not None and not policy.observes.reconstructs)):
        store = PageStore(store_namespace(lm.params, cache, lm.config), page=cache.page_size,
                          host_bytes=config.host_store_bytes, directory=config.kv_store,
                          disk_bytes=config.kv_store_bytes)
    reconstruction = repeat_prompt(lm) if policy.observes.reconstructs else None
    server = Server(lm.config, lm.params, max_num_seqs=config.max_num_seqs, max_len=config.max_model_len,
                    pages=plan.pages, cache=cache, eos_id=lm.eos_id, segment=config.segment,
                    prefill_chunk=config.prefill_chunk, prefix_entries=config.prefix_entries, store=store,
                    reconstruction=reconstruction)
    # before the engine thread and the metrics exist: the dummies leave neither a trace
    warmed = (warm_up(server, parse_warmup(config.warmup), head=chat_head(lm, encode_chat)) if config.warmup
              else None)
    metrics = Metrics(page_bytes=plan.page_bytes, pages_total=plan.pages)
    scorer = Scorer(lm.config, lm.params, cache, eos_id=lm.eos_id, max_len=config.max_model_len,
                    reconstruction=reconstruction)
    engine = Engine(server, lm.tokenizer, metrics, eos_id=lm.eos_id, scorer=scorer)
    return Service(config=config, lm=lm, server=server, engine=engine, metrics=metrics, plan=plan,
                   keys=IdempotencyKeys(config.idempotency_ttl), warmup=warmed)


def repeat_prompt(lm):
    """KVzip's repeat prompt for the served model: in its chat frame when it has a chat template (chat requests are
    what a server mostly gets; a plain completion's first tokens are then skipped as a chat header would be - the
    policy's sinks keep them), else plain."""
    from lcx.data.haystack import Frame

    chat = lm.chat_template if getattr(lm.tokenizer, "chat_template", None) else None
    return Frame(lm.tokenizer, chat).reconstruction()


# --------------------------------------------------------------------------------------------------- prompts
def encode_completion(service: Service, prompt) -> list[int]:
    from lcx.lm import encode_prompt

    if isinstance(prompt, str):
        return encode_prompt(service.lm.tokenizer, service.lm.config, prompt)
    return _checked_ids(service, prompt, "prompt")


def _checked_ids(service: Service, ids, field: str) -> list[int]:
    vocab = service.lm.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"{field} token id {bad[0]} is invalid: ids must lie in [0, {vocab})", field)
    return list(ids)


def encode_chat(service: Service, messages, add_generation_prompt: bool = True) -> list[int]:
    """The conversation rendered with the model's chat template (transformers' rendering), reply opened; the
    template's BOS text becomes the BOS id."""
    from jinja2.exceptions import TemplateError

    from lcx.data.haystack import _token_text, render_chat

    tok = service.lm.tokenizer
    template = getattr(tok, "chat_template", None)
    if not template:
        raise ApiError(400, f"model {service.config.name!r} has no chat template: use /v1/completions", "messages")
    bos = _token_text(tok, tok.bos_id) or ""
    try:
        text = render_chat(template, [{"role": m.role, "content": m.text()} for m in messages], bos_token=bos,
                           eos_token=_token_text(tok, tok.eos_id) or "", add_generation_prompt=add_generation_prompt)
    except TemplateError as err:
        raise ApiError(400, f"messages cannot be rendered by the model's chat template: {err}", "messages") from err
    head = []
    if bos and text.startswith(bos):
        head, text = [tok.bos_id], text[len(bos):]
    return head + tok.encode(text, bos=False)


def _check_model(service: Service, model: str | None, required: bool = True) -> None:
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
                      top=request.top, echo=echo, prompt_text=prompt_text if echo else "", index=index)


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


async def _await_done(service: Service, gens: list[Generation], request: Request) -> bool:
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


async def _respond(service: Service, request: Request, body: dict, parsed, prompts: list[list[int]], kind: str,
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
    if not await _await_done(service, gens, request):
        return Response(status_code=499)  # nobody reads it: the client has gone
    if any(g.finish_reason == "error" for g in gens):
        raise ApiError(500, "the serving loop failed on this request", None, type="server_error")
    first = gens[0]
    choices = [_choice(g, (g.prompt_text if g.echo else "") + g.text, _finish_reason(g.finish_reason), False,
                       logprobs=_logprobs(service, g)) for g in gens]
    return {"id": first.id, "object": _object(first, False), "created": first.created,
            "model": service.config.name, "choices": choices, "usage": _usage(gens)}


# --------------------------------------------------------------------------------------------------- bodies
async def _body(request: Request, limit: int) -> dict:
    """The request's JSON object, read up to ``limit`` bytes (413 past it) and checked for what would fail later
    (``check_json``)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body of {int(declared):,} bytes is too large: --max-body-bytes is "
                       f"{limit:,}", None, code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is too large: --max-body-bytes is {limit:,}", None,
                           code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = await asyncio.to_thread(json.loads, raw) if size > (1 << 20) else json.loads(raw)
    except RecursionError as err:
        raise ApiError(400, f"the request body is nested too deeply: at most {MAX_DEPTH} levels", None) from err
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, and a number of over 4,300 digits
        raise ApiError(400, f"the request body is not valid JSON: {str(err):.200}", None) from err
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}", None)
    check_json(body)
    return body


def check_json(body: dict) -> None:
    """Refuse (400, naming the field) what JSON allows but nothing downstream can take: nesting deeper than
    ``MAX_DEPTH`` and strings with unpaired surrogates (``"\\ud800"``: not Unicode text, no tokenizer takes it)."""
    stack = [(body, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"{field or 'body'} is nested too deeply: at most {MAX_DEPTH} levels", field)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ApiError(400, f"{field or 'body'} holds an unpaired surrogate at character {err.start}: "
                               "strings must be valid Unicode", field) from err
        elif isinstance(value, dict):
            stack.extend((v, depth + 1, field or k) for k, v in value.items())
            stack.extend((k, depth + 1, field or k) for k in value)
        elif isinstance(value, list):
            stack.extend((v, depth + 1, field) for v in value)


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise validation_error(err.errors()) from err


async def _encode(fn, *args):
    """Tokenize on a worker thread: a long prompt never blocks the event loop (every client)."""
    return await asyncio.to_thread(fn, *args)


# --------------------------------------------------------------------------------------------------- the app
class _Gate:
    """The API key and the drain, as a plain ASGI middleware (Starlette's ``BaseHTTPMiddleware`` wraps ``receive``
    so that handlers no longer see a client's disconnect)."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> ApiError | None:
        key = self.service.config.api_key
        if key is not None and scope["path"] not in PUBLIC:  # every other path, /openapi.json included
            header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or given.strip() != key:  # the scheme is case-insensitive (RFC 7235)
                return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                                code="invalid_api_key")
        if scope["method"] == "POST" and self.service.engine.draining:
            return ApiError(503, "the server is shutting down: it finishes the running requests and takes no new "
                            "ones", None, type="service_unavailable")
        return None


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="lcx serve", docs_url=None, redoc_url=None)
    app.state.service = service
    limit = service.config.max_body_bytes
    tok = service.lm.tokenizer

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        error = validation_error(list(err.errors()))
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        error = ApiError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", None)
        return JSONResponse(error.body(), status_code=err.status_code)

    app.add_middleware(_Gate, service=service)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request, limit)
        parsed = _parse(CompletionRequest, body)
        _check_model(service, parsed.model)
        texts = parsed.prompts
        if len(texts) > MAX_PROMPTS:
            raise ApiError(400, f"prompt holds {len(texts)} prompts: at most {MAX_PROMPTS} per request", "prompt")
        prompts = await _encode(lambda: [encode_completion(service, p) for p in texts])
        shown = [t if isinstance(t, str) else tok.decode(t) for t in texts] if parsed.echo else [""] * len(texts)
        return await _respond(service, request, body, parsed, prompts, "completion", shown)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request, limit)
        parsed = _parse(ChatRequest, body)
        _check_model(service, parsed.model)
        prompt = await _encode(encode_chat, service, parsed.messages)
        return await _respond(service, request, body, parsed, [prompt], "chat", [""])

    @app.post("/tokenize")
    async def tokenize(request: Request):
        parsed = _parse(TokenizeRequest, await _body(request, limit))
        _check_model(service, parsed.model, required=False)
        if parsed.messages is not None:
            ids = await _encode(encode_chat, service, parsed.messages, parsed.add_generation_prompt)
        elif parsed.add_special_tokens:
            ids = await _encode(encode_completion, service, parsed.prompt)
        else:
            ids = await _encode(lambda: list(tok.encode(parsed.prompt, bos=False)))
        return {"count": len(ids), "max_model_len": service.config.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        parsed = _parse(DetokenizeRequest, await _body(request, limit))
        _check_model(service, parsed.model, required=False)
        ids = _checked_ids(service, parsed.tokens, "tokens")
        return {"prompt": await _encode(tok.decode, ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        from lcx.data.haystack import _token_text

        return {"tokenizer_class": type(tok).__name__, "bos_token": _token_text(tok, tok.bos_id),
                "eos_token": _token_text(tok, tok.eos_id), "pad_token": _token_text(tok, tok.pad_id),
                "add_bos_token": bool(getattr(tok, "adds_bos", False)),
                "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": service.config.max_model_len, "vocab_size": service.lm.config.vocab_size}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.config.name, "object": "model", "created": 0,
                                            "owned_by": "lcx", "max_model_len": service.config.max_model_len}]}

    @app.get("/health")
    async def health():
        engine = service.engine
        if engine.failed or engine.draining:
            return JSONResponse({"status": "draining" if engine.draining else "failed", "error": engine.failed},
                                status_code=503)
        disk = getattr(service.server.store, "disk_error", None)
        if disk:  # serving goes on from host memory: degraded, not down
            return {"status": "ok", "kv_store": "degraded", "kv_store_error": disk}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


__all__ = ["Service", "build_service", "check_json", "create_app", "encode_chat", "encode_completion"]
