"""The grid report's compression plot: accuracy and perplexity grids, one line per setting without its ratio."""

import pytest

from lcx.eval.report import _without_compression, write_report


def _row(setting, policy, compression, length, metric, value, task=""):
    return {"setting": setting, "policy": policy, "budget": "", "rope": "trained", "length": length, "depth": "",
            "metric": metric, "value": value, "lo": value * 0.9, "hi": value * 1.1, "samples": 4, "seconds": 0.0,
            "task": task, "compression": compression, "protocol": "streaming", "prompt_tokens": "",
            "prefilled_tokens": "", "kv_bytes": "", "held_kv_bytes": ""}


def test_cache_dtype_variants_of_one_policy_are_separate_lines():
    assert _without_compression("tova @c=0.5 kv_dtype=int4 kv_residual=128") == "tova kv_dtype=int4 kv_residual=128"
    assert _without_compression("kvzip @c=0.75 one-shot") == "kvzip one-shot"
    assert _without_compression("full") == "full"


@pytest.mark.parametrize("metric", ["perplexity", "accuracy"])
def test_a_compression_grid_plots_its_own_metric(tmp_path, metric):
    """A perplexity grid under eviction (position buckets, no accuracy rows) once crashed the plot with zero
    panels; it now plots the whole window's perplexity against the ratio."""
    rows = [_row("full", "full", "", 2048, metric, 10.0)]
    for c in (0.5, 0.75):
        for suffix in ("", " kv_dtype=int4"):
            for length in ((256, 2048) if metric == "perplexity" else (2048,)):
                rows.append(_row(f"tova @c={c}{suffix}", "tova", c, length, metric, 11.0 + c))
    paths = write_report(rows, tmp_path, "grid")
    assert tmp_path / f"{metric}_vs_compression.png" in paths
    assert (tmp_path / f"{metric}_vs_compression.png").stat().st_size > 0
