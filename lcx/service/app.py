"""The OpenAI-compatible HTTP API of ``lcx serve`` (FastAPI): its routes - ``POST /v1/completions``,
``POST /v1/chat/completions``, ``/tokenize``, ``/detokenize``, ``GET /tokenizer_info``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` - the body limit and checks, the API key and the drain.

    service = build_service(ServeConfig(model="runs/models/SmolLM2-135M-Instruct"))   # lcx.service.compose
    app = create_app(service)          # uvicorn.run(app) - what `lcx serve` does, draining on SIGTERM

Every bad request is a 4xx with OpenAI's error body naming the field (``lcx.service.protocol``); what a request
becomes and how it is answered is ``lcx.service.serving``.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lcx.service.compose import Service, build_service
from lcx.service.protocol import (MAX_PROMPTS, ApiError, ChatRequest, CompletionRequest, DetokenizeRequest,
                                  TokenizeRequest, validation_error)
from lcx.service.serving import check_model, checked_ids, encode_chat, encode_completion, respond

MAX_DEPTH = 32  # nesting levels of a request body (OpenAI's bodies need 5)
PUBLIC = ("/health", "/metrics")  # paths served without the API key


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
        check_model(service, parsed.model)
        texts = parsed.prompts
        if len(texts) > MAX_PROMPTS:
            raise ApiError(400, f"prompt holds {len(texts)} prompts: at most {MAX_PROMPTS} per request", "prompt")
        prompts = await _encode(lambda: [encode_completion(service, p) for p in texts])
        shown = [t if isinstance(t, str) else tok.decode(t) for t in texts] if parsed.echo else [""] * len(texts)
        return await respond(service, request, body, parsed, prompts, "completion", shown)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request, limit)
        parsed = _parse(ChatRequest, body)
        check_model(service, parsed.model)
        prompt = await _encode(encode_chat, service, parsed.messages)
        return await respond(service, request, body, parsed, [prompt], "chat", [""])

    @app.post("/tokenize")
    async def tokenize(request: Request):
        parsed = _parse(TokenizeRequest, await _body(request, limit))
        check_model(service, parsed.model, required=False)
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
        check_model(service, parsed.model, required=False)
        ids = checked_ids(service, parsed.tokens, "tokens")
        return {"prompt": await _encode(tok.decode, ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        from lcx.lm import special_tokens

        text = special_tokens(tok)
        return {"tokenizer_class": type(tok).__name__, "bos_token": text["bos"], "eos_token": text["eos"],
                "pad_token": text["pad"],
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


# build_service, Service and the prompt encoders are importable from here as before
__all__ = ["Service", "build_service", "check_json", "create_app", "encode_chat", "encode_completion"]
