"""lcx against transformers on the same random weights, in float32 and bfloat16: how far the logits part, and where
greedy generation first diverges and why.

    python experiments/bench/gpu_parity.py            # Llama- and Gemma-3-shaped models (GPU: ~1 minute)
    python experiments/bench/gpu_parity.py --quick    # tiny sizes, a CPU smoke run (< 60 s)

Per model: a random-weight transformers model (transformers' own initialization, as ``decode_sweep.py``'s models:
weights of std 0.02, so the logits over the vocabulary sit close together, as on any untrained model), eager
attention, saved with ``save_pretrained`` and loaded by ``lcx.hf.load_hf`` - the same weights, no hand copy. It runs
on the GPU when torch and jax see one (torch on ``cpu`` otherwise).

Rows (``precision``):

- ``float32 ieee``: float32 weights, TF32 off on both sides (``torch.backends.cuda.matmul.allow_tf32 = False``,
  ``jax.default_matmul_precision("highest")``);
- ``float32 tf32``: float32 weights, each library's GPU default (torch with TF32 allowed, JAX at its default
  precision: TF32 on a GPU). Only on a GPU: on a CPU it would compute in full float32 and repeat the row above;
- ``bfloat16``: bfloat16 weights (and activations) on both sides, TF32 irrelevant;
- ``hf bf16 vs hf fp32`` (pair ``hf/hf``): transformers in bfloat16 against transformers in float32 (ieee) - how
  early transformers parts from itself when only the precision changes, the yardstick for the lcx / hf rows.

Columns: ``logits rel err`` = max |a - b| / max |b| over a teacher-forced prompt (``--batch`` rows x ``--prompt``
tokens, b = transformers); ``top-1 agree`` = fraction of those positions whose argmax agrees; ``first diverging`` =
per row, the first generated position (0-based, of ``--new`` greedy tokens) where the two generations differ (``-``:
none). At the position before each diverging row's divergence (a teacher-forced pass of both sides over the
prompt and the reference's greedy tokens), as ``min / median`` over those rows: ``margin there`` = the reference's
top-1 minus top-2 logit; ``float32 margin there`` = the same from transformers in float32 with TF32 off (the
margin the weights really have); ``logit err there`` = max |a - b| over the vocabulary; ``margin < err`` = how many
divergences had a float32 margin below the logit error. Such a step is a near-tie that either side's rounding can
flip - no bug needed; a float32 (ieee) row that diverges where the margin is well above the error would be a bug.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import lcx
from lcx import hf

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    family: str  # llama / gemma3
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    window: int | None = None  # gemma3's local layers


SHAPES = {
    # GQA 8 / 2, a 32k vocabulary: the margins between the top logits are those of a real vocabulary
    "llama": Shape("llama", "llama", 32000, 512, 6, 8, 2, 64, 1536),
    # five local layers (window 64: the prompt and the generation cross it) then a global one, as Gemma 3
    "gemma3": Shape("gemma3", "gemma3", 32000, 512, 6, 8, 2, 64, 1536, window=64),
}
QUICK = {
    "llama": Shape("llama", "llama", 4096, 128, 2, 4, 2, 32, 256),
    "gemma3": Shape("gemma3", "gemma3", 4096, 128, 3, 4, 2, 32, 256, window=16),
}


def hf_model(shape: Shape, max_positions: int):
    """A random-weight transformers model of ``shape`` in float32 (seed 0), eager attention."""
    import torch
    import transformers

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  head_dim=shape.head_dim, max_position_embeddings=max_positions, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager")
    if shape.family == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif shape.family == "gemma3":
        layer_types = [FULL if (i + 1) % 6 == 0 or i == shape.layers - 1 else SLIDING for i in range(shape.layers)]
        config = transformers.Gemma3TextConfig(**common, sliding_window=shape.window, layer_types=layer_types,
                                               query_pre_attn_scalar=shape.head_dim)
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(f"unknown family {shape.family!r}; allowed: llama, gemma3")
    torch.manual_seed(0)
    return cls(config).eval()


def set_tf32(on: bool) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def hf_forward(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids, device=model.device)).logits.float().cpu().numpy()


def hf_greedy(model, prompt: np.ndarray, new: int) -> np.ndarray:
    import torch

    ids = torch.as_tensor(prompt, device=model.device)
    with torch.no_grad():
        # attention_mask: with pad_token_id=0 alone, transformers would mask prompt tokens equal to 0
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    return out[:, prompt.shape[1]:].cpu().numpy()


def lcx_greedy(config, params, prompt: np.ndarray, new: int) -> np.ndarray:
    return np.asarray(lcx.generate(config, params, prompt, max_new_tokens=new).tokens)


@dataclasses.dataclass
class Side:
    """One implementation at one precision: how it scores a sequence (teacher-forced logits) and its greedy tokens."""

    forward: Callable[[np.ndarray], np.ndarray]
    tokens: np.ndarray


def first_divergence(a: np.ndarray, b: np.ndarray) -> list[int | None]:
    """Per row, the first position where the token sequences differ (None: equal)."""
    out = []
    for x, y in zip(a, b):
        diff = np.flatnonzero(x != y)
        out.append(int(diff[0]) if len(diff) else None)
    return out


def _margin(logits: np.ndarray) -> float:
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def compare(got: Side, ref: Side, truth: Callable, prompt: np.ndarray) -> dict:
    """``got`` against ``ref``; ``truth`` (transformers in float32, TF32 off) gives each divergence's true margin.

    One teacher-forced pass per side over the prompt and the reference's greedy tokens (one compiled shape for lcx):
    its prompt positions give the logit error and top-1 agreement, the position before each row's divergence the
    margins and the error there."""
    t = prompt.shape[1]
    seq = np.concatenate([prompt, ref.tokens], axis=1)
    ref_l, got_l = ref.forward(seq), got.forward(seq)
    div = first_divergence(got.tokens, ref.tokens)
    rows = [i for i, d in enumerate(div) if d is not None]
    true_l = truth(seq) if rows else None
    at = {i: t + div[i] - 1 for i in rows}  # the position whose logits pick generated token div[i]
    return {"rel": float(np.abs(got_l[:, :t] - ref_l[:, :t]).max() / np.abs(ref_l[:, :t]).max()),
            "top1": float(np.mean(got_l[:, :t].argmax(-1) == ref_l[:, :t].argmax(-1))), "div": div,
            "margins": [_margin(ref_l[i, at[i]]) for i in rows],
            "true_margins": [_margin(true_l[i, at[i]]) for i in rows],
            "errs": [float(np.max(np.abs(got_l[i, at[i]] - ref_l[i, at[i]]))) for i in rows]}


def _stat(xs: list[float]) -> str:
    return "-" if not xs else f"{min(xs):.2g} / {float(np.median(xs)):.2g}"


HEADER = ("| model | dtype | precision | pair | logits rel err | top-1 agree | first diverging (per row) "
          "| margin there (min / median) | float32 margin there | logit err there | margin < err |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def row(model: str, dtype: str, precision: str, pair: str, r: dict) -> str:
    div = " ".join("-" if d is None else str(d) for d in r["div"])
    below = sum(m < e for m, e in zip(r["true_margins"], r["errs"]))
    return (f"| {model} | {dtype} | {precision} | {pair} | {r['rel']:.2e} | {r['top1']:.1%} | {div} | "
            f"{_stat(r['margins'])} | {_stat(r['true_margins'])} | {_stat(r['errs'])} | "
            f"{below} / {len(r['margins'])} |")


def run_model(shape: Shape, batch: int, prompt_len: int, new: int, device: str, gpu: bool) -> list[str]:
    import torch

    model = hf_model(shape, max_positions=prompt_len + new + 8)
    prompt = np.random.default_rng(0).integers(0, shape.vocab, (batch, prompt_len))
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        loaded = {dtype: hf.load_hf(tmp, dtype=dtype) for dtype in ("float32", "bfloat16")}

    model.to(device)
    # a copy in bfloat16: the float32 model stays as it is for the hf/hf yardstick (Module.to works in place)
    hf_models = {"float32": model, "bfloat16": copy.deepcopy(model).to(dtype=torch.bfloat16)}

    def truth(ids):  # transformers in float32 with TF32 off, whatever the row's setting
        tf32 = torch.backends.cuda.matmul.allow_tf32
        set_tf32(False)
        try:
            return hf_forward(model, ids)
        finally:
            set_tf32(tf32)

    def sides(dtype: str, jax_precision: str) -> tuple[Side, Side]:
        hf_m = hf_models[dtype]
        config, params = loaded[dtype]
        apply = jax.jit(lcx.Decoder(config).apply)  # one jitted function: its compilations are reused

        def lcx_fwd(ids):
            with jax.default_matmul_precision(jax_precision):  # part of jit's cache key: retraced per setting
                return np.asarray(apply({"params": params}, jnp.asarray(ids, jnp.int32)), np.float32)

        with jax.default_matmul_precision(jax_precision):
            lcx_tokens = lcx_greedy(config, params, prompt, new)
        return Side(lcx_fwd, lcx_tokens), Side(lambda ids: hf_forward(hf_m, ids), hf_greedy(hf_m, prompt, new))

    def emit(dtype, precision, pair, result):
        lines.append(row(shape.name, dtype, precision, pair, result))
        print(lines[-1], flush=True)

    fp32 = None
    for precision, tf32 in (("ieee", False), ("tf32", True))[:2 if gpu else 1]:
        set_tf32(tf32)
        ours, ref = sides("float32", "default" if tf32 else "highest")
        fp32 = fp32 or ref
        emit("float32", precision, "lcx/hf", compare(ours, ref, truth, prompt))
    set_tf32(False)
    ours, ref = sides("bfloat16", "default")
    emit("bfloat16", "bfloat16", "lcx/hf", compare(ours, ref, truth, prompt))
    # the yardstick: transformers against itself, bfloat16 (``ref`` above) vs float32 with TF32 off
    emit("bfloat16", "hf bf16 vs hf fp32", "hf/hf", compare(ref, fp32, truth, prompt))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128, help="teacher-forced prompt tokens per row")
    p.add_argument("--new", type=int, default=64, help="greedy tokens generated per row")
    p.add_argument("--quick", action="store_true", help="tiny models and lengths: a CPU smoke run")
    args = p.parse_args()
    import torch
    import transformers

    shapes = QUICK if args.quick else SHAPES
    if args.quick:
        args.batch, args.prompt, args.new = min(args.batch, 2), min(args.prompt, 24), min(args.new, 12)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # TF32 exists only on a GPU: on a CPU both libraries' float32 matmuls are full float32 whatever the settings,
    # so the ``tf32`` row would repeat the ``ieee`` one
    gpu = device == "cuda" or jax.default_backend() == "gpu"
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} on {device}, "
          f"transformers {transformers.__version__}; batch {args.batch}, prompt {args.prompt}, new {args.new}")
    print(HEADER)
    t0 = time.perf_counter()
    lines = []
    for name in args.models:
        lines += run_model(shapes[name], args.batch, args.prompt, args.new, device, gpu)
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
