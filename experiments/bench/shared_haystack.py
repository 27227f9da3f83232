"""An evaluation whose haystacks several questions share prefills each haystack once.

RULER's ``niah_multikey_1`` (4 needles in prose, one asked) with ``questions_per_haystack: 4``: each haystack is
asked about each of its 4 keys. A real model in its own tokens (default: SmolLM2-135M-Instruct, chat template),
``--samples`` prompts of ``--length`` tokens, through ``lcx.eval.evaluate.retrieval_outputs`` - what ``lcx run``'s
eval and ablate stages call - in batches of 4, for three settings:

- ``one_shot, full``: the context prefilled at once, the question read after it; each run of equal contexts in a
  batch is prefilled once and forked (``Generator.fork``);
- ``one_shot, snapkv c=0.5``: the same, the context compressed once to half its length before the fork;
- ``streaming, full, paged``: the whole prompt through a paged cache; the whole pages a batch's consecutive prompts
  start with are prefilled once and shared (``Generator.prefill``).

Each against the same examples with sharing off (one_shot: every row prefilled; streaming: the contiguous layout).
Printed per setting (one Markdown row): prompt tokens asked and prefilled, wall seconds of the second of two runs
(the first compiles), accuracy, and whether the generated answers are identical with and without sharing.

    python experiments/bench/shared_haystack.py                     # SmolLM2, 8 prompts of 1,024 tokens
    python experiments/bench/shared_haystack.py --length 2048 --samples 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import lcx  # noqa: E402
from lcx.data import make_task  # noqa: E402
from lcx.data.tokenizer import resolve_tokenizer  # noqa: E402
from lcx.eval import evaluate, one_shot  # noqa: E402
from lcx.checkpoints.sources import load_source  # noqa: E402

BATCH = 4


def run(config, params, task, args, cache, protocol, share: bool):
    """(outputs, counts, seconds of the second run, accuracy)."""
    def once():
        counts = {}
        original = one_shot._runs
        if not share:  # every row prefilled on its own
            one_shot._runs = lambda prompts: [(i, 1) for i in range(len(prompts))]
        try:
            examples, outputs = evaluate.retrieval_outputs(
                config, params, task, length=args.length, depth=None, samples=args.samples, batch_size=BATCH,
                seed=0, cache=cache, max_new_tokens=12, protocol=protocol, counts=counts)
        finally:
            one_shot._runs = original
        return examples, outputs, counts

    once()
    start = time.perf_counter()
    examples, outputs, counts = once()
    seconds = time.perf_counter() - start
    accuracy = sum(task.score(ex, out) for ex, out in zip(examples, outputs)) / len(outputs)
    return outputs, counts, seconds, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/models/SmolLM2-135M-Instruct")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    config, params, _ = load_source(args.checkpoint)
    tok = resolve_tokenizer("auto", init_from=args.checkpoint, vocab_size=config.vocab_size)
    task = make_task("niah_multikey_1", {"questions_per_haystack": 4}).with_tokenizer(tok, chat=True)
    half = args.length // 2
    settings = [
        ("one_shot, full", "one_shot", lcx.CacheConfig(), lcx.CacheConfig()),
        ("one_shot, snapkv c=0.5", "one_shot",
         lcx.CacheConfig(policy="snapkv", budget=half, window=32, interval=args.length, prefill_chunk=256),
         None),
        ("streaming, full, paged", "streaming", lcx.CacheConfig(layout="paged", page_size=16), lcx.CacheConfig()),
    ]
    print(f"{config.n_layers} layers, niah_multikey_1 x 4 questions per haystack, {args.samples} prompts of "
          f"{args.length} tokens, batches of {BATCH}\n")
    print("| setting | prompt tokens | prefilled (shared) | prefilled (not shared) | seconds shared | seconds not "
          "shared | accuracy | same answers |")
    print("|---|---|---|---|---|---|---|---|")
    for name, protocol, cache, alone in settings:
        shared_out, counts, seconds, accuracy = run(config, params, task, args, cache, protocol, share=True)
        alone_out, alone_counts, alone_seconds, _ = run(config, params, task, args, alone or cache, protocol,
                                                        share=False)
        print(f"| {name} | {counts['prompt_tokens']:,} | {counts['prefilled_tokens']:,} | "
              f"{alone_counts['prefilled_tokens']:,} | {seconds:.1f} | {alone_seconds:.1f} | {accuracy:.0%} | "
              f"{shared_out == alone_out} |", flush=True)


if __name__ == "__main__":
    main()
