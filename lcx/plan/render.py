"""A plan as the text ``lcx plan`` prints: the numbers, then each checkpoint with its status and advice."""

from __future__ import annotations



from lcx.cache.storage import storage_named
from lcx.config_base import format_bytes

# fp16 keeps finite values up to 65504; past a few thousand tokens attention logits and residual activations of
# models trained in bf16 are known to exceed it. 4096 is where the planner starts warning.
FP16_SAFE_CONTEXT = 4096
# The GQA size the planner suggests for MHA models: Llama-2/3-70B's choice, one KV group per GPU on 8-way TP.
SUGGESTED_KV_HEADS = 8
STATUSES = ("pass", "warn", "fail")

from lcx.plan.inference import Plan, longest


_LABELS = {"context_vs_memory": "(a) context vs memory", "gqa_vs_tensor_parallel": "(b) GQA vs tensor parallel",
           "precision": "(c) precision"}


def render(plan: Plan) -> str:
    """The human-readable plan."""
    fb = format_bytes
    lines = [
        f"lcx plan: {plan.source or 'model'} -- {plan.n_layers} layers, {plan.n_heads} heads / {plan.n_kv_heads} KV "
        f"heads, head_dim {plan.head_dim}; context {plan.context} x batch {plan.batch} on {plan.devices} x "
        f"{fb(plan.gpu_mem_bytes)}" + (f" (mesh data={plan.data} x model={plan.model_axis})" if plan.data > 1 else ""),
        f"weights      {plan.num_params / 1e9:.2f}e9 params in {plan.weight_dtype}: {fb(plan.weight_bytes)} total, "
        f"{fb(plan.weight_bytes_per_device)} per device",
        f"KV cache     {fb(plan.kv_bytes_per_token)} per token (2 x {plan.n_layers} layers x {plan.n_kv_heads} KV "
        f"heads x {storage_named(plan.kv_dtype, 'float32').describe(plan.head_dim)})",
        f"             {fb(plan.kv_bytes_total)} total for {plan.context} tokens x batch {plan.batch}; "
        f"{fb(plan.kv_bytes_per_device)} per device ({plan.kv_heads_per_device} KV head(s) per device"
        + (f", each replicated {plan.kv_replication}x" if plan.kv_replication > 1 else "") + ")",
    ]
    if plan.n_local_layers:
        lines.append(f"layers       {plan.n_local_layers} sliding-window (window {plan.sliding_window}: "
                     f"{plan.local_slots} slots each for this context) + {plan.n_layers - plan.n_local_layers} global "
                     f"(every token); the KV figures count each layer's own slots")
    if plan.budget is not None:
        lines.append(f"budgeted     eviction budget {plan.budget} -> cache holds {plan.cache_tokens} tokens: "
                     f"{fb(plan.budget_kv_bytes_total)} total, {fb(plan.budget_kv_bytes_per_device)} per device")
    lines.append(f"per device   {fb(plan.weight_bytes_per_device)} weights + {fb(plan.kv_bytes_per_device)} KV = "
                 f"{fb(plan.total_bytes_per_device)} of {fb(plan.usable_bytes_per_device)} usable "
                 f"({plan.utilization:.0%}): {'fits' if plan.fits else 'does NOT fit'}")
    if plan.budget is not None:
        lines.append(f"with budget  {fb(plan.weight_bytes_per_device)} weights + "
                     f"{fb(plan.budget_kv_bytes_per_device)} KV = {fb(plan.budget_total_bytes_per_device)}: "
                     f"{'fits' if plan.fits_with_budget else 'does NOT fit'}")
    if plan.cache_policy is not None:
        lines.append(f"cache {plan.cache_policy:<6} device {fb(plan.cache_device_kv_bytes)} KV + "
                     f"{fb(plan.cache_device_meta_bytes)} positions / masks / routing summaries; off the device "
                     f"{fb(plan.cache_store_bytes)} (all sequences, one device)")
        if plan.cache_pages is not None:
            unshared = -(-plan.context // plan.cache_page_size) * plan.batch
            held = (f"{plan.cache_shared_tokens} shared prefix tokens stored once" if plan.cache_slots >= plan.context
                    else f"the policy's {plan.cache_slots} slots per sequence; eviction rewrites a shared prefix")
            lines.append(f"             {plan.cache_pages} pages of {plan.cache_page_size} tokens in use at the full "
                         f"context ({held}; {plan.cache_pages / unshared:.2f}x of {unshared} pages unshared)")
        if plan.cache_keep_sets is not None:
            lines.append(f"             {plan.cache_slots} slots per sequence and layer; kept positions "
                         f"{plan.cache_keep_sets} (each KV head has its own slots)")
    lines.append(f"longest context that fits (full cache, batch {plan.batch}): {longest(plan.max_context)}")
    lines.append("checkpoints")
    for c in plan.checkpoints:
        lines.append(f"  {c.status:<4}  {_LABELS.get(c.name, c.name)}: {c.reason}")
    lines.append("assumed")
    lines.extend(f"  - {a}" for a in plan.assumptions)
    if plan.notes:
        lines.append("notes")
        lines.extend(f"  - {x}" for x in plan.notes)
    return "\n".join(lines)
