"""Generation: chunked prefill, then a compiled decode loop over a fixed-capacity KV cache.

    prompt ids -> pad to a ragged batch -> prefill in chunks of ``cache.prefill_chunk`` (each chunk attends to the
    cache plus itself) -> logits of each row's last prompt token -> lax.while_loop: sample, append, forward one
    token -> tokens padded after EOS.

The cache is any cache type behind the contract of ``lcx.cache.base``: this module calls ``kind.plan``,
``kind.create``, ``kind.make_room`` before each model call, ``kind.end_prefill`` after the prompt and ``kind.sync``
between jitted calls, and never looks inside. The capacity is planned on the host before anything runs
(``lcx.engine.planning``): a prompt + new tokens that do not fit the budget or the memory limit are refused with the
bytes needed, never truncated. It runs on an ``lcx.engine.runner.Runner`` (``build``), as the server does.

A ``DecodeState`` can be saved with orbax after any step and restored in another process; continuing gives
bit-identical tokens because a row's key at step s depends on (its request's key, s) only."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from lcx.cache.base import CacheCapacityError, CacheState
from lcx.cache.config import CacheConfig
from lcx.cache.reconstruct import Reconstruction
from lcx.config_base import ConfigError, to_dict
from lcx.engine.planning import check_positions, plan_capacity, shared_prefixes
from lcx.engine.runner import build
from lcx.engine.sampling import RowSampling, SamplingConfig, row_sampling
from lcx.engine.spec_generator import generate_speculative
from lcx.engine.state import DecodeState, GenerateResult, is_int, pad_prompts
from lcx.model.config import ModelConfig
from lcx.parallel import sharding

SCORE_SEGMENT = 64  # tokens per compiled teacher-forcing scan (Generator.score of caches that cannot chunk)
STATE_VERSION = 2  # DecodeState's layout in a saved state (2: per-row sampling settings and request keys)


class Generator:
    """Prefill and decode for one model, cache and sampling configuration; states can be saved and restored.

    >>> gen = Generator(config, params, max_new_tokens=64)
    >>> state = gen.prefill([[1, 2, 3], [4, 5]])
    >>> state = gen.decode(state, steps=10)   # any number of segments
    >>> gen.save(state, "ckpt"); state = gen.restore("ckpt")
    >>> result = gen.result(gen.decode(state))

    ``mesh`` (``lcx.parallel.sharding.make_mesh``): params are placed by the sharding rules, the cache is split with the
    batch over "data" and KV heads over "model", and the steps run under the mesh (kernels once per shard). A batch
    that the data axis does not divide is padded with copies of its last prompt (``DecodeState.rows``), which
    ``result`` drops.
    """

    def __init__(self, config: ModelConfig, params, *, max_new_tokens: int, cache: CacheConfig | None = None,
                 sampling: SamplingConfig | None = None, eos_id: int | None = None, seed: int = 0,
                 pad_id: int | None = None, mesh=None, capacity: int | None = None, strict: bool = False,
                 unroll: bool | None = None, reconstruction: Reconstruction | None = None, calibration=None):
        """``capacity`` fixes the cache slots (at least what each request needs): requests of different lengths then
        share one compiled prefill and decode (evaluation grids). ``mesh``: shard params and cache over it.
        ``strict``: positions past the trained range (``check_positions``) are an error instead of a warning.
        ``unroll``: run the unrolled decoder on per-layer params (``choose_unroll``; None: when the copy of the layer
        weights fits). Generators over the same params arrays share that copy while the arrays live (or pass
        ``lcx.model.decoder.unroll_params(params)`` yourself). Same tokens either way; unrolled decodes faster (no
        per-step weight or cache slicing) and compiles in time proportional to depth. ``reconstruction``: the
        repeat prompt of a policy scored by reconstruction (``kvzip``; ``lcx.cache.reconstruct``). ``calibration``:
        token ids of a text a policy that ``calibrates`` is measured on (``duo``: its head split), unless its config
        carries the measurement."""
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens!r} is invalid: must be a positive integer")
        self.runner = build(config, params, cache=cache, eos_id=eos_id, pad_id=pad_id, mesh=mesh, unroll=unroll,
                            reconstruction=reconstruction, calibration=calibration)
        r = self.runner
        self.config, self.params, self.mesh, self.cache_config = config, r.params, mesh, r.cache
        self.kind, self.policy, self.programs = r.kind, r.policy, r.programs
        self.seq, self.unrolled = r.seq, r.unrolled
        self.reconstruction, self.pad_id, self._put = reconstruction, r.pad_id, r.put
        self.strict, self.capacity = strict, capacity
        self._open: list = []  # handles of the host resources (e.g. stores) this generator's requests opened
        self.sampling = sampling or SamplingConfig()
        # prompt tokens asked for, and run through the model (shared pages of a paged cache are prefilled once)
        self.prompt_tokens = self.prefilled_tokens = 0
        self.max_new_tokens, self.eos_id, self.seed = max_new_tokens, eos_id, seed

    def _check_prefill_across_seq(self) -> None:
        """A mesh with a ``seq`` axis splits each prompt's prefill over it: the kind must take such a prompt and the
        policy observe nothing while prefilling - ``CacheKind.check_runs`` asks both (``build`` calls it)."""
        self.kind.check_runs(self.policy, seq=self.seq)

    def _new_cache(self, batch: int, capacity: int) -> CacheState:
        self.close()  # a new request: release the host resources of the previous one
        make = functools.partial(self.kind.create, batch, capacity)
        if self.mesh is None:
            cache, handle = self.kind.open(make())
            self._open.append(handle)
            return cache
        # Created sharded: the whole cache never sits on one device.
        return jax.jit(make, out_shardings=self.kind.shardings(self.kind.abstract(batch, capacity), self.mesh))()

    # ----------------------------------------------------------------------------------------------- prefill

    def prefill(self, prompt_ids, progress: bool = False, state: DecodeState | None = None, *,
                sampling: Sequence[SamplingConfig] | None = None, seeds: Sequence[int] | None = None,
                whole=None) -> DecodeState:
        """Run the prompts through the model in chunks; returns the state before the first sampled token.
        ``progress``: show a progress bar (tokens per second, ETA) over the chunks - for long prompts.

        ``state``: append the prompts to a state's cache instead of a new one, one prompt per row (e.g. a different
        question to each row of ``fork(state, n)``); generation then starts afresh after them. The state's capacity
        must hold its tokens, the longest prompt and ``max_new_tokens`` (create the Generator with ``capacity``).

        Evicting policies see the whole prompt with full attention and compress once at the end, unless the prompt
        exceeds the capacity: then chunks of at most ``interval`` tokens are compressed between (the cache type
        decides, ``kind.prefill_chunk`` / ``kind.make_room`` / ``kind.end_prefill``).

        With a paged cache the whole pages that consecutive prompts start with (a shared system prompt, several
        questions about one document) are prefilled once and stored once: one row per run of such prompts is
        prefilled, forked (``kind.fork``), and every row continues with its own tokens. ``prompt_tokens`` /
        ``prefilled_tokens`` count the tokens asked for and run through the model.
        ``sampling``: one ``SamplingConfig`` per prompt (default: the generator's for all); ``seeds``: one seed per
        prompt, the key of that request's random stream (default: the generator's seed folded with the prompt's
        index; a ``state``'s rows keep theirs). A prompt with a seed gets the same tokens alone or in any batch.
        ``whole``: with ``state``, the whole prompts whose start the state holds and whose rest ``prompt_ids`` is
        (``lcx.engine.split_prefill``): a policy that scores by reconstruction repeats them, not only the rest.
        """
        ids, lengths = pad_prompts(prompt_ids, pad_id=0)
        rows_sampling = self._row_sampling(ids.shape[0], sampling, seeds, state)
        if np.any(ids < 0) or np.any(ids >= self.config.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.config.vocab_size)][0])
            raise ConfigError(f"prompt token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        rows = ids.shape[0]
        if self.mesh is not None:  # rows the data axis does not divide: copies of the last prompt, dropped later
            extra = -rows % sharding.axis_size(self.mesh, "data")
            ids, lengths = np.concatenate([ids, ids[-1:].repeat(extra, 0)]), np.concatenate(
                [lengths, lengths[-1:].repeat(extra)])
            rows_sampling = jax.tree.map(lambda x: np.concatenate([x, x[-1:].repeat(extra, 0)]), rows_sampling)
        batch, max_len = ids.shape
        self.prompt_tokens += int(lengths.sum())
        if state is None:
            check_positions(self.config, self.cache_config, max_len, self.max_new_tokens, self.strict)
            capacity = plan_capacity(self.config, self.cache_config, batch, max_len, self.max_new_tokens, self.mesh)
            if self.capacity is not None:
                if self.capacity < capacity:
                    raise CacheCapacityError(f"capacity={self.capacity} is too small: this request needs {capacity} "
                                             f"cache slots (prompt {max_len} + max_new_tokens {self.max_new_tokens})")
                capacity = self.capacity
            groups = shared_prefixes(self.kind, ids, lengths)
            if groups:  # runs of rows that start alike, in whole pages: each run's prefix prefilled once, shared
                first, counts, shared = (np.asarray(x) for x in zip(*groups))
                prefixes = np.zeros((len(groups), int(shared.max())), np.int32)
                for g, (row, n) in enumerate(zip(first, shared)):
                    prefixes[g, :n] = ids[row, :n]
                cache, _ = self._chunks(prefixes, shared.astype(np.int32), self._new_cache(len(groups), capacity),
                                        capacity, progress)
                cache = self.kind.fork(cache, counts)
                skip = np.repeat(shared, counts)
                ids, lengths = pad_prompts([ids[r, skip[r]:lengths[r]] for r in range(batch)])
            else:
                cache = self._new_cache(batch, capacity)
        else:
            if self.seq > 1:
                raise ConfigError(f"mesh.seq={self.seq} prefills a prompt in one chunk into a fresh cache: "
                                  "prefill(state=...) appends to a filled one - use a mesh without seq for it")
            cache, capacity = self._continued(state, batch, max_len)
        reconstructs = getattr(self.policy, "reconstructs", False)
        longest = max_len if whole is None else max(len(w) for w in whole)  # what the policy scores and keeps
        if reconstructs and ((state is not None and whole is None) or longest > capacity):
            raise ConfigError(
                f"cache.policy={self.cache_config.policy!r} compresses a fresh prompt once, after scoring all of it: "
                + ("append later tokens with Generator.score, not prefill(state=...)" if state is not None else
                   f"the prompt ({longest} tokens) must fit the capacity ({capacity}) - raise cache.interval to at "
                   f"least the prompt length - budget"))
        cache, last_logits = self._chunks(ids, lengths, cache, capacity, progress)
        if reconstructs:
            cache = self.runner.reconstruct(cache, *((ids, lengths) if whole is None else pad_prompts(whole)),
                                            progress)
        with sharding.use_mesh(self.mesh):
            cache = self.kind.sync(self.programs.end_prefill(cache))
        return DecodeState(
            cache=cache, logits=last_logits,
            tokens=self._put(np.full((batch, self.max_new_tokens), self.pad_id, np.int32)),
            n_generated=self._put(np.zeros((batch,), np.int32)), done=self._put(np.zeros((batch,), bool)),
            step=self._put(np.int32(0), False), sampling=jax.tree.map(self._put, rows_sampling),
            rows=rows if rows < batch else None)

    def _row_sampling(self, rows: int, sampling, seeds, state: DecodeState | None) -> RowSampling:
        """Each prompt's sampling settings and request key, checked (host arrays): a continued state's rows keep
        their requests' keys unless ``seeds`` are given."""
        kept = None if state is None else np.asarray(sharding.to_host(state.sampling.keys))[:rows]
        return row_sampling(rows, sampling, seeds, default=self.sampling, seed=self.seed, keys=kept)

    def _chunks(self, ids: np.ndarray, lengths: np.ndarray, cache: CacheState, capacity: int,
                progress: bool) -> tuple[CacheState, jax.Array]:
        self.prefilled_tokens += int(lengths.sum())
        return self.runner.chunks(ids, lengths, cache, capacity, progress)

    def _continued(self, state: DecodeState, batch: int, max_len: int) -> tuple[CacheState, int]:
        """The cache of ``state`` to append ``batch`` prompts of up to ``max_len`` tokens to, and its capacity."""
        cache = state.cache
        rows = int(cache.lengths.shape[0])
        if batch != rows:
            raise ConfigError(f"prefill got {batch} prompts for a state of {rows} rows: one prompt per row (fork the "
                              f"state into more rows first: Generator.fork(state, n))")
        done = int(np.max(sharding.to_host(cache.lengths)))
        check_positions(self.config, self.cache_config, done + max_len, self.max_new_tokens, self.strict)
        need = self.kind.plan(batch, done + max_len, self.max_new_tokens)
        if need > cache.capacity:
            raise CacheCapacityError(
                f"appending prompts of up to {max_len} tokens to a state holding {done} needs {need} cache slots "
                f"(+ max_new_tokens {self.max_new_tokens}) but the state was planned for {cache.capacity}: create the "
                f"Generator with capacity >= {need}")
        return cache, cache.capacity

    def fork(self, state: DecodeState, n) -> DecodeState:
        """Each row of ``state`` as ``n`` consecutive rows that continue independently: a prefilled (and possibly
        compressed) context asked ``n`` different questions with ``prefill(questions, state=...)``. ``n``: one
        count for every row, or a list of one count per row (e.g. the questions of each of several contexts). With
        ``CacheConfig(layout="paged")`` the rows share the context's full pages (stored once, ``lcx.cache.paged``);
        other caches copy the rows. The sampler state is copied too."""
        rows = int(state.cache.lengths.shape[0])
        counts = [n] if is_int(n) else list(n) if isinstance(n, (list, tuple, np.ndarray)) else None
        if not counts or not all(is_int(c) and c >= 1 for c in counts) or len(counts) not in (1, rows):
            raise ConfigError(f"fork n={n!r} is invalid: must be a positive integer (rows per row of the state) or "
                              f"a list of {rows} of them (one per row)")
        if self.mesh is not None:
            raise ConfigError("Generator.fork on a device mesh is not supported yet: fork on one device")
        counts = n if is_int(n) else np.asarray(counts, np.int64)
        repeat = lambda x: jnp.repeat(x, counts, axis=0)  # noqa: E731
        per_row = np.broadcast_to(np.asarray(counts), (rows,))
        child = np.concatenate([np.arange(c) for c in per_row]).astype(np.uint32)  # each fork's index in its row
        keys = jax.vmap(jax.random.fold_in)(repeat(state.sampling.keys), jnp.asarray(child))
        sampling = jax.tree.map(repeat, state.sampling).replace(keys=keys)  # each fork a request of its own
        return state.replace(cache=self.kind.fork(state.cache, counts), logits=repeat(state.logits),
                             tokens=repeat(state.tokens), n_generated=repeat(state.n_generated),
                             done=repeat(state.done), sampling=sampling)

    # ----------------------------------------------------------------------------------------------- decode
    def decode(self, state: DecodeState, steps: int | None = None) -> DecodeState:
        """Sample up to ``steps`` more tokens (default: to ``max_new_tokens``) or until every row hit EOS."""
        limit = self.max_new_tokens if steps is None else min(int(state.step) + steps, self.max_new_tokens)
        segment = self.kind.decode_segment
        sampled = bool(np.any(sharding.to_host(state.sampling.temperature) > 0))  # else the argmax-only program
        while True:  # one jitted loop per segment; the cache type syncs between (e.g. offloads blocks)
            step = int(state.step)
            stop = limit if segment is None else min(limit, step + segment)
            with sharding.use_mesh(self.mesh):
                state = self.programs.decode_loop(self.params, state, self._put(np.int32(stop), False),
                                                  sampled=sampled)
            state = state.replace(cache=self.kind.sync(state.cache))
            if stop >= limit or int(state.step) < stop:  # the limit, or every row hit EOS
                return state

    def score(self, state: DecodeState, tokens, progress: bool = False) -> tuple[DecodeState, np.ndarray]:
        """Log-probabilities ``[b, n]`` of given continuation ``tokens [b, n]`` after ``state`` (teacher forcing
        through the same cache and eviction schedule as decoding); returns the advanced state too.
        ``progress``: a progress bar (tokens per second, ETA).

        Perplexity under an eviction policy: ``prefill`` a prefix, then ``score`` the rest of the text.

        The tokens go through the model in chunks, each like a prefill chunk, as large as the cache type allows
        while keeping the schedule of one-token decode steps (``kind.score_width`` / ``score_room`` /
        ``score_weights``: a slot cache evicts at the same positions and accumulates the same attention
        statistics), so the log-probabilities equal decoding's up to float32 summation order; cache types that
        cannot chunk go one token per step.
        """
        state, logprobs, _, _ = self._score(state, tokens, progress, 0)
        return state, logprobs

    def score_top(self, state: DecodeState, tokens, top: int) -> tuple[DecodeState, np.ndarray, np.ndarray,
                                                                        np.ndarray]:
        """``score`` that also returns each position's ``top`` most likely tokens: ``(state, logprobs [b, n],
        top_logprobs [b, n, top], top_ids [b, n, top])`` (most likely first; a given token that is the most likely
        has exactly its top log-probability - the same float32 expression)."""
        if not is_int(top) or top < 1:
            raise ConfigError(f"top={top!r} is invalid: must be a positive integer (use score for none)")
        return self._score(state, tokens, False, top)

    def _score(self, state: DecodeState, tokens, progress: bool, top: int):
        tokens = np.asarray(tokens, np.int32)
        rows = tokens.shape[0]
        if state.rows is not None and rows == state.rows:  # a mesh's padding rows score copies of the last row
            tokens = np.concatenate([tokens, tokens[-1:].repeat(int(state.cache.lengths.shape[0]) - rows, 0)])
        # The cache was planned for prompt + max_new_tokens: a full cache (or an evicting one planned below its
        # budget + interval, for a short generation) cannot take more; its writes would fall off the end.
        done = int(jnp.max(state.cache.lengths))
        need = self.kind.plan(tokens.shape[0], done + tokens.shape[1], 0)
        if need > state.cache.capacity:
            raise CacheCapacityError(
                f"scoring {tokens.shape[1]} tokens needs {need} cache slots but the {self.cache_config.policy} cache "
                f"was planned for {state.cache.capacity} (prompt + max_new_tokens): create the Generator with "
                f"max_new_tokens >= {tokens.shape[1]}" + ("" if self.policy.evicts else " or use an eviction policy"))
        batch, total = tokens.shape
        width = self.kind.score_width(total)
        bar = tqdm(total=total * batch, disable=not progress, unit="tok", unit_scale=True, desc="score",
                   dynamic_ncols=True)
        logprobs, tops, top_ids = [], [], []
        lo = 0
        while lo < total:
            if width is None:  # one token per step, in fixed-size compiled scans (the cache type syncs between)
                segment = self.kind.decode_segment or SCORE_SEGMENT
                n = min(segment, total - lo)
                chunk = np.zeros((batch, segment), np.int32)
                chunk[:, :n] = tokens[:, lo:lo + n]
                with sharding.use_mesh(self.mesh):
                    cache, logits, part, best, best_ids = self.programs.forced_loop(
                        self.params, state.cache, state.logits, self._put(chunk), self._put(np.int32(n), False),
                        top=top)
            else:
                room = self.kind.score_room(state.cache)
                n = min(width, total - lo, width if room is None else room)
                chunk = np.zeros((batch, width), np.int32)
                chunk[:, :n] = tokens[:, lo:lo + n]
                weights = self.kind.score_weights(n, width, batch)
                with sharding.use_mesh(self.mesh):
                    cache, logits, part, best, best_ids = self.programs.forced_chunk(
                        self.params, state.cache, state.logits, self._put(chunk), self._put(np.int32(n), False),
                        None if weights is None else self._put(weights), top=top)
            state = state.replace(cache=self.kind.sync(cache), logits=logits)
            logprobs.append(sharding.to_host(part)[:, :n])
            tops.append(sharding.to_host(best)[:, :n])
            top_ids.append(sharding.to_host(best_ids)[:, :n])
            bar.update(n * batch)
            lo += n
        bar.close()
        return (state, np.concatenate(logprobs, axis=1)[:rows], np.concatenate(tops, axis=1)[:rows],
                np.concatenate(top_ids, axis=1)[:rows])

    def result(self, state: DecodeState) -> GenerateResult:
        rows = slice(state.rows)  # the requested rows (a mesh's padding dropped)
        return GenerateResult(tokens=sharding.to_host(state.tokens)[rows],
                              lengths=sharding.to_host(state.n_generated)[rows], cache_bytes=state.cache.kv_bytes(),
                              store_bytes=self.kind.store_bytes(state.cache))

    def close(self) -> None:
        """Release host resources (e.g. a long-term store) of the requests this generator served."""
        while self._open:
            self.kind.close(self._open.pop())

    def finished(self, state: DecodeState) -> bool:
        return bool(int(state.step) >= self.max_new_tokens or bool(jnp.all(state.done)))

    # ----------------------------------------------------------------------------------------------- save/restore
    def _settings(self) -> dict[str, Any]:
        """What must match between the generator that saved a state and the one restoring it (JSON-normalized)."""
        return json.loads(json.dumps({
            "model": to_dict(self.config), "cache": self.cache_config.to_dict(),
            "sampling": dataclasses.asdict(self.sampling), "max_new_tokens": self.max_new_tokens,
            "eos_id": self.eos_id, "seed": self.seed, "pad_id": self.pad_id}))

    def save(self, state: DecodeState, path: str | Path) -> None:
        """Write the state with orbax (``path/state``) plus the settings needed to continue (``path/meta.json``)."""
        import orbax.checkpoint as ocp

        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path / "state", state, force=True)
        checkpointer.wait_until_finished()
        self.kind.save_host(state.cache, path)
        # the buffers' shapes too: a forked paged state's pool is sized by its pages in use, not by batch x capacity
        meta = dict(self._settings(), state_version=STATE_VERSION, batch=int(state.tokens.shape[0]),
                    capacity=state.cache.capacity,
                    step=int(state.step), rows=state.rows, shapes=[list(x.shape) for x in jax.tree.leaves(state)])
        (path / "meta.json").write_text(json.dumps(meta, indent=2))

    def restore(self, path: str | Path) -> DecodeState:
        """Read a state written by ``save`` for this generator's configuration."""
        import orbax.checkpoint as ocp

        path = Path(path).absolute()
        meta_path = path / "meta.json"
        if not meta_path.is_file():
            raise ConfigError(f"{str(path)!r} is not a decode-state checkpoint: {meta_path} is missing")
        meta = json.loads(meta_path.read_text())
        if meta.get("state_version") != STATE_VERSION:
            raise ConfigError(f"decode state at {str(path)!r} has layout {meta.get('state_version', 1)}, this lcx "
                              f"reads {STATE_VERSION}: states saved before 0.2 carry one sampler key, now each row "
                              "carries its settings and request key (DecodeState.sampling); prefill again")
        mine = self._settings()
        mismatched = [k for k in mine if meta.get(k) != mine[k]]
        if mismatched:
            k = mismatched[0]
            raise ConfigError(f"decode state at {str(path)!r} was saved with {k}={meta.get(k)!r}, this generator has "
                              f"{k}={mine[k]!r}: restore it with the same settings")
        b, capacity = meta["batch"], meta["capacity"]
        abstract = jax.eval_shape(lambda: self._empty_state(b, capacity))
        leaves, tree = jax.tree.flatten(abstract)
        if len(meta.get("shapes", ())) == len(leaves):  # the saved shapes (e.g. a forked pool's) over the empty ones
            abstract = tree.unflatten([jax.ShapeDtypeStruct(tuple(s), a.dtype) for s, a in zip(meta["shapes"], leaves)])
        # Restored straight onto this generator's mesh (or one device), whatever mesh saved it.
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                self._state_shardings(abstract))
        state = ocp.StandardCheckpointer().restore(path / "state", abstract)
        cache, handle = self.kind.restore_host(state.cache, path)
        self._open.append(handle)
        return state.replace(cache=cache, rows=meta.get("rows"))

    def _state_shardings(self, state: DecodeState) -> DecodeState:
        if self.mesh is None:
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            return jax.tree.map(lambda _: one, state)
        rows, mesh = sharding.batch_sharding, self.mesh
        return DecodeState(cache=self.kind.shardings(state.cache, mesh), logits=rows(mesh, 2),
                           tokens=rows(mesh, 2), n_generated=rows(mesh), done=rows(mesh),
                           step=sharding.replicated(mesh),
                           sampling=RowSampling(temperature=rows(mesh), top_k=rows(mesh), top_p=rows(mesh),
                                                keys=rows(mesh, 2)))

    def _empty_state(self, batch: int, capacity: int) -> DecodeState:
        return DecodeState(
            cache=self.kind.create(batch, capacity),
            logits=jnp.zeros((batch, self.config.vocab_size), jnp.float32),
            tokens=jnp.zeros((batch, self.max_new_tokens), jnp.int32), n_generated=jnp.zeros((batch,), jnp.int32),
            done=jnp.zeros((batch,), bool), step=jnp.int32(0), sampling=RowSampling.empty(batch))


def generate(config: ModelConfig, params, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             cache: CacheConfig | None = None, seed: int = 0, mesh=None, strict: bool = False,
             speculative=None) -> GenerateResult:
    """Generate ``max_new_tokens`` per prompt. ``prompt_ids``: int array ``[batch, len]`` or a list of token lists.

    Returns ``.tokens [batch, max_new_tokens]`` (padded with ``eos_id`` after EOS) and ``.lengths``.
    ``mesh`` (``lcx.parallel.sharding.make_mesh``): generate sharded over it (see ``Generator``); the tokens equal the
    single-device ones. ``strict``: positions past the model's trained range are an error, not a warning.
    ``speculative`` (``lcx.SpeculativeConfig``): draft with a compressed cache, verify against ``cache``
    (``lcx.engine.speculative``); ``.speculative``: the acceptance counts (None: decoded plainly, too short)."""
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    spec = speculative and generate_speculative(  # None: it does not pay for these prompts, decode plainly
        config, params, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, cache=cache,
        seed=seed, mesh=mesh, strict=strict, speculative=speculative)
    if spec is not None:
        return spec
    gen = Generator(config, params, max_new_tokens=max_new_tokens, cache=cache, sampling=sampling, eos_id=eos_id,
                    seed=seed, mesh=mesh, strict=strict)
    return gen.result(gen.decode(gen.prefill(prompt_ids)))


__all__ = ["Generator", "generate"]
