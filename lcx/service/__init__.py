"""``lcx serve``: an OpenAI-compatible HTTP service over the serving loop (``lcx.engine.server``).

``config`` (``ServeConfig``: the options), ``protocol`` (request bodies, OpenAI error bodies), ``engine`` (the thread
that owns the ``Server``), ``idempotency`` (``Idempotency-Key``), ``metrics`` (Prometheus), ``app`` (the FastAPI
routes), ``run`` (uvicorn, draining on SIGTERM). FastAPI, uvicorn and prometheus_client load only here.
"""

from lcx.service.config import ServeConfig

__all__ = ["ServeConfig"]
