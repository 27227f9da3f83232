"""Several questions about one long context: prefill it once and fork, against one sequence per question.

The issue's scenario: ``--questions`` questions (8) of ``--question`` tokens each about one context of ``--context``
tokens (8K), greedy answers of ``--new`` tokens, a small random-weight Llama-style model, ``cache.policy: full``.
Three ways through the public API:

- ``separate``: a batch of ``context + question_i`` prompts (what lcx did before fork): every row prefills and stores
  the context;
- ``fork, contiguous``: ``prefill([context])``, ``Generator.fork(state, n)``, ``prefill(questions, state=...)``,
  ``decode``: the context is prefilled once, but each row keeps its own copy of its cache;
- ``fork, paged``: the same with ``CacheConfig(layout="paged", page_size=16)``: the rows share the context's pages;
- ``fork, contiguous / paged, int8``: the two forks with ``cache.kv_dtype: int8`` (8-bit codes and a float16 scale
  per token and KV head; on pages, scale pages beside the pool): their tokens are compared with each other (the
  8-bit values differ from the float ones, so separate's tokens need not be theirs);
- ``fork, SnapKV 1024``: the context compressed once to 1,024 tokens per layer (SnapKV, its last 32 tokens as the
  observation window), then forked (rows copied) and each question appended - and compressed again with the
  question as the window: kvpress users' "compress a document once, ask many questions" (tokens differ from the
  full cache's by design).

Printed per way (one Markdown row): prompt tokens through the model (prefill work), device KV
(``GenerateResult.cache_bytes``: for the paged cache the peak bytes of the pages in use; for the contiguous one the
arrays), its ratio to one sequence's KV (context + one question + answer, contiguous), wall seconds of the whole
request after a warm-up run of the same shapes, and whether every row's tokens equal ``separate``'s.

    python experiments/bench/prefix_sharing.py                    # 8 x 8K
    python experiments/bench/prefix_sharing.py --context 2048     # quicker
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import lcx  # noqa: E402
from lcx.config_base import format_bytes  # noqa: E402
from lcx.engine import Generator  # noqa: E402


def separate(config, params, context, questions, new: int):
    gen = Generator(config, params, max_new_tokens=new)
    result = gen.result(gen.decode(gen.prefill([context + q for q in questions])))
    return result, len(questions) * len(context) + sum(map(len, questions))


def forked(config, params, context, questions, new: int, layout: str, cache: lcx.CacheConfig | None = None):
    cache = cache or lcx.CacheConfig(layout=layout, page_size=16)
    # a full cache must hold the question after the context; an evicting one plans its budget + interval
    capacity = None if cache.make_policy().evicts else len(context) + max(map(len, questions)) + new
    gen = Generator(config, params, max_new_tokens=new, capacity=capacity, cache=cache)
    state = gen.fork(gen.prefill([context]), len(questions))
    result = gen.result(gen.decode(gen.prefill(questions, state=state)))
    return result, len(context) + sum(map(len, questions))


def timed(fn):
    fn()  # compile every shape
    start = time.perf_counter()
    result, work = fn()
    jax.block_until_ready(result.tokens)
    return result, work, time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--new", type=int, default=16)
    args = p.parse_args(argv)
    config = lcx.ModelConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=256,
                             max_position_embeddings=args.context + args.question + args.new)
    params = lcx.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    context = rng.integers(0, 512, args.context).tolist()
    questions = [rng.integers(0, 512, args.question - i % 3).tolist() for i in range(args.questions)]  # ragged
    one = Generator(config, params, max_new_tokens=args.new)
    one_kv = one.result(one.decode(one.prefill([context + questions[0]]))).cache_bytes
    print(f"{jax.devices()[0].device_kind}, {config.n_layers} layers, {config.n_kv_heads} KV heads x "
          f"{config.head_dim}, {args.questions} questions of ~{args.question} tokens about one {args.context}-token "
          f"context, {args.new} new tokens; one sequence's KV: {format_bytes(one_kv)}\n")
    print("| way | prompt tokens prefilled | device KV (cache_bytes) | x one sequence | seconds | tokens = separate |")
    print("|---|---|---|---|---|---|")
    want, int8 = None, {}
    for name, fn in (("separate", lambda: separate(config, params, context, questions, args.new)),
                     ("fork, contiguous", lambda: forked(config, params, context, questions, args.new, "contiguous")),
                     ("fork, paged", lambda: forked(config, params, context, questions, args.new, "paged")),
                     ("fork, contiguous, int8", lambda: forked(config, params, context, questions, args.new, "",
                                                               lcx.CacheConfig(kv_dtype="int8"))),
                     ("fork, paged, int8", lambda: forked(config, params, context, questions, args.new, "",
                                                          lcx.CacheConfig(layout="paged", page_size=16,
                                                                          kv_dtype="int8"))),
                     ("fork, SnapKV 1024", lambda: forked(config, params, context, questions, args.new, "contiguous",
                                                          lcx.CacheConfig(policy="snapkv", budget=1024, window=32)))):
        result, work, seconds = timed(fn)
        want = result.tokens if want is None else want
        same = bool(np.array_equal(result.tokens, want))
        if name.endswith("int8"):
            int8[name] = result.tokens
        print(f"| {name} | {work} | {format_bytes(result.cache_bytes)} | {result.cache_bytes / one_kv:.2f} | "
              f"{seconds:.1f} | {same} |", flush=True)
    a, b = int8.values()
    print(f"\nint8 on pages: tokens equal the contiguous int8 cache's: {bool(np.array_equal(a, b))}")


if __name__ == "__main__":
    main()
