"""lcx's ``kvzip`` vs kvpress's ``KVzipPress`` on a real model: kept (layer, KV head, position) sets and greedy tokens.

``tests/test_kvpress_parity.py`` shows exact agreement on a random Llama; this repeats it on a real checkpoint
(SmolLM2-135M-Instruct: 30 layers, 3 KV heads) and real text (BOS + the first ``--length`` tokens of English prose,
``lcx.data.haystack.prose_text()``), where float32 differences between PyTorch and XLA can flip near-ties.

Both sides use kvpress's reconstruction prompt as kvpress builds it from the tokenizer's chat template (the
instruction, the template's close of the user turn and opening of the reply; the first ``prefix_length`` prompt
tokens - the template's header - never repeated), passes of ``--chunk`` context tokens, 4 sinks, and one budget per
layer spread over its KV heads by score (kvpress ``layerwise=True``; lcx ``head_budget: adaptive, head_floor: 0``,
capped at the whole layer) - or, with ``--selection global``, one budget for the whole cache spread over every
(layer, KV head) by score (kvpress's default; lcx ``head_budget: global, head_floor: 0``, capped at the prompt).
kvpress masks the dropped keys (its AdaKV mechanism); lcx evicts them.

Usage::

    python experiments/kvzip_crosscheck.py runs/models/SmolLM2-135M-Instruct --length 1024 --ratios 0.5 0.75 \
        [--selection global]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")  # compare float32 with float32


def kvpress_prompt_ids(path: Path):
    """kvpress's ``KVzipPress`` setup as its ``__call__`` computes it: ``(prefix_length, suffix ids, first, later)``."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tok.apply_chat_template([{"role": "user", "content": dummy + separator}], add_generation_prompt=True,
                                   tokenize=False)
    context, suffix = text.split(separator)
    prefix = context.split(dummy)[0]
    encode = lambda s: tuple(tok.encode(s, add_special_tokens=False))  # noqa: E731
    return (len(encode(prefix)), encode(suffix), encode("\n\nRepeat the previous context exactly."),
            encode("\n\nRepeat the part of the previous context exactly, starting with"))


def kvpress_run(path: Path, prompt: list[int], ratio: float, chunk: int, new_tokens: int, selection: str):
    """``kept [L, k, P]`` (not masked), greedy tokens, seconds."""
    import kvpress
    import numpy as np
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    start = time.perf_counter()
    press = kvpress.KVzipPress(ratio, layerwise=selection == "layerwise", n_sink=4, chunk_size=chunk)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        cache = transformers.DynamicCache()
        with press(model):
            out = model(input_ids=ids, past_key_values=cache)
        cfg = model.config
        kept = np.ones((cfg.num_hidden_layers, cfg.num_key_value_heads, len(prompt)), bool)
        for layer, block in enumerate(model.model.layers):
            _, heads, positions = block.self_attn.masked_key_indices
            kept[layer, heads.numpy(), positions.numpy()] = False
        # the logits of the prefill came before the compression: kvpress's pipeline reads the question after it;
        # here greedy decoding continues from the last prompt token under the masks
        tokens, position = [int(out.logits[0, -1].argmax())], len(prompt)
        for _ in range(new_tokens - 1):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                        position_ids=torch.tensor([[position]]))
            tokens.append(int(out.logits[0, -1].argmax()))
            position += 1
    return kept, np.array(tokens), time.perf_counter() - start


def lcx_run(path: Path, prompt: list[int], ratio: float, chunk: int, new_tokens: int, reconstruction,
            selection: str):
    import numpy as np
    from kvpress.utils import compute_n_kept

    from lcx import hf
    from lcx.cache.config import CacheConfig
    from lcx.engine import Generator

    config, weights = hf.load_hf(path)
    start = time.perf_counter()
    budget = compute_n_kept(len(prompt), ratio)
    cache = CacheConfig(policy="kvzip", budget=budget, interval=len(prompt) - budget + new_tokens,
                        prefill_chunk=len(prompt), sinks=4, chunk=chunk,
                        head_budget="adaptive" if selection == "layerwise" else "global", head_floor=0.0,
                        head_cap=float(config.n_kv_heads) if selection == "layerwise" else len(prompt) / budget)
    gen = Generator(config, weights, max_new_tokens=new_tokens, cache=cache, reconstruction=reconstruction)
    state = gen.prefill([prompt])
    pos, valid = np.asarray(state.cache.pos)[:, 0], np.asarray(state.cache.valid)[:, 0]
    kept = np.zeros((config.n_layers, config.n_kv_heads, len(prompt)), bool)
    for layer in range(config.n_layers):
        for head in range(config.n_kv_heads):
            kept[layer, head, pos[layer, head][valid[layer, head]]] = True
    tokens = np.asarray(gen.result(gen.decode(state)).tokens[0])
    return kept, tokens, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="HF checkpoint directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    parser.add_argument("--chunk", type=int, default=512, help="context tokens per reconstruction pass")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--selection", choices=["layerwise", "global"], default="layerwise",
                        help="one budget per layer (kvpress layerwise=True) or one for the cache (kvpress's default)")
    args = parser.parse_args(argv)

    import numpy as np

    from lcx.cache.reconstruct import Reconstruction
    from lcx.data.haystack import prose_text
    from lcx.data.tokenizer import HFTokenizer

    prompt = HFTokenizer(args.model).encode(prose_text()[:8 * args.length], bos=True)[:args.length]
    skip, suffix, first, later = kvpress_prompt_ids(args.model)
    reconstruction = Reconstruction(first=first, later=later, suffix=suffix, skip=skip)
    print(f"{len(prompt)} prompt tokens, {skip} not repeated, passes of {args.chunk}")
    rows = []
    for ratio in args.ratios:
        ref, ref_tokens, ref_s = kvpress_run(args.model, prompt, ratio, args.chunk, args.new_tokens, args.selection)
        got, tokens, s = lcx_run(args.model, prompt, ratio, args.chunk, args.new_tokens, reconstruction,
                                 args.selection)
        same = np.mean([(ref[i, h] == got[i, h]).all() for i in range(ref.shape[0]) for h in range(ref.shape[1])])
        layer_jaccard = [np.sum(ref[i] & got[i]) / np.sum(ref[i] | got[i]) for i in range(ref.shape[0])]
        equal = int(np.sum(np.cumprod(ref_tokens == tokens)))
        rows.append(f"| {ratio:g} | {int(ref.sum())} / {int(got.sum())} | {same:.1%} | {np.mean(layer_jaccard):.4f} "
                    f"(min {np.min(layer_jaccard):.4f}) | {equal}/{len(tokens)} | {ref_s:.0f} | {s:.0f} |")
        print(rows[-1], flush=True)
    print("\n| ratio | kept (kvpress / lcx) | identical (layer, KV head) sets | layer Jaccard | greedy tokens equal "
          "| kvpress s | lcx s |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
