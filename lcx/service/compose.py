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
from lcx.service import multihost
from lcx.service.metrics import Metrics


@dataclasses.dataclass
class Service:
    """What an app serves: the model (``lcx.lm.LM``), the serving loop and its engine thread, the metrics, the
    pool's plan, the idempotency keys and what the warm-up ran (``lcx.service.warmup.WarmupReport``, or None).
    ``setup``: the resolved configuration (``lcx.engine.setup.ServeSetup``) everything was built from. Across
    processes (``lcx.service.multihost``) process 0's ``server`` is a ``Lockstep``; a follower's service has the
    ``Server`` and no engine, metrics or keys (None)."""

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
        if self.engine is not None:  # None on a follower process (lcx.service.multihost)
            self.engine.close()
        from lcx.engine.lockstep import Lockstep

        if isinstance(self.server, Lockstep) and not self.engine.running:
            self.server.close()  # the followers return (after the engine thread: the Lockstep's only caller)


def build_service(config: ServeConfig, lm=None) -> Service:
    """Load the model (or take ``lm``), resolve the configuration (the pool sized by ``lcx.plan.serving``), start
    the engine thread."""
    import lcx
    from lcx.engine.kv_store import PageStore
    from lcx.engine.scoring import Scorer
    from lcx.engine.server import Server
    from lcx.engine.server_group import ServerGroup
    from lcx.parallel.device_memory import free_bytes
    from lcx.plan.arithmetic import weight_bytes_per_device
    from lcx.plan.inference import weight_bytes
    from lcx.service.warmup import chat_head, parse_warmup, warm_up

    multihost.check(config)  # across processes: refused before the model loads
    speculative = config.speculative()
    if speculative is not None:
        return _speculative_service(config, *speculative, lm)
    lm = lm or lcx.load(config.model, dtype=config.dtype)
    # --tensor-parallel-size: the weights and the pool split by KV head; --data-parallel-size: replicas of that
    meshes = config.meshes(lm.config)
    mesh = meshes[0]
    weights = (weight_bytes(lm.config, lm.config.param_dtype) if mesh is None
               else weight_bytes_per_device(lm.config, lm.config.param_dtype, mesh.shape["model"]))
    setup = config.resolve(lm.config, reconstruction=lambda: repeat_prompt(lm), free_bytes=free_bytes(),
                           weight_bytes=weights, mesh=mesh)
    setup = multihost.agreed(setup)  # across processes: one pool size (the smallest any process planned)
    # pages (full: the same keys and values whoever computed them) or, asked for, compressed states (a session's
    # state gives its next turn other tokens than a fresh compression: only with --kv-store)
    store = None
    if setup.make_store:
        store = PageStore(store_namespace(lm.params, setup.settings, lm.config), page=setup.page,
                          host_bytes=config.host_store_bytes, directory=config.kv_store,
                          disk_bytes=config.kv_store_bytes)
    replicas = [Server(lm.config, lm.params, eos_id=lm.eos_id, store=store,
                       setup=dataclasses.replace(setup, mesh=m)) for m in meshes]  # one store: keys are the model's
    # before the engine thread and the metrics exist: the dummies leave neither a trace
    warmed = None
    for replica in replicas if config.warmup else []:
        warmed = warm_up(replica, parse_warmup(config.warmup), head=chat_head(lm))
    server = replicas[0] if len(replicas) == 1 else ServerGroup(replicas)
    if not multihost.leads():  # a follower: the steps process 0 drives, no HTTP (lcx.service.multihost)
        return Service(config=config, lm=lm, server=server, engine=None, metrics=None, plan=setup.plan, keys=None,
                       warmup=warmed, setup=setup)
    metrics = Metrics(page_bytes=setup.plan.page_bytes, pages_total=setup.pages * len(replicas))
    # across processes the scorer's passes would run on process 0 alone, on a mesh every process must step
    scorer = None if multihost.spans() else Scorer(lm.config, lm.params, setup.settings, eos_id=lm.eos_id,
                                                    max_len=config.max_model_len,
                                                    reconstruction=setup.reconstruction, mesh=setup.mesh)
    server = multihost.lead(server)  # across processes: its Lockstep, every step broadcast to the followers
    engine = Engine(server, lm.tokenizer, metrics, eos_id=lm.eos_id, scorer=scorer,
                    heartbeat=multihost.HEARTBEAT_S if multihost.spans() else None)
    return Service(config=config, lm=lm, server=server, engine=engine, metrics=metrics, plan=setup.plan,
                   keys=IdempotencyKeys(config.idempotency_ttl), warmup=warmed, setup=setup)


def _speculative_service(config: ServeConfig, spec, target, lm=None) -> Service:
    """``--speculative-draft``: a ``SpecServer`` (rows of a contiguous full cache, each with its draft) on one
    device, in one process; ``spec`` / ``target``: ``config.speculative()``."""
    import lcx
    from lcx.config_base import ConfigError
    from lcx.engine.scoring import Scorer
    from lcx.engine.spec_server import SpecServer

    if multihost.spans():
        raise ConfigError("--speculative-draft is not served across processes: a speculative server runs on one "
                          "device (allowed: one process)")
    lm = lm or lcx.load(config.model, dtype=config.dtype)
    draft = spec.draft
    reconstruction = repeat_prompt(lm) if draft.make_policy().observes.reconstructs else None
    server = SpecServer(lm.config, lm.params, speculative=spec, max_num_seqs=config.max_num_seqs,
                        max_len=config.max_model_len, cache=target, eos_id=lm.eos_id, segment=config.segment,
                        prefill_chunk=config.prefill_chunk, reconstruction=reconstruction, page_size=config.page_size)
    metrics = Metrics(page_bytes=server.plan.page_bytes, pages_total=server.rows * server.plan.row_pages)
    scorer = Scorer(lm.config, lm.params, target, eos_id=lm.eos_id, max_len=config.max_model_len)
    engine = Engine(server, lm.tokenizer, metrics, eos_id=lm.eos_id, scorer=scorer)
    return Service(config=config, lm=lm, server=server, engine=engine, metrics=metrics, plan=server.plan,
                   keys=IdempotencyKeys(config.idempotency_ttl))


def repeat_prompt(lm):
    """KVzip's repeat prompt for the served model: in its chat frame when it has a chat template (chat requests are
    what a server mostly gets; a plain completion's first tokens are then skipped as a chat header would be - the
    policy's sinks keep them), else plain."""
    from lcx.data.haystack import Frame

    chat = lm.chat_template if getattr(lm.tokenizer, "chat_template", None) else None
    return Frame(lm.tokenizer, chat).reconstruction()


__all__ = ["Service", "build_service", "repeat_prompt"]
