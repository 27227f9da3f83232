"""Training on a mesh of 8 fake CPU devices: the sharded step (and FSDP) follows the one-device loss curve, the
state is placed by the rules, FSDP halves bytes per device on a data axis of 2, and a checkpoint written on one mesh
resumes onto any other (or one device) with the same next-step loss."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def trained(run_worker, once):
    return once("train_sharded", lambda directory: run_worker("train_sharded", directory=str(directory))[0])


@pytest.mark.parametrize("run", ["2x4", "2x4_fsdp"])
def test_train_sharded_loss_curve_equals_one_device(trained, run):
    np.testing.assert_allclose(trained["runs"][run]["losses"], trained["runs"]["single"]["losses"], rtol=2e-3)
    assert trained["runs"][run]["matches_rules"]  # every parameter carries the sharding the rules give


def test_train_sharded_placement_and_fsdp_bytes(trained):
    plain, fsdp = trained["runs"]["2x4"], trained["runs"]["2x4_fsdp"]
    assert plain["q_spec"] == "P(None, None, 'model', None)"  # [layers, d_model, heads, head_dim]: heads on model
    assert fsdp["q_spec"] == "P(None, 'data', 'model', None)"  # FSDP also cuts d_model over data
    assert fsdp["q_shard"] == [2, 32, 2, 8] and plain["q_shard"] == [2, 64, 2, 8]
    # Every tensor this model has is split over data by FSDP (its largest free dimension is even).
    assert fsdp["param_bytes"] * 2 == plain["param_bytes"]
    assert fsdp["opt_bytes"] < 0.51 * plain["opt_bytes"]  # Adam moments follow their parameters; the count stays
    assert "partition_spec=(None, 'data', 'model', None)" in trained["saved_q_sharding"]  # saved with its sharding


@pytest.mark.parametrize("target", ["1x8", "single"])
def test_train_sharded_checkpoint_resumes_onto_any_mesh(trained, target):
    resumed = trained["resumed"][target]
    np.testing.assert_allclose(resumed[:4], trained["runs"]["2x4_fsdp"]["losses"], rtol=0)  # the logged history
    np.testing.assert_allclose(resumed[4], trained["resumed"]["single"][4], rtol=1e-6)
