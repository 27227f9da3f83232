"""The documentation: the Sphinx site builds with every warning an error (a broken cross-reference, a docstring that
no longer parses, a page outside every toctree), every public name has a page two clicks from the site's index, and
the README stays a landing page whose commands are the ones CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # Sphinx's own "basic" theme: the warnings (references, docstrings, toctrees) and the pages' ids and links come
    # from reading and resolving, the same under any theme, while furo renders the whole site's navigation tree
    # into each of the ~340 pages - two thirds of the build (59 s -> 19 s on the 2-core VM).
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-D",
                           "html_theme=basic", "docs", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"sphinx -W failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return out


def _links(page: Path) -> set[str]:
    return {href.split("#")[0] for href in re.findall(r'href="([^"]+)"', page.read_text())}


@pytest.mark.slow
def test_site_builds_and_every_public_name_is_two_clicks_from_the_index(site):
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import build_pages
    finally:
        sys.path.pop(0)
    index_links = _links(site / "index.html")
    assert "api/index.html" in index_links, "the site's index must link the API reference"
    api_links = _links(site / "api" / "index.html")
    home = build_pages.homes()
    checked = 0
    for module, _ in build_pages.PUBLIC:
        for name, obj in build_pages.exports(module):
            if isinstance(obj, types.ModuleType) or not build_pages.documented(obj):
                continue
            page = f"generated/{home[id(obj)]}.{name}.html"
            assert page in api_links, f"{module}.{name}: no link to {page} on the API reference page"
            html = (site / "api" / page).read_text()
            assert f'id="{home[id(obj)]}.{name}"' in html, f"{page} does not document {name}"
            checked += 1
    assert checked > 150
    # A docstring's content reaches its page (the signature and the text, not an empty stub).
    score = (site / "api" / "generated" / "lcx.engine.Generator.html").read_text()
    assert 'id="lcx.engine.Generator.score"' in score and "log-prob" in score
    # Guides, results and the notebooks are pages of the site.
    for page in ["guides/caches.html", "guides/serving.html", "results.html", "development.html",
                 "notebooks/03_eviction_maps.html", "changelog.html", "architecture.html"]:
        assert (site / page).exists(), page


def test_readme_is_a_landing_page_whose_test_command_is_ci_s():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    main = re.search(r"^.*pip install -e \. && lcx run .*$", readme, re.M)
    tests = re.search(r"^.*pip install -e \"\.\[test\]\" && python -m pytest.*$", readme, re.M)
    assert main and tests, "README must hold the main-job and test set-up commands"
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests.group(0).strip() in ci, "CI must run exactly the README's test command"


def test_readme_ablation_config_loads_and_builds_its_prompts(tmp_path):
    """The README's ablation grid, as written, on a tiny checkpoint in place of SmolLM2: a valid config whose every
    cell's prompts build in the checkpoint's tokenizer (what `lcx ablate` checks before its first cell)."""
    import yaml

    from lcx.data import resolve_tokenizer
    from lcx.eval import prompts
    from lcx.experiment import load_experiment
    from tests.tiny_chat_model import write_model

    block = re.search(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert yaml.safe_load(block)["checkpoint"] == "runs/models/SmolLM2-135M-Instruct"
    (tmp_path / "grid.yaml").write_text(block)
    model = write_model(tmp_path / "tiny")
    cfg = load_experiment(tmp_path / "grid.yaml", [f"checkpoint={model}"])
    assert [dict(p)["policy"] for p in cfg.ablate.policies] == ["full", "streaming", "snapkv", "tova", "kvzip"]
    cells = prompts(cfg.eval, resolve_tokenizer("auto", init_from=model))
    assert len(cells) == 11 and all(len(c.examples) == 2 for c in cells)


def test_every_yaml_block_of_the_guides_is_a_valid_config(tmp_path):
    """Each ```yaml block in docs/guides/ loads as written - with lcx.load_config, or as an experiment config where
    it has experiment sections (a tiny model added where the block shows only a cache section); the custom-policy
    example is run whole by tests/test_policy_example.py."""
    import yaml

    import lcx
    from lcx.experiment.config import load_experiment

    tiny = {"vocab_size": 260, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128}
    checked = 0
    for page in sorted((ROOT / "docs" / "guides").glob("*.md")):
        text = re.sub(r"<!-- custom-policy:start -->.*?<!-- custom-policy:end -->", "", page.read_text(), flags=re.S)
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", text, re.S)):
            data = yaml.safe_load(block)
            data.setdefault("model", tiny)
            path = tmp_path / f"{page.stem}_{i}.yaml"
            path.write_text(yaml.safe_dump(data))
            experiment = set(data) & {"stages", "train", "data", "eval", "ablate", "finetune"}
            (load_experiment if experiment else lcx.load_config)(path)  # raises ConfigError naming the bad key
            checked += 1
    assert checked >= 1
