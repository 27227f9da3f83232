"""Serving throughput: requests sharing a long system prompt, continuous batching vs static batches.

``--requests`` requests (32), each a ``--system``-token system prompt (2K) shared by all, a question of 16-64 tokens
and an answer of 16-64 greedy tokens (drawn per request), on a random-weight Llama-style model. Three ways:

- ``lcx.engine.server.Server``: continuous batching over a paged cache (``--rows`` rows, 16-token pages), the system
  prompt's pages prefilled once and kept across requests;
- ``lcx.generate``, static batches of ``--rows`` requests in arrival order (each batch decodes to its longest
  answer: a finished row waits for the others);
- transformers ``generate`` on the same weights (``lcx.hf.save_hf``), static batches, left padding, greedy,
  float32 (``--no-transformers`` to skip).

Printed per way (one Markdown row): wall seconds for all requests (after a warm-up of the same shapes for the lcx
ways), requested tokens per second (only the tokens each request asked for count), prompt tokens run through the
model, and how many requests' tokens equal the server's.

    python experiments/bench/serving.py                      # 32 requests, 2K system prompt
    python experiments/bench/serving.py --system 512         # quicker
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import lcx  # noqa: E402
from lcx.engine.server import Server  # noqa: E402


def requests(args, vocab: int):
    rng = np.random.default_rng(0)
    system = rng.integers(0, vocab, args.system).tolist()
    prompts = [system + rng.integers(0, vocab, int(rng.integers(16, 65))).tolist() for _ in range(args.requests)]
    new = [int(rng.integers(16, 65)) for _ in range(args.requests)]
    return prompts, new


def serve(config, params, prompts, new, rows):
    server = Server(config, params, max_num_seqs=rows, max_len=max(map(len, prompts)) + max(new),
                    cache=lcx.CacheConfig(layout="paged", page_size=16), prefill_chunk=512, segment=16)
    ids = [server.submit(p, max_new_tokens=n) for p, n in zip(prompts, new)]
    out = server.run()
    return [out[i] for i in ids], server.prefill_tokens


def static(config, params, prompts, new, rows):
    out = []
    for lo in range(0, len(prompts), rows):
        batch, limits = prompts[lo:lo + rows], new[lo:lo + rows]
        result = lcx.generate(config, params, batch, max_new_tokens=max(limits))
        out += [row[:n].tolist() for row, n in zip(result.tokens, limits)]
    return out, sum(map(len, prompts))


def transformers_way(config, params, prompts, new, rows):
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as d:
        lcx.hf.save_hf(config, params, d)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    out = []
    for lo in range(0, len(prompts), rows):
        batch, limits = prompts[lo:lo + rows], new[lo:lo + rows]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(limits), do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        out += [g[width:width + n].tolist() for g, n in zip(gen, limits)]
    return out, sum(map(len, prompts))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system", type=int, default=2048)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--no-transformers", action="store_true")
    args = p.parse_args(argv)
    config = lcx.ModelConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=256,
                             max_position_embeddings=args.system + 256)
    params = lcx.init_params(config, jax.random.key(0))
    prompts, new = requests(args, config.vocab_size)
    wanted = sum(new)
    print(f"{jax.devices()[0].device_kind}, {config.n_layers} layers, d_model {config.d_model}; {args.requests} "
          f"requests: {args.system}-token system prompt + 16-64 question tokens, 16-64 new tokens each ({wanted} "
          f"in all); {args.rows} rows / batch\n")
    print("| way | seconds | requested tokens / s | prompt tokens prefilled | tokens = server's |")
    print("|---|---|---|---|---|")
    ways = [("lcx.engine.server.Server (continuous, paged, prefix pages)", serve, True),
            ("lcx.generate, static batches", static, True)]
    if not args.no_transformers:
        ways.append(("transformers generate, static batches", transformers_way, False))
    reference = None
    for name, fn, warm in ways:
        if warm:
            fn(config, params, prompts, new, args.rows)  # compile every shape
        start = time.perf_counter()
        out, prefilled = fn(config, params, prompts, new, args.rows)
        seconds = time.perf_counter() - start
        reference = out if reference is None else reference
        same = sum(a == b for a, b in zip(out, reference))
        print(f"| {name} | {seconds:.1f} | {wanted / seconds:.0f} | {prefilled} | {same}/{len(out)} |", flush=True)


if __name__ == "__main__":
    main()
