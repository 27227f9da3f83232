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
# # Working and long-term memory
#
# `cache.policy: memory` keeps the newest tokens on the device (working memory: sinks + a window) and moves older
# tokens, in blocks, to a long-term store in host memory or on disk. Per layer and KV head a *router* scores the
# blocks against the current queries and recalls the best `topk` into a fixed-size device buffer; attention covers
# working memory + recalled blocks. This notebook looks at what the routers recall on a passkey prompt 4x longer than
# the model's training length, how that compares with full attention, and where the bytes live.

# %%
import tempfile

import matplotlib.pyplot as plt
import numpy as np

import lcx
from lcx.data import make_task
from lcx.eval.evaluate import retrieval_scores
from lcx.eval.recall import block_attention, recall_at_k, trace_recall
from lcx.train import DataConfig
from lcx.train.router import RouterConfig, train_router
from tiny import DATA, SMOKE, trained_model

LENGTH = 256 if SMOKE else 512  # tokens of the long prompt (512 = 4x the training length; try 2048)
ROUTER_STEPS = 20 if SMOKE else 100  # distillation steps of the learned router (the benchmark uses 300)
SAMPLES = 4 if SMOKE else 12  # passkey prompts per setting (the benchmark uses 72)
CONTEXTS = [256] if SMOKE else [256, 512, 1024]  # for device vs host bytes (smoke: one)

model, params = trained_model()
memory = dict(policy="memory", sinks=4, window=44, block=16, topk=3, positions="local", interval=16, prefill_chunk=16)

# %% [markdown]
# ## A learned router
#
# Distilled from the frozen model's own full attention at the training length (KL to the attention mass per block,
# plus a gate that learns when recall is not needed); the training-free routers need nothing.

# %%
router_dir = tempfile.mkdtemp(prefix="lcx-router-")
summary = train_router(model, params, RouterConfig(steps=ROUTER_STEPS, batch_size=8, seq_len=128, rank=16, sinks=4,
                                                   window=32, block=16, topk=2, positions="local"),
                       DataConfig(task=DATA.task, params=DATA.params), router_dir, progress=True)
print({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()})
routers = {"quest": {}, "infllm": {"representatives": 4}, "learned": {"router_path": router_dir}}

# %% [markdown]
# ## Which blocks each router recalls, per layer and KV head
#
# For the last prompt query (the question), on one passkey prompt with the key at depth 0.3. The orange line marks
# the block holding the key.

# %%
passkey = make_task("passkey", {"instruction": False, "template": "compact", "depth": 0.3})
example = passkey.examples(seed=1, index=0, count=1, seq_len=LENGTH, split="validation")[0]
key = example.answer.strip()
key_at = example.prompt.index(f"pass key is {key}") + 1 + len("pass key is ")

shown = {"quest": {}} if SMOKE else routers  # smoke (CI): one router draws (the learned one runs below)
fig, axes = plt.subplots(len(shown), 1, figsize=(9, 6), sharex=True, squeeze=False)
axes = axes[:, 0]
traces = {}
for ax, (name, extra) in zip(axes, shown.items()):
    trace = traces[name] = trace_recall(model, params, lcx.CacheConfig(**memory, router=name, **extra),
                                        [example.prompt_ids])
    n_blocks = int(trace.n_blocks[0])
    grid = np.zeros((model.n_layers * model.n_kv_heads, n_blocks))
    for layer in range(model.n_layers):
        for head in range(model.n_kv_heads):
            for block in trace.ids[layer, 0, head]:
                if block >= 0:
                    grid[layer * model.n_kv_heads + head, block] = 1
    first = trace.block_pos[0, 0, :n_blocks, 0, 0]  # first position of each block (contiguous blocks)
    key_block = int(np.searchsorted(first, key_at, side="right")) - 1
    ax.imshow(grid, aspect="auto", cmap="Greys", interpolation="nearest")
    ax.axvline(key_block, color="orange", lw=2)
    ax.set(ylabel="layer, KV head", title=f"{name}: recalled blocks (of {n_blocks})")
axes[-1].set_xlabel("long-term block")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## recall@k against full attention, and retrieval
#
# recall@k: of the k blocks that get the most attention from the question under *full* attention, the share the
# router recalled (at 128 tokens, where full attention is within the trained range). Retrieval: passkey accuracy at
# 4x the training length, `SAMPLES` prompts, for each router and for StreamingLLM at the same device budget.

# %%
short = [ex.prompt_ids for ex in make_task("passkey", {"instruction": False, "template": "compact"}).examples(
    11, 0, SAMPLES, 128, "validation")]
small = dict(memory, window=32, topk=2)
passkeys = make_task("passkey", {"instruction": False, "template": "compact"})
rows = []
measured = {"learned": routers["learned"]} if SMOKE else routers  # smoke (CI): one router runs the cell
for name, extra in measured.items():
    trace = trace_recall(model, params, lcx.CacheConfig(**small, router=name, **extra), short)
    recall = recall_at_k(trace, block_attention(model, params, short, trace.block_pos))
    accuracy = retrieval_scores(model, params, passkeys, length=LENGTH, depth=None, samples=SAMPLES, batch_size=SAMPLES,
                                seed=5, cache=lcx.CacheConfig(**memory, router=name, **extra)).mean()
    rows.append((name, recall, accuracy))
streaming = lcx.CacheConfig(policy="streaming", budget=4 + 44 + 3 * 16, sinks=4, interval=16, prefill_chunk=64)
if not SMOKE:  # smoke (CI): the tiny model retrieves nothing either way; the baseline is not worth its compile
    rows.append(("streaming", float("nan"), retrieval_scores(model, params, passkeys, length=LENGTH, depth=None,
                                                              samples=SAMPLES, batch_size=SAMPLES, seed=5,
                                                              cache=streaming).mean()))
print(f"{'setting':<10} {'recall@2':>8} {'passkey @ ' + str(LENGTH):>14}")
for name, recall, accuracy in rows:
    print(f"{name:<10} {recall:>8.2f} {accuracy:>14.0%}")

# %% [markdown]
# With the quickstart's model this printed recall@2 of 0.31 / 0.50 / 0.43 (quest / infllm / learned) and passkey
# accuracy 100% / 33% / 83% at 512 tokens, against 17% for streaming at the same device budget: a router does not need
# to agree with full attention on every block, only to find the needle's. With the tiny model (no retrieval learned)
# every accuracy is 0%.
#
# ## Device vs host bytes as the context grows
#
# The device holds sinks + window + the recall buffer whatever the context; the store grows with it (here in host
# memory; `store: disk` memory-maps files instead).

# %%
contexts = CONTEXTS
device, host = [], []
for n in contexts:
    trace = trace_recall(model, params, lcx.CacheConfig(**memory, router="quest"),
                         [passkeys.examples(2, 0, 1, n, "validation")[0].prompt_ids])
    device.append(trace.device_bytes)
    host.append(trace.store_bytes)
plt.figure(figsize=(6, 4))
plt.plot(contexts, np.array(device) / 1024, marker="o", label="device K/V")
plt.plot(contexts, np.array(host) / 1024, marker="o", label="long-term store (host)")
plt.xscale("log")
plt.yscale("log")
plt.xticks(contexts, [str(n) for n in contexts])
plt.xlabel("context (tokens)")
plt.ylabel("KiB")
plt.legend()
plt.title("memory tier: bytes per place")
plt.show()
