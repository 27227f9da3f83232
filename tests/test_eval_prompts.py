"""What an evaluation feeds the model is in the model's own tokens: a task's tokenizer and chat frame survive every
copy a grid makes of it (a needle depth, questions per haystack, a mixture), a task whose tokens are not the
model's is refused before anything runs, nested task parameters are validated under their own keys, and every
documented eval / ablate config form builds prompts that decode to its template with the answer in the context.

No model runs here: ``lcx.eval.grid.prompts`` builds a grid's prompts exactly as the grid does, from the config
and the tokenizer alone (the checkpoint below is a config.json and a tokenizer, no weights)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from lcx.config import ConfigError, ModelConfig
from lcx.data import make_task
from lcx.data.haystack import prose_text
from lcx.data.task import TOKENIZER
from lcx.data.tasks import PASSKEY_INSTRUCTION
from lcx.data.tokenizer import HFTokenizer, check_model_tokens
from lcx.eval import cell_prompts, evaluate, grid
from lcx.eval.config import EvalConfig
from lcx.eval.evaluate import check_fits
from lcx.eval.grid import check_prompts, prompts
from lcx.experiment import load_experiment, run_tokenizer
from tests.test_eval_checkpoint import VOCAB, _bpe

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 30, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
         "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint's config.json and its BPE tokenizer (with a chat template): enough to load a config and build
    its prompts."""
    path = tmp_path_factory.mktemp("ckpt")
    _bpe(path)
    (path / "config.json").write_text(json.dumps(LLAMA))
    return path


@pytest.fixture(scope="module")
def tok(ckpt):
    return HFTokenizer(ckpt)


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """A folder of four plain-text documents of prose."""
    path = tmp_path_factory.mktemp("docs")
    text = prose_text()
    for i in range(4):
        (path / f"doc{i}.txt").write_text(text[20_000 * i: 20_000 * i + 6_000])
    return path


def test_copies_of_a_task_keep_its_tokenizer_and_frame(tok):
    """Whatever copies a task - a depth, questions per haystack, ``copy`` - keeps the tokenizer and the chat frame
    (they used to be set on the instance, and ``dataclasses.replace`` rebuilt a byte-level task); a config cannot
    set them."""
    for name, change in (("passkey", {"depth": 0.75}), ("niah_single_2", {"depth": 0.25}),
                         ("niah_multikey_1", {"questions_per_haystack": 2})):
        task = make_task(name, {}).with_tokenizer(tok, chat=True)
        for other in (dataclasses.replace(task, **change), copy.copy(task), copy.deepcopy(task)):
            assert other.tokenizer == tok and other.chat == task.chat is not None
            ex = other.examples(0, 0, 1, 512, "validation")[0]
            text = tok.decode(ex.prompt_ids)
            assert text.startswith("user\n") and ex.answer in text  # the chat frame, the needle in the context
    mixture = make_task("mixture", {"parts": [{"task": "passkey", "params": {"instruction": False}},
                                              {"task": "prose"}]}).with_tokenizer(tok)
    again = dataclasses.replace(mixture)
    assert again.tokenizer == tok and all(part.tokenizer == tok for part, _, _ in again.parts)
    with pytest.raises(ConfigError, match=r"unknown key 'data.params.tokenizer'"):
        make_task("passkey", {"tokenizer": "bytes"})


def _first(tok, ids: np.ndarray, text: str) -> int:
    """The number of leading tokens that first decode to text holding ``text``."""
    for i in range(len(ids)):
        if text in tok.decode(ids[:i + 1]):
            return i + 1
    raise AssertionError(f"{text!r} is not in the prompt")


def _needle_fraction(tok, ids: np.ndarray, answer: str, start: int = 0, end: int | None = None) -> float:
    """Where the needle sits between tokens ``start`` and ``end`` of the prompt (the haystack), as a fraction."""
    end = len(ids) if end is None else end
    return (_first(tok, ids, answer) - start) / (end - start)


def test_grid_prompts_at_each_depth_are_in_the_run_tokenizer(tok):
    """``eval.depths`` on a checkpoint with its own tokenizer: every cell's prompts are in that tokenizer (they
    decode to the template, the key inside), the needle sits at the cell's depth, and ``chat`` frames them."""
    ev = EvalConfig.from_mapping({"task": "passkey", "lengths": [400], "depths": [0.25, 0.75], "samples": 2})
    cells = prompts(ev, tok)
    assert [(c.name, c.length, c.depth) for c in cells] == [("passkey", 400, 0.25), ("passkey", 400, 0.75)]
    for cell in cells:
        assert cell.task.tokenizer == tok and cell.task.depth == cell.depth
        for ex, ids in zip(cell.examples, cell.ids):
            text = tok.decode(ids)
            assert text.startswith(PASSKEY_INSTRUCTION) and f"The pass key is {ex.answer}." in text
            assert text.endswith("What is the pass key? The pass key is") and len(ex.ids) == 401
            haystack = _first(tok, ids, PASSKEY_INSTRUCTION), ex.context_len  # the question follows the context
            assert abs(_needle_fraction(tok, ids, ex.answer, *haystack) - cell.depth) < 0.05
    ruler = EvalConfig.from_mapping({"task": "niah_single_1", "lengths": [400], "depths": [0.0, 1.0], "samples": 1,
                                     "chat": True})
    shallow, deep = prompts(ruler, tok)
    for cell in (shallow, deep):
        text = tok.decode(cell.ids[0])
        assert text.startswith("user\n") and text.endswith("assistant\n" + cell.examples[0].prompt.split("\n")[-1])
    # the needle in the first and the last sentence of the haystack (after the instruction, before the question)
    start, end = (_needle_fraction(tok, c.ids[0], text, _first(tok, c.ids[0], "afterwards.\n"),
                                   c.examples[0].context_len)
                  for c, text in ((shallow, "One of the"), (deep, deep.examples[0].answer)))
    assert start < 0.1 and end > 0.9


def test_tokens_that_are_not_the_models_are_refused_before_anything_runs(tok, monkeypatch):
    """The guard: byte ids for a BPE model, a tokenizer larger than the vocabulary, ids past it; and a grid whose
    cell lost the run's tokenizer (today's copy made to drop it again) fails before its first cell."""
    smol = ModelConfig(vocab_size=49152, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    small = ModelConfig(vocab_size=300, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    passkey = make_task("passkey", {})
    ids = [ex.prompt_ids for ex in passkey.examples(0, 0, 1, 300, "validation")]
    with pytest.raises(ConfigError, match=r"data.task='passkey' builds its tokens with lcx's byte tokenizer "
                                          r"\(260 ids\), under half of the model's vocabulary of 49152"):
        check_fits(passkey, smol, ids)
    with pytest.raises(ConfigError, match=r"\(512 ids\), more ids than the model's vocabulary of 300"):
        check_fits(passkey.with_tokenizer(tok), small, ids)
    with pytest.raises(ConfigError, match=r"token id 700 in its prompts, outside the model's vocabulary \[0, 512\)"):
        check_model_tokens(tok, [np.asarray([1, 5, 700])], VOCAB, "task 'passkey'")
    check_fits(passkey.with_tokenizer(tok), dataclasses.replace(small, vocab_size=VOCAB), ids)  # its own: fine

    def lost(task, depth):  # the copy as it was: the parameters kept, the tokenizer and frame dropped
        return task if depth is None else make_task(task.name, {"depth": depth})

    for module in (evaluate, cell_prompts):
        monkeypatch.setattr(module, "with_depth", lost)
    ev = EvalConfig.from_mapping({"task": "passkey", "lengths": [300], "depths": [0.5], "samples": 1})
    model = dataclasses.replace(small, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match=r"eval cell \(task 'passkey', length 300, depth 0.5\) builds its prompts "
                                          r"with lcx's byte tokenizer, not the run's .*tokenizer.json"):
        check_prompts({"trained": (model, None)}, ev, tok)


def test_nested_task_params_are_validated_under_their_own_keys(documents):
    """``eval.perplexity: {task: documents, params: {path: DIR}}`` loads (it was refused for every path, the task
    validated before its parameters were attached), and a bad value names the key it was set under."""
    ev = EvalConfig.from_mapping({"task": "passkey", "perplexity": {"task": "documents",
                                                                    "params": {"path": str(documents)}}})
    assert ev.perplexity.make_task().path == str(documents)
    cases = [({"perplexity": {"task": "documents", "params": {"format": "csv", "path": "x"}}},
              r"eval.perplexity.params.format='csv' is invalid"),
             ({"perplexity": {"task": "documents"}}, r"eval.perplexity.params.path='' is invalid"),
             ({"perplexity": {"task": "documents", "params": {"pth": "x"}}},
              r"unknown key 'eval.perplexity.params.pth'; did you mean 'path'\?"),
             ({"perplexity": {"task": "prose", "params": {"val_fraction": 2}}},
              r"eval.perplexity.params.val_fraction=2.0 is invalid"),
             ({"params": {"depth": 1.5}}, r"eval.params.depth=1.5 is invalid"),
             ({"task": "niah_single_1", "params": {"type_haystack": "essay"}}, r"eval.params.type_haystack='essay'"),
             ({"tasks": ["passkey", "niha"]}, r"eval.tasks\[1\]='niha' is not a known task; did you mean 'niah'\?"),
             ({"task": "prose", "perplexity": {"task": "prose"}},
              r"eval.perplexity is set, but eval.task='prose' already measures perplexity")]
    for body, message in cases:
        with pytest.raises(ConfigError, match=message):
            EvalConfig.from_mapping({"task": "passkey", **body})
    # a value only an example can check names its key too, when the grid builds the prompts
    missing = EvalConfig.from_mapping({"task": "passkey", "perplexity": {"task": "documents",
                                                                         "params": {"path": "/nowhere/docs"}}})
    with pytest.raises(ConfigError, match=r"eval.perplexity.params.path='/nowhere/docs' does not exist"):
        prompts(missing, TOKENIZER)


# --------------------------------------------------------------------------------------------------- documented forms
def _readme_forms(documents: Path) -> dict[str, dict]:
    """The eval / ablate forms docs/guides/experiments.md describes inline, each as a config on the checkpoint."""
    return {
        "passkey at depths": {"eval": {"task": "passkey", "lengths": [512], "depths": [0.25, 0.75]}},
        "ruler suite, chat": {"eval": {"tasks": ["ruler"], "lengths": [2048], "chat": True}},
        "questions per haystack": {"eval": {"task": "niah_multikey_1", "params": {"questions_per_haystack": 4},
                                            "lengths": [512], "depths": [0.5], "samples": 4, "batch_size": 4}},
        "niah and mqar": {"eval": {"tasks": ["niah", "mqar"], "lengths": [512]}},
        "perplexity buckets": {"eval": {"task": "prose", "lengths": [512], "ppl_prefix": 64,
                                        "ppl_buckets": [128, 256, 512]}},
        "perplexity on documents": {"eval": {"task": "passkey", "lengths": [256, 512],
                                             "perplexity": {"task": "documents", "params": {"path": str(documents)},
                                                            "tail": 64}}},
        "perplexity next to retrieval": {"eval": {"task": "passkey", "lengths": [512],
                                                  "perplexity": {"task": "prose", "samples": 4, "batch_size": 4}}},
    }


def _config_files() -> list[Path]:
    return sorted(p for p in (ROOT / "experiments" / "configs").glob("*.yaml")
                  if "eval" in (yaml.safe_load(p.read_text()) or {}))


def _source_text(task) -> str:
    """The text a perplexity task's windows are cut from."""
    if task.name == "documents":
        return "".join(p.read_text() for p in sorted(Path(task.path).glob("*.txt")))
    if task.name == "prose":
        return "".join(text for _, text in task.documents())
    return "".join(p.read_text(errors="replace") for p in task.files("validation"))  # corpus: bytes of files


def _check_cells(cfg, tokenizer) -> int:
    """Every cell's prompts: in the run's tokenizer and the model's vocabulary, of the cell's length; a retrieval
    prompt decodes to text holding every answer it is graded on; a perplexity window to a piece of its source."""
    cells = prompts(cfg.eval, tokenizer, samples=min(cfg.eval.samples, 4))
    assert len(cells) == len(cfg.eval.lengths) * (
        len(cfg.eval.task_names()) * len(cfg.eval.depths or (None,)) if cfg.eval.metric == "accuracy" else 1
    ) + (len(cfg.eval.lengths) if cfg.eval.perplexity is not None else 0)
    for cell in cells:
        assert cell.task.tokenizer == tokenizer, cell
        check_fits(cell.task, cfg.model, cell.ids)
        if cell.metric == "accuracy":
            for ex in cell.examples:
                text = tokenizer.decode(ex.prompt_ids)
                assert len(ex.ids) <= cell.length + 1, (cell.name, len(ex.ids))
                assert all(ref in text for ref in ex.references), (cell.name, ex.references, text[-300:])
                if cell.name == "passkey":
                    assert "The pass key is" in text
                if cell.name.startswith("niah_"):
                    assert "special magic" in text
        else:
            source = re.sub(r"\s+", " ", _source_text(cell.task))
            for window in cell.ids:
                assert len(window) == cell.length
                # a slice of tokens may cut a character's bytes at either end: those decode to U+FFFD
                piece = re.sub(r"\s+", " ", tokenizer.decode(window[len(window) // 2: len(window) // 2 + 24]))
                piece = piece.strip("\ufffd").strip()
                assert piece and piece in source, (cell.task.name, piece)
    return len(cells)


@pytest.mark.parametrize("form", ["passkey at depths", "ruler suite, chat", "questions per haystack",
                                  "niah and mqar", "perplexity buckets", "perplexity on documents",
                                  "perplexity next to retrieval"])
def test_readme_config_forms_build_prompts_in_the_checkpoint_tokens(form, ckpt, tok, documents, tmp_path):
    body = _readme_forms(documents)[form]
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "runs_dir": str(tmp_path), "checkpoint": str(ckpt),
                                    "stages": ["ablate"], "ablate": {"policies": ["full"]}, **body}))
    cfg = load_experiment(path)
    assert run_tokenizer(cfg, cfg.model) == tok
    assert _check_cells(cfg, tok) > 0


@pytest.mark.parametrize("config", _config_files(), ids=lambda p: p.stem)
def test_experiment_configs_build_their_prompts(config, ckpt, tok, tmp_path):
    """Every config in experiments/configs/ with an evaluation, loaded as ``lcx run`` loads it (a real-model
    config on the checkpoint above, in its tokenizer) and its prompts built and checked."""
    overrides = [f"runs_dir={tmp_path}"]
    if "checkpoint" in yaml.safe_load(config.read_text()):
        overrides.append(f"checkpoint={ckpt}")
    cfg = load_experiment(config, overrides)
    tokenizer = run_tokenizer(cfg, cfg.model)
    assert tokenizer == (tok if cfg.checkpoint else TOKENIZER)
    assert _check_cells(cfg, tokenizer) > 0


def test_router_distillation_reads_the_model_tokens(tok, tmp_path):
    """``lcx train-router`` built its sequences in byte ids whatever the model: the teacher (a checkpoint with its
    own tokenizer) then attended over garbage. Now the run's tokenizer builds them, a mismatch is refused before the
    first step, and real tokens end at the last non-pad one (a BPE tokenizer pads with its end-of-text id)."""
    from lcx.train.config import DataConfig
    from lcx.train.router import RouterConfig, sample_queries, train_router

    smol = ModelConfig(vocab_size=49152, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                       max_position_embeddings=512)
    cfg = RouterConfig(steps=1, batch_size=1, seq_len=256, rank=4, window=16, block=8, queries=4)
    with pytest.raises(ConfigError, match=r"data.task='passkey' builds its tokens with lcx's byte tokenizer"):
        train_router(smol, None, cfg, DataConfig(task="passkey"), tmp_path / "router", progress=False)
    eos = tok.eos_id
    assert tok.pad_id == eos  # no pad token of its own: padding is end-of-text
    batch = {"inputs": np.asarray([[1] + [7] * 30 + [eos] + [9] * 5 + [eos] * 27]),
             "answer": np.zeros((1, 64), np.float32)}
    picks = sample_queries(np.random.default_rng(0), batch, dataclasses.replace(cfg, queries=64), pad_id=eos)
    assert picks.max() == 36 and picks.min() >= cfg.sinks + cfg.block + cfg.window - 1  # the EOS at 31 is real


def test_a_stage_whose_prompts_the_fix_changed_reruns(ckpt, tok, tmp_path):
    """A done.json written before the fix records the same settings: ``prompt_fixes`` (only where the prompts
    changed - depths in a checkpoint's tokenizer) makes exactly those stages rerun, and no other."""
    from lcx.experiment.stages import _settings
    from lcx.train.checkpoint import CheckpointInfo

    info = CheckpointInfo(ckpt, 0, "sha256:0")
    path = tmp_path / "exp.yaml"
    for depths, fixed in ((None, False), ([0.25, 0.75], True)):
        path.write_text(yaml.safe_dump({"name": "x", "runs_dir": str(tmp_path), "checkpoint": str(ckpt),
                                        "stages": ["eval"], "eval": {"task": "passkey", "depths": depths}}))
        cfg = load_experiment(path)
        assert ("prompt_fixes" in _settings(cfg, "eval", info, {}, tok)) == fixed
        assert "prompt_fixes" not in _settings(cfg, "eval", info, {}, TOKENIZER)  # byte-level runs: unchanged


def test_bos_is_recorded_and_only_cells_whose_prompts_lost_it_rerun(ckpt, tok, tmp_path):
    """Prompts begin with BOS as the tokenizer says (this tokenizer.json adds none): a cell whose prompts lost the
    BOS they had before records ``bos: false`` in its inputs, so its old record is stale and it reruns - plain
    prompts and prose windows; a chat prompt (its template's BOS text decides) and a byte-level run keep their
    inputs and stay done. The stage's done.json says so where any cell changed; results carry a ``bos`` column, and
    a results.csv from before the column reads back with it empty."""
    from lcx.config import CacheConfig
    from lcx.eval.config import AblateConfig, RopeVariant
    from lcx.eval.report import FIELDS, read_csv, write_report
    from lcx.experiment.stages import _settings
    from lcx.train.checkpoint import CheckpointInfo

    model = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    inputs = {}
    for chat in (False, True):
        for name, tokenizer in (("bpe", tok), ("bytes", TOKENIZER)):
            if chat and tokenizer is TOKENIZER:
                continue
            ev = EvalConfig.from_mapping({"task": "passkey", "lengths": [300], "samples": 1, "chat": chat,
                                          "perplexity": {"task": "prose"}})
            models = {"trained": (dataclasses.replace(model, vocab_size=tokenizer.vocab_size), None)}
            cells = grid._plan(models, ev, [AblateConfig.of_cache(CacheConfig())], (RopeVariant("trained"),),
                               tokenizer, {}).cells
            inputs[name, chat] = {c.inputs["metric"]: c.inputs.get("bos") for c in cells}
    assert not tok.adds_bos and TOKENIZER.adds_bos
    assert inputs["bpe", False] == {"accuracy": False, "perplexity": False}
    assert inputs["bpe", True] == {"accuracy": None, "perplexity": False}  # the template writes <|im_start|>
    assert inputs["bytes", False] == {"accuracy": None, "perplexity": None}  # unchanged: old cells stay done
    tasks, ppl_task = grid.grid_tasks(EvalConfig.from_mapping({"task": "passkey", "chat": True,
                                                               "perplexity": {"task": "prose"}}), tok)
    assert tasks["passkey"].starts_with_bos and not ppl_task.starts_with_bos  # chat: BOS text; prose: none
    assert make_task("prose", {"bos": True}).with_tokenizer(tok).starts_with_bos  # explicit: as asked
    assert not grid.dropped_bos(make_task("prose", {"bos": False}).with_tokenizer(tok))

    info = CheckpointInfo(ckpt, 0, "sha256:0")
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "runs_dir": str(tmp_path), "checkpoint": str(ckpt),
                                    "stages": ["eval"], "eval": {"task": "passkey"}}))
    cfg = load_experiment(path)
    assert _settings(cfg, "eval", info, {}, tok)["bos"] == "as the tokenizer adds it"
    assert "bos" not in _settings(cfg, "eval", info, {}, TOKENIZER)  # a byte-level run's done.json: unchanged

    assert FIELDS.index("bos") == FIELDS.index("held_kv_bytes") + 1  # appended: the columns before keep their order
    row = {"setting": "full", "policy": "full", "budget": "", "rope": "trained", "length": 300, "depth": "",
           "metric": "accuracy", "value": 1.0, "lo": 0.5, "hi": 1.0, "samples": 1, "seconds": 0.0, "task": "",
           "compression": "", "protocol": "streaming"}
    write_report([{**row, "bos": False}], tmp_path / "new", "eval")
    assert read_csv(tmp_path / "new" / "results.csv")[0]["bos"] is False
    assert "accuracy prompts without BOS first" in (tmp_path / "new" / "results.md").read_text()
    old = tmp_path / "old.csv"  # written before the column
    old.write_text(",".join(FIELDS[:-1]) + "\n" + ",".join(str(row.get(k, "")) for k in FIELDS[:-1]) + "\n")
    assert read_csv(old)[0]["bos"] == "" and read_csv(old)[0]["value"] == 1.0


def test_eval_bos_forces_the_bos_of_plain_retrieval_prompts(ckpt, tok):
    """``eval.bos: true`` puts BOS first on every plain retrieval prompt of a tokenizer that adds none (the prompts
    lcx built before it followed the tokenizer), so its cells' inputs equal those records again; ``false`` drops it;
    the perplexity windows and a chat frame keep their own rule; what a tokenizer cannot follow is refused by name."""
    from lcx.config import CacheConfig
    from lcx.eval.config import AblateConfig, RopeVariant

    base = {"task": "passkey", "lengths": [300], "samples": 2, "perplexity": {"task": "prose"}}
    built = {bos: prompts(EvalConfig.from_mapping({**base, "bos": bos}), tok) for bos in (None, True, False)}
    for cell_none, cell_true, cell_false in zip(*built.values()):
        for ids_none, ids_true, ids_false in zip(cell_none.ids, cell_true.ids, cell_false.ids):
            if cell_none.metric == "perplexity":  # eval.perplexity's windows: their own bos parameter
                assert np.array_equal(ids_none, ids_true) and np.array_equal(ids_none, ids_false)
                continue
            assert ids_true[0] == tok.bos_id and ids_none[0] != tok.bos_id and np.array_equal(ids_false, ids_none)
            # the same prompt after the BOS, its filler a token shorter: the prompt keeps the cell's length
            assert len(ids_true) == len(ids_none) and np.array_equal(ids_true[1:40], ids_none[:39])
        for ex_none, ex_true in zip(cell_none.examples, cell_true.examples):  # the BOS counted in the context
            assert ex_true.answer == ex_none.answer and ex_true.context_len == ex_none.context_len
            assert np.array_equal(ex_true.ids[ex_true.context_len:], ex_none.ids[ex_none.context_len:])
    model = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    records = {}
    for bos in (None, True):
        ev = EvalConfig.from_mapping({**base, "bos": bos, "perplexity": None})
        cells = grid._plan({"trained": (model, None)}, ev, [AblateConfig.of_cache(CacheConfig())],
                           (RopeVariant("trained"),), tok, {}).cells
        records[bos] = cells[0].inputs
    assert records[None]["bos"] is False and "bos" not in records[True]  # BOS first: the record from before
    assert "bos" not in EvalConfig.from_mapping(base).to_dict()  # default: done.json files stay done
    with pytest.raises(ConfigError, match=r"eval.bos=true cannot be combined with eval.chat=true"):
        EvalConfig.from_mapping({**base, "bos": True, "chat": True})
    with pytest.raises(ConfigError, match=r"eval.bos=false is invalid for lcx's byte tokenizer"):
        prompts(EvalConfig.from_mapping({**base, "bos": False}), None)
    with pytest.raises(ConfigError, match=r"eval.bos='yes' is invalid: must be true or false or null"):
        EvalConfig.from_mapping({**base, "bos": "yes"})
    with pytest.raises(ConfigError, match=r"eval.bos=true is invalid with eval.task='prose'.*eval.params.bos"):
        EvalConfig.from_mapping({"task": "prose", "bos": True})
    mixture = make_task("mixture", {"parts": [{"task": "passkey"}, {"task": "niah"}]}).with_tokenizer(tok)
    forced = dataclasses.replace(mixture, bos_first=True)  # as a grid copies a task: every part follows
    assert forced.starts_with_bos and all(part.starts_with_bos for part, _, _ in forced.parts)
    assert not any(part.starts_with_bos for part, _, _ in mixture.parts)
