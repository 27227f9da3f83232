"""The device half of generation and serving: ``build`` checks a model, a cache config and a mesh once and returns a
``Runner`` - the placed (and unrolled) params, the cache kind and policy, the configuration's compiled ``Programs``
- that runs prompts and decode segments over cache states it is handed and keeps none.

``Generator`` (contiguous batches: prefill in chunks, across a ``seq`` axis, KVzip's passes) and ``Server`` (rows
of one paged state: a prefill chunk of the rows reading their prompts, a decode segment of the others) are both built
on one ``Runner``; everything on the host - requests, queues, kept prefixes - stays with them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from lcx.cache.base import CacheState, round_chunk
from lcx.cache.config import CacheConfig
from lcx.config_base import ConfigError
from lcx.engine import rows
from lcx.engine.planning import auto_prefill_chunk, cache_kind, choose_unroll, keep_unrolled, kept_unrolled
from lcx.engine.programs import Programs, programs
from lcx.engine.prompt_end import compress_rows, pl2
from lcx.engine.sampling import sample_rows
from lcx.engine.state import is_int
from lcx.model.attention_choice import announce_attention
from lcx.model.config import ModelConfig
from lcx.model.decoder import is_unrolled
from lcx.model.placement import shard_params
from lcx.parallel import context as context_parallel
from lcx.parallel import sharding


@dataclasses.dataclass(frozen=True, eq=False)
class Runner:
    """One model over one cache configuration (``build``). ``params``: placed on ``mesh`` and, ``unrolled``, one
    block per layer; ``kind`` / ``policy``: the cache kind and its (calibrated) eviction policy; ``programs``: the
    compiled functions; ``seq``: the mesh's ``seq`` axis size; ``reconstruction``: KVzip's repeat prompt."""

    config: ModelConfig
    cache: CacheConfig
    kind: Any
    policy: Any
    params: Any
    programs: Programs
    mesh: Any
    seq: int
    unrolled: bool
    eos_id: int | None
    pad_id: int
    reconstruction: Any = None

    def put(self, x, batch_axis: bool = True):
        """A host value as a step input: split by rows over "data" (or replicated) on the mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        x = np.asarray(x)
        spec = sharding.batch_sharding(self.mesh, x.ndim) if batch_axis else sharding.replicated(self.mesh)
        return sharding.put(x, spec)

    # ------------------------------------------------------------------------------------------- contiguous batches
    def chunks(self, ids: np.ndarray, lengths: np.ndarray, cache: CacheState, capacity: int,
               progress: bool) -> tuple[CacheState, jax.Array]:
        """Prompts ``ids [b, n]`` (real tokens ``lengths [b]``) through the model into ``cache`` in chunks of one
        compiled shape: ``(cache, logits of each row's last token)``."""
        batch, max_len = ids.shape
        if self.seq > 1:
            return self._across_seq(ids, lengths, cache, capacity)
        requested = self.cache.prefill_chunk or auto_prefill_chunk(self.config, batch, max_len)
        chunk = self.kind.prefill_chunk(requested, max_len, capacity)
        n_chunks = -(-max_len // chunk)
        padded = np.zeros((batch, n_chunks * chunk), np.int32)
        padded[:, :max_len] = ids
        ok = np.arange(n_chunks * chunk)[None, :] < lengths[:, None]
        weights = self.kind.prefill_weights(lengths, n_chunks * chunk)
        last_logits = self.put(np.zeros((batch, self.config.vocab_size), np.float32))
        bar = tqdm(total=n_chunks * chunk * batch, disable=not progress, unit="tok", unit_scale=True, desc="prefill",
                   dynamic_ncols=True)
        for c in range(n_chunks):
            lo = c * chunk
            last = lengths - 1 - lo
            last_index = np.where((last >= 0) & (last < chunk), last, -1).astype(np.int32)
            with sharding.use_mesh(self.mesh):
                cache, last_logits = self.programs.prefill_chunk(
                    self.params, cache, self.put(padded[:, lo:lo + chunk]), self.put(ok[:, lo:lo + chunk]),
                    self.put(last_index), last_logits,
                    None if weights is None else self.put(weights[:, lo:lo + chunk]))
            cache = self.kind.sync(cache)
            bar.update(chunk * batch)
        bar.close()
        return cache, last_logits

    def _across_seq(self, ids: np.ndarray, lengths: np.ndarray, cache: CacheState,
                    capacity: int) -> tuple[CacheState, jax.Array]:
        """The prompts as one chunk split over the mesh's ``seq`` axis: padded to a multiple of ``2 x seq``, laid
        out in zig-zag order (``lcx.parallel.context``), attention across ``seq``; the cache is then whole on every
        ``seq`` device and decoding runs there as on a mesh without one."""
        batch, max_len = ids.shape
        width = -(-max_len // (2 * self.seq)) * (2 * self.seq)
        if max_len > capacity:  # (padding is never written)
            raise ConfigError(f"mesh.seq={self.seq} prefills a prompt in one chunk into a fresh cache: the prompt "
                              f"({max_len} tokens) must fit the capacity ({capacity}) - raise "
                              "cache.budget / cache.interval or prefill on a mesh without seq")
        padded = np.zeros((batch, width), np.int32)
        padded[:, :max_len] = ids
        ok = np.arange(width)[None, :] < lengths[:, None]
        laid = context_parallel.layout_batch({"ids": padded, "ok": ok}, self.seq)
        last_index = np.argsort(context_parallel.zigzag_order(width, self.seq))[lengths - 1].astype(np.int32)
        put = lambda x: sharding.put(x, sharding.sequence_sharding(self.mesh, x.ndim))  # noqa: E731
        with sharding.use_mesh(self.mesh):
            cache, last_logits = self.programs.prefill_chunk(
                self.params, cache, put(laid["ids"]), put(laid["ok"]), self.put(last_index),
                self.put(np.zeros((batch, self.config.vocab_size), np.float32)), None, put(laid["positions"]))
        return self.kind.sync(cache), last_logits

    def reconstruct(self, cache: CacheState, ids: np.ndarray, lengths: np.ndarray, progress: bool) -> CacheState:
        """The reconstruction passes of a ``reconstructs`` policy over the prefilled prompts (``Reconstruction
        .passes``): each scores the slots of its chunk; the cache keeps only the prompt."""
        passes = self.reconstruction.passes(ids, lengths, self.policy.chunk)
        for tokens, ok, lo, hi in tqdm(passes, disable=not progress, desc="reconstruct", unit="pass"):
            with sharding.use_mesh(self.mesh):
                cache = self.programs.probe_chunk(self.params, cache, self.put(tokens), self.put(ok),
                                                  self.put(lo, False), self.put(hi))
        return cache

    # ------------------------------------------------------------------------------------------- a server's rows
    def prefill_rows(self, setup, state, reading: list, sampling) -> tuple[Any, list[int], list[int], np.ndarray]:
        """One prefill chunk of the requests ``reading`` (each ``.row``, ``.prompt``, ``.read``), as a batch of their
        rows only: the pool is shared, so a sub-batch is their rows of every per-row buffer (padded to a power of
        two with empty rows), written back after. ``(state, tokens read per request, the indices of the requests
        whose prompt ended, their first tokens)`` - a prompt that ends is compressed first under eviction."""
        row_ids = [r.row for r in reading]
        batch = min(setup.max_num_seqs, pl2(len(row_ids)))
        index = jnp.asarray(row_ids + [setup.max_num_seqs] * (batch - len(row_ids)), jnp.int32)  # past: empty rows
        chunk = min(setup.chunk, round_chunk(max(r.prompt.size - r.read for r in reading)))  # a few widths
        ids = np.zeros((batch, chunk), np.int32)
        ok = np.zeros((batch, chunk), bool)
        last_index = np.full(batch, -1, np.int32)
        weights = None
        for i, r in enumerate(reading):
            n = min(chunk, r.prompt.size - r.read)
            ids[i, :n], ok[i, :n] = r.prompt[r.read:r.read + n], True
            if r.read + n == r.prompt.size:
                last_index[i] = n - 1
            w = self.kind.prefill_weights(np.asarray([r.prompt.size]), r.prompt.size)
            if w is not None:
                weights = np.zeros((batch, chunk), np.float32) if weights is None else weights
                weights[i, :n] = w[0, r.read:r.read + n]
        sub = rows.gather(state, index)
        logits = jnp.zeros((batch, self.config.vocab_size), jnp.float32)
        narrow, wide = _narrowed(sub, width(setup, max(r.read + chunk for r in reading)))
        with sharding.use_mesh(self.mesh):  # a server's mesh has no "data" axis: its inputs are replicated
            narrow, logits = self.programs.prefill_chunk(self.params, narrow, self.put(ids), self.put(ok),
                                                         self.put(last_index), self.put(logits),
                                                         None if weights is None else self.put(weights))
        sub = self.kind.sync(_widened(narrow, wide))
        ending = [i for i in range(len(reading)) if last_index[i] >= 0]
        if setup.evicts and ending:  # the policy's end-of-prefill eviction, for the rows whose prompt ended only
            with sharding.use_mesh(self.mesh):
                sub = compress_rows(self.kind, self.programs, self.params, sub, ending,
                                    [reading[i].prompt for i in ending], self.reconstruction)
        state = rows.scatter(rows.rows_of(state), sub, index, len(row_ids))
        read = [int(n) for n in ok.sum(axis=1)[:len(reading)]]
        if not ending:
            return state, read, ending, np.zeros(0, np.int32)
        picked = jnp.asarray([reading[i].row for i in ending], jnp.int32)
        first = _first_tokens(logits[jnp.asarray(ending)], jax.tree.map(lambda x: jnp.asarray(x)[picked], sampling))
        return state, read, ending, sharding.to_host(first)

    def decode_rows(self, setup, state, decoding: dict, sampling) -> tuple[Any, np.ndarray, np.ndarray]:
        """One decode segment (``setup.segment`` steps) of the requests ``decoding`` (row -> request past its
        prompt: ``.tokens``, ``.prompt``, ``.max_new_tokens``, ``.ignore_eos``), each sampled by its row of
        ``sampling``: ``(state, tokens [S, b], emitted [S, b])``."""
        b = setup.max_num_seqs
        token, active = np.zeros(b, np.int32), np.zeros(b, bool)
        left, steps, eos_stops = np.zeros(b, np.int32), np.zeros(b, np.int32), np.ones(b, bool)
        for row, request in decoding.items():
            token[row], active[row] = request.tokens[-1], True
            left[row] = request.max_new_tokens - len(request.tokens)
            steps[row] = len(request.tokens)
            eos_stops[row] = not request.ignore_eos
        held = max(r.prompt.size + len(r.tokens) for r in decoding.values())
        narrow, wide = _narrowed(state, width(setup, held + setup.segment))
        with sharding.use_mesh(self.mesh):
            narrow, tokens, emitted = self.programs.serve_segment(
                self.params, narrow, self.put(token), self.put(active), self.put(left), self.put(eos_stops),
                jax.tree.map(self.put, sampling), self.put(steps), n_steps=setup.segment,
                sampled=bool(np.any(sampling.temperature[active] > 0)))  # all greedy: the argmax-only program
        # to_host: on a mesh across processes every process reads the whole (replicated) tokens - the same host steps
        return self.kind.sync(_widened(narrow, wide)), sharding.to_host(tokens), sharding.to_host(emitted)


def width(setup, tokens: int) -> int:
    """Table entries a call reads for rows of at most ``tokens`` tokens: the pages rounded up to a power of two
    under the full policy - attention gathers and masks every entry, so a row of 1k tokens in a server of max_len
    16k would read 16x what it holds - and the whole table under eviction (its slots are the table)."""
    if setup.evicts:
        return setup.row_pages
    # a power of two: at most 2x what the rows hold, and one compiled width per octave - finer widths
    # (round_chunk's quarters) compiled ~4x as many programs, 124 while one 16k prompt arrived among 8 streams
    return min(setup.row_pages, pl2(-(-tokens // setup.page)))


def _narrowed(state, entries: int):
    """``(state with its table cut to entries, the whole table)``; the whole state when no cut."""
    if entries >= state.table.shape[1]:
        return state, None
    return state.replace(table=state.table[:, :entries]), state.table


def _widened(state, wide):
    """``state`` (its table cut by ``_narrowed``) with the entries past the cut from ``wide`` (None: uncut). Rows
    hold no page past the cut that the call could have changed: it granted only within it."""
    if wide is None:
        return state
    return state.replace(table=wide.at[:, :state.table.shape[1]].set(state.table))


_first_tokens = jax.jit(lambda logits, rows: sample_rows(logits, rows, jnp.zeros_like(rows.top_k)))


# --------------------------------------------------------------------------------------------------- build
def build(config: ModelConfig, params, *, cache: CacheConfig | None = None, eos_id: int | None = None,
          pad_id: int | None = None, mesh=None, unroll: bool | None = None, reconstruction=None, calibration=None,
          kind=None, policy=None) -> Runner:
    """The ``Runner`` of ``config`` / ``params`` over ``cache`` (default: the full contiguous cache), checked once:
    ids in the vocabulary, the mesh's topology, the policy against the cache kind (``check_runs``), a calibrating
    policy measured on ``calibration``, KVzip's ``reconstruction`` present. ``unroll``: ``choose_unroll`` (None:
    when the copy of the layer weights fits; generators over the same params arrays share that copy). ``kind``: the
    cache kind and ``policy`` already made from ``cache`` (a ``ServeSetup``'s)."""
    announce_attention(config)  # attention.impl this machine cannot run (cudnn on a CPU) fails here, untraced
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if value is not None and not (is_int(value) and 0 <= value < config.vocab_size):
            raise ConfigError(f"{name}={value!r} is invalid: must be a token id in [0, {config.vocab_size}) "
                              "(the model's vocabulary) or None")
    placed = params
    if mesh is not None:
        sharding.mesh_topology(config, mesh)  # raises for a model axis that cannot split the KV heads
        if is_unrolled(params):
            raise ConfigError("params are unrolled (layers_0, ...): on a mesh pass the stacked params; the "
                              "generator places them, then unrolls its own copy")
        placed = shard_params(params, config, mesh)
    cache = cache or CacheConfig()
    kind = kind or cache_kind(config, cache, mesh)  # validates the policy against the model
    policy = policy if policy is not None else cache.make_policy()
    kind.check_runs(policy)  # the kind's capabilities against what the policy observes (refuses by them)
    if policy.observes.calibrates:
        policy = _calibrated(config, policy, params, calibration)
        kind = dataclasses.replace(kind, policy=policy)
    if mesh is not None and not kind.shardable:
        raise ConfigError(f"cache.policy={cache.policy!r} (cache type {kind.name!r}) does not run on a device mesh "
                          "yet; generate on one device or use an eviction policy")
    if mesh is not None:
        kind.check_mesh(mesh)
    seq = sharding.axis_size(mesh, "seq")
    if seq > 1:  # a prompt split over seq: the kind must take it, the policy observe nothing while prefilling
        kind.check_runs(policy, seq=seq)
    kept = kept_unrolled(placed)
    fresh = kept is None or unroll is not None or config.rope.rerotate  # else: the kept copy, unrolled
    unrolled = choose_unroll(config, placed, unroll) if fresh else True
    if unrolled:
        placed = kept if kept is not None else keep_unrolled(placed)
    elif is_unrolled(placed):
        raise ConfigError("unroll=False needs stacked params (a 'layers' entry); these are unrolled")
    pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
    if policy.observes.reconstructs and reconstruction is None:
        raise ConfigError(f"cache.policy={cache.policy!r} scores the prompt by asking the model to repeat it: pass "
                          "Generator(reconstruction=...) - the repeat prompt's token ids, e.g. "
                          "lcx.data.haystack.Frame(tokenizer, chat).reconstruction()")
    return Runner(config=config, cache=cache, kind=kind, policy=policy, params=placed,
                  programs=programs(config, eos_id, pad_id, kind, mesh, unrolled), mesh=mesh, seq=seq,
                  unrolled=unrolled, eos_id=eos_id, pad_id=pad_id, reconstruction=reconstruction)


def _calibrated(config: ModelConfig, policy, params, calibration):
    """``policy`` measured on this model (``EvictionPolicy.calibrate``)."""
    if not policy.calibrated:
        if calibration is None:
            raise ConfigError(f"cache.policy={policy.name!r} is calibrated on the model: pass Generator("
                              "calibration=token ids [rows, tokens], e.g. lcx.data.policy_inputs.calibration_ids("
                              "Frame(tokenizer)) - passkey prompts with their answers) or cache.scores")
        if is_unrolled(params):
            raise ConfigError("calibrating a policy needs the stacked params (a 'layers' entry)")
        policy = policy.calibrate(config, params, calibration)
    policy.check_calibration(config)
    return policy


__all__ = ["Runner", "build", "width"]
