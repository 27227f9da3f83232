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
# # Eviction maps
#
# A fixed-capacity cache keeps `budget` tokens per layer (and, for score-based policies, per KV head). Which ones
# is the policy. The structured policies (window, StreamingLLM, the LaCache ladder) decide from positions alone, so
# `lcx.cache.simulate` can draw them without a model; the score-based ones (H2O, SnapKV, ...) need a model's
# attention, so the second half runs a small trained model.

# %%
import matplotlib.pyplot as plt
import numpy as np

import lcx
from lcx.cache import simulate
from lcx.data import make_task
from lcx.model import attention_inputs

N_LAYERS, LENGTH, BUDGET = 16, 512, 64

# %% [markdown]
# ## Layer x position: what stays after decoding 512 tokens with a budget of 64

# %%
policies = {
    "window": {"policy": "window", "budget": BUDGET},
    "streaming (4 sinks)": {"policy": "streaming", "budget": BUDGET, "sinks": 4},
    "ladder (span 4)": {"policy": "ladder", "budget": BUDGET, "sinks": 4, "span": 4, "overlap": 0, "recent": 8},
}
fig, axes = plt.subplots(len(policies), 1, figsize=(9, 7), sharex=True)
for ax, (name, spec) in zip(axes, policies.items()):
    kept = simulate(spec, n_layers=N_LAYERS, length=LENGTH)  # [layers, positions] bool
    ax.imshow(kept, aspect="auto", cmap="Greys", interpolation="nearest")
    ax.set(ylabel="layer", title=f"{name}: {kept.sum(1).max()} kept per layer")
axes[-1].set_xlabel("token position")
plt.tight_layout()
plt.show()

# %% [markdown]
# Window and streaming keep the same recent tokens in every layer (streaming also the first 4, the attention
# sinks). The ladder gives each layer a different stretch of the past - a staircase over the layers - so the model
# as a whole still covers old context. When the staircase reaches the oldest tokens it starts over:

# %%
kept = simulate(policies["ladder (span 4)"], n_layers=N_LAYERS, length=2048)
covered = kept.any(axis=0)
print(f"ladder at 2048 tokens: {covered[:-BUDGET].mean():.0%} of the positions before the recent window survive "
      f"in at least one layer; streaming keeps {4 / (2048 - BUDGET):.1%} of them (the sinks)")
plt.figure(figsize=(9, 3))
plt.imshow(kept, aspect="auto", cmap="Greys", interpolation="nearest")
plt.xlabel("token position")
plt.ylabel("layer")
plt.title("ladder, 2048 tokens")
plt.show()

# %% [markdown]
# ## A small trained model: where attention goes
#
# The notebooks' tiny model (`tiny.py`, 2 layers, 4 query / 2 KV heads, trained at 128 tokens). Attention a key
# receives, averaged over the queries that see it, per layer and head - on a 128-token passkey prompt.

# %%
from tiny import SMOKE, trained_model  # noqa: E402

model, params = trained_model()
passkey = make_task("passkey", {"instruction": False, "template": "compact", "depth": 0.3})
example = passkey.examples(seed=0, index=0, count=1, seq_len=128, split="validation")[0]
ids = example.prompt_ids
key = example.answer.strip()
needle = example.prompt.index(f"pass key is {key}") + 1  # byte tokenizer: BOS + one token per byte
print(f"{len(ids)} prompt tokens; key {key} at tokens {needle + 12}-{needle + 12 + len(key) - 1}")

q, k = attention_inputs(model, params, np.asarray(ids)[None])  # [L, 1, t, h, d], [L, 1, t, k, d]
q, k = np.asarray(q[:, 0], np.float32), np.asarray(k[:, 0], np.float32)
group = model.n_heads // model.n_kv_heads
k = np.repeat(k, group, axis=2)  # every query head next to its KV head
scores = np.einsum("lthd,lshd->lhts", q, k) / np.sqrt(model.head_dim)
t = len(ids)
scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
probs = np.exp(scores - scores.max(-1, keepdims=True))
probs /= probs.sum(-1, keepdims=True)  # [L, h, t, s]
received = probs.sum(axis=2) / np.arange(t, 0, -1)  # mean attention per query that sees the key

fig, axes = plt.subplots(model.n_layers, 1, figsize=(9, 4), sharex=True)
for layer, ax in enumerate(axes):
    for head in range(model.n_heads):
        ax.plot(received[layer, head], lw=1, label=f"head {head}")
    ax.axvspan(needle, needle + len(f"pass key is {key}"), color="orange", alpha=0.3)
    ax.set(ylabel=f"layer {layer}", yscale="log")
axes[0].legend(fontsize=7, ncol=4)
axes[-1].set_xlabel("key position (orange: the needle)")
plt.suptitle("mean attention received per key")
plt.show()
print("share of attention on token 0, per layer and head:\n", np.round(probs[:, :, 64:, 0].mean(-1), 3))

# %% [markdown]
# ## Which tokens H2O and SnapKV keep for this prompt
#
# Prefill through a cache with a budget of 48 tokens per layer and KV head, then read the cache's positions.
# Keep sets are per KV head (`heads: per_head`, the default of score-based policies, as in the papers); rows below
# are (layer, KV head). `interval` is set so that budget + interval holds the whole prompt: it is attended in full
# and compressed once, as the papers do. With a smaller capacity the prompt is compressed chunk by chunk, before the
# question has been read - try `interval=16` and watch SnapKV lose the key.

# %%
budget, interval = 48, 96
settings = {
    "h2o": lcx.CacheConfig(policy="h2o", budget=budget, interval=interval),
    "h2o, shared by the layer": lcx.CacheConfig(policy="h2o", budget=budget, interval=interval, heads="shared"),
    "snapkv (window 16)": lcx.CacheConfig(policy="snapkv", budget=budget, interval=interval, window=16),
}
if SMOKE:  # smoke (CI): per-head H2O and SnapKV run the cell
    settings.pop("h2o, shared by the layer")
fig, axes = plt.subplots(len(settings), 1, figsize=(9, 5), sharex=True)
for ax, (name, cache) in zip(axes, settings.items()):
    gen = lcx.Generator(model, params, max_new_tokens=len(key) + 1, cache=cache)
    state = gen.prefill([ids])
    pos, valid = np.asarray(state.cache.pos[:, 0]), np.asarray(state.cache.valid[:, 0])  # [L, H, C]
    kept = np.zeros((model.n_layers, model.n_kv_heads, t), bool)
    for layer in range(model.n_layers):
        for head in range(model.n_kv_heads):
            h = min(head, pos.shape[1] - 1)  # a shared set serves every KV head
            kept[layer, head, pos[layer, h][valid[layer, h]]] = True
    answer = "".join(chr(i) for i in gen.result(gen.decode(state)).tokens[0] if 32 <= i < 127)
    ax.imshow(kept.reshape(-1, t), aspect="auto", cmap="Greys", interpolation="nearest")
    ax.axvspan(needle, needle + len(f"pass key is {key}"), color="orange", alpha=0.3)
    ax.set(ylabel="layer, KV head", title=f"{name}: answers {answer.strip()!r} (key {key})")
axes[-1].set_xlabel("token position (orange: the needle)")
plt.tight_layout()
plt.show()

# %% [markdown]
# SnapKV scores tokens by the attention of the last `window` prompt queries - the question - so what it keeps
# depends on where the question looks: with the quickstart's model it keeps the key's digits in one KV head of the
# last layer, and that is enough to answer. H2O sums the attention of every query so far, most of which read the
# haystack. (With the tiny model, which has not learned retrieval, no policy can answer: look at the maps.)
# `experiments/bench/heads.py` measures the policies over many prompts (README: per-head H2O 33% vs 72% shared at
# the quickstart's budget).
