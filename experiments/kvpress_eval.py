"""kvpress's presses on the prompts of an lcx experiment's evaluation: the reference score of the same press,
compression ratio, model and prompts, in the same tables as ``lcx run`` writes (per task, macro average, 95% interval).

The experiment config (e.g. ``experiments/configs/smollm2_ruler_grid.yaml``) supplies the checkpoint (an HF
directory), the tasks, lengths, samples, seed and chat setting; the prompts are built exactly as ``lcx run`` builds
them (the checkpoint's own tokenizer, the validation split; ``prompt_tokens`` per cell equals lcx's), and each task
generates as many tokens as in lcx's grid. kvpress's protocol, as lcx's ``one_shot``: the context
(``ids[:context_len]``) prefilled under the press, which compresses it once; then the question read into the
compressed cache and greedy decoding with the press removed, positions continuing from the context's length (kvpress's
pipeline); graded by the task's own ``score``. Settings are labelled ``kvpress:<press> @c=<ratio> one-shot``.

Usage::

    python experiments/kvpress_eval.py experiments/configs/smollm2_ruler_grid.yaml --ratios 0.75 \
        --presses expected_attention tova snapkv kvzip --out runs/kvpress_ruler_075
    python experiments/kvpress_eval.py experiments/configs/smollm2_passkey_compression.yaml --ratios 0.5 0.75

``--hf-caches dynamic quanto-int4 quanto-int2`` runs transformers' own KV caches instead of presses: the whole prompt
through ``generate`` with its float cache or its ``QuantizedCache`` (optimum-quanto, ``pip install optimum-quanto``;
transformers quantizes the prompt at prefill and keeps decoded tokens in a float residual), labelled ``hf:<cache>`` -
the anchor for lcx's quantized caches on the same prompts. Every run also writes ``outputs.jsonl`` (each prompt's
generation and grade, as lcx's grids do), so ``python -m lcx.eval.paired`` compares it with an lcx run prompt by
prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

# lcx's setting of each name, as kvpress spells it (window 32 / kernel 5 as in lcx's configs; PyramidKV's beta 2 is
# lcx's default slope; AdaKV's safeguard 0.2 is both libraries' default)
PRESSES = {
    "streaming": lambda kp, r: kp.StreamingLLMPress(r, n_sink=4),
    "knorm": lambda kp, r: kp.KnormPress(r),
    "tova": lambda kp, r: kp.TOVAPress(r),
    "snapkv": lambda kp, r: kp.SnapKVPress(r, window_size=32, kernel_size=5),
    "adakv": lambda kp, r: kp.AdaKVPress(kp.SnapKVPress(r, window_size=32, kernel_size=5)),
    "pyramidkv": lambda kp, r: kp.PyramidKVPress(r, window_size=32, kernel_size=5, beta=2),
    "chunkkv": lambda kp, r: kp.ChunkKVPress(kp.SnapKVPress(r, window_size=32, kernel_size=5), chunk_length=20),
    "expected_attention": lambda kp, r: kp.ExpectedAttentionPress(r, n_future_positions=512, n_sink=4),
    # reconstruction scoring: kvpress's default moves budget between layers; layerwise keeps each layer's
    "kvzip": lambda kp, r: kp.KVzipPress(r, n_sink=4, chunk_size=2048),
    "kvzip_layerwise": lambda kp, r: kp.KVzipPress(r, n_sink=4, chunk_size=2048, layerwise=True),
}


# transformers' caches by name: None = its default float DynamicCache, else the cache_config of its QuantizedCache
HF_CACHES = {"dynamic": None, "quanto-int4": {"backend": "quanto", "nbits": 4},
             "quanto-int2": {"backend": "quanto", "nbits": 2}}


def press(name: str, ratio: float):
    import kvpress

    if name not in PRESSES:
        raise SystemExit(f"--presses: {name!r} is not one of {sorted(PRESSES)}")
    return PRESSES[name](kvpress, ratio)


def generate(model, ex, press_obj, max_new: int, eos_id: int | None) -> list[int]:
    """kvpress's one-shot protocol for one example: the greedy tokens after its question."""
    import torch
    import transformers

    cache = transformers.DynamicCache()
    with torch.no_grad():
        with press_obj(model):
            model(input_ids=torch.tensor([ex.prompt_ids[:ex.context_len].tolist()]), past_key_values=cache)
        position, tokens, feed = ex.context_len, [], ex.prompt_ids[ex.context_len:].tolist()
        for _ in range(max_new):
            pos = torch.arange(position, position + len(feed))[None]
            out = model(input_ids=torch.tensor([feed]), past_key_values=cache, position_ids=pos)
            position += len(feed)
            nxt = int(out.logits[0, -1].argmax())
            if nxt == eos_id:
                break
            tokens.append(nxt)
            feed = [nxt]
    return tokens


def generate_hf_cache(model, ex, cache: str, max_new: int, eos_id: int | None) -> list[int]:
    """The greedy tokens of transformers' ``generate`` on the whole prompt with the cache ``HF_CACHES[cache]``."""
    import torch

    ids = torch.tensor([ex.prompt_ids.tolist()])
    kwargs = {} if HF_CACHES[cache] is None else {"cache_implementation": "quantized",
                                                  "cache_config": dict(HF_CACHES[cache])}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=eos_id, **kwargs)
    tokens = out[0, ids.shape[1]:].tolist()
    return tokens[:tokens.index(eos_id)] if eos_id in tokens else tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="an lcx experiment YAML with a checkpoint and an eval section")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for lcx run (e.g. eval.samples=4)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    parser.add_argument("--presses", nargs="+", default=["expected_attention", "tova", "snapkv"])
    parser.add_argument("--hf-caches", nargs="+", default=None, choices=sorted(HF_CACHES),
                        help="run transformers' caches (float or quantized) on the whole prompt instead of presses")
    parser.add_argument("--out", type=Path, default=None, help="where the tables go (default runs/<name>_kvpress)")
    args = parser.parse_args(argv)

    import numpy as np
    import transformers
    from tqdm import tqdm

    from lcx.eval.evaluate import check_fits
    from lcx.eval.grid import _max_new, grid_tasks, prompts
    from lcx.eval.report import write_report
    from lcx.eval.stats import wilson_interval
    from lcx.experiment import load_experiment, run_tokenizer

    cfg = load_experiment(args.config, args.overrides)
    if cfg.checkpoint is None or cfg.eval is None:
        raise SystemExit(f"{args.config}: needs a 'checkpoint' (an HF directory) and an 'eval' section")
    ev = cfg.eval
    if args.hf_caches is None:
        for name in args.presses:
            press(name, 0.5)  # an unknown name fails before the model loads
    tok = run_tokenizer(cfg, cfg.model)
    tasks, _ = grid_tasks(ev, tok)
    max_new = _max_new(ev, tasks)
    # the prompts lcx's grid feeds its own model, cell by cell (task, length, depth), in the checkpoint's tokens
    if ev.metric != "accuracy":
        raise SystemExit(f"{args.config}: eval.task {ev.task!r} measures perplexity; kvpress_eval runs retrieval tasks")
    retrieval = prompts(dataclasses.replace(ev, perplexity=None), tok)
    for cell in retrieval:
        check_fits(cell.task, cfg.model, cell.ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg.checkpoint, attn_implementation="sdpa").eval()
    out = args.out or Path("runs") / f"{cfg.name}_{'hf_caches' if args.hf_caches else 'kvpress'}"
    if args.hf_caches:  # (setting, how one example generates, compression, protocol)
        runs = [(f"hf:{c}", lambda ex, n, c=c: generate_hf_cache(model, ex, c, n, tok.eos_id), "", "")
                for c in args.hf_caches]
    else:
        runs = [(f"kvpress:{p} @c={r:g} one-shot", lambda ex, n, p=p, r=r: generate(model, ex, press(p, r), n,
                                                                                   tok.eos_id), r, "one_shot")
                for p in args.presses for r in args.ratios]
    cells = [(run, cell) for run in runs for cell in retrieval]
    rows, generations = [], []
    for (label, gen, ratio, protocol), cell in tqdm(cells, desc="reference", unit="cell", dynamic_ncols=True):
        examples, task_name = cell.examples, cell.name
        start = time.perf_counter()
        texts = [tok.decode(np.array(gen(ex, max_new[task_name]), np.int64)) for ex in examples]
        scores = [cell.task.score(ex, text) for ex, text in zip(examples, texts)]
        generations += [{"setting": label, "task": task_name, "length": cell.length, "depth": cell.depth, "sample": i,
                         "answer": ex.answer, "output": text, "grade": float(g)}
                        for i, (ex, text, g) in enumerate(zip(examples, texts, scores))]
        lo, hi = wilson_interval(float(np.sum(scores)), len(scores))
        context = sum(int(ex.context_len if protocol else len(ex.prompt_ids)) for ex in examples)
        rows.append({"policy": label.split(" ")[0], "budget": "", "rope": "trained", "length": cell.length,
                     "depth": "" if cell.depth is None else cell.depth,
                     "metric": "accuracy", "value": float(np.mean(scores)), "lo": lo, "hi": hi,
                     "setting": label, "samples": len(scores),
                     "seconds": round(time.perf_counter() - start, 2), "task": task_name if len(tasks) > 1 else "",
                     "compression": ratio, "protocol": protocol,
                     "prompt_tokens": context, "prefilled_tokens": context})  # no context shared
    kind = "transformers caches" if args.hf_caches else "kvpress"
    write_report(rows, out, f"{kind} {len(tasks)} tasks" if len(tasks) > 1 else f"{kind} {next(iter(tasks))}")
    with open(out / "outputs.jsonl", "w") as f:
        f.writelines(json.dumps(g) + "\n" for g in generations)
    print(f"tables: {out}")


if __name__ == "__main__":
    main()
