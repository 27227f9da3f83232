"""Which way to group 4- and 2-bit keys on a real model: per channel (KIVI) or per token.

For every layer of a checkpoint, the keys of one long prose prompt are quantized with ``lcx.kernels.lowbit`` -
per channel (a scale and zero per ``group`` tokens of each channel) or per token (per ``group`` channels of each
token) - and the last ``queries`` positions' attention over them is compared with the float attention: the total
variation distance between the two softmax rows (0 = the same distribution, 1 = disjoint), averaged over queries,
heads and layers, and the share of rows whose argmax key changed. The keys are the rotated ones a cache stores.

    python experiments/bench/lowbit_keys.py runs/models/SmolLM2-135M-Instruct --length 2048

A second table asks what eviction does to per-channel groups: ``--evictions`` rounds each keep a random 3/4 of the
tokens (the same ones for every scheme; the newest ``queries`` always), then the survivors are either re-grouped and
quantized again from their dequantized values (what compacting a cache of codes into new groups does) or keep the
scales of the groups they were quantized in (the error of quantizing once), against the float keys of the same
survivors.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from lcx import hf
from lcx.data import make_task, resolve_tokenizer
from lcx.kernels import lowbit
from lcx.model import attention_inputs


def quantized_keys(keys: np.ndarray, scheme: str, kv_dtype: str, group: int) -> np.ndarray:
    """``keys [t, d]`` of one KV head through ``scheme`` (``channel`` / ``token``) and back, float32."""
    k = jnp.asarray(keys)
    if scheme == "channel":
        return np.asarray(lowbit.dequantize_channels(*lowbit.quantize_channels(k, kv_dtype, group), kv_dtype))
    return np.asarray(lowbit.dequantize_tokens(*lowbit.quantize_tokens(k, kv_dtype, group), kv_dtype))


def attention_rows(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """Causal softmax rows of the last ``len(q)`` positions over ``k [t, d]``: ``[n, t]``."""
    t, n = k.shape[0], q.shape[0]
    logits = (q @ k.T) * scale
    mask = np.arange(t)[None, :] <= (t - n + np.arange(n))[:, None]
    logits = np.where(mask, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="an HF directory (its tokenizer.json is used)")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--groups", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--evictions", type=int, default=3, help="rounds of keeping 3/4 of the tokens (second table)")
    args = parser.parse_args(argv)

    config, params = hf.load_hf(args.checkpoint)
    tok = resolve_tokenizer("auto", init_from=args.checkpoint)
    text = "".join(t for _, t in make_task("prose").documents())
    ids = np.asarray(tok.encode(text)[:args.length])[None]
    q_all, k_all = (np.asarray(x) for x in attention_inputs(config, params, jnp.asarray(ids), rotated=True))
    L, _, t, h, d = q_all.shape
    kv = k_all.shape[3]
    g = h // kv
    scale = (config.query_scale or d) ** -0.5
    print(f"{args.checkpoint}: {L} layers, {h} query / {kv} KV heads, head_dim {d}, {t} tokens, last {args.queries} "
          "queries; TV = total variation distance of the attention rows to float's (mean), flips = argmax changed")
    print("| keys | group | TV int4 | flips int4 | TV int2 | flips int2 |")
    print("|---|---|---|---|---|---|")
    for scheme in ("channel", "token"):
        for group in args.groups:
            cells = []
            for kv_dtype in ("int4", "int2"):
                tvs, flips = [], []
                for layer in range(L):
                    for head in range(kv):
                        k = k_all[layer, 0, :, head]
                        k_hat = quantized_keys(k, scheme, kv_dtype, group)
                        for qh in range(head * g, (head + 1) * g):
                            q = q_all[layer, 0, -args.queries:, qh]
                            p, p_hat = attention_rows(q, k, scale), attention_rows(q, k_hat, scale)
                            tvs.append(0.5 * np.abs(p - p_hat).sum(-1).mean())
                            flips.append(np.mean(p.argmax(-1) != p_hat.argmax(-1)))
                cells += [f"{np.mean(tvs):.4f}", f"{100 * np.mean(flips):.1f}%"]
            print(f"| per {scheme} | {group} | " + " | ".join(cells) + " |")
    evictions(q_all, k_all, g, scale, args)


def _survivors(t: int, queries: int, rounds: int, group: int, seed: int = 0) -> list[np.ndarray]:
    """The kept token indices after each round: a random 3/4 (a multiple of ``group``), the newest ``queries`` kept."""
    rng, kept, out = np.random.default_rng(seed), np.arange(t), []
    for _ in range(rounds):
        n = (len(kept) * 3 // 4) // group * group
        old, new = kept[:-queries], kept[-queries:]
        kept = np.concatenate([np.sort(rng.choice(old, n - queries, replace=False)), new])
        out.append(kept)
    return out


def evictions(q_all: np.ndarray, k_all: np.ndarray, g: int, scale: float, args) -> None:
    L, _, t, _, _ = q_all.shape
    group = min(args.groups)
    rounds = _survivors(t, args.queries, args.evictions, group)
    print(f"\nper-channel keys (groups of {group}) after {args.evictions} evictions of 1/4 "
          f"({t} -> {len(rounds[-1])} tokens): TV of the last {args.queries} queries' rows to float's")
    print("| kv_dtype | quantized once, original groups | re-quantized at each eviction |")
    print("|---|---|---|")
    for kv_dtype in ("int4", "int2"):
        once, again = [], []
        for layer in range(L):
            for head in range(k_all.shape[3]):
                k = k_all[layer, 0, :, head]
                k_again = quantized_keys(k, "channel", kv_dtype, group)  # the first quantization, all tokens
                k_once = k_again[rounds[-1]]
                for kept, prev in zip(rounds, [np.arange(t)] + rounds[:-1]):
                    index = np.searchsorted(prev, kept)  # kept tokens' rows in the previous round's array
                    k_again = quantized_keys(k_again[index], "channel", kv_dtype, group)
                k_kept = k[rounds[-1]]
                for qh in range(head * g, (head + 1) * g):
                    q = q_all[layer, 0, -args.queries:, qh]
                    p = attention_rows(q, k_kept, scale)
                    once.append(0.5 * np.abs(p - attention_rows(q, k_once, scale)).sum(-1).mean())
                    again.append(0.5 * np.abs(p - attention_rows(q, k_again, scale)).sum(-1).mean())
        print(f"| {kv_dtype} | {np.mean(once):.4f} | {np.mean(again):.4f} |")


if __name__ == "__main__":
    main()
