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
# # Decoding step by step
#
# What `lcx.generate` does, one piece at a time, on a Hugging Face checkpoint directory: load it, prefill the prompt
# in chunks, decode a few tokens, look inside the cache, save the decode state and resume it elsewhere - and at the
# end the text-level API that does all of it from text. Nothing is downloaded: the checkpoint is written here by
# `lcx.hf.save_hf` from a small random Llama. Point `CHECKPOINT` at a real local Llama / Mistral / Qwen2 directory
# (with its tokenizer.json) to do the same with it.

# %%
import json
import tempfile
from pathlib import Path

import jax
import matplotlib.pyplot as plt
import numpy as np

import lcx

CHECKPOINT = None  # a local Hugging Face directory (config.json + safetensors); None: write a small random one
TOKENIZER = "auto"  # the checkpoint's tokenizer.json

if CHECKPOINT is None:
    CHECKPOINT = Path(tempfile.mkdtemp(prefix="lcx-hf-"))
    small = lcx.ModelConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=256,
                            max_position_embeddings=512, init_std=0.1)
    lcx.hf.save_hf(small, lcx.init_params(small, jax.random.key(0)), CHECKPOINT)
    TOKENIZER = "bytes"  # random weights come without a tokenizer.json: lcx's byte tokenizer (260 ids) stands in
print(sorted(p.name for p in Path(CHECKPOINT).iterdir()))
print(json.dumps({k: v for k, v in json.loads((Path(CHECKPOINT) / "config.json").read_text()).items()
                  if k in ("architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                           "hidden_size", "rope_parameters", "max_position_embeddings")}, indent=1))

# %% [markdown]
# ## Load
#
# `lcx.load` reads the checkpoint (an HF directory here; a `.gguf` file or an lcx run load the same way) with its
# tokenizer: `lm.config` is the checkpoint's config mapped to an `lcx.ModelConfig` (RoPE scaling included), `lm.params`
# its tensors in lcx's parameter tree (the parity tests check the logits against transformers). The sections below
# use them with the token-level API; the last one goes back to text.

# %%
lm = lcx.load(CHECKPOINT, tokenizer=TOKENIZER)
print(lm)
config, params = lm.config, lm.params
print(config)
print(jax.tree_util.tree_map(lambda x: x.shape, params))

# %% [markdown]
# ## Prefill in chunks, then decode
#
# A `Generator` owns the compiled steps for one model, cache and sampling setting. `prefill` runs the prompt through
# the model `prefill_chunk` tokens at a time into the cache; `decode` samples tokens in segments of any length. Here
# the cache is StreamingLLM with a budget of 64 tokens, so eviction runs during both.

# %%
prompt = np.random.default_rng(0).integers(0, config.vocab_size, 200).tolist()
cache = lcx.CacheConfig(policy="streaming", budget=64, sinks=4, interval=16, prefill_chunk=32)
gen = lcx.Generator(config, params, max_new_tokens=24, cache=cache)
state = gen.prefill([prompt])
print("after prefill: step", int(state.step), "| cache slots", state.cache.capacity,
      "| live tokens per layer", np.asarray(state.cache.count[:, 0, 0]).tolist())
state = gen.decode(state, steps=8)
print("after 8 steps:", np.asarray(state.tokens[0, :8]).tolist())

# %% [markdown]
# ## Inside the cache
#
# `state.cache.pos [layers, batch, keep heads, slots]` holds the original position of the token in each slot (-1:
# empty); slots are packed in position order. Streaming keeps the 4 sinks and the newest tokens in every layer.

# %%
pos = np.asarray(state.cache.pos[:, 0, 0])
valid = np.asarray(state.cache.valid[:, 0, 0])
for layer in range(config.n_layers):
    kept = pos[layer][valid[layer]]
    print(f"layer {layer}: {len(kept)} tokens: {kept[:6].tolist()} ... {kept[-4:].tolist()}")
plt.figure(figsize=(8, 2.5))
plt.imshow(np.where(valid, pos, np.nan), aspect="auto", interpolation="nearest")
plt.colorbar(label="original position")
plt.xlabel("slot")
plt.ylabel("layer")
plt.title("what each slot holds")
plt.show()

# %% [markdown]
# ## Save, restore, continue
#
# `Generator.save` writes the state with orbax (plus the settings needed to continue); another process - here a
# fresh `Generator` - restores it and continues with the same tokens as an uninterrupted run.

# %%
saved = Path(tempfile.mkdtemp(prefix="lcx-state-")) / "state"
gen.save(state, saved)
resumed = lcx.Generator(config, params, max_new_tokens=24, cache=cache)
finished = resumed.result(resumed.decode(resumed.restore(saved)))

straight = lcx.Generator(config, params, max_new_tokens=24, cache=cache)
reference = straight.result(straight.decode(straight.prefill([prompt])))
print("resumed :", finished.tokens[0].tolist())
print("straight:", reference.tokens[0].tolist())
print("identical:", bool(np.array_equal(finished.tokens, reference.tokens)))

# %% [markdown]
# ## Text in, text out
#
# `lm.generate` does all of the above from text: it encodes each prompt with the checkpoint's tokenizer (BOS first;
# `chat=True` applies its chat template), prefills and decodes through the cache, stops at the tokenizer's EOS and
# returns the new text. `lm.score` returns each token's log-probability under a cache policy: the first token
# prefilled, the rest teacher-forced through the cache on decoding's eviction schedule - perplexity under a policy.
# (Random weights write gibberish; a real checkpoint answers.)

# %%
texts = ["The grass is green. The sky is", "Here we go. There and back"]
print(lm.generate(texts, max_new_tokens=16, cache=cache))
logprobs = lm.score(" ".join(texts) * 4, cache=cache)  # float32 [tokens - 1]; cache=None: the full cache
print(f"{len(logprobs)} tokens scored, perplexity {np.exp(-logprobs.mean()):.1f} under streaming (budget 64)")
