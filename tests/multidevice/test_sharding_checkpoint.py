"""Params saved (orbax) from a (2, 4) mesh restore onto a (1, 8) mesh and onto one device, in fresh processes,
with identical logits; a decode state saved on (2, 4) resumes there with the uninterrupted tokens."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def checkpoints(spawn, once):
    def make(path):
        directory = str(path)
        saved = spawn("checkpoint_save", 8, directory=directory, mesh_shape=[2, 4])()[0]
        # both restores at once: separate processes, one with 8 devices, one with a single device
        on_1x8 = spawn("checkpoint_restore", 8, directory=directory, mesh_shape=[1, 8])
        on_one = spawn("checkpoint_restore", 1, directory=directory, mesh_shape=None)
        return {"saved": saved, "1x8": on_1x8()[0], "one_device": on_one()[0]}

    return once("sharded_ckpt", make)


def test_sharding_checkpoint_saved_sharded(checkpoints):
    assert "model" in checkpoints["saved"]["spec_q"]  # q heads really were split when saved


@pytest.mark.parametrize("target", ["1x8", "one_device"])
def test_sharding_checkpoint_restores_identical_params_and_logits(checkpoints, target):
    got = checkpoints[target]
    assert got["devices"] == (8 if target == "1x8" else 1)
    assert got["same_params"] and got["shardings_ok"], got["restored_q_sharding"]
    assert got["logits_identical"]  # restored vs original params, same target
    assert got["max_abs_diff_vs_single_device"] <= 1e-5


@pytest.mark.parametrize("target", ["1x8", "one_device"])
def test_sharding_decode_state_resumes_on_other_mesh(checkpoints, target):
    assert checkpoints[target]["resumed_tokens"] == checkpoints["saved"]["ref_tokens"]
