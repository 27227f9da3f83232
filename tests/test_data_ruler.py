"""RULER suite (``lcx.data.ruler``) with lcx's byte tokenizer and a small trained BPE: lengths (NIAH exact), answer
masks, determinism, where the answers sit in the prompt, RULER's grading, the fit search and config errors."""

from __future__ import annotations

import collections
import json
import math
import re

import numpy as np
import pytest

from lcx.config_base import ConfigError
from lcx.data import ByteTokenizer, HFTokenizer, make_task, task_names
from lcx.data.haystack import NOISE, prose_text
from lcx.data.ruler import CWE_INSTRUCTION, FWE_INSTRUCTION, RULER_SUITE, VT_INSTRUCTION, macro_average, words, zeta
from lcx.data.ruler.base import _largest_fitting

SEQ = 2048
NIAH = [name for name in RULER_SUITE if name.startswith("niah")]
# RULER's synthetic.yaml, the defaults each task must carry
RULER_SETTINGS = {
    "niah_single_1": dict(type_haystack="noise", type_needle_k="words", type_needle_v="numbers", num_needle_k=1,
                          num_needle_v=1, num_needle_q=1),
    "niah_single_2": dict(type_haystack="prose", type_needle_k="words", type_needle_v="numbers", num_needle_k=1,
                          num_needle_v=1, num_needle_q=1),
    "niah_single_3": dict(type_haystack="prose", type_needle_k="words", type_needle_v="uuids", num_needle_k=1,
                          num_needle_v=1, num_needle_q=1),
    "niah_multikey_1": dict(type_haystack="prose", type_needle_k="words", type_needle_v="numbers", num_needle_k=4,
                            num_needle_v=1, num_needle_q=1),
    "niah_multikey_2": dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers", num_needle_k=1,
                            num_needle_v=1, num_needle_q=1),
    "niah_multikey_3": dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids", num_needle_k=1,
                            num_needle_v=1, num_needle_q=1),
    "niah_multivalue": dict(type_haystack="prose", type_needle_k="words", type_needle_v="numbers", num_needle_k=1,
                            num_needle_v=4, num_needle_q=1),
    "niah_multiquery": dict(type_haystack="prose", type_needle_k="words", type_needle_v="numbers", num_needle_k=1,
                            num_needle_v=1, num_needle_q=4),
    "vt": dict(num_chains=1, num_hops=4),
    "cwe": dict(freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": dict(alpha=2.0),
}
_NEEDLE = re.compile(r"One of the special magic (\w+) for ([\w-]+) is: ([\w-]+)\.")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE (vocab 1000, <s> / </s>) trained on the prose and noise texts, loaded as lcx loads one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([prose_text()[:100000], NOISE * 50], trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path)


@pytest.fixture(params=["bytes", "bpe"])
def tokenizer(request, bpe):
    return ByteTokenizer() if request.param == "bytes" else bpe


def _task(name, tokenizer, **params):
    return make_task(name, params).with_tokenizer(tokenizer)


def _one(name, tokenizer, seq_len=SEQ, seed=0, index=0, **params):
    return _task(name, tokenizer, **params).examples(seed, index, 1, seq_len)[0]


# --------------------------------------------------------------------------------------------------- registry
def test_ruler_suite_registered_with_ruler_defaults():
    assert RULER_SUITE == tuple(RULER_SETTINGS)  # RULER's order
    assert set(RULER_SUITE) <= set(task_names())
    for name, settings in RULER_SETTINGS.items():
        task = make_task(name)
        assert task.name == name and task.accepts_tokenizer
        assert {key: getattr(task, key) for key in settings} == settings, name
    assert make_task("niah_single_2", {"num_needle_v": 2}).num_needle_v == 2  # parameters stay overridable


# --------------------------------------------------------------------------------------------------- shape
@pytest.mark.parametrize("name", RULER_SUITE)
def test_ruler_length_mask_and_answer(name, tokenizer):
    task = _task(name, tokenizer)
    for ex in task.examples(1, 0, 2, SEQ):
        n = len(ex.ids)
        if name in NIAH:
            assert n == SEQ + 1  # exact: the haystack takes whatever the fixed pieces leave
        else:  # the largest list that fits: one more noise line / word would overflow
            assert SEQ + 1 - 128 <= n <= SEQ + 1
        # BOS first where the tokenizer adds one (bytes: yes; this tokenizer.json's post-processor adds none)
        assert (ex.ids[0] == tokenizer.bos_id) == tokenizer.adds_bos and ex.ids[-1] == tokenizer.eos_id
        answer = np.flatnonzero(ex.loss_mask)
        assert answer.tolist() == list(range(ex.prompt_len, n))  # the answer and EOS, nothing else
        assert tokenizer.decode(ex.ids[ex.prompt_len:-1]) == " " + ex.answer
        assert ex.prompt == tokenizer.decode(ex.prompt_ids)
        question = tokenizer.decode(ex.ids[ex.context_len:ex.prompt_len])  # context_len: where the question starts
        assert question.startswith(("What ", "Question:")) and tokenizer.decode(ex.ids[:ex.context_len])[-1] == "\n"
        assert ex.references and all(ref in ex.answer for ref in ex.references)


@pytest.mark.parametrize("name", RULER_SUITE)
def test_ruler_deterministic_per_seed(name, tokenizer):
    task = _task(name, tokenizer)
    first = task.examples(5, 3, 1, SEQ)[0]
    again = task.examples(5, 3, 1, SEQ)[0]
    other_index = task.examples(5, 4, 1, SEQ)[0]
    other_seed = task.examples(6, 3, 1, SEQ)[0]
    assert np.array_equal(first.ids, again.ids) and first.references == again.references
    assert not np.array_equal(first.ids, other_index.ids) and first.references != other_index.references
    assert first.references != other_seed.references


# --------------------------------------------------------------------------------------------------- niah
def _asked_keys(prompt: str) -> list[str]:
    asked = re.findall(r"special magic \w+ for (.+?) mentioned in the provided text\?", prompt)[-1]
    return [k for k in re.split(r", and |, ", asked)]


@pytest.mark.parametrize("name", NIAH)
def test_ruler_niah_values_follow_their_keys(name, tokenizer):
    task = _task(name, tokenizer)
    ex = task.examples(2, 0, 1, SEQ)[0]
    prompt = ex.prompt
    needles = [(m.group(2), m.group(3), m.start(), m.end()) for m in _NEEDLE.finditer(prompt)]
    assert {m.group(1) for m in _NEEDLE.finditer(prompt)} == {task.type_needle_v}  # plural in the needle
    asked = _asked_keys(prompt)
    assert len(asked) == task.num_needle_q
    found = [value for key, value, _, _ in needles if key in asked]
    assert sorted(found) == sorted(ex.references)
    assert len(ex.references) == task.num_needle_q * task.num_needle_v
    for _, _, start, end in needles:  # at sentence starts, never inside a word
        before = prompt[:start].rstrip(" ")
        assert before[-1] in ".!?\n" and prompt[end] in " \n", prompt[max(start - 30, 0):end + 10]
    keys = {key for key, _, _, _ in needles}
    if task.type_haystack == "needle":  # a haystack of distractor needles, none with an asked key
        assert len(needles) > 10 and sum(key in asked for key, _, _, _ in needles) == len(ex.references)
    else:
        assert len(keys) == max(task.num_needle_k, task.num_needle_q)
        assert len(needles) == len(keys) * task.num_needle_v
    source = "The grass is green. The sky is blue." if task.type_haystack == "noise" else None
    assert source is None or source in prompt
    singular = task.num_needle_q * task.num_needle_v == 1
    kind = task.type_needle_v[:-1] if singular else task.type_needle_v
    opening = f"A special magic {kind} is hidden" if singular else f"Some special magic {kind} are hidden"
    assert prompt.startswith(opening)
    assert prompt.endswith("mentioned in the provided text " + ("is" if singular else "are"))
    if task.type_needle_k == "uuids":
        assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", k)
                   for k in asked)


@pytest.mark.parametrize("name", ["niah_multikey_1", "niah_single_1", "niah_multikey_3"])
def test_ruler_niah_questions_per_haystack_share_one_context(name, tokenizer):
    """Runs of 3 examples share one haystack (the same ids before the question) and ask 3 different keys, each
    answered by its own needle; the longest example fills seq_len + 1, the others fit."""
    task = _task(name, tokenizer, questions_per_haystack=3)
    examples = task.examples(4, 0, 5, SEQ)  # a run of 3, then the first 2 of the next
    for run in (examples[:3], examples[3:]):
        context = run[0].ids[:run[0].context_len]
        assert all(np.array_equal(ex.ids[:ex.context_len], context) for ex in run)
        asked = [tuple(_asked_keys(ex.prompt)) for ex in run]
        assert len(set(asked)) == len(run)  # a different key each
        needles = {m.group(2): m.group(3) for m in _NEEDLE.finditer(run[0].prompt[:run[0].prompt.rindex("What")])}
        assert all([needles[k] for k in keys] == list(ex.references) for keys, ex in zip(asked, run))
    assert max(len(ex.ids) for ex in examples[:3]) == SEQ + 1 and all(len(ex.ids) <= SEQ + 1 for ex in examples)
    assert not np.array_equal(examples[0].ids[:examples[0].context_len], examples[3].ids[:examples[3].context_len])
    with pytest.raises(ConfigError, match=r"data\.params\.questions_per_haystack=0 is invalid"):
        make_task(name, {"questions_per_haystack": 0})


@pytest.mark.parametrize("depth,low,high", [(0.0, 0.0, 0.1), (0.5, 0.35, 0.65), (1.0, 0.85, 1.0)])
def test_ruler_niah_depth(depth, low, high, bpe):
    ex = _one("niah_single_2", bpe, depth=depth, seq_len=4096)
    head = ex.prompt.index("afterwards.\n") + len("afterwards.\n")
    tail = ex.prompt.rindex("\nWhat is the special magic")
    at = _NEEDLE.search(ex.prompt).start()
    assert low <= (at - head) / (tail - head) <= high


def test_ruler_niah_long_exact(bpe):
    for name in ("niah_multikey_3", "niah_multivalue"):
        ex = _one(name, bpe, seq_len=16384)
        assert len(ex.ids) == 16385
        assert all(ref in ex.prompt for ref in ex.references)


# --------------------------------------------------------------------------------------------------- vt
def _main_part(prompt: str, instruction: str) -> str:
    """The prompt after the last copy of the instruction (the one-shot example comes before it)."""
    return prompt[prompt.rindex(instruction):]


@pytest.mark.parametrize("params", [{}, {"num_chains": 2, "num_hops": 3}, {"fewshot": False}])
def test_ruler_vt_chain_in_prompt(params, tokenizer):
    task = _task("vt", tokenizer, **params)
    ex = task.examples(4, 0, 1, SEQ)[0]
    assert ex.prompt.count(VT_INSTRUCTION) == (1 if params.get("fewshot") is False else 2)
    text = _main_part(ex.prompt, VT_INSTRUCTION)
    value = re.search(r"assigned the value (\d+) in the text above", text).group(1)
    names = list(ex.references)
    assert len(names) == task.num_hops + 1 and ex.answer == " ".join(names)
    lines = text.split("\n")
    statements = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
    where = [lines.index(s) for s in statements]
    assert where == sorted(where) and all(b - a >= 2 for a, b in zip(where, where[1:]))  # in order, noise between
    assigned = [line for line in lines if line.startswith("VAR ")]
    assert len(assigned) == task.num_chains * (task.num_hops + 1)
    assert sum(line.endswith(f"= {value}") for line in assigned) == 1  # other chains hold other values
    assert f"{task.num_hops + 1} variables are assigned the value {value}, they are:" in text


# --------------------------------------------------------------------------------------------------- cwe
def _cwe_list(prompt: str) -> list[str]:
    text = _main_part(prompt, CWE_INSTRUCTION)
    listed = text[len(CWE_INSTRUCTION) + 1:text.index("\nQuestion:")]
    items = re.findall(r"(\d+)\. (\S+)", listed)
    assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
    return [w for _, w in items]


@pytest.mark.parametrize("seq_len,params,freq", [
    (4000, {}, (6, 1)),  # below 4096: RULER's short setting
    (8192, {}, (30, 3)),
    (6000, {"short_below": 0, "freq_cw": 5, "freq_ucw": 2}, (5, 2)),
])
def test_ruler_cwe_common_words_are_most_common(seq_len, params, freq, tokenizer):
    task = _task("cwe", tokenizer, **params)
    ex = task.examples(3, 0, 1, seq_len)[0]
    counts = collections.Counter(_cwe_list(ex.prompt))
    common = set(ex.references)
    assert len(common) == 10 and len(counts) > 20
    assert {w for w, _ in counts.most_common(10)} == common
    assert all(counts[w] == (freq[0] if w in common else freq[1]) for w in counts)
    assert ex.answer.startswith("1. ") and ex.prompt.count(CWE_INSTRUCTION) == 2  # RULER's one-shot first


def test_ruler_cwe_more_words_than_the_list():
    """A list that needs more distinct words than ``words()`` holds continues with "word-word" pairs."""
    task = _task("cwe", ByteTokenizer(), short_below=10 ** 6, num_fewshot=0)
    ex = task.examples(0, 0, 1, 45000)[0]
    counts = collections.Counter(_cwe_list(ex.prompt))
    assert len(counts) > len(words()) and any("-" in w for w in counts)
    assert {w for w, _ in counts.most_common(10)} == set(ex.references)
    assert all("-" not in w for w in ex.references)
    assert 45001 - 64 <= len(ex.ids) <= 45001


# --------------------------------------------------------------------------------------------------- fwe
def test_ruler_fwe_answers_are_most_frequent(tokenizer):
    ex = _one("fwe", tokenizer, seed=7)
    text = ex.prompt[ex.prompt.index(FWE_INSTRUCTION) + len(FWE_INSTRUCTION):ex.prompt.index("\nQuestion:")]
    counts = collections.Counter(text.split())
    assert counts.most_common(1)[0][0] == "..."  # the top rank is noise
    del counts["..."]
    ranked = counts.most_common()
    assert {w for w, _ in ranked[:3]} == set(ex.references)
    assert ranked[2][1] > ranked[3][1]
    assert all(re.fullmatch("[a-z]{6}", w) for w in counts)


# --------------------------------------------------------------------------------------------------- grading
@pytest.mark.parametrize("name", RULER_SUITE)
def test_ruler_score_string_match_all(name):
    task = make_task(name)
    ex = task.examples(0, 0, 1, SEQ)[0]
    refs = ex.references
    assert task.score(ex, ex.answer) == 1.0
    assert task.score(ex, "The answer: " + ex.answer.upper() + ".") == 1.0  # case-insensitive, anywhere
    assert task.score(ex, "???") == 0.0
    assert task.score(ex, ex.answer[::-1] if len(refs) == 1 else "???") == 0.0
    if len(refs) > 1:
        partial = " ".join(refs[: len(refs) // 2])
        assert not any(ref in partial for ref in refs[len(refs) // 2:])  # the rest really is missing
        assert task.score(ex, partial) == pytest.approx((len(refs) // 2) / len(refs))


def test_ruler_macro_average():
    scores = {name: i / 10 for i, name in enumerate(RULER_SUITE)}
    assert macro_average(scores) == pytest.approx(sum(range(11)) / 110)
    assert macro_average({**scores, "qa_1": 0.0}) == macro_average(scores)  # other tasks do not count
    with pytest.raises(ValueError, match="missing: \\['fwe'\\]"):
        macro_average({k: v for k, v in scores.items() if k != "fwe"})


# --------------------------------------------------------------------------------------------------- frames
@pytest.fixture(scope="module")
def chat_bpe(bpe, tmp_path_factory):
    """The BPE with a chat template beside it (``tokenizer_config.json``), as a model directory has."""
    folder = tmp_path_factory.mktemp("chat")
    (folder / "tokenizer.json").write_text(bpe.file.read_text())
    template = ("{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return HFTokenizer(folder)


@pytest.mark.parametrize("name", ["niah_single_2", "niah_multikey_2", "vt", "cwe"])
def test_ruler_chat_frame(name, chat_bpe):
    """In a chat template the context and question are the user's message, the answer prefix opens the reply."""
    task = make_task(name).with_tokenizer(chat_bpe, chat=True)
    ex = task.examples(0, 0, 1, SEQ)[0]
    assert len(ex.ids) == SEQ + 1 if name in NIAH else SEQ + 1 - 128 <= len(ex.ids) <= SEQ + 1
    assert ex.prompt.startswith("<|user|>\n")
    message, reply = ex.prompt.split("<|end|>\n<|assistant|>\n")
    assert message.endswith(("?", "text above.")) and reply.startswith(("The special magic", "Answer:"))
    assert chat_bpe.decode(ex.ids[ex.prompt_len:-1]) == " " + ex.answer


# --------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("name", RULER_SUITE)
def test_ruler_too_short_seq_len(name, tokenizer):
    with pytest.raises(ConfigError, match=r"seq_len=100 is too short for data.task="):
        _task(name, tokenizer).examples(0, 0, 1, 100)


@pytest.mark.parametrize("name,params,key", [
    ("niah_single_2", {"type_haystack": "essay"}, "type_haystack"),
    ("niah_single_1", {"type_needle_v": "letters"}, "type_needle_v"),
    ("niah_multivalue", {"num_needle_v": 0}, "num_needle_v"),
    ("niah_multiquery", {"depth": 1.5}, "depth"),
    ("vt", {"num_hops": 0}, "num_hops"),
    ("cwe", {"freq_cw": 3, "freq_ucw": 3}, "freq_cw"),
    ("cwe", {"num_cw": 0}, "num_cw"),
    ("fwe", {"alpha": 1.0}, "alpha"),
    ("fwe", {"vocab_size": 3}, "vocab_size"),
])
def test_ruler_bad_params(name, params, key):
    with pytest.raises(ConfigError, match=rf"data\.params\.{key}=.* is invalid"):
        make_task(name, params)


# --------------------------------------------------------------------------------------------------- helpers
def test_ruler_largest_fitting_is_tight():
    for per_item, base, limit in [(3, 10, 1000), (7, 0, 131072), (1, 999, 1000)]:
        def length(n):
            return base + per_item * n + (n % 5 == 0)  # not quite linear, not quite monotone

        n = _largest_fitting(length, 0, limit)
        assert length(n) <= limit < length(n + 1)


def test_ruler_words_and_zeta():
    vocab = words()
    assert len(vocab) > 2000 and list(vocab) == sorted(set(vocab))
    assert all(re.fullmatch("[a-z]{3,10}", w) for w in vocab)
    assert zeta(2.0) == pytest.approx(math.pi ** 2 / 6, abs=1e-10)
    assert zeta(3.0) == pytest.approx(1.2020569031595942, abs=1e-10)
