"""What a generation carries between compiled calls (``DecodeState``), what it returns (``GenerateResult``), and
the checks that turn user prompts into a padded batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import numpy as np

from lcx.cache.base import CacheState
from lcx.config_base import ConfigError
from lcx.engine.sampling import RowSampling


@flax.struct.dataclass
class DecodeState:
    """Everything decoding needs to continue: the cache and the sampler state after ``step`` tokens."""

    cache: CacheState
    logits: jax.Array  # [b, V] float32: the distribution of the next token
    tokens: jax.Array  # [b, max_new_tokens] int32 generated so far (pad after EOS)
    n_generated: jax.Array  # [b] int32 tokens generated per row, EOS included
    done: jax.Array  # [b] bool
    step: jax.Array  # int32 scalar: tokens sampled so far
    sampling: RowSampling  # each row's settings and request key
    rows: int | None = flax.struct.field(pytree_node=False, default=None)  # the requested rows (None: all): on a
    # mesh a batch is padded to a multiple of the data axis with copies of its last prompt, dropped from results


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    tokens: np.ndarray  # [b, max_new_tokens] int32, padded with pad_id after EOS
    lengths: np.ndarray  # [b] int32 generated tokens per row, EOS included
    cache_bytes: int  # bytes of the KV buffers held on the device
    store_bytes: int = 0  # bytes of keys/values the cache keeps off the device (host memory or disk)
    speculative: Any = None  # decoded with a draft (lcx.SpeculativeConfig): its SpeculativeStats, else None


# --------------------------------------------------------------------------------------------------- prompts
def pad_prompts(prompt_ids: Any, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A ``[b, len]`` int array or a list of token lists -> (right-padded ids ``[b, max_len]``, lengths ``[b]``).
    Anything else - a flat list, float ids, an empty prompt - is a ``ConfigError`` saying what was expected."""
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        ids = np.asarray(prompt_ids)
        if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
            hint = "; one prompt of shape [len] is written ids[None]" if ids.ndim == 1 else ""
            raise ConfigError(f"prompt_ids has shape {ids.shape} and dtype {ids.dtype}: expected a non-empty int "
                              f"array [batch, len] or a list of token lists{hint}")
        return ids.astype(np.int32), np.full((ids.shape[0],), ids.shape[1], np.int32)
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise ConfigError(f"prompt_ids={prompt_ids!r:.60} is invalid: expected a list of token-id lists (one per "
                          "prompt) or an int array [batch, len]; encode text with a tokenizer first")
    rows = list(prompt_ids)
    if rows and all(is_int(x) for x in rows):
        raise ConfigError(f"prompt_ids is a flat list of {len(rows)} ids: expected a list of prompts, each a list "
                          "of token ids - wrap one prompt as [ids]")
    rows = [_prompt_row(r, i) for i, r in enumerate(rows)]
    if not rows or any(len(r) == 0 for r in rows):
        raise ConfigError("prompt_ids must hold at least one prompt and no empty prompt")
    lengths = np.asarray([len(r) for r in rows], np.int32)
    ids = np.full((len(rows), int(lengths.max())), pad_id, np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, lengths


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _prompt_row(row, i: int) -> list[int]:
    if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
        raise ConfigError(f"prompt_ids[{i}]={row!r:.60} is invalid: each prompt is a list of token ids")
    row = list(np.asarray(row).tolist()) if isinstance(row, (np.ndarray, jax.Array)) else list(row)
    bad = next((x for x in row if not is_int(x)), None)
    if bad is not None:
        raise ConfigError(f"prompt_ids[{i}] holds {bad!r} ({type(bad).__name__}): token ids must be integers")
    return row

__all__ = ["DecodeState", "GenerateResult", "is_int", "pad_prompts"]
