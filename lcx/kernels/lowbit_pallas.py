"""Decode and prefill attention on a bit-packed cache's codes in Pallas (``cache.kv_dtype: int4 | int2``): the codes
are read tile by tile and unpacked in registers, never as a float copy of the cache. :func:`decode_lowbit_tiles`
(split-K, below) and :func:`chunk_lowbit_tiles` (a prefill chunk: one program per block of queries and KV head, the
same step per key group with each query's causal bound, the window merged the same way).

The store is ``lcx.cache.lowbit_slots``' (see ``lcx.kernels.lowbit_decode`` for the layout and the fused XLA
formulation every other backend uses). The cache is cut into ``n`` splits of whole key groups; program (split, b,
KV head) streams its split one key group (``G`` slots) per step:

- logits: the group's key codes ``[d, G * bits / 8]`` (channel-major) unpacked to ``[d, G]``, and ``(q * scale_n)
  @ codes + q . zero_n`` - the group's scales folded into the query, one dot per tile;
- values: the tile's value codes ``[G, d * bits / 8]`` unpacked and scaled per token and channel group in
  registers, then the online-softmax update of the float decode kernel (``lcx.kernels.common``);
- only the slots below the window's first one are read (``win_start``, a multiple of ``G``): the tiles past it are
  skipped, not masked. The float window (the recent tokens and the key group still filling) is attended apart in
  XLA - at most ``kv_residual + G`` slots - and merged with the codes' partial exactly
  (:func:`lcx.kernels.merge_partials`).

``weights``: each program writes its tile's scaled logits; the probabilities follow from the merged log-sum-exp, as
in :func:`lcx.kernels.decode.decode_attention`. Results equal :func:`lcx.kernels.decode_lowbit` up to
float32 summation order (``tests/kernels/test_lowbit_decode.py``, interpret mode). On a GPU it compiles through
Triton: no slice of a register tile, every loaded tile a power of two in size - the query rows of a KV group padded
to one (>= 16 in decode; ``block_q`` x ``g`` rounded up per query in a chunk: SmolLM2's 3 heads per KV head take 4
rows), so the real models' head shapes lower (``tests/kernels/test_cuda_lowering.py``, from a CPU); a head dim that
is no power of two does not (``triton_compiles``), and the backend takes the XLA formulation for it. Forward only
(inference).

Shapes: b batch, h query heads, k KV heads, g = h / k, r program rows (g padded to >= 16), C slots, n key groups, G
slots per group, W window slots, d head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import einops
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lcx.kernels.attended import Attended
from lcx.kernels.common import (LN2, LOG2E, combine_splits, merge_partials, online_softmax, online_update, pad_axis,
                               target_programs)
from lcx.kernels.lowbit import LOWBIT
from lcx.kernels.lowbit_decode import LowbitKV
from lcx.kernels.mode import pallas_call_kwargs, resolve_interpret
from lcx.kernels.reference import capped

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Static:
    group: int  # G: slots per key group = per loop step
    split_len: int  # slots per split (whole groups)
    rows: int  # r
    sm_scale: float
    softcap: float | None
    bits: int
    value_group: int  # channels per value scale
    return_weights: bool


def triton_compiles(head_dim: int) -> bool:
    """Whether these kernels lower for Triton at ``head_dim``: every tile they load (``[d, G * bits / 8]`` key codes,
    ``[G, d * bits / 8]`` value codes, ``[rows, d]`` queries, ...) must have a power-of-two size. ``kv_group`` is one
    by config and the query rows are padded to one, so the head dim decides (64 / 128 / 256 do; 80 / 96 do not)."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


def _check_compiles(head_dim: int, interpret: bool | None) -> None:
    if not resolve_interpret(interpret) and not triton_compiles(head_dim):
        raise ValueError(f"head_dim={head_dim} is not a power of two: the bit-packed Pallas kernels do not lower for "
                         "Triton at it; use lcx.kernels.decode_lowbit (the fused XLA formulation), as the pallas "
                         "backend does for such a model")


def _unpack(x: jax.Array, bits: int) -> jax.Array:
    """Packed codes ``[..., n]`` uint8 (the first in the low bits) -> ``[..., n * 8 / bits]`` float32, in
    registers."""
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.int32) * bits
    codes = (x.astype(jnp.int32)[..., None] >> shifts) & (2**bits - 1)
    return codes.reshape(*x.shape[:-1], x.shape[-1] * per).astype(_F32)


def lowbit_kernel(start_ref, q_ref, k_ref, ks_ref, kz_ref, v_ref, vs_ref, vz_ref, live_ref, acc_ref, m_ref, l_ref,
                  *s_refs, st: _Static):
    """One split of one KV group. Refs: win_start [] (the first slot not held as codes), q [r, d], key codes
    [d, split * bits / 8], key scales and zeros [split / G, d], value codes [split, d * bits / 8], value scales
    and zeros [split, d / Gv], live [split] int32 -> acc [r, d], m [r], l [r], [scores [r, split]]."""
    G, bits = st.group, st.bits
    group_bytes = G * bits // 8
    start = pl.program_id(0) * st.split_len
    q = q_ref[...]  # [r, d] float32
    n_tiles = st.split_len // G
    hi = jnp.clip((jnp.maximum(start_ref[()] - start, 0) + G - 1) // G, 0, n_tiles)

    def body(i, carry):
        k0 = pl.multiple_of(i * G, G)
        codes = _unpack(k_ref[:, pl.ds(i * group_bytes, group_bytes)], bits)  # [d, G]
        scale, zero = ks_ref[pl.ds(i, 1), :].astype(_F32), kz_ref[pl.ds(i, 1), :].astype(_F32)  # [1, d]
        s = jnp.dot(q * scale, codes, preferred_element_type=_F32) + jnp.sum(q * zero, axis=1, keepdims=True)
        s = capped(s * st.sm_scale, st.softcap) * LOG2E  # [r, G] base-2 logits, as the float decode kernel's
        if st.return_weights:  # every program row: Triton has no slice of a register tile (the caller keeps g)
            s_refs[0][:, pl.ds(k0, G)] = s
        v_codes = _unpack(v_ref[pl.ds(k0, G), :], bits)  # [G, d]
        d = v_codes.shape[1]
        vs, vz = vs_ref[pl.ds(k0, G), :].astype(_F32), vz_ref[pl.ds(k0, G), :].astype(_F32)  # [G, d / Gv]
        values = (v_codes.reshape(G, d // st.value_group, st.value_group) * vs[..., None]
                  + vz[..., None]).reshape(G, d)
        return online_update(carry, s, live_ref[pl.ds(k0, G)] != 0, values)

    online_softmax(body, hi, q, acc_ref, m_ref, l_ref)


def decode_lowbit_tiles(q: jax.Array, k: jax.Array, v: jax.Array, kv: LowbitKV, *, valid: jax.Array,
                        sm_scale: float, softcap: float | None = None, weights: bool = False,
                        residuals: bool = False, num_splits: int | None = None,
                        interpret: bool | None = None) -> Attended:
    """:func:`lcx.kernels.decode_lowbit`'s contract (one query per row ``q [b, h, d]`` on the codes
    ``k [b, k, d, C' * bits / 8]``, ``v [b, k, C, d * bits / 8]`` and ``kv``'s groups and window; ``valid [b, C]``
    or ``[b, k, C]``) through the Pallas kernel. ``num_splits``: splits of the cache per row and KV head (None:
    enough programs for a GPU's SMs, among divisors of the group count); ``interpret``: see ``lcx.kernels.mode``."""
    b, heads, d = q.shape
    kv_heads, slots = v.shape[1], v.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads must be a multiple of {kv_heads=} key/value heads")
    _check_compiles(d, interpret)
    bits, G = LOWBIT[kv.quant], kv.group
    groups = kv.k_scale.shape[2]
    padded = groups * G  # C': the key codes' slots
    g = heads // kv_heads
    rows = max(16, pl.next_power_of_2(g))
    want = num_splits or -(-target_programs() // (b * kv_heads))  # ~2 waves of the GPU's SMs, as the float kernel
    n_splits = max(n for n in range(1, min(want, groups) + 1) if groups % n == 0)
    value_groups = kv.v_scale.shape[-1]
    st = _Static(group=G, split_len=padded // n_splits, rows=rows, sm_scale=float(sm_scale), softcap=None if softcap is None else float(softcap), bits=bits,
                 value_group=d // value_groups, return_weights=bool(weights))

    seen = jnp.broadcast_to(valid.astype(bool).reshape(b, -1, slots), (b, kv_heads, slots))
    place = jnp.arange(slots)[None, None, :] - kv.win_start[..., None]
    live = pad_axis((seen & (place < 0)).astype(jnp.int32), 2, padded)  # the codes' slots: below the window
    qg = pad_axis(einops.rearrange(q.astype(_F32), "b (k g) d -> b k g d", k=kv_heads), 2, rows)  # [b, k, r, d]
    # slots past C (the last key group's tail) exist only in the key codes: values and their groups padded
    vp, vs, vz = (pad_axis(x, 2, padded) for x in (v, kv.v_scale, kv.v_zero))
    split, split_groups = st.split_len, st.split_len // G
    per_row = lambda shape, index: pl.BlockSpec((None, None, *shape), index)  # noqa: E731
    in_specs = [per_row((), lambda n, bi, ki: (bi, ki)),
                per_row((rows, d), lambda n, bi, ki: (bi, ki, 0, 0)),
                per_row((d, split * bits // 8), lambda n, bi, ki: (bi, ki, 0, n)),
                per_row((split_groups, d), lambda n, bi, ki: (bi, ki, n, 0)),
                per_row((split_groups, d), lambda n, bi, ki: (bi, ki, n, 0)),
                per_row((split, d * bits // 8), lambda n, bi, ki: (bi, ki, n, 0)),
                per_row((split, value_groups), lambda n, bi, ki: (bi, ki, n, 0)),
                per_row((split, value_groups), lambda n, bi, ki: (bi, ki, n, 0)),
                per_row((split,), lambda n, bi, ki: (bi, ki, n))]
    out_specs = [pl.BlockSpec((None, None, None, rows, d), lambda n, bi, ki: (bi, ki, n, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda n, bi, ki: (bi, ki, n, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda n, bi, ki: (bi, ki, n, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, kv_heads, n_splits, rows, d), _F32),
                 jax.ShapeDtypeStruct((b, kv_heads, n_splits, rows), _F32),
                 jax.ShapeDtypeStruct((b, kv_heads, n_splits, rows), _F32)]
    if weights:
        out_specs.append(pl.BlockSpec((None, None, rows, split), lambda n, bi, ki: (bi, ki, 0, n)))
        out_shape.append(jax.ShapeDtypeStruct((b, kv_heads, rows, padded), _F32))
    with jax.named_scope("lcx_lowbit_decode"):
        outs = pl.pallas_call(
            functools.partial(lowbit_kernel, st=st), grid=(n_splits, b, kv_heads), in_specs=in_specs,
            out_specs=out_specs, out_shape=out_shape, name="lcx_lowbit_decode",
            **pallas_call_kwargs(interpret, num_warps=4, num_stages=2),
        )(kv.win_start.astype(jnp.int32), qg, k, kv.k_scale, kv.k_zero, vp, vs, vz, live)
    o, m2, l_codes, empty = combine_splits(*outs[:3])  # [b, k, r, d], [b, k, r] (base 2)
    codes = (o[:, :, :g], jnp.where(empty, -jnp.inf, m2 * LN2)[:, :, :g], l_codes[:, :, :g])

    # the float window, in XLA: its slots win_start + w (those past the capacity do not exist)
    width = kv.k_win.shape[2]
    window_slots = kv.win_start[..., None] + jnp.arange(width)  # [b, k, W]
    window_seen = (window_slots < slots) & jnp.take_along_axis(seen, jnp.minimum(window_slots, slots - 1), axis=-1)
    logits = capped(jnp.einsum("bkgd,bkwd->bkgw", qg[:, :, :g], kv.k_win.astype(_F32)) * sm_scale, softcap)
    logits = jnp.where(window_seen[:, :, None], logits, -jnp.inf)
    m_w = jnp.max(logits, axis=-1)
    p_w = jnp.exp(logits - jnp.where(jnp.isfinite(m_w), m_w, 0.0)[..., None])
    l_w = jnp.sum(p_w, axis=-1)
    o_w = jnp.einsum("bkgw,bkwd->bkgd", p_w, kv.v_win.astype(_F32)) / jnp.where(l_w == 0, 1.0, l_w)[..., None]
    out, m, l = merge_partials(codes, (o_w, m_w, l_w))  # [b, k, g, d], [b, k, g]
    result = Attended(out=out.reshape(b, heads, d).astype(q.dtype))
    if weights:  # per slot: the codes' probabilities from the merged log-sum-exp, the window's added at its slots
        lse = m + jnp.log(jnp.where(l == 0, 1.0, l))  # natural; rows with no slot get p = 0 below
        p_codes = jnp.where(live[:, :, None, :slots] != 0, jnp.exp2(outs[3][:, :, :g, :slots] - lse[..., None] * LOG2E),
                            0.0)
        p_window = jnp.where(window_seen[:, :, None], jnp.exp(logits - lse[..., None]), 0.0)
        rows_, heads_ = jnp.arange(b)[:, None, None], jnp.arange(kv_heads)[None, :, None]
        per_slot = jnp.sum(p_codes, axis=2).at[rows_, heads_, window_slots].add(jnp.sum(p_window, axis=2),
                                                                                mode="drop")
        result = result.replace(weights=per_slot)
    if residuals:
        result = result.replace(m=m.reshape(b, heads), l=l.reshape(b, heads))
    return result


@dataclasses.dataclass(frozen=True)
class _ChunkStatic:
    group: int
    block_q: int  # queries per program (their g heads each: block_q * g rows)
    heads: int  # rows per query: g padded to a power of two
    groups: int  # key groups of the codes (n)
    sm_scale: float
    softcap: float | None
    bits: int
    value_group: int


def lowbit_chunk_kernel(start_ref, offset_ref, q_ref, k_ref, ks_ref, kz_ref, v_ref, vs_ref, vz_ref, o_ref, m_ref,
                        l_ref, *, st: _ChunkStatic):
    """One block of ``block_q`` queries (``g`` heads each, rows query-major) of one KV group against the codes below
    the window: query ``i`` sits at slot ``offset + i`` and sees the code slots ``<= offset + i`` below
    ``win_start``. Refs: win_start [], offset [], q [rows, d], the row's whole key codes [d, n * G * bits / 8], key
    scales and zeros [n, d], value codes [n * G, d * bits / 8], value scales and zeros [n * G, d / Gv] -> out [rows,
    d] (normalized), m, l [rows] (base 2)."""
    G, bits = st.group, st.bits
    group_bytes = G * bits // 8
    q = q_ref[...]  # [rows, d] float32
    rows = q.shape[0]
    first = pl.program_id(2) * st.block_q
    start, offset = start_ref[()], offset_ref[()]
    query_slot = offset + first + jnp.arange(rows) // st.heads  # [rows]
    last_seen = jnp.minimum(start, offset + first + st.block_q)  # the block sees no code slot at or past this
    hi = jnp.clip((last_seen + G - 1) // G, 0, st.groups)

    def body(i, carry):
        acc, m, l = carry
        k0 = pl.multiple_of(i * G, G)
        codes = _unpack(k_ref[:, pl.ds(i * group_bytes, group_bytes)], bits)  # [d, G]
        scale, zero = ks_ref[pl.ds(i, 1), :].astype(_F32), kz_ref[pl.ds(i, 1), :].astype(_F32)
        s = jnp.dot(q * scale, codes, preferred_element_type=_F32) + jnp.sum(q * zero, axis=1, keepdims=True)
        s = capped(s * st.sm_scale, st.softcap) * LOG2E  # [rows, G]
        slot = k0 + jnp.arange(G)
        live = (slot[None, :] < start) & (slot[None, :] <= query_slot[:, None])
        s = jnp.where(live, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(live, jnp.exp2(s - safe[:, None]), 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp2(m - safe), 0.0)
        v_codes = _unpack(v_ref[pl.ds(k0, G), :], bits)  # [G, d]
        d = v_codes.shape[1]
        vs, vz = vs_ref[pl.ds(k0, G), :].astype(_F32), vz_ref[pl.ds(k0, G), :].astype(_F32)
        values = (v_codes.reshape(G, d // st.value_group, st.value_group) * vs[..., None]
                  + vz[..., None]).reshape(G, d)
        return (acc * alpha[:, None] + jnp.dot(p, values, preferred_element_type=_F32), m_new,
                l * alpha + jnp.sum(p, axis=1))

    init = (jnp.zeros(q.shape, _F32), jnp.full((rows,), -jnp.inf, _F32), jnp.zeros((rows,), _F32))
    acc, m, l = jax.lax.fori_loop(0, hi, body, init)
    o_ref[...] = acc / jnp.where(l == 0, 1.0, l)[:, None]
    m_ref[...] = m
    l_ref[...] = l


def chunk_lowbit_tiles(q: jax.Array, k: jax.Array, v: jax.Array, kv: LowbitKV, *, q_offsets: jax.Array,
                       kv_lengths: jax.Array, sm_scale: float, softcap: float | None = None,
                       residuals: bool = False, block_q: int = 16, interpret: bool | None = None) -> Attended:
    """A prefill chunk ``q [b, t, h, d]`` against a bit-packed layer (codes ``k, v`` and ``kv``'s groups and float
    window, as :func:`decode_lowbit_tiles`): query ``i`` at slot ``q_offsets + i`` sees the slots up to it and below
    ``kv_lengths`` (``[b]`` or ``[b, k]``: the slot cache keeps its live slots packed, so nothing else is masked).
    The codes below the window go through the Pallas kernel (a block of ``block_q`` queries per program, one key
    group per step, unpacked in registers); the window's slots through XLA; the two merged exactly. Returns an
    ``Attended`` as the backends' ``chunk``: ``out [b, t, h, d]``; with ``residuals`` ``m, l [b, t, h]``."""
    b, t, heads, d = q.shape
    kv_heads = v.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads must be a multiple of {kv_heads=} key/value heads")
    _check_compiles(d, interpret)
    bits, G = LOWBIT[kv.quant], kv.group
    groups = kv.k_scale.shape[2]
    padded, g = groups * G, heads // kv_heads
    offsets = jnp.broadcast_to(jnp.asarray(q_offsets, jnp.int32).reshape(b, -1), (b, kv_heads))
    lengths = jnp.broadcast_to(jnp.asarray(kv_lengths, jnp.int32).reshape(b, -1), (b, kv_heads))
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"{block_q=} must be a power of two (Triton's blocks are)")
    n_blocks = -(-t // block_q)
    # each query's g heads padded to a power of two: a program's block_q * gp rows must be one (SmolLM2: g = 3 -> 4)
    gp = pl.next_power_of_2(g)
    st = _ChunkStatic(group=G, block_q=block_q, heads=gp, groups=groups, sm_scale=float(sm_scale),
                      softcap=None if softcap is None else float(softcap), bits=bits,
                      value_group=d // kv.v_scale.shape[-1])
    qg = einops.rearrange(pad_axis(q.astype(_F32), 1, n_blocks * block_q), "b t (k g) d -> b k t g d", k=kv_heads)
    qg = pad_axis(qg, 3, gp).reshape(b, kv_heads, n_blocks * block_q * gp, d)  # rows query-major
    vp, vs, vz = (pad_axis(x, 2, padded) for x in (v, kv.v_scale, kv.v_zero))
    rows = block_q * gp
    whole = lambda *shape: pl.BlockSpec((None, None, *shape), lambda bi, ki, qi: (bi, ki) + (0,) * len(shape))  # noqa
    in_specs = [whole(), whole(),
                pl.BlockSpec((None, None, rows, d), lambda bi, ki, qi: (bi, ki, qi, 0)),
                whole(d, k.shape[-1]), whole(groups, d), whole(groups, d),
                whole(padded, v.shape[-1]), whole(padded, vs.shape[-1]), whole(padded, vz.shape[-1])]
    out_specs = [pl.BlockSpec((None, None, rows, d), lambda bi, ki, qi: (bi, ki, qi, 0)),
                 pl.BlockSpec((None, None, rows), lambda bi, ki, qi: (bi, ki, qi)),
                 pl.BlockSpec((None, None, rows), lambda bi, ki, qi: (bi, ki, qi))]
    total = n_blocks * rows
    out_shape = [jax.ShapeDtypeStruct((b, kv_heads, total, d), _F32),
                 jax.ShapeDtypeStruct((b, kv_heads, total), _F32), jax.ShapeDtypeStruct((b, kv_heads, total), _F32)]
    with jax.named_scope("lcx_lowbit_chunk"):
        o, m2, l_codes = pl.pallas_call(
            functools.partial(lowbit_chunk_kernel, st=st), grid=(b, kv_heads, n_blocks), in_specs=in_specs,
            out_specs=out_specs, out_shape=out_shape, name="lcx_lowbit_chunk",
            **pallas_call_kwargs(interpret, num_warps=4, num_stages=2),
        )(kv.win_start.astype(jnp.int32), offsets, qg, k, kv.k_scale, kv.k_zero, vp, vs, vz)
    per_query = lambda x: einops.rearrange(x, "b k (t g) ... -> b k g t ...", g=gp)[:, :, :g, :t]  # noqa: E731
    codes = (per_query(o), per_query(jnp.where(l_codes > 0, m2 * LN2, -jnp.inf)), per_query(l_codes))

    # the float window: slots win_start + w, seen by query i when below the length and at or before its slot
    width = kv.k_win.shape[2]
    window_slots = kv.win_start[..., None] + jnp.arange(width)  # [b, k, W]
    query_slots = offsets[..., None] + jnp.arange(t)  # [b, k, t]
    seen = (window_slots[:, :, None, :] < lengths[..., None, None]) \
        & (window_slots[:, :, None, :] <= query_slots[..., None])  # [b, k, t, W]
    q4 = einops.rearrange(q.astype(_F32), "b t (k g) d -> b k g t d", k=kv_heads)
    logits = capped(jnp.einsum("bkgtd,bkwd->bkgtw", q4, kv.k_win.astype(_F32)) * sm_scale, softcap)
    logits = jnp.where(seen[:, :, None], logits, -jnp.inf)
    m_w = jnp.max(logits, axis=-1)
    p_w = jnp.exp(logits - jnp.where(jnp.isfinite(m_w), m_w, 0.0)[..., None])
    l_w = jnp.sum(p_w, axis=-1)
    o_w = jnp.einsum("bkgtw,bkwd->bkgtd", p_w, kv.v_win.astype(_F32)) / jnp.where(l_w == 0, 1.0, l_w)[..., None]
    out, m, l = merge_partials(codes, (o_w, m_w, l_w))  # [b, k, g, t, d], [b, k, g, t]
    result = Attended(out=einops.rearrange(out, "b k g t d -> b t (k g) d").astype(q.dtype))
    if residuals:
        flat = lambda x: einops.rearrange(x, "b k g t -> b t (k g)")  # noqa: E731
        result = result.replace(m=flat(m), l=flat(l))
    return result


__all__ = ["chunk_lowbit_tiles", "decode_lowbit_tiles", "lowbit_chunk_kernel", "lowbit_kernel", "triton_compiles"]
