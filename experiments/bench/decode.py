"""Decode throughput: lcx.generate vs Hugging Face transformers generate (torch CPU) on the same weights,
and per-token decode time against context length.

    python experiments/bench/decode.py                       # the full table (CPU: a few minutes)
    python experiments/bench/decode.py --quick               # small sizes, a smoke run
    python experiments/bench/decode.py --skip-hf --contexts 512,2048,8192

Model: a 4-layer Llama, d_model 256, 8 query / 2 KV heads (GQA), vocab 32000, random weights, float32.
Both libraries run in this one process on the same weights (lcx loads the checkpoint transformers saved).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import numpy as np

import lcx
from lcx import hf
from lcx.config import CacheConfig
from lcx.engine import Generator


def _hf_model(vocab: int):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_vs_hf(model, config, params, batch: int, prompt_len: int, new: int, repeats: int) -> dict:
    import torch

    prompt = np.random.default_rng(batch).integers(0, config.vocab_size, (batch, prompt_len))
    gen = Generator(config, params, max_new_tokens=new, cache=CacheConfig(prefill_chunk=512))

    def run_lcx():
        state = gen.decode(gen.prefill(prompt))
        state.tokens.block_until_ready()
        return state

    ours = np.asarray(run_lcx().tokens)  # compiles
    t_lcx = _time(run_lcx, repeats)
    state = gen.prefill(prompt)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    jax.block_until_ready(gen.decode(state))
    t_decode = time.perf_counter() - t0
    row = {"batch": batch, "lcx_s": t_lcx, "lcx_tok_s": batch * new / t_lcx,
           "lcx_decode_tok_s": batch * new / t_decode}
    if model is not None:
        ids = torch.as_tensor(prompt)

        def run_hf():
            with torch.no_grad():
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False,
                                      pad_token_id=0)

        theirs = run_hf()[:, prompt_len:].numpy()
        t_hf = _time(run_hf, repeats)
        row.update(hf_s=t_hf, hf_tok_s=batch * new / t_hf, speedup=t_hf / t_lcx,
                   same_tokens=bool(np.array_equal(ours, theirs)))
    return row


def bench_context(config, params, contexts, steps: int, batch: int = 1, cache: CacheConfig | None = None
                  ) -> list[dict]:
    rows = []
    for ctx in contexts:
        gen = Generator(config, params, max_new_tokens=steps + 1, cache=cache or CacheConfig(prefill_chunk=1024))
        prompt = np.random.default_rng(ctx).integers(0, config.vocab_size, (batch, ctx))
        state = gen.prefill(prompt)
        jax.block_until_ready(gen.decode(state, steps=1))  # compile
        state = gen.decode(gen.prefill(prompt), steps=1)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        jax.block_until_ready(gen.decode(state, steps=steps))
        dt = (time.perf_counter() - t0) / steps
        rows.append({"context": ctx, "ms_per_token": dt * 1e3, "cache_MiB": state.cache.kv_bytes() / 2**20})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--skip-hf", action="store_true", help="lcx only")
    parser.add_argument("--impl", default="xla", help="attention.impl for lcx (default xla)")
    parser.add_argument("--contexts", default=None, help="comma-separated contexts for the per-token table")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--eviction-contexts", default=None,
                        help="contexts for the streaming-vs-full table (default 1024,4096,16384)")
    parser.add_argument("--eviction-steps", type=int, default=None,
                        help="decode steps timed per context in that table (default 32; 256 includes an eviction)")
    args = parser.parse_args()
    prompt_len, new = (64, 16) if args.quick else (512, 128)
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else (
        [256, 1024] if args.quick else [512, 1024, 2048, 4096, 8192])
    vocab = 32000

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; attention.impl={args.impl}")
    model = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.skip_hf:
            config = lcx.ModelConfig(vocab_size=vocab, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=688,
                                     max_position_embeddings=16384)
            params = lcx.init_params(config, jax.random.key(0))
        else:
            import torch

            torch.set_num_threads(max(1, torch.get_num_threads()))
            model = _hf_model(vocab)
            model.save_pretrained(tmp)
            config, params = hf.load_hf(tmp)
        config = dataclasses.replace(config, attention=lcx.AttentionConfig(impl=args.impl))

        print(f"\n## lcx.generate vs transformers generate (prompt {prompt_len}, {new} new tokens, greedy)")
        print("| batch | lcx tokens/s | lcx decode-only tokens/s | HF tokens/s | speedup | same tokens |")
        print("|---|---|---|---|---|---|")
        for batch in (1, 8):
            r = bench_vs_hf(model, config, params, batch, prompt_len, new, args.repeats)
            print(f"| {r['batch']} | {r['lcx_tok_s']:.1f} | {r['lcx_decode_tok_s']:.1f} | "
                  f"{r.get('hf_tok_s', float('nan')):.1f} | {r.get('speedup', float('nan')):.2f}x | "
                  f"{r.get('same_tokens', '-')} |", flush=True)

        print("\n## per-token decode time vs context (batch 1, full cache)")
        print("| context | ms / token | KV cache MiB |")
        print("|---|---|---|")
        for r in bench_context(config, params, contexts, steps=8 if args.quick else 32):
            print(f"| {r['context']} | {r['ms_per_token']:.2f} | {r['cache_MiB']:.1f} |", flush=True)

        ev_contexts = [int(c) for c in args.eviction_contexts.split(",")] if args.eviction_contexts else (
            [256, 1024] if args.quick else [1024, 4096, 16384])
        budget = 128 if args.quick else 1024
        streaming = CacheConfig(policy="streaming", budget=budget, sinks=4, interval=256, prefill_chunk=1024)
        print(f"\n## per-token decode time: streaming (budget {budget}, interval 256) vs full cache")
        print("| context | full ms / token | full cache MiB | streaming ms / token | streaming cache MiB |")
        print("|---|---|---|---|---|")
        steps = args.eviction_steps or (8 if args.quick else 32)
        for ctx in ev_contexts:
            f = bench_context(config, params, [ctx], steps=steps)[0]
            s = bench_context(config, params, [ctx], steps=steps, cache=streaming)[0]
            print(f"| {ctx} | {f['ms_per_token']:.2f} | {f['cache_MiB']:.1f} | {s['ms_per_token']:.2f} | "
                  f"{s['cache_MiB']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
