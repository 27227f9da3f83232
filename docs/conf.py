"""Sphinx configuration of lcx's documentation site.

Build: ``pip install -e ".[docs]" && python -m sphinx -W -b html docs docs/_build`` (``tests/test_docs.py`` runs the
same build, so a broken cross-reference or a docstring that no longer parses fails the suite).

Two kinds of pages are generated at build time, into directories git ignores, so neither can go stale:
``api/`` (one table per package of the public surface, every object on its own page: ``lcx.docs_api``) and
``notebooks/`` (the jupytext notebooks rendered as Markdown pages; not executed).
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS))

import build_pages  # noqa: E402  (docs/build_pages.py: the generated pages)

project = "lcx"
author = "the lcx authors"
copyright = "2026, the lcx authors"
release = build_pages.version(ROOT)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "**/_build", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]
root_doc = "index"

# Markdown: $...$ math (the notebooks), ::: fences, anchors for headings so pages can link to sections.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# The result files lcx's reports write (results.md of a grid, copied under quickstart/ and real_model/) start at H3:
# they are sections of a run's report, shown here as they were written.
suppress_warnings = ["myst.header"]

# Docstrings: ``x`` is code already; a single-backtick `x` is code too (the docstrings use it that way).
default_role = "code"
autosummary_generate = True
autosummary_imported_members = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Every cross-reference must resolve (-W turns a broken one into a failure), except to the third-party types that
# signatures name (jax, numpy, the standard library ...), which this site does not document.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|numpy|np|flax|optax|orbax|pathlib|collections|typing|abc|enum|concurrent|threading|"
               r"fastapi|pydantic|uvicorn|tokenizers|gguf)(\..*)?"),
    (r"py:.*", r"(tuple|list|dict|int|float|str|bool|bytes|object|type|None)(\[.*)?"),
]

html_theme = "furo"
html_title = f"lcx {release}"
html_static_path: list[str] = []

build_pages.write_all(ROOT, DOCS)
