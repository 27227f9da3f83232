"""Context parallelism on 8 fake CPU devices: training on ``seq`` meshes (the ring on ``seq=8`` and ``2x2x2``, the
latter through the Pallas flash blocks; all-gather on ``2x2x2``; packed documents; FSDP and remat on ``2x2x2``)
follows one device's run - losses and the weights the gradients moved; a sharded prefill gives the same logits,
generation after it the same tokens; the step's compiled per-device memory at ``seq=8`` is a fraction of one
device's.

One test function: the worker (the heaviest multi-device scenario) must run once, never twice at the same time on
two pytest workers - two 8-device processes on 2 cores can starve a device thread past XLA's collective timeout."""

from __future__ import annotations

import numpy as np

RUNS = ["seq8_ring", "2x2x2_ring", "2x2x2_all_gather"]


def test_context_parallel_training_prefill_and_memory(run_worker, tmp_path):
    result = run_worker("context_parallel", directory=str(tmp_path))[0]
    single = result["runs"]["single"]["losses"]
    assert len(single) == 4 and single[0] > single[-1]  # 4 logged steps of a run that learns
    for run in RUNS:
        np.testing.assert_allclose(result["runs"][run]["losses"], single, rtol=2e-3, err_msg=run)
        # the weights after 4 updates: the gradients agreed
        assert result["runs"][run]["param_rel_err"] < 2e-3, (run, result["runs"][run]["param_rel_err"])
    gen = result["generate"]  # prefill across seq (2 x 2 x 2) into a cache, decode from it
    assert gen["logits_rel_err"] < 1e-4 and gen["tokens_equal"], gen
    memory = result["memory"]
    assert memory["seq8"] <= 0.2 * memory["single"], memory
