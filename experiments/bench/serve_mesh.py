"""Serving on a device mesh: ``lcx serve --tensor-parallel-size M --data-parallel-size D`` as ``build_service`` makes
it (``ServeConfig.meshes`` -> one ``Server`` per replica -> ``ServerGroup`` for D > 1), against one device.

On a CPU the devices are fake (``--xla_force_host_platform_device_count``, set here before jax starts): every "device"
shares the same cores, so these numbers show what the mesh costs in partitioning and dispatch on a CPU, not what it
buys on GPUs - correctness (the tokens column) is the point here; speed on a mesh needs real devices.

``--requests`` requests of ``--prompt`` random tokens and ``--new`` greedy tokens each, on a random-weight model of
SmolLM2-135M's attention shape (9 query / 3 KV heads, head dim 64, hidden 576, MLP 1536) with ``--layers`` layers.
Per mesh: wall seconds for all requests after a warm-up of the same shapes, generated tokens per second, and how
many requests' tokens equal one device's.

    python experiments/bench/serve_mesh.py                        # (D, M) in 1x1, 1x3, 2x1, 2x3
    python experiments/bench/serve_mesh.py --requests 8 --new 8   # quicker
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import jax  # noqa: E402
import numpy as np  # noqa: E402

import lcx  # noqa: E402
from lcx.engine.server import Server  # noqa: E402
from lcx.engine.server_group import ServerGroup  # noqa: E402
from lcx.engine.setup import resolve  # noqa: E402
from lcx.service.config import ServeConfig  # noqa: E402

MESHES = [(1, 1), (1, 3), (2, 1), (2, 3)]  # (data, model)


def build(config, params, cache, data: int, model: int, kw: dict):
    meshes = ServeConfig(model="bench", data_parallel_size=data, tensor_parallel_size=model).meshes(config)
    setup = resolve(config, cache, mesh=meshes[0], **kw)
    servers = [Server(config, params, setup=dataclasses.replace(setup, mesh=m)) for m in meshes]
    return servers[0] if len(servers) == 1 else ServerGroup(servers)


def serve(target, prompts, new) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    ids = [target.submit(p, new) for p in prompts]
    done = target.run()
    return time.perf_counter() - t0, [list(map(int, done[i])) for i in ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=4, help="--max-num-seqs of each replica")
    args = p.parse_args()
    config = lcx.ModelConfig(vocab_size=4096, d_model=576, n_layers=args.layers, n_heads=9, n_kv_heads=3,
                             head_dim=64, d_ff=1536, attention=lcx.AttentionConfig(impl="xla"))
    params = lcx.init_params(config, jax.random.key(0))
    cache = lcx.CacheConfig(layout="paged")
    kw = dict(max_num_seqs=args.rows, max_len=args.prompt + args.new, segment=8, prefill_chunk=128)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, args.prompt).tolist() for _ in range(args.requests)]
    print(f"{jax.device_count()} {jax.devices()[0].platform} devices (fake on a CPU: they share its cores); "
          f"{args.requests} requests x ({args.prompt} prompt + {args.new} new tokens), {args.layers} layers")
    print("| data x model | devices | wall s | generated tok/s | requests equal to 1 device |")
    print("|---|---:|---:|---:|---:|")
    ref = None
    for data, model in MESHES:
        target = build(config, params, cache, data, model, kw)
        serve(target, prompts[:args.rows * data], args.new)  # warm-up: the same shapes compiled
        wall, tokens = serve(target, prompts, args.new)
        ref = tokens if ref is None else ref
        same = sum(a == b for a, b in zip(tokens, ref))
        print(f"| {data} x {model} | {data * model} | {wall:.1f} | {args.requests * args.new / wall:.1f} | "
              f"{same}/{args.requests} |", flush=True)


if __name__ == "__main__":
    main()
