"""Config loading, overrides and validation errors (each names the key, the value and what is allowed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lcx.config import (Config, ConfigError, ModelConfig, RopeConfig, load_config, load_dict, load_model_config,
                        to_dict)

TINY = """
name: tiny
model:
  vocab_size: 128
  d_model: 64
  n_layers: 2
  n_heads: 4
  n_kv_heads: 2
  d_ff: 128
  rope: {type: yarn, factor: 4.0, original_max_position_embeddings: 256}
"""


@pytest.fixture
def tiny_yaml(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def test_config_loads_yaml_into_frozen_dataclasses(tiny_yaml):
    cfg = load_config(tiny_yaml)
    assert isinstance(cfg, Config) and cfg.name == "tiny"
    assert cfg.model.head_dim == 16 and cfg.model.n_groups == 2
    assert cfg.model.rope == RopeConfig(type="yarn", factor=4.0, original_max_position_embeddings=256)
    with pytest.raises(AttributeError):
        cfg.model.d_model = 3  # frozen


def test_config_dotted_overrides(tiny_yaml):
    cfg = load_config(tiny_yaml, ["model.rope.type=linear", "model.n_kv_heads=1", "model.dtype=bf16"])
    assert cfg.model.rope.type == "linear" and cfg.model.n_kv_heads == 1
    assert cfg.model.dtype == "bfloat16"  # canonical name


def test_config_round_trips_through_dict(tiny_yaml):
    cfg = load_config(tiny_yaml)
    from lcx.config import from_dict

    assert from_dict(Config, to_dict(cfg)) == cfg


@pytest.mark.parametrize("override, message", [
    (["model.n_head=4"], "unknown key 'model.n_head'; did you mean 'n_heads'?"),
    (["model.rope.tpye=yarn"], "unknown key 'model.rope.tpye'; did you mean 'type'?"),
    (["model.n_heads=5"], "model.n_heads=5 is invalid: must be a multiple of model.n_kv_heads=2"),
    (["model.rope.type=xpos"], "rope.type='xpos' is invalid: must be one of ['default', 'linear', 'ntk'"),
    (["model.rope.type=llama3"], "rope.low_freq_factor is required for rope.type='llama3'"),
    (["model.rope.type=linear", "model.rope.factor=null"], "rope.factor is required for rope.type='linear'"),
    (["model.dtype=float8"], "model.dtype='float8' is not a dtype lcx supports; allowed: ['bf16', 'bfloat16'"),
    (["model.param_dtype=int8"], "model.param_dtype='int8' is not a dtype lcx supports"),
    (["model.d_model=abc"], "model.d_model='abc' is invalid: must be an integer"),
    (["model.norm_eps=0"], "model.norm_eps=0.0 is invalid: must be > 0"),
    (["model.attention.impl=flash2"], "attention.impl='flash2' is invalid: must be one of"),
    (["model.tie_embeddings=maybe"], "model.tie_embeddings='maybe' is invalid: must be true or false"),
    (["model.rope.partial_rotary_factor=1.5"], "rope.partial_rotary_factor=1.5 is invalid: must be in (0, 1]"),
    (["model.rope.factor=0.5", "model.rope.type=linear"], "rope.factor=0.5 is invalid"),
])
def test_config_bad_input_names_key_value_and_allowed(tiny_yaml, override, message):
    with pytest.raises(ConfigError) as err:
        load_config(tiny_yaml, override)
    assert message in str(err.value)


def test_config_missing_required_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {vocab_size: 8, d_model: 8, n_layers: 1, n_heads: 1, n_kv_heads: 1}\n")
    with pytest.raises(ConfigError, match=r"model is missing required key\(s\) \['d_ff'\]"):
        load_config(path)


def test_config_longrope_factor_lengths_checked():
    with pytest.raises(ConfigError, match="rope.short_factor has 3 values; .* needs rotary_dim/2 = 8"):
        ModelConfig(vocab_size=8, d_model=64, n_layers=1, n_heads=4, n_kv_heads=4, d_ff=8,
                    rope=RopeConfig(type="longrope", short_factor=(1.0, 1.0, 1.0), long_factor=(1.0,) * 8))


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="could not be parsed"):
        load_config(bad)
    with pytest.raises(ConfigError, match="overrides are dotted key=value pairs"):
        load_dict(None, ["model.d_model"])


def test_config_model_file_with_or_without_section(tmp_path, tiny_yaml):
    flat = tmp_path / "flat.yaml"
    flat.write_text("vocab_size: 8\nd_model: 8\nn_layers: 1\nn_heads: 2\nn_kv_heads: 1\nd_ff: 16\n")
    assert load_model_config(flat).n_groups == 2
    assert load_model_config(tiny_yaml).vocab_size == 128


def test_config_every_experiment_yaml_loads(tmp_path, hf_factory):
    root = Path(__file__).resolve().parents[1] / "experiments" / "configs"
    paths = sorted(root.rglob("*.yaml"))
    assert paths, "experiments/configs holds no YAML"
    from lcx.experiment import load_experiment

    # configs that evaluate a downloaded checkpoint (experiments/real_model/run.sh fetches it) load against a tiny
    # stand-in of the same family: every section is validated, the model keys they override included
    stand_in = tmp_path / "checkpoint"
    hf_factory("llama", max_position_embeddings=4096, num_hidden_layers=30).save_pretrained(stand_in)  # as SmolLM2
    checked = 0
    for path in paths:
        data = load_dict(path)
        if set(data) <= {"model"}:
            load_model_config(path)  # a bare model shape (experiments/configs/models/)
        else:  # an experiment: every section validated
            cfg = load_experiment(path, [f"checkpoint={stand_in}"] if "checkpoint" in data else [])
            checked += cfg.checkpoint is not None
    assert checked >= 2  # the real-model configs


def test_config_model_overrides_apply_to_flat_and_sectioned_files(tmp_path, tiny_yaml):
    flat = tmp_path / "flat.yaml"
    flat.write_text("vocab_size: 8\nd_model: 8\nn_layers: 1\nn_heads: 2\nn_kv_heads: 1\nd_ff: 16\n")
    assert load_model_config(flat, ["model.n_kv_heads=2"]).n_kv_heads == 2
    assert load_model_config(tiny_yaml, ["model.n_kv_heads=4"]).n_kv_heads == 4
    with pytest.raises(ConfigError, match="model overrides are written model.KEY=VALUE"):
        load_model_config(flat, ["n_kv_heads=2"])
