"""Decoding speed as users call it: ``lcx.generate`` with default settings vs transformers ``generate``, across
model shapes, with a per-call breakdown of where lcx's time goes.

    python experiments/bench/decode_sweep.py                    # every shape, batch 1 and 8 (CPU: ~15 minutes)
    python experiments/bench/decode_sweep.py --shapes tiny-gqa --batches 1
    python experiments/bench/decode_sweep.py --shapes llama-1b --dtype bfloat16 --bandwidth 4800   # an H200

Per shape: a random-weight transformers Llama (float32, eager attention) saved with ``save_pretrained`` and loaded
by ``lcx.hf.load_hf`` - the same weights in one process. Each library runs a warm-up call, then ``--repeats`` fresh
calls (``lcx.generate(config, params, prompt, max_new_tokens=128)``: a new Generator each time, as user code
does; ``model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False)``); the best wall time gives
tokens/s = batch x new tokens / time. Greedy tokens are compared.

The breakdown times the phases of one more lcx call with the public ``Generator`` API, synchronizing after each:
``host`` (Generator construction: cache planning, the per-layer copy of the weights the unrolled decoder reads,
compiled-function lookup), ``prefill`` (prompt padding, capacity check, cache creation and the prefill chunks),
``decode`` (the on-device decode loop: a while_loop of model steps and sampling), ``to_host`` (copying the tokens
back); ``sampling`` is the greedy pick (``lcx.engine.sampling.greedy``) over ``[batch, vocab]`` timed on its own per
token
(it runs inside the decode loop).

``floor ms/step`` is the memory-bound minimum of one decode step: the bytes it must read - every layer weight, the
output layer, one embedding row, and the float32 keys and values of every cache slot (prompt + new tokens) - over
the bandwidth a float32 matrix-vector product reaches on this machine (measured once per run); ``ceiling`` is the
lcx / HF ratio a decode running exactly at that floor (with this prefill) would reach - where it is below a goal,
the goal is out of reach for float32 weights on this machine. ``roofline`` is floor / measured decode time per step:
the fraction of the memory roofline the decode loop reaches. ``--bandwidth`` replaces the measured bandwidth by a
datasheet figure (GB/s; an H200's HBM: 4800).

On a GPU, transformers runs on the GPU too (``torch.cuda``), and ``--dtype bfloat16`` stores both models' weights
(and lcx's cache) in bfloat16; ``llama-1b`` (a Llama 3.2 1B-sized decoder, 2.5 GB of bfloat16 weights) is the shape
whose decode is weight-bound on such a machine - the six CPU shapes are launch-bound there. In bfloat16 the two
libraries round differently, so greedy tokens may part after a near-tie: ``same tokens`` then reads as the fraction
of positions that agree."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import lcx  # noqa: E402
from decode import _time  # noqa: E402  (the sibling script: best wall time of repeated calls)
from lcx import hf
from lcx.config import dtype_bytes
from lcx.engine import Generator
from lcx.engine.sampling import greedy


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    d_ff: int
    tied: bool = False  # tied input and output embeddings (SmolLM2, Llama 3.2 1B)


SHAPES = (
    Shape("tiny-mha", 512, 128, 2, 4, 4, 344),
    Shape("tiny-gqa", 512, 256, 4, 8, 2, 688),
    Shape("small-32k", 32000, 256, 4, 8, 2, 688),
    Shape("wide-32k", 32000, 1024, 4, 16, 4, 2752),
    Shape("deep-32k", 32000, 256, 8, 8, 8, 688),
    Shape("vocab-128k", 128256, 256, 2, 8, 2, 688),
)
# Sized for a GPU (2.5 GB of weights in bfloat16): minutes per call on the 2-core CPU, so never in the default list.
GPU_SHAPES = (Shape("llama-1b", 128256, 2048, 16, 32, 8, 8192),)


def hf_model(shape: Shape, dtype: str, max_positions: int = 4096, attention: str = "eager"):
    """A random-weight transformers Llama of ``shape`` (seed 0), on the GPU when there is one."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.d_model, intermediate_size=shape.d_ff,
                                   num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                                   num_key_value_heads=shape.kv_heads, max_position_embeddings=max_positions,
                                   tie_word_embeddings=shape.tied, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None, attn_implementation=attention)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(getattr(torch, dtype))
    return model.to("cuda") if torch.cuda.is_available() else model


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up: compiles (lcx) / allocates (torch)
    return _time(fn, repeats)


def breakdown(config, params, prompt, new: int) -> dict[str, float]:
    """Seconds per phase of one call through the public Generator API (see the module docstring)."""
    t = {}
    t0 = time.perf_counter()
    gen = Generator(config, params, max_new_tokens=new)
    t["host"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(gen.prefill(prompt))
    t["prefill"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(gen.decode(state))
    t["decode"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    gen.result(state)
    t["to_host"] = time.perf_counter() - t0
    # ``new`` greedy picks over [batch, vocab] float32 in one compiled loop (as inside the decode loop)
    logits = jax.random.normal(jax.random.key(0), (prompt.shape[0], config.vocab_size), jnp.float32)
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, new, lambda i, acc: acc + greedy(x + i), 0 * x[:, 0].astype(int)))
    jax.block_until_ready(loop(logits))
    t0 = time.perf_counter()
    jax.block_until_ready(loop(logits))
    t["sampling"] = time.perf_counter() - t0
    return t


def agreement(a: np.ndarray, b: np.ndarray) -> str:
    """``True`` when the greedy tokens are equal, else the fraction of positions that agree."""
    return "True" if np.array_equal(a, b) else f"{np.mean(a == b):.0%}"


def weight_bytes_per_step(config, params) -> int:
    """Bytes of weights one decode step must read: every layer weight, the output layer, one embedding row per
    token (the embedding is gathered, not streamed)."""
    layers = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    head = params["lm_head"].nbytes if "lm_head" in params else params["embed"].nbytes
    norm = params["final_norm"]["scale"].nbytes
    return layers + head + norm + config.d_model * params["embed"].dtype.itemsize


def stream_bandwidth() -> float:
    """Bytes/s of a float32 matrix-vector product over a 256 MiB matrix (larger than any cache): what a memory-bound
    decode step can reach on this machine through XLA."""
    w = jnp.ones((4096, 16384), jnp.float32)
    x = jnp.ones((1, 4096), jnp.float32)
    gemv = jax.jit(lambda x, w: x @ w)
    return w.nbytes / best_of(lambda: jax.block_until_ready(gemv(x, w)), 10)


def run_shape(shape: Shape, batches, prompt_len: int, new: int, repeats: int, bandwidth: float,
              dtype: str) -> list[dict]:
    import torch

    model = hf_model(shape, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        config, params = hf.load_hf(tmp)
    rows = []
    for batch in batches:
        prompt = np.random.default_rng(batch).integers(0, shape.vocab, (batch, prompt_len))
        ids = torch.as_tensor(prompt, device=model.device)
        out = {}

        def run_lcx():
            out["lcx"] = lcx.generate(config, params, prompt, max_new_tokens=new).tokens

        def run_hf():
            with torch.no_grad():
                # attention_mask: with pad_token_id=0 alone, transformers would mask prompt tokens equal to 0
                hf_out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                        min_new_tokens=new, do_sample=False, pad_token_id=0)
            out["hf"] = hf_out[:, prompt_len:].cpu().numpy()

        t_lcx, t_hf = best_of(run_lcx, repeats), best_of(run_hf, repeats)
        parts = breakdown(config, params, prompt, new)
        kv = (2 * config.n_layers * batch * (prompt_len + new) * config.n_kv_heads * config.head_dim  # all slots
              * dtype_bytes(config.dtype))
        floor = (weight_bytes_per_step(config, params) + kv) / bandwidth  # s per step, memory-bound
        rows.append({"shape": shape, "batch": batch, "lcx_tok_s": batch * new / t_lcx, "hf_tok_s": batch * new / t_hf,
                     "ratio": t_hf / t_lcx, "same": agreement(out["lcx"], out["hf"]), **parts,
                     "floor": floor, "ceiling": t_hf / (parts["prefill"] + new * floor),
                     "roofline": floor * new / parts["decode"]})
        print(_row(rows[-1], new), flush=True)
    return rows


HEADER = ("| shape | vocab | d_model | layers | heads / KV | batch | lcx tok/s | HF tok/s | lcx / HF | same tokens "
          "| host ms | prefill ms | decode ms/token | sampling ms/token | to host ms | floor ms/step | ceiling "
          "| roofline |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _row(r: dict, new: int) -> str:
    s = r["shape"]
    return (f"| {s.name} | {s.vocab} | {s.d_model} | {s.layers} | {s.heads} / {s.kv_heads} | {r['batch']} | "
            f"{r['lcx_tok_s']:.0f} | {r['hf_tok_s']:.0f} | {r['ratio']:.2f}x | {r['same']} | "
            f"{r['host'] * 1e3:.1f} | {r['prefill'] * 1e3:.1f} | {r['decode'] * 1e3 / new:.2f} | "
            f"{r['sampling'] * 1e3 / new:.3f} | {r['to_host'] * 1e3:.2f} | {r['floor'] * 1e3:.2f} | "
            f"{r['ceiling']:.2f}x | {r['roofline']:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=[s.name for s in SHAPES],
                        help="shape names (default: the six CPU shapes; llama-1b only when named)")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights (both libraries) and lcx's cache")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="GB/s for the floor (default: measured, a float32 matrix-vector product)")
    args = parser.parse_args()
    known = {s.name: s for s in SHAPES + GPU_SHAPES}
    unknown = [n for n in args.shapes if n not in known]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; known: {list(known)}")
    print(f"jax {jax.__version__} on {jax.default_backend()}; prompt {args.prompt} + {args.new} new tokens, greedy, "
          f"{args.dtype}, best of {args.repeats} fresh calls after a warm-up")
    bandwidth = stream_bandwidth() if args.bandwidth is None else args.bandwidth * 1e9
    source = "a float32 matrix-vector product over 256 MiB" if args.bandwidth is None else "given by --bandwidth"
    print(f"memory-bound floor: (weight + KV) bytes per decode step / {bandwidth / 1e9:.1f} GB/s ({source}); "
          "ceiling: the HF time over (this prefill + new x floor), the best lcx / HF a decode at the floor would "
          "reach; roofline: floor / decode time per step")
    print(HEADER)
    for name in args.shapes:
        run_shape(known[name], args.batches, args.prompt, args.new, args.repeats, bandwidth, args.dtype)


if __name__ == "__main__":
    main()
