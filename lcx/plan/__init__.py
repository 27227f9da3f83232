"""The planner: memory arithmetic and the three deployment decisions, for inference (``inference``, its text form
``render``) and training (``training``). The command line is ``lcx.cli.plan``."""

from lcx.plan.inference import (STATUSES, SUGGESTED_KV_HEADS, UNBOUNDED, Checkpoint, Plan, PlanInputs, checkpoints,
                                kv_bytes_for_context, kv_bytes_per_token, kv_bytes_per_token_per_device,
                                kv_heads_per_device, local_slots, make_plan, max_context, valid_model_axis_sizes,
                                weight_bytes, weight_bytes_per_device)
from lcx.plan.render import render

__all__ = ["Checkpoint", "Plan", "PlanInputs", "STATUSES", "SUGGESTED_KV_HEADS", "UNBOUNDED", "checkpoints",
           "kv_bytes_for_context", "kv_bytes_per_token", "kv_bytes_per_token_per_device", "kv_heads_per_device",
           "local_slots", "make_plan", "max_context", "render", "valid_model_axis_sizes", "weight_bytes",
           "weight_bytes_per_device"]

_CLI = ("add_parser", "run", "load_model")


def __getattr__(name: str):
    if name in _CLI:
        raise AttributeError(f"lcx.plan.{name} moved to lcx.cli.plan.{name} (the planner's command line)")
    raise AttributeError(f"module 'lcx.plan' has no attribute {name!r}")
