"""The rest of the KVzip question of docs/real_model (e): kvpress's own ``KVzipPress`` on the chat prose prompts, and
why one budget per KV head loses the passkey there - measured on kvpress's scores, so the answer does not rest on
lcx's implementation.

    python experiments/real_model/kvzip_prose_heads.py runs/models/SmolLM2-135M-Instruct [--prompts 8]

The prompts are ``kvzip_protocols.py``'s (``lm_kvzip_passkeys.py``'s pydoc_data prose of ~1,024 tokens, a passkey
sentence at a random depth, the question, in the chat template), read with kvpress's protocol: the context (up to the
question) prefilled under the press, the question and the answer after it. Rows:

- the full cache, and kvpress's ``KVzipPress`` at ``--compression`` with its default allocation (the scores of all
  layers and heads pooled: one global top-k), with ``layerwise=True`` (one budget per layer, pooled over its heads)
  and with its scores cut per KV head (``compress_post`` replaced: each head keeps its own top ``(1 - c)``, lcx's
  default allocation);
- per-head analysis on the same scores (captured from the default press before it compresses): for each layer and
  KV head, the share of the passkey's digit tokens (both occurrences) that the head's own top ``(1 - c)`` of the
  context keeps (a budget per KV head, lcx's default) and that the global top-k keeps there (kvpress's default), and
  how many slots the global top-k gives each head against its per-head share.

Arrays in ``runs/kvzip_prose_heads.npz``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from pathlib import Path

import numpy as np

import lcx

sys.path.insert(0, str(Path(__file__).parent))
from kvzip_protocols import split_at_question  # noqa: E402
from lm_kvzip_passkeys import passkey_texts  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
import kvpress_eval  # noqa: E402


class _Example:
    def __init__(self, ids, cut):
        self.prompt_ids, self.context_len = np.asarray(ids), cut


def key_positions(tok, ids: list[int], cut: int, key: str) -> list[int]:
    """Context token indices whose text is part of the passkey's digits (every occurrence before ``cut``)."""
    hits, text = [], ""
    spans = []
    for i, t in enumerate(ids[:cut]):
        piece = tok.decode([t])
        spans.append((len(text), len(text) + len(piece)))
        text += piece
    start = text.find(key)
    while start >= 0:
        hits += [i for i, (a, b) in enumerate(spans) if a < start + len(key) and b > start]
        start = text.find(key, start + 1)
    return sorted(set(hits))


def main() -> None:
    import kvpress
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an HF directory")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--compression", type=float, default=0.75)
    parser.add_argument("--new", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    lm = lcx.load(args.model)
    texts, keys = passkey_texts(args.prompts, args.tokens, lm)
    prompts = [lm.encode(t, chat=True) for t in texts]
    cuts = [split_at_question(lm.tokenizer, p) for p in prompts]
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    print(f"{len(prompts)} chat prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"compression {args.compression}, kvpress {importlib.metadata.version('kvpress')}")

    def answer(ex, press):
        tokens = kvpress_eval.generate(model, ex, press, args.new, lm.eos_id)
        return lm.tokenizer.decode(tokens)

    captured = []
    original = kvpress.KVzipPress.compress_post

    def capture(self, model_):  # the scores of every layer and head, before the press turns them into a mask
        captured.append(self.score_val.detach().clone().float().numpy())  # [L, b, k, n]
        return original(self, model_)

    def cut_per_head(self, model_):  # the same scores, each KV head keeping its own top (1 - c) of the context
        self.score_val[..., :self.n_sink] = self.score_val.amax() + 1.0
        _, b, k, n = self.score_val.shape
        pruned = int(n * self.compression_ratio)
        for layer in model_.model.layers:
            module = layer.self_attn
            drop = torch.topk(-self.score_val[int(module.layer_idx)], pruned, dim=-1).indices  # [b, k, pruned]
            module.masked_key_indices = (torch.arange(b).repeat_interleave(k * pruned),
                                         torch.arange(k).repeat_interleave(pruned).repeat(b), drop.reshape(-1))

    kvpress.KVzipPress.compress_post = capture
    rows = {"full cache": [], "KVzipPress (default: global over layers and heads)": [],
            "KVzipPress layerwise=True (per layer)": [],
            "KVzipPress scores, one budget per KV head (compress_post replaced)": []}
    per_head, pooled, shares = [], [], []
    for i, (ids, cut, key) in enumerate(zip(prompts, cuts, keys)):
        t0 = time.perf_counter()
        ex = _Example(ids, cut)
        outs = [answer(ex, _null_press()),
                answer(ex, kvpress.KVzipPress(args.compression, n_sink=4, chunk_size=2048)),
                answer(ex, kvpress.KVzipPress(args.compression, n_sink=4, chunk_size=2048, layerwise=True))]
        kvpress.KVzipPress.compress_post = cut_per_head
        outs.append(answer(ex, kvpress.KVzipPress(args.compression, n_sink=4, chunk_size=2048)))
        kvpress.KVzipPress.compress_post = capture
        for name, out in zip(rows, outs):
            rows[name].append(key in out)
        scores = captured[-2][:, 0]  # the default press's (then layerwise's): [L, k, n]
        scores[..., :4] = scores.max() + 1.0  # the sinks, as the press keeps them
        digits = key_positions(lm.tokenizer, ids, cut, key)
        n = scores.shape[-1]
        keep = n - int(n * args.compression)  # a head's own share of the context
        head_cut = -np.sort(-scores, axis=-1)[..., keep - 1:keep]  # [L, k, 1] the head's lowest kept score
        global_cut = -np.sort(-scores.reshape(-1))[scores.size - int(scores.size * args.compression) - 1]
        per_head.append(np.mean(scores[..., digits] >= head_cut, axis=-1))  # [L, k] share of digit tokens kept
        pooled.append(np.mean(scores[..., digits] >= global_cut, axis=-1))
        shares.append(np.mean(scores >= global_cut, axis=-1) / (keep / n))  # [L, k] global slots / per-head slots
        print(f"[{i + 1}/{len(prompts)}] {time.perf_counter() - t0:.0f} s, {len(digits)} key tokens: "
              f"{' / '.join(repr(o) for o in outs)}; digit tokens kept, mean over (layer, head): "
              f"{per_head[-1].mean():.0%} per head, {pooled[-1].mean():.0%} global", flush=True)
    kvpress.KVzipPress.compress_post = original
    print("\n| kvpress 0.5.5, question after the compression | passkeys found |\n|---|---:|")
    for name, found in rows.items():
        print(f"| {name} | {sum(found)}/{len(found)} |")
    ph, gl, sh = np.stack(per_head), np.stack(pooled), np.stack(shares)  # [prompts, L, k]
    print(f"\nDigit tokens kept, mean over prompts, layers and heads: per head {ph.mean():.1%}, global {gl.mean():.1%}")
    print(f"(layer, head) pairs keeping every digit token: per head {np.mean(ph == 1):.1%}, "
          f"global {np.mean(gl == 1):.1%}")
    print(f"Global top-k slots of a head over its per-head share: median {np.median(sh):.2f}, "
          f"10th-90th percentile {np.percentile(sh, 10):.2f}-{np.percentile(sh, 90):.2f}")
    print("By layer (per head / global share of digit tokens kept; global slots over per-head share):")
    for layer in range(ph.shape[1]):
        print(f"  {layer:2d}: {ph[:, layer].mean():.0%} / {gl[:, layer].mean():.0%}; {sh[:, layer].mean():.2f}")
    Path("runs").mkdir(exist_ok=True)
    np.savez(Path("runs") / "kvzip_prose_heads.npz", per_head=ph, global_=gl, shares=sh,
             found=np.asarray([rows[k] for k in rows]))


def _null_press():
    import contextlib

    return lambda model: contextlib.nullcontext()


if __name__ == "__main__":
    main()
