"""The custom-policy example of docs/guides/caches.md, run exactly as written: registered, loaded from YAML, used to
generate - on the float cache and on the 8-bit one, where it must read dequantized values, not the codes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.cache.policy import SlotView, top_budget
from lcx.kernels.quant import quantize

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "caches.md"


def _blocks():
    text = GUIDE.read_text()
    section = text.split("<!-- custom-policy:start -->")[1].split("<!-- custom-policy:end -->")[0]
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    yaml = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    return python, yaml


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """The guide's experiment config, its policy module importable as written (imported once: a policy name
    registers once per process; the registration is undone after the module)."""
    from lcx.cache.policy import _REGISTRY

    python, yaml = _blocks()
    assert len(python.strip().splitlines()) <= 25  # "about 20 lines"
    folder = tmp_path_factory.mktemp("readme")
    (folder / "my_policies.py").write_text(python)
    (folder / "experiment.yaml").write_text(yaml)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        sys.modules.pop("my_policies", None)
        yield lcx.load_config(folder / "experiment.yaml")
    sys.modules.pop("my_policies", None)
    _REGISTRY.pop("vnorm", None)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp4"])
def test_readme_custom_policy_registers_loads_and_generates(config, kv_dtype):
    assert config.cache.policy == "vnorm" and config.cache.params == {"sinks": 4}
    cache = lcx.CacheConfig(**config.cache.to_dict(), kv_dtype=kv_dtype)
    params = lcx.init_params(config.model, jax.random.key(0))
    prompt = np.random.default_rng(0).integers(0, 260, (1, 40))
    gen = lcx.Generator(config.model, params, max_new_tokens=30, cache=cache)
    state = gen.decode(gen.prefill(prompt))
    assert state.cache.capacity == 40  # budget 32 + interval 8
    kept = np.asarray(state.cache.pos[0, 0][state.cache.valid[0, 0]])
    assert kept[:4].tolist() == [0, 1, 2, 3]  # the sinks survived 30 steps of eviction
    assert int(state.step) == 30


def test_readme_custom_policy_reads_dequantized_values_on_an_8bit_cache(config):
    """Its scores on an int8 view (codes and scales) are the float view's up to rounding, and it keeps the same
    slots. Codes are each vector scaled to +-127, so a scorer reading ``view.v`` would score every slot alike."""
    policy = config.cache.make_policy()
    rng = np.random.default_rng(1)
    b, slots, heads, dim = 2, 48, 2, 16
    k = rng.normal(size=(b, slots, heads, dim)).astype(np.float32)
    v = (rng.normal(size=(b, slots, heads, dim)) * rng.uniform(0.1, 3.0, size=(b, slots, 1, 1))).astype(np.float32)
    pos = np.broadcast_to(np.arange(slots, dtype=np.int32), (b, slots))
    common = dict(layer=jnp.int32(0), pos=jnp.asarray(pos), valid=jnp.ones((b, slots), bool),
                  count=jnp.full((b,), slots, jnp.int32), score=jnp.zeros((b, slots), jnp.float32))
    float_view = SlotView(k=jnp.asarray(k), v=jnp.asarray(v), **common)
    (k8, k_scale), (v8, v_scale) = quantize(jnp.asarray(k), "int8"), quantize(jnp.asarray(v), "int8")
    int8_view = SlotView(k=k8, v=v8, k_scale=k_scale, v_scale=v_scale, **common)
    budget = jnp.int32(24)
    want, got = policy.scores(float_view, budget), policy.scores(int8_view, budget)
    np.testing.assert_allclose(np.asarray(got)[:, 4:], np.asarray(want)[:, 4:], rtol=2e-2)
    np.testing.assert_array_equal(top_budget(got, int8_view, budget), top_budget(want, float_view, budget))
