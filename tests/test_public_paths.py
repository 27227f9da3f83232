"""Public paths after the 0.2 package layout (CHANGELOG.md): moved modules import as aliases with a
DeprecationWarning naming the new path; ``lcx.generate`` stays the function and its old module is refused with the
new path; the planner's command line moved to ``lcx.cli.plan``."""

from __future__ import annotations

import importlib
import sys

import pytest

import lcx

MOVED = sorted(lcx.MOVED.items())


@pytest.mark.parametrize("old, new", MOVED)
def test_moved_module_is_an_alias_with_a_warning(monkeypatch, old, new):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_generate_is_the_function_and_its_old_module_names_the_new_path():
    assert callable(lcx.generate) and lcx.generate is lcx.engine.generate
    with pytest.raises(ModuleNotFoundError, match=r"lcx.generate moved to lcx.engine"):
        importlib.import_module("lcx.generate")
    assert callable(lcx.generate)  # the failed import left the function in place


def test_public_names_kept():
    import lcx.plan  # a subpackage: its attribute on lcx exists once imported (else the test depends on order)
    from lcx.cli import main

    assert callable(main)
    assert lcx.hf.load_hf is lcx.checkpoints.hf.load_hf and lcx.hf.load_gguf is lcx.checkpoints.hf.load_gguf
    assert lcx.Generator is lcx.engine.Generator and lcx.CacheConfig is lcx.cache.CacheConfig
    with pytest.raises(AttributeError, match="lcx.plan.run moved to lcx.cli.plan.run"):
        lcx.plan.run  # noqa: B018


def test_a_state_saved_before_per_row_sampling_is_refused_by_name(tmp_path):
    import json

    import jax

    from tests.test_generate import CFG

    gen = lcx.Generator(CFG, lcx.init_params(CFG, jax.random.key(0)), max_new_tokens=2)
    (tmp_path / "meta.json").write_text(json.dumps(gen._settings()))  # the old layout had no state_version
    with pytest.raises(lcx.ConfigError, match="has layout 1, this lcx reads 2.*DecodeState.sampling"):
        gen.restore(tmp_path)
