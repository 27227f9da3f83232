"""Prefill and scoring speed as users call them, on real model shapes: lcx with default settings vs transformers.

    python experiments/bench/prefill.py                                   # the 135M shape, 1k-8k (CPU: ~15 min)
    python experiments/bench/prefill.py --lengths 2048 --score-length 2048
    python experiments/bench/prefill.py --shapes llama-1b --lengths 1024 2048 --dtype bfloat16   # a GPU

Per shape: a random-weight transformers Llama (``tie_word_embeddings`` as the real checkpoint has it) saved with
``save_pretrained`` and loaded by ``lcx.hf.load_hf``: the same weights in one process.

- **prefill**: ``Generator(config, params, max_new_tokens=1).prefill(ids)`` with default settings - a fresh
  Generator per call, as user code does - against ``model(ids, logits_to_keep=1)`` (transformers' prefill: the last
  position's logits only; sdpa attention). ``first call`` is lcx's first prefill of that length in the process
  (compilation included); the timed columns are the best of ``--repeats`` calls after it.
- **scoring** (perplexity under a cache policy): ``prefill`` of a ``--prefix``-token prefix, then
  ``Generator.score`` of the rest, against one transformers forward pass over all the tokens (every position's
  logits, what perplexity needs). Policies: ``full``, ``streaming`` (budget 128, 4 sinks) and ``h2o`` (budget 128),
  interval 64 (the default). ``logprob err`` is the largest difference of lcx's log-probabilities from
  transformers' log-softmax of the full-attention pass - for ``full`` a parity check, for the others the effect of
  eviction.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import lcx  # noqa: E402
from lcx import hf  # noqa: E402
from lcx.engine import Generator  # noqa: E402
from decode_sweep import Shape, hf_model  # noqa: E402  (the sibling script: shapes, the transformers model)


SHAPES = {
    # SmolLM2-135M's shape (a Llama: 30 layers, GQA 9 / 3, head_dim 64, tied embeddings)
    "smollm2-135m": Shape("smollm2-135m", 49152, 576, 30, 9, 3, 1536, tied=True),
    # Llama 3.2 1B's shape: 5 GB of float32 weights per library; minutes per call on a 2-core CPU
    "llama-1b": Shape("llama-1b", 128256, 2048, 16, 32, 8, 8192, tied=True),
}
POLICIES = {
    "full": {},
    "streaming": dict(policy="streaming", budget=128, sinks=4),
    "h2o": dict(policy="h2o", budget=128),
}


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def lcx_prefill(config, params, ids):
    gen = Generator(config, params, max_new_tokens=1)
    return jax.block_until_ready(gen.prefill(ids).logits)


def run_prefill(shape, model, config, params, lengths, repeats):
    import torch

    print(f"\n### Prefill: {shape.name}, batch 1\n")
    print("| tokens | lcx first call s | lcx s | HF s | lcx / HF speed | lcx tok/s | last logits max err |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in lengths:
        ids = np.random.default_rng(n).integers(0, shape.vocab, (1, n))
        t0 = time.perf_counter()
        logits = np.asarray(lcx_prefill(config, params, ids))
        first = time.perf_counter() - t0
        t_lcx = best(lambda: lcx_prefill(config, params, ids), repeats)
        tids = torch.as_tensor(ids, device=model.device)

        def run_hf():
            with torch.inference_mode():
                out["hf"] = model(tids, logits_to_keep=1).logits[:, -1].float().cpu().numpy()

        out = {}
        run_hf()  # warm-up
        t_hf = best(run_hf, repeats)
        err = float(np.abs(logits - out["hf"]).max())
        print(f"| {n} | {first:.2f} | {t_lcx:.2f} | {t_hf:.2f} | {t_hf / t_lcx:.2f}x | {n / t_lcx:.0f} | "
              f"{err:.1e} |", flush=True)


def run_score(shape, model, config, params, length, prefix, repeats, policies):
    import torch

    print(f"\n### Scoring: {shape.name}, {length - prefix} tokens after a {prefix}-token prefix, batch 1\n")
    ids = np.random.default_rng(0).integers(0, shape.vocab, (1, length))
    tids = torch.as_tensor(ids, device=model.device)
    with torch.inference_mode():
        ref = torch.log_softmax(model(tids).logits.float(), dim=-1)[0, prefix - 1:-1]
        ref = ref.gather(-1, tids[0, prefix:, None])[:, 0].cpu().numpy()

    def run_hf():
        with torch.inference_mode():
            model(tids)

    t_hf = best(run_hf, repeats)
    print(f"One transformers forward pass over the {length} tokens (all logits): {t_hf:.2f} s.\n")
    print("| policy | lcx first call s | lcx s | lcx tok/s | lcx / HF forward time | logprob err vs full HF |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in policies:
        cache = lcx.CacheConfig(**POLICIES[name])

        def run_lcx():
            gen = Generator(config, params, max_new_tokens=length - prefix, cache=cache)
            out["lp"] = gen.score(gen.prefill(ids[:, :prefix]), ids[:, prefix:])[1][0]

        out = {}
        t0 = time.perf_counter()
        run_lcx()
        first = time.perf_counter() - t0
        t_lcx = best(run_lcx, repeats)
        err = float(np.abs(out["lp"] - ref).max())
        print(f"| {name} | {first:.2f} | {t_lcx:.2f} | {(length - prefix) / t_lcx:.0f} | {t_lcx / t_hf:.2f}x | "
              f"{err:.1e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=["smollm2-135m"], choices=sorted(SHAPES))
    parser.add_argument("--lengths", nargs="*", type=int, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--score-length", type=int, default=2048, help="tokens of the scoring run (0: none)")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.default_backend()}; {args.dtype}; best of {args.repeats} calls after the "
          "first")
    for name in args.shapes:
        shape = SHAPES[name]
        model = hf_model(shape, args.dtype, max(args.lengths + [args.score_length, 8192]) + 64, "sdpa")
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            config, params = hf.load_hf(tmp, dtype=args.dtype)
        if args.lengths:
            run_prefill(shape, model, config, params, args.lengths, args.repeats)
        if args.score_length:
            run_score(shape, model, config, params, args.score_length, args.prefix, args.repeats, args.policies)


if __name__ == "__main__":
    main()
