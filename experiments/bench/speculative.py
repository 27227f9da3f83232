"""Self-speculative decoding with compressed-KV drafts against plain full-cache decoding, on a real checkpoint.

    python experiments/bench/speculative.py runs/models/SmolLM2-135M-Instruct                 # the default grid
    python experiments/bench/speculative.py MODEL --contexts 4096 16384 --batches 8 --drafts streaming-256 int8

For every context length and batch: ``batch`` prompts of prose (``pydoc_data.topics``, each row its own passage)
cut to ``context`` tokens, greedy, ``--new`` tokens. Plain decoding is ``lcx.Generator`` with the full cache;
each draft is ``SpeculativeGenerator`` with that draft and ``--k`` drafts per verification, verified against the
same full cache. All of them decode from one prefill per context and batch (``SpeculativeGenerator.prefill_cache``
under the draft policy that observes the prompt - its keys and values are a plain prefill's -, copied for each
method); the decode phase is timed after one compiling step (plain: one token; speculative: one verification), so
compilation is not counted, and tokens/s = tokens emitted in the timed part / its wall time. ``derive_s``: deriving
the draft from the prefilled cache (compiling included). ``same`` is whether every row's tokens equal plain decoding's;
``accept`` the mean tokens emitted per verification (accepted drafts + the target's own), ``accept_min`` /
``accept_max`` its spread over the rows; ``draft KV`` the draft cache's bytes beside the full cache's. Writes
``--out`` (CSV) and, with ``--plot``, speed-up against context.

``--confidence C ...`` adds each draft with adaptive ``k`` at those confidences (``SpeculativeConfig.confidence``,
method ``DRAFT@cC``; ``drafts_per_verification`` shows how many it drafted).

Drafts: ``streaming-W`` (4 sinks + a window, budget W; ``streaming-W-orig`` keys at their true positions instead of
re-rotated by rank), ``snapkv-C`` / ``tova-C`` / ``h2o-C`` (compression C of the
prompt: budget = (1 - C) x context), ``int8`` / ``fp8`` (8-bit codes of every token), ``fp4`` (e2m1 codes with a
scale per 16 values: the 4-bit draft a rejected token can be forgotten from one at a time), ``int4`` / ``int2``
(KIVI's grouped codes, the cache's default groups of 64: a rejection that crossed a group boundary brings that group
back into the float window dequantized).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import lcx
from lcx.config import CacheConfig
from lcx.engine import DecodeState, Generator
from lcx.engine.spec_generator import SpeculativeGenerator
from lcx.engine.speculative import SpeculativeConfig

COLUMNS = ("context", "batch", "method", "k", "tokens_per_s", "speedup", "same", "accept", "accept_rate",
           "accept_min", "accept_max", "decode_s", "prefill_s", "derive_s", "kv_bytes", "draft_bytes", "confidence",
           "drafts_per_verification")


def prose_prompts(lm, batch: int, context: int) -> list[list[int]]:
    """``batch`` prompts of ``context`` tokens: pydoc topics, each row starting at its own topic."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    prompts = []
    for r in range(batch):
        text, i = "", r * 7
        while len(text) < 6 * context:  # ~4 characters per token: enough text, cut in tokens below
            text += topics[names[i % len(names)]] + "\n\n"
            i += 1
        prompts.append(lm.encode(text)[:context])
    return prompts


def draft_config(name: str, context: int) -> CacheConfig:
    kind, _, arg = name.partition("-")
    if kind == "streaming":  # streaming-W: keys re-rotated by rank (StreamingLLM); streaming-W-orig: true positions
        width, _, mode = arg.partition("-")
        extra = {"positions": "original"} if mode == "orig" else {}
        return CacheConfig(policy="streaming", budget=int(width), sinks=4, **extra)
    if kind in ("snapkv", "tova", "h2o"):
        budget = max(int(round((1 - float(arg)) * context)), 16)
        extra = {"window": 32} if kind == "snapkv" else {}
        return CacheConfig(policy=kind, budget=budget, **extra)
    if kind in ("int8", "fp8", "fp4", "int4", "int2"):
        return CacheConfig(kv_dtype=kind)
    raise SystemExit(f"--drafts {name!r}: expected streaming-W, snapkv-C, tova-C, h2o-C, int8, fp8, fp4, int4 or int2")


def timed(fn):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree.leaves(out))
    return out, time.perf_counter() - start


def copied(tree):
    return jax.tree.map(jnp.copy, tree)


def plain(lm, owner: SpeculativeGenerator, cache, logits, rows, new: int) -> dict:
    """Plain full-cache decoding from the shared prefill (the owner's target view of a copy of it)."""
    gen = Generator(lm.config, lm.params, max_new_tokens=new)
    batch = logits.shape[0]
    state = DecodeState(cache=owner.target_view(cache), logits=logits,
                        tokens=jnp.full((batch, new), gen.pad_id, jnp.int32), n_generated=jnp.zeros(batch, jnp.int32),
                        done=jnp.zeros(batch, bool), step=jnp.int32(0), sampling=jax.tree.map(jnp.asarray, rows))
    state, _ = timed(lambda: gen.decode(state, steps=1))  # compiles
    before = int(np.sum(np.asarray(state.n_generated)))
    state, decode_s = timed(lambda: gen.decode(state))
    result = gen.result(state)
    tokens = int(result.lengths.sum()) - before
    return dict(tokens=result.tokens, tokens_per_s=tokens / decode_s, decode_s=decode_s,
                kv_bytes=result.cache_bytes, draft_bytes=0)


def speculative(lm, cache, logits, rows, new: int, draft: CacheConfig, k: int, confidence=None) -> dict:
    gen = SpeculativeGenerator(lm.config, lm.params, max_new_tokens=new,
                               speculative=SpeculativeConfig(draft=draft, k=k, confidence=confidence))
    state, derive_s = timed(lambda: gen.start(cache, logits, rows))
    state, _ = timed(lambda: gen.decode(state, iterations=1))  # compiles
    before = int(np.sum(np.asarray(state.n_generated)))
    state, decode_s = timed(lambda: gen.decode(state))
    result, stats = gen.result(state)
    tokens = int(result.lengths.sum()) - before
    verified = np.maximum(stats.verifications, 1)
    per_row = (stats.accepted + stats.verifications) / verified  # each row's tokens per verification: its spread
    return dict(tokens=result.tokens, tokens_per_s=tokens / decode_s, decode_s=decode_s, derive_s=derive_s,
                kv_bytes=result.cache_bytes, draft_bytes=stats.draft_bytes, accept=stats.acceptance,
                accept_rate=stats.accept_rate, accept_min=float(per_row.min()), accept_max=float(per_row.max()),
                confidence="" if confidence is None else confidence,
                drafts_per_verification=float(stats.drafted.sum() / max(int(stats.verifications.sum()), 1)))


def owner_of(lm, drafts: list[CacheConfig], new: int, k: int) -> SpeculativeGenerator:
    """The generator whose prefill every draft derives from: the first draft that observes the prompt (its kind
    gathers the statistics while prefilling; the others read only keys, values and positions), else the first."""
    gens = [SpeculativeGenerator(lm.config, lm.params, max_new_tokens=new,
                                 speculative=SpeculativeConfig(draft=d, k=k)) for d in drafts]
    observing = [g for g in gens if g.observes_prefill]
    if len({g.draft_kind.policy.name for g in observing}) > 1:
        raise SystemExit("--drafts: at most one policy that observes the prompt (snapkv, tova or h2o) per run: "
                         "they need different statistics from the one shared prefill")
    return (observing or gens)[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--drafts", nargs="+", default=["streaming-256-orig", "snapkv-0.9", "int8"])
    parser.add_argument("--k", type=int, nargs="+", default=[4])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--confidence", type=float, nargs="+", default=None,
                        help="also run each draft with adaptive k at these confidences (SpeculativeConfig.confidence)")
    parser.add_argument("--out", default="runs/bench/speculative.csv")
    parser.add_argument("--plot", default=None, help="write speed-up against context to this PNG")
    args = parser.parse_args(argv)

    lm = lcx.load(args.model)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_out = []
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for batch in args.batches:
            for context in args.contexts:
                prompts = prose_prompts(lm, batch, context)
                drafts = {name: draft_config(name, context) for name in args.drafts}
                owner = owner_of(lm, list(drafts.values()), args.new, max(args.k))
                (cache, logits, rows), prefill_s = timed(lambda: owner.prefill_cache(prompts))
                base = plain(lm, owner, copied(cache), copied(logits), rows, args.new)
                line = dict(context=context, batch=batch, method="plain", k=0, speedup=1.0, same=True, accept="",
                            accept_rate="", prefill_s=prefill_s, **{c: base[c] for c in COLUMNS if c in base})
                writer.writerow(line)
                rows_out.append(line)
                print(f"ctx {context:6d} b {batch}: plain {base['tokens_per_s']:7.2f} tok/s (shared prefill "
                      f"{prefill_s:.0f} s)", flush=True)
                variants = [(name, draft, k, c) for name, draft in drafts.items() for k in args.k
                            for c in [None, *(args.confidence or [])]]
                for name, draft, k, c in variants:
                    r = speculative(lm, copied(cache), logits, rows, args.new, draft, k, c)
                    same = bool(np.array_equal(r["tokens"], base["tokens"]))
                    name = name if c is None else f"{name}@c{c:g}"
                    line = dict(context=context, batch=batch, method=name, k=k, same=same, prefill_s=prefill_s,
                                speedup=r["tokens_per_s"] / base["tokens_per_s"],
                                **{c: r[c] for c in COLUMNS if c in r})
                    writer.writerow(line)
                    f.flush()
                    rows_out.append(line)
                    print(f"ctx {context:6d} b {batch}: {name:>15} k={k} {r['tokens_per_s']:7.2f} tok/s "
                          f"x{line['speedup']:.2f} accept {r['accept']:.2f} "
                          f"drafts/verification {r['drafts_per_verification']:.2f} same={same} "
                          f"draft {r['draft_bytes'] / 2**20:.0f} MiB / KV {r['kv_bytes'] / 2**20:.0f} MiB",
                          flush=True)
                del cache
    if args.plot:
        plot(rows_out, args.plot)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for batch in sorted({r["batch"] for r in rows}):
        for method in sorted({r["method"] for r in rows if r["method"] != "plain"}):
            pts = sorted((r["context"], r["speedup"]) for r in rows if r["batch"] == batch and r["method"] == method)
            ax.plot(*zip(*pts), marker="o", label=f"{method}, batch {batch}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode speed-up over the full cache")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
