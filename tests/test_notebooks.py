"""Every notebook runs top to bottom (as the script its jupytext percent format is), so CI catches one that broke.

Each runs in its own process from ``notebooks/`` with matplotlib's non-interactive backend; the shared tiny model
(``notebooks/tiny.py``) is trained by the first notebook that needs it and loaded by the others.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PAGES = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def test_notebooks_are_all_found():
    assert len(PAGES) >= 5, PAGES


@pytest.mark.parametrize("name", PAGES)
def test_notebook_runs_top_to_bottom(name):
    env = {**os.environ, "MPLBACKEND": "Agg", "LCX_NOTEBOOK_SMOKE": "1", "PYTHONPATH": os.pathsep.join(
        [str(NOTEBOOKS.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = subprocess.run([sys.executable, name], cwd=NOTEBOOKS, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
