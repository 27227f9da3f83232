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
from lcx.service.protocol import ApiError, ChatRequest, CompletionRequest, validation_error

DISCONNECT_POLL = 0.05  # seconds between checks that a non-streaming client is still there


@dataclasses.dataclass
class Service:
    """What an app serves: the model (``lcx.lm.LM``), the serving loop and its engine thread, the metrics, the
    pool's plan and the idempotency keys."""

    config: ServeConfig
    lm: Any
    server: Any
    engine: Engine
    metrics: Metrics
    plan: Any
    keys: IdempotencyKeys

    def close(self) -> None:
        self.engine.close()


def build_service(config: ServeConfig, lm=None) -> Service:
    """Load the model (or take ``lm``), size the pool (``lcx.plan.serving``), start the engine thread."""
    import lcx
    from lcx.engine.kv_store import PageStore
    from lcx.engine.server import Server
    from lcx.kernels.names import LOWBIT_DTYPES
    from lcx.parallel.device_memory import free_bytes
    from lcx.plan.inference import weight_bytes
    from lcx.plan.serving import serve_plan

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
    if not cache.make_policy().evicts and not lowbit:
        store = PageStore(store_namespace(lm.params, cache, lm.config), page=cache.page_size,
                          host_bytes=config.host_store_bytes, directory=config.kv_store,
                          disk_bytes=config.kv_store_bytes)
    elif config.kv_store is not None:
        raise ConfigError(f"--kv-store with --cache-policy={cache.policy!r}: stored pages are a full cache's; "
                          "an evicting policy's compressed state is not stored yet (allowed: --cache-policy full)")
    server = Server(lm.config, lm.params, max_num_seqs=config.max_num_seqs, max_len=config.max_model_len,
                    pages=plan.pages, cache=cache, eos_id=lm.eos_id, segment=config.segment,
                    prefill_chunk=config.prefill_chunk, prefix_entries=config.prefix_entries, store=store)
    metrics = Metrics(page_bytes=plan.page_bytes, pages_total=plan.pages)
    engine = Engine(server, lm.tokenizer, metrics, eos_id=lm.eos_id)
    return Service(config=config, lm=lm, server=server, engine=engine, metrics=metrics, plan=plan,
                   keys=IdempotencyKeys(config.idempotency_ttl))


# --------------------------------------------------------------------------------------------------- prompts
def encode_completion(service: Service, prompt) -> list[int]:
    from lcx.lm import encode_prompt

    if isinstance(prompt, str):
        return encode_prompt(service.lm.tokenizer, service.lm.config, prompt)
    vocab = service.lm.config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"prompt token id {bad[0]} is invalid: ids must lie in [0, {vocab})", "prompt")
    return list(prompt)


def encode_chat(service: Service, messages) -> list[int]:
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
                           eos_token=_token_text(tok, tok.eos_id) or "", add_generation_prompt=True)
    except TemplateError as err:
        raise ApiError(400, f"messages cannot be rendered by the model's chat template: {err}", "messages") from err
    head = []
    if bos and text.startswith(bos):
        head, text = [tok.bos_id], text[len(bos):]
    return head + tok.encode(text, bos=False)


def _generation(service: Service, request, prompt: list[int], kind: str, limit: int | None) -> Generation:
    """Check ``request`` against the model and the budget (4xx naming the field) and make its ``Generation``."""
    config = service.config
    if request.model not in (config.name, config.model):
        raise ApiError(404, f"model={request.model!r} does not exist: this server serves {config.name!r}", "model",
                       code="model_not_found")
    what = "messages" if kind == "chat" else "prompt"
    if not prompt:
        raise ApiError(400, f"{what} encodes to no tokens: send some text", what)
    if len(prompt) >= config.max_model_len:
        raise ApiError(400, f"{what} of {len(prompt)} tokens is too long: --max-model-len is {config.max_model_len} "
                       "tokens (prompt + new tokens)", what, code="context_length_exceeded")
    room = config.max_model_len - len(prompt)
    if limit is None:
        limit = min(room, config.default_max_tokens)
    elif limit > room:
        raise ApiError(400, f"max_tokens={limit} is too large: the prompt has {len(prompt)} tokens and "
                       f"--max-model-len is {config.max_model_len}, so at most {room} new tokens",
                       "max_tokens", code="context_length_exceeded")
    try:
        service.server.check(len(prompt), limit)
        top_k = None if request.top_k in (None, -1, 0) else request.top_k
        sampling = SamplingConfig(temperature=float(request.temperature), top_k=top_k,
                                  top_p=None if request.top_p >= 1 else float(request.top_p))
    except CacheCapacityError as err:
        raise ApiError(400, str(err), what, code="kv_budget_exceeded") from err
    except ConfigError as err:
        raise ApiError(400, str(err), None) from err
    return Generation(kind=kind, prompt=prompt, max_tokens=limit, sampling=sampling, seed=request.seed,
                      stops=request.stops, loop=asyncio.get_running_loop())


# --------------------------------------------------------------------------------------------------- responses
def _choice(gen: Generation, text: str, finish: str | None, delta: bool, first: bool = False) -> dict:
    if gen.kind == "completion":
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    if delta:
        body = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
        return {"index": 0, "delta": body, "finish_reason": finish, "logprobs": None}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
            "logprobs": None}


def _object(gen: Generation, chunk: bool) -> str:
    if gen.kind == "completion":
        return "text_completion"
    return "chat.completion.chunk" if chunk else "chat.completion"


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "abort"


async def _await_done(service: Service, gen: Generation, request: Request) -> None:
    """Wait for ``gen`` to finish; cancel it if the client goes away meanwhile (and nobody else waits for it)."""
    queue = gen.subscribe()
    try:
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return  # (finally) cancelled: nobody will read the answer
                continue
            if event[0] == "done":
                return
    finally:
        gen.unsubscribe(queue)
        if not gen.finished and not gen.subscribers:
            service.engine.cancel(gen)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _stream(service: Service, gen: Generation, request, include_usage: bool):
    queue = gen.subscribe()
    head = {"id": gen.id, "object": _object(gen, True), "created": gen.created, "model": service.config.name}
    try:
        first = True
        if gen.kind == "chat":
            yield _sse(head | {"choices": [_choice(gen, "", None, True, first=True)]})
            first = False
        while True:
            event = await queue.get()
            if event[0] == "text":
                yield _sse(head | {"choices": [_choice(gen, event[1], None, True, first)]})
                first = False
                continue
            if event[1] == "error":
                yield _sse({"error": {"message": "the serving loop failed on this request", "type": "server_error",
                                      "param": None, "code": None}})
            else:
                yield _sse(head | {"choices": [_choice(gen, "", _finish_reason(event[1]), True)]})
                if include_usage:
                    yield _sse(head | {"choices": [], "usage": gen.usage()})
            yield _sse("[DONE]")
            return
    finally:  # also when the client went away (the response task is cancelled)
        gen.unsubscribe(queue)
        if not gen.finished and not gen.subscribers:
            service.engine.cancel(gen)


async def _respond(service: Service, request: Request, body: dict, parsed, prompt: list[int], kind: str,
                   limit: int | None):
    key = request.headers.get("idempotency-key")
    digest = IdempotencyKeys.digest(request.url.path, body)
    gen = service.keys.get(key, digest) if key is not None else None
    if gen is None:
        gen = _generation(service, parsed, prompt, kind, limit)
        if key is not None:
            service.keys.put(key, digest, gen)
        service.engine.submit(gen)
    if parsed.stream:
        include = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return StreamingResponse(_stream(service, gen, request, include), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    await _await_done(service, gen, request)
    if gen.finish_reason == "error":
        raise ApiError(500, "the serving loop failed on this request", None, type="server_error")
    return {"id": gen.id, "object": _object(gen, False), "created": gen.created, "model": service.config.name,
            "choices": [_choice(gen, gen.text, _finish_reason(gen.finish_reason), False)], "usage": gen.usage()}


async def _body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}", None) from err
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}", None)
    return body


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise validation_error(err.errors()) from err


# --------------------------------------------------------------------------------------------------- the app
class _Gate:
    """The API key and the drain, as a plain ASGI middleware (Starlette's ``BaseHTTPMiddleware`` wraps ``receive``
    so that handlers no longer see a client's disconnect)."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            error = self._refusal(scope)
            if error is not None:
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> ApiError | None:
        key = self.service.config.api_key
        headers = dict(scope.get("headers") or [])
        if key is not None and headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {key}":
            return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                            code="invalid_api_key")
        if scope["method"] == "POST" and self.service.engine.draining:
            return ApiError(503, "the server is shutting down: it finishes the running requests and takes no new "
                            "ones", None, type="service_unavailable")
        return None


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="lcx serve", docs_url=None, redoc_url=None)
    app.state.service = service

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
        body = await _body(request)
        parsed = _parse(CompletionRequest, body)
        prompt = encode_completion(service, parsed.prompt)
        return await _respond(service, request, body, parsed, prompt, "completion", parsed.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request)
        parsed = _parse(ChatRequest, body)
        prompt = encode_chat(service, parsed.messages)
        return await _respond(service, request, body, parsed, prompt, "chat", parsed.limit)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.config.name, "object": "model", "created": 0,
                                            "owned_by": "lcx", "max_model_len": service.config.max_model_len}]}

    @app.get("/health")
    async def health():
        engine = service.engine
        if engine.failed or engine.draining:
            return JSONResponse({"status": "draining" if engine.draining else "failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


__all__ = ["Service", "build_service", "create_app", "encode_chat", "encode_completion"]
