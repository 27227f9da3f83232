"""TrainConfig / DataConfig: building from mappings, validation messages, hashing, round trip."""

from __future__ import annotations

import pytest

from lcx.config import ConfigError, from_dict, to_dict
from lcx.train import DataConfig, TrainConfig


def test_train_config_from_dict_and_round_trip():
    cfg = from_dict(TrainConfig, {"steps": 50, "lr": 1, "compute_dtype": "bf16", "grad_clip": None,
                                  "init_from": "/x"}, prefix="train")
    assert cfg.lr == 1.0 and cfg.compute_dtype == "bfloat16" and cfg.grad_clip is None and cfg.init_from == "/x"
    assert from_dict(TrainConfig, to_dict(cfg), prefix="train") == cfg
    hash(cfg)


@pytest.mark.parametrize("data,match", [
    ({"steps": 0}, r"train.steps=0 is invalid: must be an integer >= 1"),
    ({"lr": 0.0}, r"train.lr=0.0 is invalid: must be a number in \(0.0, 1.0\]"),
    ({"warmup_steps": 20, "steps": 10}, r"train.warmup_steps=20 is invalid: must be <= train.steps=10"),
    ({"batch_size": 6, "grad_accum": 4}, r"train.grad_accum=4 is invalid: must divide train.batch_size=6 .*"
                                         r"allowed: \[1, 2, 3, 6\]"),
    ({"compute_dtype": "float16"}, r"train.compute_dtype='float16' is invalid"),
    ({"compute_dtype": "int8"}, r"train.compute_dtype='int8' is not a dtype"),
    ({"min_lr_ratio": 2.0}, r"train.min_lr_ratio=2.0 is invalid"),
    ({"b2": 1.0}, r"train.b2=1.0 is invalid"),
    ({"grad_clip": 0.0}, r"train.grad_clip=0.0 is invalid"),
    ({"save_every": 0}, r"train.save_every=0 is invalid"),
    ({"stesp": 3}, r"unknown key 'train.stesp'; did you mean 'steps'\?"),
    ({"steps": "many"}, r"train.steps='many' is invalid: must be an integer"),
])
def test_train_config_invalid(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(TrainConfig, data, prefix="train")


def test_data_config_from_dict_validates_task_and_params():
    cfg = from_dict(DataConfig, {"task": "passkey", "params": {"depth": 0.5, "filler_tokens": 100}}, prefix="data")
    assert cfg.params["depth"] == 0.5 and dict(cfg.params) == {"depth": 0.5, "filler_tokens": 100}
    hash(cfg)
    assert from_dict(DataConfig, to_dict(cfg), prefix="data") == cfg
    assert cfg.make_task().filler_tokens == 100
    with pytest.raises(ConfigError, match=r"data.task='niha' is not a known task; did you mean 'niah'\?"):
        DataConfig(task="niha")
    with pytest.raises(ConfigError, match=r"unknown key 'data.params.num_key'; did you mean 'num_keys'\?"):
        DataConfig(task="niah", params={"num_key": 3})
    with pytest.raises(ConfigError, match=r"data.prompt_loss_weight=-1"):
        DataConfig(prompt_loss_weight=-1)
    with pytest.raises(ConfigError, match=r"data.params=.* must be a mapping"):
        DataConfig(params=[1, 2])
