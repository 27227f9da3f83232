"""``lcx plan``: the command line of the planner (``lcx.plan``): read a model config or checkpoint, print the plan."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from collections.abc import Sequence

import yaml

from lcx.checkpoints import hf
from lcx.config import ConfigError, ModelConfig, apply_model_overrides, load_model_config
from lcx.config_base import format_bytes, parse_bytes
from lcx.parallel.device_memory import UTILIZATION

# fp16 keeps finite values up to 65504; past a few thousand tokens attention logits and residual activations of
# models trained in bf16 are known to exceed it. 4096 is where the planner starts warning.
FP16_SAFE_CONTEXT = 4096
# The GQA size the planner suggests for MHA models: Llama-2/3-70B's choice, one KV group per GPU on 8-way TP.
SUGGESTED_KV_HEADS = 8
STATUSES = ("pass", "warn", "fail")

from lcx.plan.inference import PlanInputs, make_plan
from lcx.plan.render import render


# --------------------------------------------------------------------------------------------------- loading
def load_model(path: str | Path, overrides: Sequence[str] = ()) -> ModelConfig:
    """A ``ModelConfig`` from a YAML model config or a Hugging Face checkpoint directory (``config.json``), with
    dotted ``model.key=value`` overrides applied on top."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"CONFIG_OR_HF_DIR={str(path)!r} is a directory without config.json: expected a YAML "
                              f"model config or a Hugging Face checkpoint directory")
        model = hf.read_hf_config(p)
    elif p.is_file() and p.name == "config.json":
        model = hf.read_hf_config(p.parent)
    elif p.is_file():
        model = load_model_config(p)
    else:
        raise ConfigError(f"CONFIG_OR_HF_DIR={str(path)!r} does not exist: expected a YAML model config or a Hugging "
                          f"Face checkpoint directory with config.json")
    return apply_overrides(model, overrides)


apply_overrides = apply_model_overrides  # ``model.n_kv_heads=8``-style overrides (lcx.config)


# --------------------------------------------------------------------------------------------------- cli
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="KV-cache / memory plan and the three decision checkpoints",
        description="Weight and KV-cache memory per device for a context, batch and device count; whether it fits; "
                    "the longest context that fits; and pass/warn/fail checkpoints (a) context vs memory, "
                    "(b) GQA vs tensor parallel, (c) precision.")
    p.add_argument("config", metavar="CONFIG_OR_HF_DIR",
                   help="a YAML model config or a Hugging Face checkpoint directory (config.json)")
    p.add_argument("overrides", nargs="*", metavar="model.KEY=VALUE", help="overrides, e.g. model.n_kv_heads=8")
    p.add_argument("--context", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--gpu-mem", required=True, help="memory per device, e.g. 80GiB, 24GB, 141GiB")
    p.add_argument("--devices", type=int, default=1, help="devices in all (default 1)")
    p.add_argument("--data", type=int, default=1,
                   help="devices along the data axis, splitting the batch (default 1: all devices on the model axis)")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: model.dtype), or int8 / fp8: 8-bit "
                   "codes with a float16 scale per token and KV head, int4 / int2: bit-packed codes with a float16 "
                   "scale and zero per group of 64, or fp4: e2m1 codes with a float16 scale per 16 values "
                   "(cache.kv_dtype)")
    p.add_argument("--weight-dtype", default=None, help="weight dtype (default: model.param_dtype)")
    p.add_argument("--budget", type=int, default=None, metavar="TOKENS",
                   help="eviction budget: tokens per sequence the cache keeps")
    p.add_argument("--cache-policy", default=None, metavar="NAME",
                   help="also plan this cache policy's tiers, e.g. memory: device vs host / disk bytes")
    p.add_argument("--cache-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of --cache-policy (repeatable), e.g. window=1024")
    p.add_argument("--page-size", type=int, default=None, metavar="TOKENS",
                   help="plan a paged cache (layout paged, policy full unless --cache-policy) with pages this long")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="tokens of --context every sequence starts with, stored once by a paged cache")
    p.add_argument("--utilization", type=float, default=UTILIZATION,
                   help=f"usable fraction of device memory (default {UTILIZATION})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--speculative-draft", default=None, metavar="POLICY",
                   help="also size a speculative draft cache of this policy (lcx generate --speculative-draft) beside "
                        "the full cache: its bytes at --context and --batch")
    p.add_argument("--speculative-param", action="append", default=[], metavar="KEY=VALUE",
                   help="the draft's settings (repeatable), e.g. budget=256, sinks=4, kv_dtype=int8")
    s = p.add_argument_group("serving (--serve): the page pool of `lcx serve` at --context = --max-model-len")
    s.add_argument("--serve", action="store_true", help="plan a serve configuration: pages, sequences at max length")
    s.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together (default 8)")
    s.add_argument("--kv-memory", default=None, metavar="SIZE", help="the KV budget (default: --utilization of "
                   "--gpu-mem less the weights)")
    t = p.add_argument_group("training (--train): params, optimizer state, gradients and activations per device")
    t.add_argument("--train", action="store_true", help="plan a training run: --context is train.seq_len and "
                   "--batch train.batch_size")
    t.add_argument("--fsdp", action="store_true", help="also split weights and optimizer state over --data")
    t.add_argument("--remat", default="none", help="none, full, dots or dots_no_batch (default none)")
    t.add_argument("--attention", default="flash", help="flash (Pallas) or xla (materialized scores)")
    t.add_argument("--compute-dtype", default="bfloat16", help="matmul dtype (default bfloat16)")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    t.add_argument("--seq", type=int, default=1, help="devices along the sequence axis: context parallelism splits "
                   "each row's tokens over them (default 1)")
    t.add_argument("--context-parallel", default="ring", help="ring or all_gather: attention across --seq")
    p.set_defaults(func=run)
    return p


def _cache_section(policy: str | None, budget: int | None, params: Sequence[str], page_size: int | None = None):
    if policy is None and page_size is None:
        if params:
            raise ConfigError("--cache-param needs --cache-policy (the policy the parameters belong to)")
        return None
    from lcx.cache.config import CacheConfig

    spec = {"policy": policy or "full", "budget": budget}
    if page_size is not None:
        spec |= {"layout": "paged", "page_size": page_size}
    for item in params:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--cache-param {item!r} is invalid: write KEY=VALUE, e.g. window=1024")
        spec[key] = yaml.safe_load(value)
    return CacheConfig.from_mapping(spec, prefix="--cache-param")


def _serve(args: argparse.Namespace, model: ModelConfig, gpu_mem: int) -> int:
    """``lcx plan --serve``: the pool ``lcx serve`` would size with these flags (``lcx.plan.serving``)."""
    from lcx.cache.config import CacheConfig
    from lcx.plan.arithmetic import weight_bytes_per_device
    from lcx.plan.inference import weight_bytes
    from lcx.plan.serving import serve_plan, tensor_parallel_sizes

    cache = _cache_section(args.cache_policy or "full", args.budget, args.cache_param, args.page_size or 16)
    if args.kv_dtype is not None:
        cache = CacheConfig(**(cache.to_dict() | {"kv_dtype": args.kv_dtype}))
    if args.data != 1:
        raise ConfigError(f"--data={args.data} with --serve: lcx serve splits its pool by KV head over all --devices "
                          "(--tensor-parallel-size); allowed --data 1")
    dtype = args.weight_dtype or model.param_dtype
    plan = serve_plan(model, cache, max_num_seqs=args.max_num_seqs, max_model_len=args.context,
                      kv_memory=None if args.kv_memory is None else parse_bytes(args.kv_memory, "--kv-memory"),
                      free_bytes=gpu_mem, utilization=args.utilization, tensor_parallel_size=args.devices,
                      weight_bytes=weight_bytes(model, dtype) if args.devices == 1
                      else weight_bytes_per_device(model, dtype, args.devices))
    if args.json:
        print(json.dumps(dataclasses.asdict(plan) | {"pool_bytes": plan.pool_bytes,
                                                      "at_max_length": plan.at_max_length}, indent=2))
    else:
        print(f"lcx serve plan for {args.config} (policy {cache.policy!r}, kv dtype {cache.kv_dtype or model.dtype})")
        print("\n".join(plan.lines()))
        print(f"serve it with: lcx serve MODEL --tensor-parallel-size {args.devices} (the sizes that fit "
              f"{model.n_kv_heads} KV groups: {tensor_parallel_sizes(model)})")
    return 0


def run(args: argparse.Namespace) -> int:
    """Print the plan; 0 when a plan was made (whatever the checkpoints say), ConfigError for bad input."""
    gpu_mem = parse_bytes(args.gpu_mem, "--gpu-mem")
    model = load_model(args.config, args.overrides)
    if args.seq != 1 and not args.train:
        raise ConfigError(f"--seq={args.seq} plans context parallelism of a training run: add --train (inference "
                          "prefill over seq gathers the cache for decode, so its KV bytes per device do not change)")
    if args.train:
        from lcx.plan.training import TrainPlanInputs, render_train, train_plan

        t_inputs = TrainPlanInputs(model=model, seq_len=args.context, batch=args.batch, gpu_mem_bytes=gpu_mem,
                                   devices=args.devices, data=args.data, fsdp=args.fsdp, remat=args.remat,
                                   attention=args.attention, compute_dtype=args.compute_dtype,
                                   grad_accum=args.grad_accum, utilization=args.utilization, seq=args.seq,
                                   context_parallel=args.context_parallel)
        t_plan = train_plan(t_inputs)
        print(json.dumps(t_plan, indent=2) if args.json else render_train(t_inputs, t_plan, str(args.config)))
        return 0
    if args.serve:
        return _serve(args, model, gpu_mem)
    inputs = PlanInputs(model=model, context=args.context, batch=args.batch, gpu_mem_bytes=gpu_mem,
                        devices=args.devices, data=args.data, kv_dtype=args.kv_dtype, weight_dtype=args.weight_dtype,
                        budget=args.budget, utilization=args.utilization,
                        cache=_cache_section(args.cache_policy, args.budget, args.cache_param, args.page_size),
                        shared_prefix=args.shared_prefix)
    plan = make_plan(inputs, source=str(args.config))
    draft = _draft_bytes(args, model)
    if args.json:
        print(json.dumps(plan.to_dict() | ({} if draft is None else {"speculative_draft_bytes": draft}), indent=2))
    else:
        print(render(plan))
        if draft is not None:
            print(f"speculative draft ({args.speculative_draft}): {format_bytes(draft)} of KV at --context "
                  f"{args.context} x --batch {args.batch}, read by each draft step; the full cache is read once per "
                  "verification")
    return 0


def _draft_bytes(args: argparse.Namespace, model: ModelConfig) -> int | None:
    """The KV bytes of ``--speculative-draft``'s cache at ``--context`` x ``--batch`` (its budget + interval slots
    for an eviction policy, every token in its codes for a quantized one), as ``SpeculativeGenerator`` sizes it."""
    if args.speculative_draft is None:
        if args.speculative_param:
            raise ConfigError("--speculative-param needs --speculative-draft (the draft the settings belong to)")
        return None
    from lcx.engine.speculative import SpeculativeConfig

    spec = {"policy": args.speculative_draft}
    for item in args.speculative_param:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--speculative-param {item!r} is invalid: write KEY=VALUE, e.g. budget=256")
        spec[key] = yaml.safe_load(value)
    draft = SpeculativeConfig.from_mapping({"draft": spec}).draft
    kind = draft.kind(model)
    return kind.nbytes(args.batch, kind.plan(args.batch, args.context, 0))
