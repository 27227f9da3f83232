"""Context parallelism on 8 fake CPU devices: training on ``seq`` meshes (ring and all-gather, packed documents; the
``2x2x2`` ring through the Pallas flash blocks, with FSDP and remat) follows one device's run - losses and the
weights the gradients moved; a sharded prefill gives the same logits, generation after it the same tokens; the
step's compiled per-device memory at ``seq=8`` is a fraction of one device's."""

from __future__ import annotations

import numpy as np
import pytest

RUNS = ["seq8_ring", "seq8_all_gather", "2x2x2_ring", "2x2x2_all_gather"]


@pytest.fixture(scope="module")
def result(run_worker, tmp_path_factory):
    return run_worker("context_parallel", directory=str(tmp_path_factory.mktemp("cp")))[0]


@pytest.mark.parametrize("run", RUNS)
def test_context_parallel_training_follows_one_device(result, run):
    losses, single = result["runs"][run]["losses"], result["runs"]["single"]["losses"]
    assert len(losses) == 4 and single[0] > single[-1]  # 4 logged steps of a run that learns
    np.testing.assert_allclose(losses, single, rtol=2e-3)
    assert result["runs"][run]["param_rel_err"] < 2e-3  # the weights after 4 updates: the gradients agreed


def test_context_parallel_prefill_generation_and_memory(result):
    gen = result["generate"]  # prefill across seq (2 x 2 x 2) into a cache, decode from it
    assert gen["logits_rel_err"] < 1e-4 and gen["tokens_equal"], gen
    memory = result["memory"]
    assert memory["seq8"] <= 0.2 * memory["single"], memory
