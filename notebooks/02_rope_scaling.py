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
# # RoPE and its scaling
#
# Rotary position embedding rotates each pair of query/key dimensions `i` by the angle `position x inv_freq[i]`,
# with `inv_freq[i] = theta^(-2i/d)`: the first pairs turn fast (short wavelengths), the last ones slowly. A model
# trained on `L` tokens has seen every angle of the fast pairs but only a fraction of a turn of the slow ones, and
# that is what breaks beyond `L`. The scaling types change the frequencies so that `4L` looks more like `L`:
#
# - **linear** (position interpolation): every frequency divided by the factor;
# - **NTK**: the base `theta` raised, so slow pairs are interpolated and fast ones barely change;
# - **dynamic NTK**: NTK with a factor that grows with the current length (no change up to `L`);
# - **YaRN**: fast pairs untouched, slow pairs interpolated, a ramp in between, plus an attention temperature;
# - **llama3**: the same idea as YaRN with wavelength thresholds;
# - **LongRoPE**: one searched factor per frequency (a ramp here, for illustration).

# %%
import dataclasses

import matplotlib.pyplot as plt
import numpy as np

import lcx
from lcx.data import make_task
from lcx.eval.evaluate import window_nll
from lcx.model.rope import inv_freq_and_factor

DIM, TRAINED, FACTOR = 128, 4096, 4.0  # head dim, training length, target = FACTOR x TRAINED
VARIANTS = {
    "default": lcx.RopeConfig(),
    "linear": lcx.RopeConfig(type="linear", factor=FACTOR),
    "ntk": lcx.RopeConfig(type="ntk", factor=FACTOR),
    "dynamic": lcx.RopeConfig(type="dynamic", factor=FACTOR, original_max_position_embeddings=TRAINED),
    "yarn": lcx.RopeConfig(type="yarn", factor=FACTOR, original_max_position_embeddings=TRAINED),
    "llama3": lcx.RopeConfig(type="llama3", factor=FACTOR, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=TRAINED),
    "longrope": lcx.RopeConfig(type="longrope", short_factor=(1.0,) * (DIM // 2),
                               long_factor=tuple(np.linspace(1.0, FACTOR, DIM // 2)),
                               original_max_position_embeddings=TRAINED),
}

# %% [markdown]
# ## Wavelength per dimension pair
#
# `inv_freq_and_factor` is what the model uses (the length-dependent types are evaluated at `4L`).

# %%
target = int(FACTOR * TRAINED)
inv = {name: inv_freq_and_factor(rope, DIM, target, seq_len=target)[0] for name, rope in VARIANTS.items()}
fig, ax = plt.subplots(figsize=(7, 4))
for name, f in inv.items():
    ax.plot(2 * np.pi / f, label=name)
ax.axhline(TRAINED, color="gray", ls="--", lw=1)
ax.text(0, TRAINED * 1.3, "trained length", color="gray")
ax.set(yscale="log", xlabel="dimension pair i", ylabel="wavelength (tokens)",
       title=f"wavelengths, head dim {DIM}, factor {FACTOR:g}")
ax.legend(fontsize=8, ncol=2)
plt.show()

# %% [markdown]
# ## What each type does at 4x the trained length
#
# For each pair: the largest angle reached at position `4L` with the scaled frequencies, divided by the largest
# angle the model saw in training (positions below `L`, default frequencies; a pair that completed a full turn has
# seen every angle). Above 1, the pair rotates further than anything seen in training - extrapolation.

# %%
base = inv["default"]
seen = np.minimum(TRAINED * base, 2 * np.pi)
fig, ax = plt.subplots(figsize=(7, 4))
for name, f in inv.items():
    ax.plot(np.minimum(target * f, 2 * np.pi) / seen, label=name)
ax.axhline(1.0, color="gray", ls="--", lw=1)
ax.set(xlabel="dimension pair i", ylabel="angle at 4L / angle seen in training",
       title="> 1: rotations the model never saw")
ax.legend(fontsize=8, ncol=2)
plt.show()

# %% [markdown]
# Raw RoPE (`default`) pushes the slow half of the pairs up to 4x beyond their trained range; linear brings every
# pair back (at the cost of crowding the fast ones); NTK, YaRN and llama3 leave the fast pairs alone and fix the slow
# ones.
#
# ## On a small trained model
#
# The notebooks' tiny model (`tiny.py`: 2 layers, trained at 128 tokens on text and passkeys, about a minute) scored
# on held-out text at 1x-4x its training length, with the frequencies replaced at inference (no fine-tuning).
# Perplexity of the same final 32 tokens at every length: only the history before them grows.

# %%
from tiny import SMOKE, trained_model  # noqa: E402

model, params = trained_model()
corpus = make_task("corpus", {"bos": True})
LENGTHS = [256] if SMOKE else [128, 256, 512]  # smoke (CI): one length, every cell still runs
at_inference = {
    "raw": model.rope,
    "NTK x4": dataclasses.replace(model.rope, type="ntk", factor=4.0),
    "dynamic NTK": dataclasses.replace(model.rope, type="dynamic", factor=4.0),
    "YaRN x4": dataclasses.replace(model.rope, type="yarn", factor=4.0, original_max_position_embeddings=128),
}
if SMOKE:  # smoke (CI): raw and one scaling run the cells
    at_inference = {name: at_inference[name] for name in ("raw", "YaRN x4")}
ppl = {}
for name, rope in at_inference.items():
    # dynamic NTK scales once the length exceeds max_position_embeddings (transformers' convention), so it keeps the
    # trained 128; the others are told the new range.
    longer = max(LENGTHS) if rope.type != "dynamic" else model.max_position_embeddings
    scaled = dataclasses.replace(model, rope=rope, max_position_embeddings=longer)
    nll = [window_nll(scaled, params, corpus, length=n, samples=4 if SMOKE else 16,
                      batch_size=16, seed=0, cache=lcx.CacheConfig(),
                      tail=32, longest=max(LENGTHS)) for n in LENGTHS]  # the same 32 tokens at every length
    ppl[name] = [float(np.exp(x.mean())) for x in nll]
    print(f"{name:<12}", "  ".join(f"{p:7.2f}" for p in ppl[name]))

fig, ax = plt.subplots(figsize=(6, 4))
for name, values in ppl.items():
    ax.plot(LENGTHS, values, marker="o", label=name)
ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="perplexity (last 32 tokens)",
       title="tiny model trained at 128 tokens")
ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
ax.legend()
plt.show()

# %% [markdown]
# What it printed on a 2-core CPU (300 training steps): raw extrapolation goes from 8.1 at 128 tokens to 11.9 and
# 12.9 at 2x and 4x; static NTK costs almost nothing at 1x and holds 2x but not 4x; dynamic NTK is identical to raw
# up to 128 and softens the damage beyond (8.7, 10.7); YaRN pays a little at 1x (8.4) and stays flat to 4x (8.5) -
# without any fine-tuning. Fine-tuning with YaRN at the longer length (`experiments/configs/finetune_yarn.yaml`)
# is what the README's YaRN table shows at the quickstart's scale.
