"""kvpress's presses on the passkey prompts of lcx's one-shot ablation: the reference accuracy for the same press,
compression ratio, model and prompts (``experiments/configs/smollm2_passkey_compression.yaml``).

The prompts are built exactly as ``lcx run`` builds them (``EvalConfig`` defaults: seed, validation split, the
checkpoint's own tokenizer; the totals of prompt tokens printed here equal ``prompt_tokens`` in the run's
results.csv). kvpress's protocol, as lcx's ``one_shot``: the context (``ids[:context_len]``) prefilled under the
press, which compresses it once; then the question read into the compressed cache and greedy decoding, press removed,
positions continuing from the context's length (kvpress's pipeline); graded by the task's own ``score``.

Usage::

    python experiments/kvpress_passkey.py runs/models/SmolLM2-135M-Instruct --ratios 0.5 0.75
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def presses(name: str, ratio: float):
    import kvpress

    return {
        "expected_attention": kvpress.ExpectedAttentionPress(ratio, n_future_positions=512, n_sink=4),
        "tova": kvpress.TOVAPress(ratio),
        "snapkv": kvpress.SnapKVPress(ratio, window_size=32, kernel_size=5),
        # reconstruction scoring: kvpress's default moves budget between layers; layerwise keeps each layer's
        "kvzip": kvpress.KVzipPress(ratio, n_sink=4, chunk_size=2048),
        "kvzip_layerwise": kvpress.KVzipPress(ratio, n_sink=4, chunk_size=2048, layerwise=True),
    }[name]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="HF checkpoint directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    parser.add_argument("--presses", nargs="+", default=["expected_attention", "tova", "snapkv"])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    import transformers

    from lcx.data.tokenizer import HFTokenizer
    from lcx.eval.config import EvalConfig
    from lcx.eval.grid import _tokenized
    from lcx.eval.stats import wilson_interval

    ev = EvalConfig(task="passkey", lengths=(args.length,), samples=args.samples)
    tok = HFTokenizer(args.model)
    task = _tokenized(ev.make_task(), tok, ev.chat)
    examples = task.examples(ev.seed, 0, args.samples, args.length, "validation")
    print(f"{len(examples)} prompts, {sum(ex.prompt_len for ex in examples)} prompt tokens")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()
    max_new = max(len(tok.encode(ex.answer, bos=False)) for ex in examples) + 2
    rows = []
    for name in args.presses:
        for ratio in args.ratios:
            start, right = time.perf_counter(), 0
            for ex in examples:
                ids = torch.tensor([ex.prompt_ids[:ex.context_len].tolist()])
                question = ex.prompt_ids[ex.context_len:].tolist()
                cache = transformers.DynamicCache()
                with torch.no_grad():
                    with presses(name, ratio)(model):
                        model(input_ids=ids, past_key_values=cache)
                    position, out, tokens = ex.context_len, None, []
                    feed = question
                    for _ in range(max_new):
                        pos = torch.arange(position, position + len(feed))[None]
                        out = model(input_ids=torch.tensor([feed]), past_key_values=cache, position_ids=pos)
                        position += len(feed)
                        nxt = int(out.logits[0, -1].argmax())
                        if nxt == tok.eos_id:
                            break
                        tokens.append(nxt)
                        feed = [nxt]
                right += task.score(ex, tok.decode(np.array(tokens)))
            lo, hi = wilson_interval(right, len(examples))
            rows.append(f"| {name} | {ratio:g} | {right:g}/{len(examples)} | {right / len(examples):.0%} "
                        f"({lo:.0%}-{hi:.0%}) | {time.perf_counter() - start:.0f} |")
            print(rows[-1], flush=True)
    print("\n| press (kvpress) | ratio | right | accuracy (95% interval) | seconds |\n|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
