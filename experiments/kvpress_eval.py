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
"""

from __future__ import annotations

import argparse
import dataclasses
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="an lcx experiment YAML with a checkpoint and an eval section")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for lcx run (e.g. eval.samples=4)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    parser.add_argument("--presses", nargs="+", default=["expected_attention", "tova", "snapkv"])
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
    out = args.out or Path("runs") / f"{cfg.name}_kvpress"
    cells = [(p, r, cell) for p in args.presses for r in args.ratios for cell in retrieval]
    rows = []
    for name, ratio, cell in tqdm(cells, desc="kvpress", unit="cell", dynamic_ncols=True):
        examples, task_name = cell.examples, cell.name
        start = time.perf_counter()
        scores = [cell.task.score(ex, tok.decode(np.array(generate(model, ex, press(name, ratio),
                                                                     max_new[task_name], tok.eos_id), np.int64)))
                  for ex in examples]
        lo, hi = wilson_interval(float(np.sum(scores)), len(scores))
        rows.append({"policy": f"kvpress:{name}", "budget": "", "rope": "trained", "length": cell.length,
                     "depth": "" if cell.depth is None else cell.depth,
                     "metric": "accuracy", "value": float(np.mean(scores)), "lo": lo, "hi": hi,
                     "setting": f"kvpress:{name} @c={ratio:g} one-shot", "samples": len(scores),
                     "seconds": round(time.perf_counter() - start, 2), "task": task_name if len(tasks) > 1 else "",
                     "compression": ratio, "protocol": "one_shot",
                     "prompt_tokens": sum(int(ex.context_len) for ex in examples),
                     "prefilled_tokens": sum(int(ex.context_len) for ex in examples)})  # no context shared
    write_report(rows, out, f"kvpress {len(tasks)} tasks" if len(tasks) > 1 else f"kvpress {next(iter(tasks))}")
    print(f"tables: {out}")


if __name__ == "__main__":
    main()
