"""Synthetic tasks: templates, answers and masks, determinism, lengths, registry errors."""

from __future__ import annotations

import re

import numpy as np
import pytest

from lcx.config import ConfigError
from lcx.data import BatchSource, ByteTokenizer, make_task, pack, task_names
from lcx.data.tasks import NOISE, PASSKEY_INSTRUCTION, PASSKEY_QUESTION

TOK = ByteTokenizer()


def _text(ids) -> str:
    return TOK.decode(ids)


def test_tasks_registry_names():
    assert {"passkey", "niah", "mqar", "corpus"} <= set(task_names())


def test_tasks_unknown_name_did_you_mean():
    with pytest.raises(ConfigError, match=r"data.task='paskey' is not a known task; did you mean 'passkey'\?"):
        make_task("paskey")


def test_tasks_unknown_param_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown key 'data.params.dept'; did you mean 'depth'\?"):
        make_task("passkey", {"dept": 0.5})


@pytest.mark.parametrize("name,params,match", [
    ("passkey", {"depth": 1.5}, r"data.params.depth=1.5 is invalid: must be in \[0, 1\]"),
    ("passkey", {"key_min": 10, "key_max": 5}, r"data.params.key_max=5 is invalid"),
    ("passkey", {"filler_tokens": -1}, r"data.params.filler_tokens=-1 is invalid"),
    ("niah", {"num_keys": 2, "num_queries": 3}, r"data.params.num_queries=3 is invalid: must be <= "),
    ("mqar", {"num_pairs": 2, "num_queries": 3}, r"data.params.num_queries=3 is invalid"),
    ("mqar", {"num_pairs": 30, "key_len": 1}, r"data.params.num_pairs=30 is invalid"),
])
def test_tasks_invalid_params(name, params, match):
    with pytest.raises(ConfigError, match=match):
        make_task(name, params)


def test_tasks_passkey_template_answer_and_mask():
    task = make_task("passkey", {"depth": 0.5})
    ex = task.example(np.random.default_rng(0), 512)
    assert len(ex.ids) == 513 and ex.ids[0] == TOK.bos_id and ex.ids[-1] == TOK.eos_id
    text = _text(ex.ids)
    assert text.startswith(PASSKEY_INSTRUCTION + "\n")
    key = ex.answer
    assert key.isdigit() and ex.references == (key,) and 1 <= int(key) <= 50000
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in text
    assert _text(ex.prompt_ids).endswith(PASSKEY_QUESTION)
    assert _text(ex.ids[ex.loss_mask]) == " " + key  # the answer digits (+ the masked EOS, not text)
    assert ex.loss_mask[-1] and ex.loss_mask.sum() == len(key) + 2
    assert ex.prompt == _text(ex.prompt_ids)


@pytest.mark.parametrize("depth", [0.0, 0.25, 1.0])
def test_tasks_passkey_depth(depth):
    ex = make_task("passkey", {"depth": depth, "filler_tokens": 400, "instruction": False}).example(
        np.random.default_rng(1), 1024)
    prefix, rest = _text(ex.prompt_ids).split("\nThe pass key is", 1)
    assert abs(len(prefix) - depth * 400) <= len(NOISE) // 2  # snapped to a sentence start
    assert prefix == "" or prefix.endswith(". ") or len(prefix) == 400  # depth 1: after the whole filler
    assert len(prefix) + len(rest.split("pass key.\n", 1)[1].rsplit("\n", 1)[0]) == 400


def test_tasks_passkey_filler_tokens_exact_and_too_long():
    short = make_task("passkey", {"filler_tokens": 0, "instruction": False}).example(np.random.default_rng(0), 256)
    longer = make_task("passkey", {"filler_tokens": 50, "instruction": False}).example(np.random.default_rng(0), 256)
    assert len(longer.ids) - len(short.ids) == 50
    with pytest.raises(ConfigError, match=r"data.params.filler_tokens=5000 does not fit seq_len=256"):
        make_task("passkey", {"filler_tokens": 5000}).example(np.random.default_rng(0), 256)
    with pytest.raises(ConfigError, match=r"seq_len=64 is too short for data.task='passkey'"):
        make_task("passkey").example(np.random.default_rng(0), 64)


def test_tasks_niah_multikey_values_queries():
    task = make_task("niah", {"num_keys": 5, "num_values": 2, "num_queries": 2})
    ex = task.example(np.random.default_rng(3), 2048)
    text = _text(ex.prompt_ids)
    needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", text)
    assert len(needles) == 10 and len({k for k, _ in needles}) == 5
    asked = re.search(r"What are all the special magic numbers for (.+?) mentioned", text).group(1)
    queries = asked.split(" and ")
    assert len(queries) == 2
    expected = [v for k, v in needles if k in queries]
    assert list(ex.references) == expected and ex.answer == ", ".join(expected)
    assert _text(ex.ids[ex.loss_mask]) == " " + ex.answer and len(ex.ids) == 2049


def test_tasks_mqar_values_masked():
    ex = make_task("mqar", {"num_pairs": 6, "num_queries": 3}).example(np.random.default_rng(0), 128)
    text = _text(ex.ids)
    context, queries = text.split("\n")
    pairs = dict(p.split(":") for p in context.split())
    asked = [q.split(":") for q in queries.split()]
    assert len(pairs) == 6 and len(asked) == 3
    assert [v for _, v in asked] == [pairs[k] for k, _ in asked] == list(ex.references)
    assert _text(ex.ids[ex.loss_mask]) == "".join(ex.references)
    assert _text(ex.prompt_ids).endswith(asked[0][0] + ":")


@pytest.mark.parametrize("name", ["passkey", "niah", "mqar"])
def test_tasks_deterministic_in_seed_and_index(name):
    task = make_task(name, {"instruction": False} if name != "mqar" else {})
    a = task.examples(7, 3, 4, 512)
    b = task.examples(7, 3, 4, 512)
    c = task.examples(7, 4, 4, 512)
    v = task.examples(7, 3, 4, 512, split="validation")
    assert all(np.array_equal(x.ids, y.ids) and x.answer == y.answer for x, y in zip(a, b))
    assert any(not np.array_equal(x.ids, y.ids) for x, y in zip(a, c))
    assert any(not np.array_equal(x.ids, y.ids) for x, y in zip(a, v))


def test_data_batches_shapes_shift_and_weights():
    src = BatchSource(make_task("passkey", {"instruction": False, "filler_tokens": 20}), seq_len=128, batch_size=3,
                      seed=0, prompt_loss_weight=0.25)
    batch = src(0)
    exs = src.examples(0)
    assert {k: v.shape for k, v in batch.items()} == {k: (3, 128) for k in ("inputs", "targets", "weights", "answer")}
    assert batch["inputs"].dtype == np.int32 and batch["weights"].dtype == np.float32
    for i, ex in enumerate(exs):
        n = len(ex.ids)
        np.testing.assert_array_equal(batch["inputs"][i, : n - 1], ex.ids[:-1])
        np.testing.assert_array_equal(batch["targets"][i, : n - 1], ex.ids[1:])
        assert (batch["inputs"][i, n:] == TOK.pad_id).all() and (batch["targets"][i, n - 1:] == TOK.pad_id).all()
        expected = np.where(ex.loss_mask[1:], 1.0, 0.25)
        np.testing.assert_array_equal(batch["weights"][i, : n - 1], expected)
        np.testing.assert_array_equal(batch["answer"][i, : n - 1], ex.loss_mask[1:])
        assert (batch["weights"][i, n - 1:] == 0).all()
    np.testing.assert_array_equal(src(0)["inputs"], batch["inputs"])


def test_data_pack_rejects_overlong_example():
    ex = make_task("passkey", {"instruction": False}).example(np.random.default_rng(0), 256)
    with pytest.raises(ConfigError, match="does not fit seq_len=128"):
        pack([ex], 128)


def test_tasks_score_generations():
    passkey = make_task("passkey", {"instruction": False})
    ex = passkey.example(np.random.default_rng(0), 256)
    assert passkey.score(ex, f" {ex.answer}. The") == 1.0
    assert passkey.score(ex, f" 9{ex.answer}") == 0.0 and passkey.score(ex, " none") == 0.0
    niah = make_task("niah", {"num_values": 2, "instruction": False})
    ex = niah.example(np.random.default_rng(0), 1024)
    assert niah.score(ex, f" {ex.references[1]}, 1234") == 0.5 and niah.score(ex, " " + ex.answer) == 1.0
    mqar = make_task("mqar")
    ex = mqar.example(np.random.default_rng(0), 128)
    assert mqar.score(ex, ex.references[0] + " xx:") == 1.0 and mqar.score(ex, "!!") == 0.0
    with pytest.raises(ValueError, match="no references"):
        make_task("corpus").score(make_task("corpus").example(np.random.default_rng(0), 32), "x")


def test_tasks_passkey_filler_min_varies_length_within_bounds():
    task = make_task("passkey", {"instruction": False, "filler_min": 10, "filler_tokens": 60})
    lengths = {len(ex.ids) - len(ex.answer) for ex in task.examples(0, 0, 64, 256)}
    assert len(lengths) > 10
    full = make_task("passkey", {"instruction": False, "filler_tokens": 60}).example(np.random.default_rng(0), 256)
    assert max(lengths) <= len(full.ids) - len(full.answer) and min(lengths) >= max(lengths) - 50
    with pytest.raises(ConfigError, match=r"data.params.filler_min=70 is invalid: must be <= "):
        make_task("passkey", {"filler_min": 70, "filler_tokens": 60})


def test_tasks_old_forms_fail_naming_the_new_ones(monkeypatch):
    """Two contracts issue 26 changed: a passkey template is now (needle, question, answer prefix), and
    ``AblateConfig.caches`` takes the cells' length; the old forms say so instead of failing somewhere deep."""
    from lcx.data import tasks
    from lcx.eval.config import AblateConfig

    monkeypatch.setitem(tasks.PASSKEY_TEMPLATES, "mine", ("The pass key is {key}.", "What is the pass key?"))
    with pytest.raises(ConfigError, match=r"each entry is now \(needle with \{key\}, question, answer prefix\)"):
        make_task("passkey", {"template": "mine"})
    ablate = AblateConfig.from_mapping({"policies": ["full", "window"], "compressions": [0.5]})
    with pytest.raises(TypeError, match=r"caches\(length\) takes the cells' length in tokens"):
        ablate.caches()
    assert [c.budget for c in ablate.caches(256) if c.policy == "window"] == [128]  # half of 256 evicted
