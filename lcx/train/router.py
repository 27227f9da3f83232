"""Training the learned memory router by distillation: the base model frozen, its full attention the teacher.

Shape letters: L layers, B batch, T tokens, Q sampled queries, h query heads, k kv heads, g query heads per kv head,
n blocks, j tokens per block, d head dim, r router rank.

For training sequences (``data:``), every layer's queries and keys come from one uncached forward pass of the frozen
model (``lcx.model.attention_inputs``). The tokens after the ``sinks`` form blocks of ``block`` tokens; for a query
at position t, the blocks ending at or before ``t - window`` are the ones a memory cache with that window would hold
in its long-term store. The teacher is the full attention the query gives those blocks (summed over the query heads
of each KV group):

- routing loss: KL(teacher's distribution over the eligible blocks || softmax of the router's scores);
- gate loss: binary cross-entropy of the gate against "the eligible blocks get at least ``gate_threshold`` of the
  query's attention" (recall is needed).

Only the router's parameters train (optax AdamW); they are saved with orbax (``lcx.cache.memory.learned.save``)
with ``router.json`` recording the shapes, the positions mode and the held-out recall@k of the learned router next
to Quest's at the same k.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import einops
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from lcx.cache.memory import learned, make_router
from lcx.config_base import ConfigError
from lcx.data.batches import BatchSource
from lcx.data.task import TOKENIZER
from lcx.data.tokenizer import check_model_tokens
from lcx.model import attention_inputs
from lcx.model.config import ModelConfig
from lcx.train.config import DataConfig


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The ``router:`` section. ``window``, ``block`` and ``sinks`` describe the memory cache the router is for;
    ``queries`` query positions per sequence are sampled from those that have eligible blocks, an ``answer_queries``
    share of them (where the data has any) from the positions that predict answer tokens - the queries a retrieval
    depends on; ``topk`` is the k of the held-out recall@k report."""

    steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    rank: int = 32
    sinks: int = 4
    window: int = 32
    block: int = 16
    topk: int = 2
    queries: int = 32
    answer_queries: float = 0.5
    gate_threshold: float = 0.1
    positions: str = "original"
    seed: int = 0
    log_every: int = 20

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "rank", "window", "block", "topk", "queries", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"router.{name}={value!r} is invalid: must be a positive integer")
        if self.positions not in ("original", "local"):
            raise ConfigError(f"router.positions={self.positions!r} is invalid: must be 'original' or 'local'")
        if not 0 <= self.answer_queries <= 1:
            raise ConfigError(f"router.answer_queries={self.answer_queries!r} is invalid: must be in [0, 1]")
        if not 0 < self.gate_threshold < 1:
            raise ConfigError(f"router.gate_threshold={self.gate_threshold!r} is invalid: must be in (0, 1)")
        if self.seq_len < self.sinks + self.window + 2 * self.block:
            raise ConfigError(f"router.seq_len={self.seq_len} is invalid: a sequence needs sinks + window + two "
                              f"blocks = {self.sinks + self.window + 2 * self.block} tokens to hold blocks to route")


def init_router(key: jax.Array, n_layers: int, head_dim: int, rank: int) -> dict:
    k1, k2 = jax.random.split(key)
    return {"w_query": jax.random.normal(k1, (n_layers, head_dim, rank)) * head_dim ** -0.5,
            "w_block": jax.random.normal(k2, (n_layers, 3, head_dim, rank)) * (3 * head_dim) ** -0.5,
            "gate_w": jnp.zeros((n_layers, head_dim)), "gate_b": jnp.zeros((n_layers,))}


def teacher(q: jax.Array, k: jax.Array, query_pos: jax.Array, cfg: RouterConfig):
    """Per layer: block summaries, the sampled queries, and the teacher's mass on each eligible block.

    ``q [L, B, T, h, d]``, ``k [L, B, T, k, d]``, ``query_pos [B, Q]`` -> ``stats [L, B, n, k, 3, d]`` (mean, min,
    max keys), ``queries [L, B, Q, h, d]``, ``mass [L, B, Q, k, n]`` (attention mass per block), ``eligible [B, Q,
    n]``, ``share [L, B, Q, k]`` (the eligible blocks' share of the query's attention)."""
    L, B, T, h, d = q.shape
    heads = k.shape[3]
    n = (T - cfg.sinks) // cfg.block
    blocks = einops.rearrange(k[:, :, cfg.sinks:cfg.sinks + n * cfg.block], "L B (n j) k d -> L B n j k d",
                              j=cfg.block)
    stats = jax.vmap(make_router("learned").summarize, in_axes=(0, None))(blocks, None)["kstats"]  # [L,B,n,k,3,d]
    rows = jnp.arange(B)[:, None]
    queries = q[:, rows, query_pos]  # [L, B, Q, h, d]
    qg = einops.rearrange(queries, "L B Q (k g) d -> L B Q k g d", k=heads)
    logits = jnp.einsum("LBQkgd,LBTkd->LBQkgT", qg.astype(jnp.float32), k.astype(jnp.float32)) * d ** -0.5
    causal = jnp.arange(T)[None, None, :] <= query_pos[:, :, None]  # [B, Q, T]
    probs = jax.nn.softmax(jnp.where(causal[None, :, :, None, None], logits, -jnp.inf), axis=-1)
    per_token = jnp.sum(probs, axis=4) / (h // heads)  # [L, B, Q, k, T]: the group's mean attention
    mass = einops.reduce(per_token[..., cfg.sinks:cfg.sinks + n * cfg.block], "L B Q k (n j) -> L B Q k n", "sum",
                         j=cfg.block)
    block_end = cfg.sinks + (jnp.arange(n) + 1) * cfg.block  # exclusive
    eligible = block_end[None, None, :] <= query_pos[:, :, None] - cfg.window + 1  # [B, Q, n]
    share = jnp.sum(jnp.where(eligible[None, :, :, None, :], mass, 0.0), axis=-1)
    return stats, queries, mass, eligible, share


def router_scores(params: dict, queries: jax.Array, stats: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scores ``[L, B, Q, k, n]`` and gate logits ``[L, B, Q, k]`` of the learned router, per layer."""
    router = make_router("learned")
    heads = stats.shape[3]

    def one_layer(p, q, s):  # q [B, Q, h, d], s [B, n, k, 3, d]
        score = jax.vmap(lambda qq: router.score(qq, {"kstats": s}, p), in_axes=1, out_axes=1)(q)  # [B, Q, k, n]
        qg = jnp.mean(einops.rearrange(q, "B Q (k g) d -> B Q k g d", k=heads), axis=3)
        return score, jnp.einsum("BQkd,d->BQk", qg, p["gate_w"]) + p["gate_b"]

    return jax.vmap(one_layer)(params, queries.astype(jnp.float32), stats)


def losses(params, stats, queries, mass, eligible, share, gate_threshold):
    scores, gate = router_scores(params, queries, stats)
    ok = eligible[None, :, :, None, :]  # [1, B, Q, 1, n]
    target = jnp.where(ok, mass, 0.0)
    total = jnp.sum(target, axis=-1, keepdims=True)
    target = target / jnp.maximum(total, 1e-9)
    log_p = jax.nn.log_softmax(jnp.where(ok, scores, -1e9), axis=-1)
    counted = (total[..., 0] > 1e-6).astype(jnp.float32)  # queries with eligible blocks
    kl = jnp.sum(jnp.where(ok, target * (jnp.log(jnp.maximum(target, 1e-9)) - log_p), 0.0), axis=-1)
    route = jnp.sum(kl * counted) / jnp.maximum(jnp.sum(counted), 1.0)
    needed = (share >= gate_threshold).astype(jnp.float32)
    gate_loss = jnp.mean(optax.sigmoid_binary_cross_entropy(gate, needed))
    return route + gate_loss, {"route_kl": route, "gate_bce": gate_loss,
                               "gate_accuracy": jnp.mean((gate > 0) == (needed > 0)),
                               "recall_needed": jnp.mean(needed)}


def sample_queries(rng: np.random.Generator, batch: dict, cfg: RouterConfig, pad_id: int = TOKENIZER.pad_id
                   ) -> np.ndarray:
    """``[B, Q]`` query positions within each sequence's real tokens that have at least one eligible block; a share
    ``answer_queries`` from positions whose next token is an answer token, where a sequence has any. ``pad_id``: the
    batch's padding (the task's tokenizer's; an end-of-text id in many BPE tokenizers, so a sequence's real tokens
    run up to its last non-pad token rather than being counted)."""
    real = batch["inputs"] != pad_id
    lengths = np.where(real.any(axis=1), real.shape[1] - np.argmax(real[:, ::-1], axis=1), 0)
    lo = cfg.sinks + cfg.block + cfg.window - 1
    out = []
    for row, n in enumerate(lengths):
        picks = rng.integers(min(lo, n - 1), n, cfg.queries)
        answers = np.flatnonzero(batch["answer"][row][:n] > 0)
        answers = answers[answers >= lo]
        if len(answers) and len(answers) < n - lo:  # not a corpus window, where every token is an answer
            share = rng.random(cfg.queries) < cfg.answer_queries
            picks = np.where(share, rng.choice(answers, cfg.queries), picks)
        out.append(picks)
    return np.stack(out).astype(np.int32)


def recall_at_k(scores, mass, eligible, k: int) -> float:
    """Share of the teacher's top-k eligible blocks among the router's top-k, over queries with >= k blocks."""
    scores, mass, eligible = np.asarray(scores), np.asarray(mass), np.asarray(eligible)
    hits, total = 0, 0
    L, B, Q, heads, n = scores.shape
    for layer in range(L):
        for b in range(B):
            for q in range(Q):
                ok = np.flatnonzero(eligible[b, q])
                if len(ok) < k:
                    continue
                for head in range(heads):
                    best = set(ok[np.argsort(-mass[layer, b, q, head, ok], kind="stable")[:k]])
                    got = set(ok[np.argsort(-scores[layer, b, q, head, ok], kind="stable")[:k]])
                    hits += len(best & got)
                    total += k
    return hits / max(total, 1)


def quest_scores(queries, stats):
    """Quest's scores on the same blocks (min / max of the keys), for the comparison in ``router.json``."""
    router = make_router("quest")

    def one_layer(q, s):
        summaries = {"kmin": s[:, :, :, 1], "kmax": s[:, :, :, 2]}
        return jax.vmap(lambda qq: router.score(qq, summaries, None), in_axes=1, out_axes=1)(q)

    return jax.vmap(one_layer)(queries.astype(jnp.float32), stats)


def train_router(model: ModelConfig, params, cfg: RouterConfig, data: DataConfig, out_dir: str | Path, *,
                 progress: bool = True, tokenizer=None) -> dict:
    """Distil a learned router for ``model`` (frozen ``params``) on ``data``; writes ``out_dir`` (orbax params,
    ``router.json``, ``metrics.jsonl``) and returns the summary written to ``router.json``. ``tokenizer``: the
    model's (None: lcx's byte tokenizer), which builds the data task's sequences."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.seq_len > model.max_position_embeddings:
        raise ConfigError(f"router.seq_len={cfg.seq_len} is invalid: the teacher's full attention must be within the "
                          f"model's trained range (max_position_embeddings={model.max_position_embeddings})")
    task = data.make_task().with_tokenizer(tokenizer or TOKENIZER)
    source = BatchSource(task, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                         prompt_loss_weight=data.prompt_loss_weight)
    pad = task.tokenizer.pad_id
    # the teacher must read its own tokens: byte ids fed to a BPE model distil a router from garbage attention
    check_model_tokens(task.tokenizer, list(source(0)["inputs"]), model.vocab_size, f"data.task={data.task!r}")
    optimizer = optax.adamw(cfg.lr, weight_decay=0.0)
    router = init_router(jax.random.key(cfg.seed), model.n_layers, model.head_dim, cfg.rank)
    opt_state = optimizer.init(router)
    inputs = jax.jit(functools.partial(attention_inputs, model, rotated=cfg.positions == "original"))

    @jax.jit
    def step(router, opt_state, ids, query_pos):
        q, k = inputs(params, ids)
        stats, queries, mass, eligible, share = teacher(q, k, query_pos, cfg)
        (loss, metrics), grads = jax.value_and_grad(losses, has_aux=True)(
            router, stats, queries, mass, eligible, share, cfg.gate_threshold)
        updates, opt_state = optimizer.update(grads, opt_state, router)
        return optax.apply_updates(router, updates), opt_state, dict(metrics, loss=loss)

    rng = np.random.default_rng(cfg.seed)
    metrics_path = out_dir / "metrics.jsonl"
    bar = tqdm(range(cfg.steps), desc="router", unit="step", disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    with metrics_path.open("w") as log:
        for i in bar:
            batch = source(i)
            router, opt_state, metrics = step(router, opt_state, jnp.asarray(batch["inputs"]),
                                              jnp.asarray(sample_queries(rng, batch, cfg, pad)))
            if (i + 1) % cfg.log_every == 0 or i + 1 == cfg.steps:
                row = {"step": i + 1, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.set_postfix(kl=f"{row['route_kl']:.3f}", gate=f"{row['gate_accuracy']:.2f}")
    heldout = evaluate(model, params, router, cfg, source, rng)
    summary = {"steps": cfg.steps, "seconds": round(time.perf_counter() - t0, 1), **heldout}
    learned.save(out_dir, router, model, cfg.rank,
                 {"positions": cfg.positions, "window": cfg.window, "block": cfg.block, "sinks": cfg.sinks,
                  "heldout": summary})
    return summary


def evaluate(model, params, router, cfg: RouterConfig, source: BatchSource, rng, batches: int = 4) -> dict:
    """Held-out recall@k of the learned router and of Quest against the teacher, and the gate's skip rate."""
    pad = source.task.tokenizer.pad_id
    inputs = jax.jit(functools.partial(attention_inputs, model, rotated=cfg.positions == "original"))
    learned_hits, quest_hits, skip = [], [], []
    for i in range(batches):
        batch = source(i, "validation")
        q, k = inputs(params, jnp.asarray(batch["inputs"]))
        stats, queries, mass, eligible, share = teacher(q, k, jnp.asarray(sample_queries(rng, batch, cfg, pad)), cfg)
        scores, gate = router_scores(router, queries, stats)
        learned_hits.append(recall_at_k(scores, mass, eligible, cfg.topk))
        quest_hits.append(recall_at_k(quest_scores(queries, stats), mass, eligible, cfg.topk))
        skip.append(float(jnp.mean(gate <= 0)))
    return {f"recall@{cfg.topk}_learned": float(np.mean(learned_hits)),
            f"recall@{cfg.topk}_quest": float(np.mean(quest_hits)), "gate_skip_rate": float(np.mean(skip))}


__all__ = ["RouterConfig", "evaluate", "init_router", "losses", "router_scores", "teacher", "train_router"]
