"""``lcx serve``: an OpenAI-compatible HTTP service over the serving loop (``lcx.engine.server``).

``config`` (``ServeConfig``: the options - each ``lcx serve`` flag declared once - and ``resolve``, the one
``ServeSetup`` they describe), ``compose`` (``build_service``: the composition root), ``protocol`` (request bodies,
OpenAI error bodies), ``serving`` (request -> prompt -> generation -> body / server-sent events), ``engine`` (the
thread that owns the ``Server``), ``idempotency`` (``Idempotency-Key``), ``metrics`` (Prometheus), ``app`` (the
FastAPI routes), ``run`` (uvicorn, draining on SIGTERM). FastAPI, uvicorn and prometheus_client load only here.
"""

from lcx.service.config import ServeConfig

__all__ = ["ServeConfig"]
