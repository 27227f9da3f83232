"""The composition root of ``lcx serve``: ``build_service`` loads the model, resolves the ``ServeConfig`` once
(``ServeConfig.resolve``: the cache, its policy and kind, the pool, what a store may keep), makes the store, the
``Server``, the scorer, the metrics and the engine thread from that one value, and warms up when asked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lcx.service.config import ServeConfig, store_namespace
from lcx.service.engine import Engine
from lcx.service.idempotency import IdempotencyKeys
from lcx.service.metrics import Metrics


@dataclasses.dataclass
class Service:
    """What an app serves: the model (``lcx.lm.LM``), the serving loop and its engine thread, the metrics, the
    pool's plan, the idempotency keys and what the warm-up ran (``lcx.service.warmup.WarmupReport``, or None).
    ``setup``: the resolved configuration (``lcx.engine.setup.ServeSetup``) everything was built from."""

    config: ServeConfig
    lm: Any
    server: Any
    engine: Engine
    metrics: Metrics
    plan: Any
    keys: IdempotencyKeys
    warmup: Any = None
    setup: Any = None

    def close(self) -> None:
        self.engine.close()


def build_service(config: ServeConfig, lm=None) -> Service:
    """Load the model (or take ``lm``), resolve the configuration (the pool sized by ``lcx.plan.serving``), start
    the engine thread."""
    import lcx
    from lcx.engine.kv_store import PageStore
    from lcx.engine.scoring import Scorer
    from lcx.engine.server import Server
    from lcx.parallel.device_memory import free_bytes
    from lcx.plan.inference import weight_bytes
    from lcx.service.warmup import chat_head, parse_warmup, warm_up

    lm = lm or lcx.load(config.model, dtype=config.dtype)
    setup = config.resolve(lm.config, reconstruction=lambda: repeat_prompt(lm), free_bytes=free_bytes(),
                           weight_bytes=weight_bytes(lm.config, lm.config.param_dtype))
    # pages (full: the same keys and values whoever computed them) or, asked for, compressed states (a session's
    # state gives its next turn other tokens than a fresh compression: only with --kv-store)
    store = None
    if setup.make_store:
        store = PageStore(store_namespace(lm.params, setup.settings, lm.config), page=setup.page,
                          host_bytes=config.host_store_bytes, directory=config.kv_store,
                          disk_bytes=config.kv_store_bytes)
    server = Server(lm.config, lm.params, eos_id=lm.eos_id, store=store, setup=setup)
    # before the engine thread and the metrics exist: the dummies leave neither a trace
    warmed = warm_up(server, parse_warmup(config.warmup), head=chat_head(lm)) if config.warmup else None
    metrics = Metrics(page_bytes=setup.plan.page_bytes, pages_total=setup.pages)
    scorer = Scorer(lm.config, lm.params, setup.settings, eos_id=lm.eos_id, max_len=config.max_model_len,
                    reconstruction=setup.reconstruction)
    engine = Engine(server, lm.tokenizer, metrics, eos_id=lm.eos_id, scorer=scorer)
    return Service(config=config, lm=lm, server=server, engine=engine, metrics=metrics, plan=setup.plan,
                   keys=IdempotencyKeys(config.idempotency_ttl), warmup=warmed, setup=setup)


def repeat_prompt(lm):
    """KVzip's repeat prompt for the served model: in its chat frame when it has a chat template (chat requests are
    what a server mostly gets; a plain completion's first tokens are then skipped as a chat header would be - the
    policy's sinks keep them), else plain."""
    from lcx.data.haystack import Frame

    chat = lm.chat_template if getattr(lm.tokenizer, "chat_template", None) else None
    return Frame(lm.tokenizer, chat).reconstruction()


__all__ = ["Service", "build_service", "repeat_prompt"]
