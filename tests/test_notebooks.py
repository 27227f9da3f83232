"""Every notebook runs top to bottom (as the script its jupytext percent format is), so CI catches one that broke.

Each runs in the test worker itself (``runpy``, from ``notebooks/``, matplotlib's non-interactive backend, the smoke
sizes of ``LCX_NOTEBOOK_SMOKE=1``): no interpreter start per notebook, and the programs a notebook compiles are
shared with the other tests of the worker. The shared tiny model (``notebooks/tiny.py``) is trained by the first
notebook that needs it and loaded by the others.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PAGES = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def test_notebooks_are_all_found():
    assert len(PAGES) >= 5, PAGES


@pytest.mark.slow
@pytest.mark.parametrize("name", PAGES)
def test_notebook_runs_top_to_bottom(name, monkeypatch):
    import matplotlib

    monkeypatch.setenv("LCX_NOTEBOOK_SMOKE", "1")  # read when notebooks/tiny.py is first imported
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(NOTEBOOKS)
    monkeypatch.syspath_prepend(str(NOTEBOOKS))
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        runpy.run_path(str(NOTEBOOKS / name), run_name="__main__")
    finally:
        plt.close("all")
