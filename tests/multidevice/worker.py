"""Scenarios the multi-device tests run in a fresh process, where XLA_FLAGS (the fake CPU device count) is set
before jax starts: ``python tests/multidevice/worker.py SCENARIO JSON_ARGS``. The result is one stdout line
``RESULT {json}`` (from process 0 only in a multi-process run); the tests assert on it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

from lcx.parallel import distributed

distributed.initialize_from_env()  # before anything touches a device; no-op without LCX_COORDINATOR

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import lcx  # noqa: E402
from lcx.parallel import sharding  # noqa: E402
from lcx.model import placement  # noqa: E402
from lcx.engine import Generator  # noqa: E402
from lcx.model import Decoder  # noqa: E402

VOCAB = 64


def tiny(impl: str = "pallas", n_kv_heads: int = 8, n_heads: int = 8, d_model: int = 64) -> lcx.ModelConfig:
    return lcx.ModelConfig(vocab_size=VOCAB, d_model=d_model, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                           d_ff=128, init_std=0.1, attention=lcx.AttentionConfig(impl=impl))


def prompts(batch: int = 8, seed: int = 0) -> list[list[int]]:
    """A ragged batch (lengths 5..7), so padding and per-row lengths are exercised."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, 5 + i % 3).tolist() for i in range(batch)]


def forward_ids(batch: int = 8, length: int = 12) -> np.ndarray:
    return np.random.default_rng(1).integers(0, VOCAB, (batch, length)).astype(np.int32)


def forward(config, params, ids, mesh=None) -> np.ndarray:
    """Logits of ``Decoder.apply`` (jitted) under ``mesh`` with params placed by the rules."""
    model = Decoder(config)
    if mesh is None:
        return np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids)))
    placed = placement.shard_params(params, config, mesh)
    with sharding.use_mesh(mesh):
        ids = sharding.put(ids, sharding.batch_sharding(mesh, 2))
        return sharding.to_host(jax.jit(model.apply)({"params": placed}, ids))


class CountLcxWarnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# --------------------------------------------------------------------------------------------------- scenarios
def parity(impl: str, n_kv_heads: int, meshes: list[list[int]], new_tokens: int = 5, cache: dict | None = None) -> dict:
    """Sharded forward and greedy generate vs one device, for each (data, model) mesh (``cache``: CacheConfig
    fields, default the full cache)."""
    logs = CountLcxWarnings()
    logging.getLogger("lcx").addHandler(logs)
    config = tiny(impl, n_kv_heads)
    params = lcx.init_params(config, jax.random.key(0))
    ids = forward_ids()
    ref_logits = forward(config, params, ids)
    cache = lcx.CacheConfig(**cache) if cache else None
    ref_tokens = lcx.generate(config, params, prompts(), max_new_tokens=new_tokens, cache=cache).tokens
    out = {"ref_tokens": ref_tokens.tolist(), "meshes": {}}
    for shape in meshes:
        mesh = sharding.make_mesh(*shape)
        logits = forward(config, params, ids, mesh)
        gen = Generator(config, params, max_new_tokens=new_tokens, mesh=mesh, cache=cache)
        state = gen.decode(gen.prefill(prompts()))
        cache_k = state.cache.k
        out["meshes"][f"{shape[0]}x{shape[1]}"] = {
            "forward_max_abs_diff": float(np.max(np.abs(logits - ref_logits))),
            "tokens": gen.result(state).tokens.tolist(),
            "cache_k_shape": list(cache_k.shape),
            "cache_k_spec": [None if a is None else str(a) for a in cache_k.sharding.spec],
            "cache_k_shard_shape": list(cache_k.addressable_shards[0].data.shape),
            "cache_pos_shape": list(state.cache.pos.shape),
            "cache_pos_shard_shape": list(state.cache.pos.addressable_shards[0].data.shape),
            # 7 prompts: padded to the data axis with a copy of the last, the copy dropped (same compiled shapes)
            "ragged_tokens": gen.result(gen.decode(gen.prefill(prompts()[:7]))).tokens.tolist(),
        }
    out["lcx_warnings"] = logs.messages
    return out


def hybrid_parity(mesh_shape: list[int], new_tokens: int = 12) -> dict:
    """A Gemma-3-shaped model (a sliding-window layer with its own RoPE, a global one, QK-norm, sandwich norms, a
    final soft-cap) on a mesh vs one device: forward logits, loss gradients, and greedy tokens through the bounded
    cache (the local layer evicting every 2 steps) with its shardings."""
    config = lcx.ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128,
                             init_std=0.1, family="gemma3", layer_types=("sliding_attention", "full_attention"),
                             sliding_window=4, final_softcap=10.0, query_scale=16.0,
                             local_rope=lcx.RopeConfig(theta=100.0), attention=lcx.AttentionConfig(impl="xla"))
    params = lcx.init_params(config, jax.random.key(0))
    ids = forward_ids()
    mesh = sharding.make_mesh(*mesh_shape)

    def loss(params, ids):
        logits = Decoder(config).apply({"params": params}, ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    ref_grads = jax.jit(jax.grad(loss))(params, jnp.asarray(ids))
    placed = placement.shard_params(params, config, mesh)
    with sharding.use_mesh(mesh):
        grads = jax.jit(jax.grad(loss))(placed, sharding.put(ids, sharding.batch_sharding(mesh, 2)))
    grad_diff = max(float(np.max(np.abs(sharding.to_host(a) - np.asarray(b))))
                    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
    cache = lcx.CacheConfig(interval=2)
    ref_tokens = lcx.generate(config, params, prompts(), max_new_tokens=new_tokens, cache=cache).tokens
    gen = Generator(config, params, max_new_tokens=new_tokens, mesh=mesh, cache=cache)
    state = gen.decode(gen.prefill(prompts()))
    local_k = state.cache.loc.k
    return {"forward_max_abs_diff": float(np.max(np.abs(forward(config, params, ids, mesh)
                                                        - forward(config, params, ids)))),
            "grad_max_abs_diff": grad_diff, "ref_tokens": ref_tokens.tolist(),
            "tokens": gen.result(state).tokens.tolist(), "local_k_shape": list(local_k.shape),
            "local_k_shard_shape": list(local_k.addressable_shards[0].data.shape),
            "global_k_shape": list(state.cache.glob.k.shape)}


def topology_error(n_kv_heads: int, n_heads: int, mesh_shape: list[int]) -> dict:
    """The error a model axis that neither divides nor is a multiple of kv_heads gives, from each entry point."""
    config = tiny("xla", n_kv_heads, n_heads=n_heads, d_model=8 * n_heads)
    params = lcx.init_params(config, jax.random.key(0))
    mesh = sharding.make_mesh(*mesh_shape)
    errors = {}
    for name, call in {
        "generate": lambda: lcx.generate(config, params, prompts(), max_new_tokens=2, mesh=mesh),
        "shard_params": lambda: placement.shard_params(params, config, mesh),
        "apply_under_mesh": lambda: _apply_unsharded_params(config, params, mesh),
    }.items():
        try:
            call()
            errors[name] = None
        except lcx.ConfigError as err:
            errors[name] = str(err)
    return {"errors": errors}


def _apply_unsharded_params(config, params, mesh):
    with sharding.use_mesh(mesh):
        return jax.jit(Decoder(config).apply)({"params": params}, jnp.asarray(forward_ids()))


def decode_hlo(impl: str, cases: list[list], directory: str) -> dict:
    """For each ``[n_kv_heads, [data, model]]``: compile the sharded decode loop, write its HLO text, and report the
    cache buffers' global, per-shard and per-layer-per-shard shapes."""
    out = {}
    for n_kv_heads, mesh_shape in cases:
        config = tiny(impl, n_kv_heads)
        params = lcx.init_params(config, jax.random.key(0))
        mesh = sharding.make_mesh(*mesh_shape)
        gen = Generator(config, params, max_new_tokens=4, mesh=mesh)
        state = gen.prefill(prompts())
        limit = sharding.put(np.int32(4), sharding.replicated(mesh))
        with sharding.use_mesh(mesh):
            text = gen.programs.decode_loop.lower(gen.params, state, limit, sampled=False).compile().as_text()
        name = f"kv{n_kv_heads}_{mesh_shape[0]}x{mesh_shape[1]}"
        path = Path(directory) / f"{name}.hlo.txt"
        path.write_text(text)
        cache = {}
        for field in ("k", "v", "pos", "valid", "count", "score"):
            x = getattr(state.cache, field)
            shard = list(x.addressable_shards[0].data.shape)
            cache[field] = {"global": list(x.shape), "shard": shard, "layer_shard": shard[1:]}
        out[name] = {"hlo": str(path), "cache": cache, "batch_shard": state.cache.batch // mesh_shape[0],
                     "d_model": config.d_model}
    return out


def checkpoint_save(directory: str, mesh_shape: list[int]) -> dict:
    """Save sharded params (orbax) and a decode state after 2 of 5 tokens; record single-device references."""
    import orbax.checkpoint as ocp

    config = tiny("xla")  # the checkpoint, not the kernels, is under test
    params = lcx.init_params(config, jax.random.key(0))
    mesh = sharding.make_mesh(*mesh_shape)
    placed = placement.shard_params(params, config, mesh)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(Path(directory).absolute() / "params", placed, force=True)
    checkpointer.wait_until_finished()
    gen = Generator(config, params, max_new_tokens=5, mesh=mesh)
    state = gen.decode(gen.prefill(prompts()), steps=2)
    gen.save(state, Path(directory) / "decode_state")
    # the uninterrupted run (sharded = single-device tokens is test_sharding_parity's business)
    return {"spec_q": str(placed["layers"]["attn"]["q"].sharding.spec),
            "ref_tokens": gen.result(gen.decode(state)).tokens.tolist()}


def checkpoint_restore(directory: str, mesh_shape: list[int] | None) -> dict:
    """Restore the params onto ``mesh_shape`` (None: one device); logits vs the original params on that target."""
    import orbax.checkpoint as ocp

    config = tiny("xla")  # the checkpoint, not the kernels, is under test
    original = lcx.init_params(config, jax.random.key(0))
    mesh = None if mesh_shape is None else sharding.make_mesh(*mesh_shape)
    target = placement.param_structs(config, mesh)
    restored = ocp.StandardCheckpointer().restore(Path(directory).absolute() / "params", target)
    same_params = all(np.array_equal(np.asarray(a), np.asarray(b))
                      for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(original)))
    shardings_ok = all(a.sharding.is_equivalent_to(t.sharding, a.ndim)
                       for a, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target)))
    ids = forward_ids()
    model = Decoder(config)
    with sharding.use_mesh(mesh):
        ids_in = jnp.asarray(ids) if mesh is None else sharding.put(ids, sharding.batch_sharding(mesh, 2))
        restored_logits = np.asarray(jax.jit(model.apply)({"params": restored}, ids_in))
    original_logits = forward(config, original, ids, mesh)
    single_logits = forward(config, original, ids)
    gen = Generator(config, restored, max_new_tokens=5, mesh=mesh)
    state = gen.restore(Path(directory) / "decode_state")
    tokens = gen.result(gen.decode(state)).tokens
    return {"devices": len(jax.devices()), "same_params": same_params, "shardings_ok": shardings_ok,
            "logits_identical": bool(np.array_equal(restored_logits, original_logits)),
            "max_abs_diff_vs_single_device": float(np.max(np.abs(restored_logits - single_logits))),
            "resumed_tokens": tokens.tolist(),
            "restored_q_sharding": str(jax.tree.leaves(restored)[0].sharding)}


def generate_tokens(meshes: list[list[int]], impl: str = "xla") -> dict:
    """Greedy generate on each mesh (over all processes' devices); tokens gathered on every process."""
    config = tiny(impl)
    params = lcx.init_params(config, jax.random.key(0))
    out = {"processes": jax.process_count(), "devices": len(jax.devices()),
           "local_devices": len(jax.local_devices()), "tokens": {}}
    for shape in meshes:
        mesh = sharding.make_mesh(*shape)
        out["tokens"][f"{shape[0]}x{shape[1]}"] = lcx.generate(config, params, prompts(), max_new_tokens=5,
                                                               mesh=mesh).tokens.tolist()
    return out


def train_sharded(directory: str) -> dict:
    """A few training steps on one device, on a 2 x 4 mesh and on it with FSDP; then the FSDP run's checkpoint
    resumed for one more step onto (1, 8) and one device. Losses, shardings and bytes per device."""
    import dataclasses
    import shutil

    from lcx.train import DataConfig, TrainConfig, read_metrics, run_training
    from lcx.train import make_optimizer
    from lcx.train.step import state_struct, step_shardings

    config = dataclasses.replace(tiny("xla", n_kv_heads=4), vocab_size=260)  # the byte tokenizer's ids
    data = DataConfig(task="passkey", params={"instruction": False, "template": "compact"})

    def train(steps: int = 4, fsdp: bool = False) -> TrainConfig:
        return TrainConfig(steps=steps, batch_size=8, seq_len=48, lr=3e-3, warmup_steps=0, compute_dtype="float32",
                           save_every=4, log_every=1, async_save=False, fsdp=fsdp)

    def losses(run: Path) -> list[float]:
        return [row["loss"] for row in read_metrics(run / "metrics.jsonl")]

    def device_bytes(arrays, shardings) -> int:  # what one device holds, from the shard shapes
        return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
                   for a, s in zip(jax.tree.leaves(arrays), jax.tree.leaves(shardings)))

    root = Path(directory)
    out = {"runs": {}}
    for name, shape, fsdp in (("single", None, False), ("2x4", [2, 4], False), ("2x4_fsdp", [2, 4], True)):
        mesh = None if shape is None else sharding.make_mesh(*shape)
        result = run_training(config, train(fsdp=fsdp), data, root / name, progress=False, mesh=mesh)
        run = {"losses": losses(root / name)}
        if mesh is not None:
            state_sh, _ = step_shardings(config, train(fsdp=fsdp), mesh)
            abstract = state_struct(config, make_optimizer(train(fsdp=fsdp)))
            q = result.params["layers"]["attn"]["q"]
            run.update(q_spec=str(q.sharding.spec), q_shard=list(q.addressable_shards[0].data.shape),
                       matches_rules=all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in
                                         zip(jax.tree.leaves(result.params), jax.tree.leaves(state_sh.params))),
                       param_bytes=device_bytes(result.params, [p.sharding for p in jax.tree.leaves(result.params)]),
                       opt_bytes=device_bytes(abstract.opt_state, state_sh.opt_state))
        out["runs"][name] = run
    from lcx.train import checkpoint as ckpt

    manager = ckpt.open_manager(root / "2x4_fsdp" / "checkpoints", create=False, async_save=False)
    meta = manager.item_metadata(4)["params"]
    manager.close()
    out["saved_q_sharding"] = str(getattr(meta["layers"]["attn"]["q"], "sharding", None))
    out["resumed"] = {}
    for name, shape in (("1x8", [1, 8]), ("single", None)):  # all-model and no mesh (8x1 costs CI time, adds little)
        run = root / f"resume_{name}"
        shutil.copytree(root / "2x4_fsdp", run)
        mesh = None if shape is None else sharding.make_mesh(*shape)
        run_training(config, train(steps=5, fsdp=shape is not None), data, run, progress=False, mesh=mesh,
                     allow_changes=True)  # one step more than the run was started with
        out["resumed"][name] = losses(run)
    return out


def context_parallel(directory: str) -> dict:
    """Context parallelism on ``seq`` meshes against one device: 4-step runs on packed documents (ring on ``seq=8``
    and ``data=2, seq=2, model=2``, the latter through the Pallas blocks; all-gather on ``2 x 2 x 2``), a sharded
    prefill's logits, generation after a prefill across ``seq``, and the compiled per-device memory of the train
    step."""
    import dataclasses
    import time

    from lcx.train import DataConfig, TrainConfig, run_training
    from lcx.train.metrics import read_metrics
    from lcx.train.loop import training_model
    from lcx.train.step import compile_train_step

    root = Path(directory)
    docs = root / "docs"
    docs.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = "attention ring device chunk query key value token sequence gradient layer shard".split()
    for i in range(24):  # documents of 5..60 words: several per 64-token row, some crossing rows
        (docs / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, int(rng.integers(5, 60)))))
    config = dataclasses.replace(tiny("xla", n_kv_heads=2), vocab_size=260)  # byte tokenizer ids; 4 query heads / KV
    pallas = dataclasses.replace(config, attention=lcx.AttentionConfig(impl="pallas"))
    data = DataConfig(task="documents", params={"path": str(docs), "val_fraction": 0.0})

    def train(strategy: str = "ring", fsdp: bool = False) -> TrainConfig:
        # data x seq x model runs with FSDP and remat: the ring's custom VJP under a rematerialized layer
        return TrainConfig(steps=4, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=0, compute_dtype="float32",
                           save_every=4, log_every=1, async_save=False, context_parallel=strategy, fsdp=fsdp,
                           remat=fsdp)

    out: dict = {"runs": {}, "timings": {}}
    # all-gather runs once, on 2 x 2 x 2 (on seq=8 it is the same program with a larger gather: CI time)
    for name, shape, strategy, fsdp in (("single", None, "ring", False), ("seq8_ring", (1, 8, 1), "ring", False),
                                        ("2x2x2_ring", (2, 2, 2), "ring", True),
                                        ("2x2x2_all_gather", (2, 2, 2), "all_gather", True)):
        t0 = time.perf_counter()
        mesh = None if shape is None else sharding.make_mesh(shape[0], shape[2], seq=shape[1])
        # the 2x2x2 ring through the Pallas flash blocks (interpret mode here): forward and backward kernels per block
        model = pallas if name == "2x2x2_ring" else config
        result = run_training(model, train(strategy, fsdp), data, root / name, progress=False, mesh=mesh)
        params = jax.tree.map(sharding.to_host, result.params)
        out["runs"][name] = {"losses": [row["loss"] for row in read_metrics(root / name / "metrics.jsonl")],
                             "params": params}
        out["timings"][name] = round(time.perf_counter() - t0, 1)
    single = out["runs"]["single"].pop("params")
    for run in out["runs"].values():
        if "params" in run:
            run["param_rel_err"] = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
                                       for a, b in zip(jax.tree.leaves(run.pop("params")), jax.tree.leaves(single)))

    # Generation on a seq mesh: ragged prompts prefilled across seq into a cache gathered for decode, under a policy
    # that compresses at the end of the prefill. (A cacheless forward across seq is the training runs'.)
    t0 = time.perf_counter()
    params = lcx.init_params(config, jax.random.key(2))
    prompts = [np.random.default_rng(2).integers(0, 260, n).tolist() for n in (40, 29, 33, 17)]
    cache = lcx.CacheConfig(policy="streaming", budget=24, sinks=4)
    # the scanned decoder: one layer body to compile (the unrolled one compiles each layer; same tokens)
    ref = Generator(config, params, max_new_tokens=6, cache=cache, unroll=False)
    state = ref.prefill(prompts)
    ref_logits, ref_tokens = np.asarray(state.logits), ref.result(ref.decode(state)).tokens
    gen = Generator(config, params, max_new_tokens=6, cache=cache, mesh=sharding.make_mesh(2, 2, seq=2), unroll=False)
    state = gen.prefill(prompts)
    out["generate"] = {"logits_rel_err": float(np.max(np.abs(sharding.to_host(state.logits) - ref_logits))
                                               / np.max(np.abs(ref_logits))),
                       "tokens_equal": bool(np.array_equal(gen.result(gen.decode(state)).tokens, ref_tokens))}
    out["timings"]["generate"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()

    # Compiled per-device bytes of the train step, seq=8 (FSDP over seq) vs one device, same length; flash blocks.
    def step_bytes(train_cfg, mesh) -> int:
        m = compile_train_step(training_model(pallas, train_cfg), train_cfg, mesh=mesh).memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)

    long = TrainConfig(steps=2, batch_size=1, seq_len=1024, compute_dtype="float32", remat=True)
    out["memory"] = {"single": step_bytes(long, None),
                     "seq8": step_bytes(dataclasses.replace(long, fsdp=True), sharding.make_mesh(1, 1, seq=8))}
    out["timings"]["memory"] = round(time.perf_counter() - t0, 1)
    return out


def serve_mesh(cases: list[dict], directory: str) -> dict:
    """``lcx serve``'s Server on a tensor-parallel mesh (``--tensor-parallel-size``) against one device, per case
    ``{name, impl, n_kv_heads, n_heads, d_model, model_axis, cache}``: the tokens of 8 ragged requests (4 rows, so
    rows are reused), the pool's global / per-device shapes and bytes, the planner's pool for the same budget, and the
    compiled decode segment's HLO (written to ``directory``)."""
    from lcx.engine.server import Server
    from lcx.engine.setup import resolve
    from lcx.plan.serving import pool_plan, serve_plan, tensor_parallel_mesh

    out = {}
    for case in cases:
        config = dataclasses.replace(tiny(case["impl"], case["n_kv_heads"], case["n_heads"], case["d_model"]),
                                     d_ff=case.get("d_ff", 128))
        params = lcx.init_params(config, jax.random.key(0))
        cache = lcx.CacheConfig(layout="paged", **case["cache"])
        budget = 40 * 1024  # per device: fewer pages than every row at its largest, so the budget decides
        kw = dict(max_num_seqs=4, max_len=48, segment=4, prefill_chunk=16)

        def served(mesh):
            setup = resolve(config, cache, mesh=mesh, **kw)
            setup = dataclasses.replace(setup, pages=pool_plan(setup, kv_memory=budget).pages)
            server = Server(config, params, setup=setup)
            ids = [server.submit(p, 6) for p in prompts()]
            got = server.run()
            return [list(map(int, got[i])) for i in ids], server

        ref, _ = served(None)
        mesh = tensor_parallel_mesh(config, case["model_axis"], jax.devices())
        tokens, server = served(mesh)
        plan = serve_plan(config, cache, max_num_seqs=kw["max_num_seqs"], max_model_len=kw["max_len"],
                          kv_memory=budget, tensor_parallel_size=case["model_axis"])
        state = server.state
        pool = [n for n, f in server.kind.fields().items() if "pages" in f.axes and f.role == "kv"]
        # the compiled decode segment, as the server calls it (its cache narrowed to the rows' pages)
        b = server.rows
        rows_ = lambda dtype: sharding.put(np.zeros(b, dtype), sharding.replicated(mesh))  # noqa: E731
        with sharding.use_mesh(mesh):
            text = server.programs.serve_segment.lower(
                server.runner.params, state, rows_(np.int32), rows_(bool), rows_(np.int32), rows_(bool),
                jax.tree.map(lambda x: sharding.put(np.asarray(x), sharding.replicated(mesh)), server.sampling),
                rows_(np.int32), n_steps=4, sampled=False).compile().as_text()
        path = Path(directory) / f"{case['name']}.hlo.txt"
        path.write_text(text)
        out[case["name"]] = {
            "tokens": tokens, "ref_tokens": ref, "pages": server.pages, "plan_pages": plan.pages,
            "plan_page_bytes": plan.page_bytes, "hlo": str(path),
            "pool": {n: {"global": list(getattr(state, n).shape),
                         "shard": list(getattr(state, n).addressable_shards[0].data.shape),
                         "shard_bytes": int(getattr(state, n).addressable_shards[0].data.nbytes),
                         "bytes": int(getattr(state, n).nbytes),
                         "spec": [None if a is None else str(a) for a in getattr(state, n).sharding.spec]}
                     for n in pool}}
    return out


def serve_lockstep(new_tokens: int = 6, model_axis: int = 8) -> dict:
    """``lcx serve`` across processes (``lcx.engine.lockstep``): every process builds the same Server on a tensor-
    parallel mesh over all processes' devices; process 0 submits 8 ragged prompts (4 rows: rows are reused) and one
    more that its ``on_token`` cancels at its second token, the others ``follow``. Process 0 reports the tokens, the
    cancelled ids and the steps, and one local device's Server's tokens for the same prompts (after the followers
    returned: nothing spans processes then)."""
    import time

    from lcx.engine.lockstep import Lockstep, follow
    from lcx.engine.server import Server
    from lcx.plan.serving import tensor_parallel_mesh

    config = tiny("xla", 8)
    params = lcx.init_params(config, jax.random.key(0))
    cache = lcx.CacheConfig(layout="paged")
    kw = dict(max_num_seqs=4, max_len=48, segment=4, prefill_chunk=16)
    mesh = tensor_parallel_mesh(config, model_axis, jax.devices())
    t0 = time.perf_counter()
    server = Server(config, params, cache=cache, mesh=mesh, **kw)
    if jax.process_index() != 0:
        follow(server)
        return {}
    lead = Lockstep(server)
    ids = [lead.submit(p, new_tokens) for p in prompts()]
    stopped = lead.submit(prompts()[0], new_tokens)
    seen: dict[int, int] = {}

    def on_token(request_id: int, token: int) -> None:
        seen[request_id] = seen.get(request_id, 0) + 1
        if request_id == stopped and seen[request_id] == 2:
            lead.cancel(request_id)  # deferred to the step's end, as a stop string is

    got = lead.run(on_token)
    lead.close()
    elapsed = time.perf_counter() - t0
    ref_server = Server(config, params, cache=cache, **kw)  # one device (this process's first)
    ref_ids = [ref_server.submit(p, new_tokens) for p in prompts()]
    ref = ref_server.run()
    return {"processes": jax.process_count(), "devices": len(jax.devices()), "mesh": dict(mesh.shape),
            "tokens": [list(map(int, got[i])) for i in ids], "ref_tokens": [list(map(int, ref[i])) for i in ref_ids],
            "stopped": {"id": stopped, "in_result": stopped in got, "streamed": seen.get(stopped, 0),
                        "cancelled": sorted(lead.server.cancelled)},
            "lockstep_s": round(elapsed, 1)}


def serve_replicas(data: int, model: int) -> dict:
    """``lcx serve --data-parallel-size data --tensor-parallel-size model`` as ``build_service`` makes it
    (``ServeConfig.meshes`` -> one ``Server`` per replica -> a ``ServerGroup``): tokens of 8 ragged requests against
    one device's Server, and which devices each replica's pool is on."""
    from lcx.engine.server import Server
    from lcx.engine.server_group import ServerGroup
    from lcx.engine.setup import resolve
    from lcx.service.config import ServeConfig

    config = tiny("xla", 4)
    params = lcx.init_params(config, jax.random.key(0))
    cache = lcx.CacheConfig(layout="paged")
    kw = dict(max_num_seqs=4, max_len=48, segment=4, prefill_chunk=16)
    one = Server(config, params, cache=cache, **kw)
    ids = [one.submit(p, 6) for p in prompts()]
    ref = one.run()
    meshes = ServeConfig(model="tiny", data_parallel_size=data, tensor_parallel_size=model).meshes(config)
    setup = resolve(config, cache, mesh=meshes[0], **kw)
    group = ServerGroup([Server(config, params, setup=dataclasses.replace(setup, mesh=m)) for m in meshes])
    gids = [group.submit(p, 6) for p in prompts()]
    got = group.run()
    return {"tokens": [list(map(int, got[i])) for i in gids], "ref_tokens": [list(map(int, ref[i])) for i in ids],
            "devices": [sorted(d.id for d in s.state.k.sharding.device_set) for s in group.servers],
            "served": [s.prefill_tokens for s in group.servers]}


SCENARIOS = {f.__name__: f for f in (parity, hybrid_parity, topology_error, decode_hlo, checkpoint_save,
                                     checkpoint_restore, generate_tokens, train_sharded, context_parallel,
                                     serve_mesh, serve_replicas, serve_lockstep)}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](**json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}"))
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(result), flush=True)
