"""Why the memory tier recalls passkeys but not numbers hidden in prose past the trained context (docs/real_model,
"The memory tier on numbers in prose"): for each prompt, where the needle's block ranks among the long-term blocks
when the question routes, per layer and KV head, and what the model answers with the router as configured and with
the needle's block forced into every recall (an oracle router).

    python experiments/real_model/memory_router_probe.py runs/models/SmolLM2-135M-Instruct \
        --config experiments/configs/smollm2_past_context.yaml --task niah_single_2 --length 16384 --samples 8

The prompts are the grid's (the config's ``eval`` section, its seed and chat setting). The cache is the grid's
memory-tier row (``--cache`` overrides it, YAML inline). Per prompt the script

1. reads the whole prompt as the grid does (one ``prefill``: chunks of ``prefill_chunk``, spills between them), then,
   per layer and KV head, scores every long-term block with the router and the pooled last queries of the prompt;
   ``rank`` is the best rank of a block holding the needle sentence (0: the top), ``in_top`` the share of (layer,
   head) pairs where it is among the ``topk`` recalled;
2. decodes the answer (the router as configured);
3. with ``--oracle``: reads the context (up to the question), widens the Quest bounds of the needle's blocks to
   +-1e4 so every layer and KV head recalls them from then on, reads the question and decodes - the answer the model
   gives when routing is perfect. A needle still in the working window has no block: no oracle row;
4. with ``--control``: the oracle's two calls without the widening, so the oracle's effect is the widening's alone.

The ranks are taken after the prompt's last call and its spill, over every block then in the store - the candidates
of the first decode step, which pools the same last queries and its own.

Prints one line per prompt and writes ``--out`` (JSON lines: ranks per layer and head, answers). Settings it does
not reproduce are refused (``check_probe``): a device store, clustered blocks, shared or grouped routing, the learned
router.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import yaml

import lcx
from lcx.cache.config import CacheConfig
from lcx.cache.memory.store import get_store
from lcx.engine import Generator


def examples(lm, config: str, task_name: str, length: int, samples: int, start: int = 0):
    """The grid's prompts ``start .. start + samples - 1`` of a cell (a cell of ``start + samples`` prompts asks
    the same ones)."""
    from lcx.eval.cell_prompts import grid_tasks
    from lcx.eval.evaluate import cell_examples
    from lcx.experiment.config import load_experiment

    ev = load_experiment(config).eval
    tasks = grid_tasks(ev, lm.tokenizer)[0]
    if task_name not in tasks:
        raise SystemExit(f"--task={task_name!r} is not in {config}'s eval.tasks {sorted(tasks)}")
    task = tasks[task_name]
    return task, cell_examples(task, length=length, depth=None, samples=start + samples, seed=ev.seed)[start:]


def needle_span(tok, ids: list[int], value: str) -> tuple[int, int]:
    """Token indices ``[start, end)`` of the needle sentence holding ``value`` (the shortest prefix whose text contains
    the value ends it; the sentence's ~20 tokens before it)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if value in tok.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return max(lo - 24, 0), lo


def memory_cache(config: str, override: str | None, length: int) -> CacheConfig:
    """The grid's memory-tier row for ``length`` (its budget, interval and prefill chunk), or ``override``."""
    raw = yaml.safe_load(Path(config).read_text())["ablate"]
    if override:
        row = yaml.safe_load(override)
    else:
        row = next(p for p in raw["policies"] if p["policy"] == "memory" and length in p.get("lengths", [length]))
    row = {k: v for k, v in row.items() if k not in ("ropes", "lengths", "samples")}
    if "budget" not in row:
        row["budget"] = raw["budgets"][0]
    return CacheConfig(interval=raw.get("interval", 64), prefill_chunk=raw.get("prefill_chunk"), **row)


def block_of(store, layer: int, positions: range) -> list[int]:
    """The long-term block ids of ``layer`` (row 0, KV head 0: contiguous blocks) holding any of ``positions``."""
    pos = store.pos[layer, 0, :int(store.n_blocks[0]), :, 0]  # [n, j]
    hit = np.isin(pos, np.asarray(list(positions)))
    return sorted(set(np.flatnonzero(hit.any(axis=1)).tolist()))


def _rank(scores: np.ndarray, blocks: list[int]) -> np.ndarray:
    """``scores [k, n]`` -> the best rank of ``blocks`` per KV head ``[k]`` (0: the top)."""
    order = np.argsort(-scores, axis=-1)
    return np.stack([min(int(np.flatnonzero(order[h] == b)[0]) for b in blocks) for h in range(order.shape[0])])


def ranks(gen, cache, needle_blocks: list[list[int]], store=None, pools=(1, 8, 32, 64)):
    """Per layer and KV head, the needle's best rank among the blocks as the next step routes (the pooled recent
    queries against every block): ``{"routed": [L, k]}`` with the router as configured, and, for Quest, the
    alternatives the buffer of recent queries allows - ``pool<m>``: the mean of the last ``m`` queries (``m`` up to
    ``route_queries``); ``max_heads``: the bound of each query head of a group, the best of them (Quest sums them);
    ``exact_max``: the block's largest true ``q . k`` per query head, summed like Quest's bound (what Quest bounds:
    no summary of a block ranks it better for this query); ``max_queries`` / ``exact_max_queries``: each recent query
    scored alone (Quest's bound / the true largest ``q . k``), the best of them - and the blocks' count ``[L]``."""
    kind = getattr(gen.kind, "glob", None) or gen.kind
    out, counts = {}, []
    for layer in range(cache.k.shape[0]):
        view = _layer(cache, layer)
        n = int(view.n_blocks[0])
        summaries = {f: getattr(view, f)[:, :n] for f in kind.router.summary_fields()}
        q = np.asarray(view.recent_q[0])  # [R, h, d], the newest last
        m = int(view.recent_n[0])
        pooled = q[-m:].mean(axis=0)[None]
        found = {"routed": _rank(np.asarray(kind.router.score(jnp.asarray(pooled), summaries, None)[0]),
                                 needle_blocks[layer])}
        if kind.router.name == "quest":
            for size in pools:
                if size <= m:
                    found[f"pool{size}"] = _rank(np.asarray(kind.router.score(
                        jnp.asarray(q[-size:].mean(axis=0)[None]), summaries, None)[0]), needle_blocks[layer])
            kmin, kmax = np.asarray(summaries["kmin"][0]), np.asarray(summaries["kmax"][0])  # [n, k, d]
            qg = pooled[0].reshape(kmin.shape[1], -1, kmin.shape[2])  # [k, g, d]
            bound = np.maximum(np.einsum("kgd,nkd->kgnd", qg, kmin), np.einsum("kgd,nkd->kgnd", qg, kmax))
            found["max_heads"] = _rank(bound.sum(axis=-1).max(axis=1), needle_blocks[layer])
            # every recent query scored alone, the best of them (the mean blurs a question's queries into one)
            each = q[-m:].reshape(m, kmin.shape[1], -1, kmin.shape[2])  # [m, k, g, d]
            bounds = np.maximum(np.einsum("mkgd,nkd->mkgnd", each, kmin), np.einsum("mkgd,nkd->mkgnd", each, kmax))
            found["max_queries"] = _rank(bounds.sum(axis=(2, 4)).max(axis=0), needle_blocks[layer])
            if store is not None and store.format.host_dtype == np.float32:  # what no block summary can beat:
                keys = store.k[layer, 0, :n]  # [n, j, k, d] the blocks' own keys, as stored (unrotated: local)
                dots = np.einsum("kgd,njkd->kgnj", qg, keys)  # each query head against each key of each block
                found["exact_max"] = _rank(dots.max(axis=-1).sum(axis=1), needle_blocks[layer])
                dots = np.einsum("mkgd,njkd->mkgnj", each, keys)
                found["exact_max_queries"] = _rank(dots.max(axis=-1).sum(axis=2).max(axis=0), needle_blocks[layer])
        for name, rank in found.items():
            out.setdefault(name, []).append(rank)
        counts.append(n)
    return {name: np.stack(r) for name, r in out.items()}, np.asarray(counts)


class _layer:
    """One layer's slice of a MemoryCache (the fields routing reads)."""

    def __init__(self, cache, layer):
        self._c, self._l = cache, layer

    def __getattr__(self, name):
        return getattr(self._c, name)[self._l]


def memory_of(cache):
    """The memory tier's state: the cache itself, or a sliding-window model's global layers' (``HybridCache.glob``;
    its layer axis counts the global layers only)."""
    return getattr(cache, "glob", None) or cache


def _needle_blocks(state, start: int, end: int) -> list[list[int]]:
    memory = memory_of(state.cache)
    store = get_store(int(memory.store_id[0]))
    return [block_of(store, layer, range(start, end)) for layer in range(memory.k.shape[0])]


def _widened(cache, blocks):
    if hasattr(cache, "glob"):
        return cache.replace(glob=widen(cache.glob, blocks))
    return widen(cache, blocks)


def widen(cache, needle_blocks: list[list[int]]):
    """The oracle: the needle's blocks' Quest bounds widened so every layer and KV head recalls them."""
    kmin, kmax = np.asarray(cache.kmin).copy(), np.asarray(cache.kmax).copy()
    for layer, blocks in enumerate(needle_blocks):
        kmin[layer, 0, blocks] = -1e4
        kmax[layer, 0, blocks] = 1e4
    return cache.replace(kmin=jnp.asarray(kmin), kmax=jnp.asarray(kmax))


def run(lm, cache_cfg, ex, new: int, mode: str):
    """One prompt in one ``mode`` (:data:`MODES`): ``(answer, ranks, block count, needle span, needle blocks)``;
    answer None where the mode needs a needle block and the needle is still in the working window."""
    ids = list(map(int, ex.prompt_ids))
    cut = ex.context_len
    # room for the question read after the context (the split modes' second call), the same in every mode
    gen = Generator(lm.config, lm.params, max_new_tokens=new, cache=cache_cfg, eos_id=lm.eos_id,
                    unroll=False, capacity=len(ids) + new + 128)
    start, end = needle_span(lm.tokenizer, ids, ex.references[0])
    if mode == "router":  # the whole prompt in one prefill, as the grid reads it
        state = gen.prefill([ids])
        blocks = _needle_blocks(state, start, end)
    else:  # the context, then (the needle's blocks widened for the oracle) the question
        state = gen.prefill([ids[:cut]])
        blocks = _needle_blocks(state, start, end)
        if not all(blocks):  # the needle is still in the working window: nothing to force
            gen.close()
            return None, None, None, (start, end), []
        if mode == "oracle":
            state = state.replace(cache=_widened(state.cache, blocks))
        state = gen.prefill([ids[cut:]], state=state)
    memory = memory_of(state.cache)
    rank, count = (ranks(gen, memory, blocks, get_store(int(memory.store_id[0]))) if all(blocks) else (None, None))
    result = gen.result(gen.decode(state, steps=new))
    gen.close()
    answer = lm.tokenizer.decode([t for t in result.tokens[0][:result.lengths[0]] if t != lm.eos_id])
    return answer, rank, count, (start, end), blocks[0]


MODES = ("router", "oracle", "control")


def check_probe(cfg: CacheConfig, modes) -> None:
    """Refuse the memory settings the probe does not reproduce: it ranks blocks per KV head over every block, reads
    block positions from a host / disk store, and widens Quest's per-block bounds."""
    p = dict(cfg.policy_params)
    unsupported = {"store": p.get("store", "host") == "device", "blocks": p.get("blocks", "contiguous") != "contiguous",
                   "route_heads": p.get("route_heads", "per_head") != "per_head",
                   "route_groups": bool(p.get("route_groups", 0)), "router": p.get("router", "quest") == "learned"}
    bad = sorted(name for name, hit in unsupported.items() if hit)
    if bad:
        raise SystemExit(f"the probe does not reproduce cache.{', cache.'.join(bad)} as set: it needs store host or "
                         "disk, contiguous blocks, per-head routing, no route_groups and a quest or infllm router")
    if "oracle" in modes and p.get("router", "quest") != "quest":
        raise SystemExit("--oracle widens Quest's bounds: it needs router: quest")


def prompt_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments that pick a cell's prompts: model, config, task, length, samples and the first one's index."""
    ap.add_argument("model")
    ap.add_argument("--config", default="experiments/configs/smollm2_past_context.yaml")
    ap.add_argument("--task", default="niah_single_2")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--start", type=int, default=0, help="the first prompt's index (a cell's prompts continue)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    prompt_arguments(ap)
    ap.add_argument("--cache", default=None, help="the memory row, YAML inline (default: the config's)")
    ap.add_argument("--oracle", action="store_true", help="also answer with the needle's blocks forced")
    ap.add_argument("--control", action="store_true",
                    help="also answer from the oracle's two calls without the widening (what the split alone does)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=None,
                    help="exactly these modes (default: router, and oracle / control where asked)")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    lm = lcx.load(args.model)
    cfg = memory_cache(args.config, args.cache, args.length)
    modes = tuple(args.modes or ("router",) + ("oracle",) * args.oracle + ("control",) * args.control)
    check_probe(cfg, modes)
    if args.start < 0:
        ap.error(f"--start={args.start} is invalid: must be >= 0")
    task, exs = examples(lm, args.config, args.task, args.length, args.samples, args.start)
    rows = []
    topk = dict(cfg.policy_params).get("topk", 8)
    print(f"cache: {cfg}", flush=True)
    for i, ex in enumerate(exs, start=args.start):
        t0 = time.time()
        row = {"prompt": i, "answer": ex.answer, "length": len(ex.prompt_ids)}
        for mode in modes:
            answer, rank, count, span, blocks = run(lm, cfg, ex, args.new, mode)
            row["needle_tokens"] = list(span)
            if answer is None:
                row[mode] = {"output": None, "found": None}
                continue
            row[mode] = {"output": answer, "found": task.score(ex, answer) == 1.0}  # the grid's grading
            if mode == "router" and rank is not None:
                routed = rank["routed"]
                row.update(needle_blocks=blocks, blocks=int(count[0]), rank=routed.tolist(),
                           in_top=float(np.mean(routed < topk)), median_rank=float(np.median(routed)),
                           alternatives={name: {"in_top": float(np.mean(r < topk)), "median_rank": float(np.median(r))}
                                         for name, r in rank.items() if name != "routed"})
        rows.append(row)
        answers = "; ".join(f"{m} {row[m]['found']} {row[m]['output']!r}" for m in modes)
        print(f"[{i + 1}/{args.start + len(exs)}] {time.time() - t0:.0f} s  needle tokens "
              f"{row.get('needle_tokens')} of {row['length']}, blocks {row.get('blocks')}: in the top {topk} for "
              f"{row.get('in_top', 0):.0%} of "
              f"layer x head, median rank {row.get('median_rank')} {row.get('alternatives', '')}; {answers}",
              flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    for mode in modes:
        done = [r[mode]["found"] for r in rows if r[mode]["found"] is not None]
        print(f"{mode}: {sum(done)}/{len(done)} found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
