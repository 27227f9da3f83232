# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # KV-cache budget: the arithmetic behind an OOM
#
# Decoding keeps the keys and values of every past token of every layer. Per token and sequence that is
#
# $$\text{bytes} = 2 \times \text{layers} \times \text{KV heads} \times \text{head dim} \times \text{dtype bytes}$$
#
# and it grows linearly with the context and the batch, while the weights stay put. This notebook does the
# arithmetic for real model shapes, compares MHA, GQA and MQA, and runs the three checks of `lcx plan` from Python.
# Nothing here needs a model's weights: shapes are enough.

# %%
import dataclasses
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from lcx.config import load_model_config
from lcx.config_base import format_bytes
from lcx.plan import PlanInputs, kv_bytes_per_token, make_plan, render, weight_bytes

MODELS = Path("..") / "experiments" / "configs" / "models"  # model shapes as lcx YAML configs
GiB = 1024**3

# %% [markdown]
# ## Bytes per token for real shapes
#
# Llama-2-7B uses multi-head attention (one KV head per query head); Llama-3, Mistral and Qwen2 use grouped-query
# attention (GQA), where a group of query heads shares one KV head.

# %%
names = ["llama2-7b", "llama3-8b", "mistral-7b", "qwen2-7b", "llama3-70b"]
models = {name: load_model_config(MODELS / f"{name}.yaml") for name in names}
print(f"{'model':<12} {'layers':>6} {'heads':>5} {'KV heads':>8} {'head dim':>8} {'KV / token (bf16)':>18} "
      f"{'weights (bf16)':>15}")
for name, m in models.items():
    print(f"{name:<12} {m.n_layers:>6} {m.n_heads:>5} {m.n_kv_heads:>8} {m.head_dim:>8} "
          f"{format_bytes(kv_bytes_per_token(m, 'bfloat16')):>18} {format_bytes(weight_bytes(m, 'bfloat16')):>15}")

# %% [markdown]
# Llama-2-7B needs 512 KiB per token: 32k tokens of one sequence take 16 GiB, more than its 12.6 GiB of weights.
# Llama-3-8B, about the same size, needs a quarter of that, because 32 query heads share 8 KV heads.
#
# ## MHA vs GQA vs MQA
#
# Same Llama-3-8B shape, only the number of KV heads changes.

# %%
base = models["llama3-8b"]
variants = {"MHA (32 KV heads)": 32, "GQA (8 KV heads)": 8, "GQA (4 KV heads)": 4, "MQA (1 KV head)": 1}
contexts = np.array([2**k for k in range(10, 18)])  # 1k .. 128k tokens
fig, ax = plt.subplots(figsize=(7, 4))
for label, kv in variants.items():
    m = dataclasses.replace(base, n_kv_heads=kv)
    ax.plot(contexts, contexts * kv_bytes_per_token(m, "bfloat16") / GiB, marker="o", label=label)
ax.axhline(80, color="gray", ls="--", lw=1)
ax.text(contexts[0], 82, "one 80 GiB GPU", color="gray")
ax.set(xscale="log", yscale="log", xlabel="context (tokens, batch 1)", ylabel="KV cache (GiB, bf16)",
       title="Llama-3-8B shape: KV cache vs context")
ax.legend()
plt.show()

# %% [markdown]
# ## Budgets and dtypes
#
# An eviction policy caps the tokens the cache keeps (its *budget*); a smaller KV dtype halves the bytes per token.
# Batch 8 of Llama-3-8B against context:

# %%
batch = 8
fig, ax = plt.subplots(figsize=(7, 4))
for dtype in ("float32", "bfloat16"):
    per_token = kv_bytes_per_token(base, dtype) * batch
    ax.plot(contexts, contexts * per_token / GiB, marker="o", label=f"full cache, {dtype}")
    for budget in (4096, 16384):
        ax.plot(contexts, np.minimum(contexts, budget) * per_token / GiB, ls="--",
                label=f"budget {budget}, {dtype}")
ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="KV cache (GiB)",
       title=f"Llama-3-8B, batch {batch}")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## The three checks of `lcx plan`, from Python
#
# `make_plan` answers (a) does this context fit the memory, and what is the longest that does; (b) does the GQA
# group count split over the devices' model axis without communication; (c) are training and inference precisions
# consistent. Llama-3-70B at 128k tokens on 8 x 80 GiB:

# %%
plan = make_plan(PlanInputs(model=models["llama3-70b"], context=131072, batch=1, gpu_mem_bytes=80 * GiB, devices=8))
print(render(plan))

# %% [markdown]
# Change the device count to 6 and check (b) fails: 8 KV heads cannot be split over a model axis of 6, and the
# planner lists the sizes that work. With a budget, (a) says what an eviction policy buys.

# %%
for devices, budget in ((6, None), (2, None), (2, 16384)):
    plan = make_plan(PlanInputs(model=models["llama3-70b"], context=131072, batch=1, gpu_mem_bytes=80 * GiB,
                                devices=devices, budget=budget))
    print(f"--- {devices} devices, budget {budget}")
    for check in plan.checkpoints:
        print(f"  {check.status:<4} {check.name}: {check.reason[:160]}")
