"""Context parallelism on one device: the zig-zag assignment's equal work (counted tiles), the batch layout, the
blockwise attention ops the ring is built from (forward and backward against the reference, jnp and Pallas), and
the config errors. The 8-device runs are in tests/multidevice/test_context_parallel.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.parallel import context as cp
from lcx.config import ConfigError
from lcx.kernels import blockwise
from lcx.kernels.reference import attention_reference
from lcx.train import TrainConfig


@pytest.mark.parametrize("n, tile", [(2, 16), (4, 16), (8, 16)])
def test_zigzag_gives_every_device_equal_attention_tiles(n, tile):
    length = 2 * n * 64
    zigzag = cp.attention_tiles(cp.zigzag_order(length, n), n, tile)
    assert len(set(zigzag.tolist())) == 1  # every device the same count
    total = sum(q // tile + 1 for q in range(0, length, tile))  # the causal triangle's tiles, once each
    assert zigzag.sum() == total
    contiguous = cp.attention_tiles(cp.contiguous_order(length, n), n, tile)
    assert contiguous.sum() == total and contiguous[-1] > 2 * contiguous[0]  # what zig-zag fixes


def test_layout_batch_permutes_rows_and_unlayout_restores():
    ids = np.arange(2 * 32, dtype=np.int32).reshape(2, 32)
    laid = cp.layout_batch({"inputs": ids}, 4)
    order = cp.zigzag_order(32, 4)
    assert order[:4].tolist() == [0, 1, 2, 3] and order[4:8].tolist() == [28, 29, 30, 31]  # device 0: chunks 0, 7
    np.testing.assert_array_equal(laid["inputs"], ids[:, order])
    np.testing.assert_array_equal(laid["positions"][0], order)  # positions added where absent, permuted
    np.testing.assert_array_equal(np.asarray(cp.unlayout(jnp.asarray(laid["inputs"]), 4)), ids)
    with pytest.raises(ValueError, match=r"must be a multiple of 8"):
        cp.zigzag_order(36, 4)


# Pallas: the offsets and separate query / key segment ids are what is new here (windows and caps are the flash
# kernels' own tests); jnp: every mask.
@pytest.mark.slow
@pytest.mark.parametrize("impl, window, softcap", [("jnp", None, None), ("jnp", 8, None), ("jnp", None, 5.0),
                                                   ("pallas", 8, None)])
def test_blocks_merge_and_backward_to_the_whole_attention(impl, window, softcap):
    """2 x 2 chunk blocks (one hidden, one diagonal, one fully visible) with packed segments: merged forward and
    summed backward shares equal the reference attention and its VJP."""
    b, t, h, kv, d, c = 2, 32, 4, 2, 16, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, d))
    k, v = (jax.random.normal(x, (b, t, kv, d)) for x in keys[1:3])
    seg = jnp.array([[0] * 10 + [1] * 22, [0] * 32])
    spec = blockwise.BlockSpec(sm_scale=d ** -0.5, window=window, softcap=softcap, impl=impl)
    chunk = lambda x, i: x[:, i * c:(i + 1) * c]  # noqa: E731
    pairs = [(a, j) for a in range(2) for j in range(2)]

    @jax.jit  # one program (op-by-op dispatch would compile every small op)
    def blocks(q, k, v, do):
        parts = []
        for a in range(2):
            acc = blockwise.empty(chunk(q, a))
            for j in range(2):
                acc = blockwise.merge(acc, blockwise.forward(spec, chunk(q, a), chunk(k, j), chunk(v, j),
                                                             (a - j) * c, chunk(seg, a), chunk(seg, j)))
            parts.append(acc)
        o, lse = (jnp.concatenate(x, axis=1) for x in zip(*parts))
        grads = [jnp.zeros_like(x) for x in (q, k, v)]
        for a, j in pairs:
            gq, gk, gv = blockwise.backward(spec, chunk(q, a), chunk(k, j), chunk(v, j), (a - j) * c, chunk(seg, a),
                                            chunk(seg, j), chunk(o, a), chunk(lse, a), chunk(do, a))
            grads = [grads[0].at[:, a * c:(a + 1) * c].add(gq), grads[1].at[:, j * c:(j + 1) * c].add(gk),
                     grads[2].at[:, j * c:(j + 1) * c].add(gv)]
        return o, grads

    do = jax.random.normal(keys[3], q.shape)
    o, grads = blocks(q, k, v, do)
    ref, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True, sm_scale=d ** -0.5,
                                                           segment_ids=seg, window=window, softcap=softcap), q, k, v)
    np.testing.assert_allclose(o, ref, atol=2e-6)
    for got, want in zip(grads, vjp(do)):
        np.testing.assert_allclose(got, want, atol=5e-6)


def test_token_nll_gradient_is_written_out_and_equals_autodiff():
    """The loss used with rows split over seq: its value is log_softmax's, its gradient softmax - onehot."""
    from lcx.train.step import token_nll

    logits = jax.random.normal(jax.random.key(0), (2, 8, 300)) * 3
    targets = jax.random.randint(jax.random.key(1), (2, 8), 0, 300)
    weights = jax.random.normal(jax.random.key(2), (2, 8))
    autodiff = lambda x: -jnp.take_along_axis(jax.nn.log_softmax(x), targets[..., None], -1)[..., 0]  # noqa: E731
    np.testing.assert_array_equal(token_nll(logits, targets), autodiff(logits))
    got, want = (jax.grad(lambda x, f=f: jnp.sum(f(x) * weights))(logits)
                 for f in (lambda x: token_nll(x, targets), autodiff))
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert float(jnp.abs(got).max()) > 0.1


def test_context_parallel_config_errors():
    with pytest.raises(ConfigError, match=r"train.context_parallel='ulysses' is invalid: must be one of"):
        TrainConfig(context_parallel="ulysses")
    with pytest.raises(ConfigError, match=r"mesh.seq=3 is invalid: it must divide the 8 devices"):
        from lcx.parallel.sharding import MeshConfig

        MeshConfig(seq=3).shape(8)
    from pathlib import Path

    from lcx.experiment import load_experiment

    config = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "context_parallel.yaml"
    assert load_experiment(config, []).mesh.seq == 8
    with pytest.raises(ConfigError, match=r"train.seq_len=2048 is invalid with mesh.seq=3: .* a multiple of 6"):
        load_experiment(config, ["mesh.seq=3"])  # at load, before any device is touched
