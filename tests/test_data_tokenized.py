"""Tasks in a subword tokenizer's tokens: exact lengths, needles at their depth, grading on decoded text, chat
templates rendered as transformers renders them, and the prose perplexity source."""

import json

import numpy as np
import pytest

from lcx.config_base import ConfigError
from lcx.data import make_task
from lcx.data.haystack import NOISE, ChatTemplate, haystack, prose_text, render_chat
from lcx.data.tokenizer import HFTokenizer

CHAT = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
        "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A byte-level BPE of 1,000 ids trained on the prose haystack and the noise text, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    inner.train_from_iterator([prose_text()[:150_000], NOISE * 20], trainer)
    folder = tmp_path_factory.mktemp("bpe")
    inner.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT}))
    out = HFTokenizer(folder)
    if getattr(out, "chat_template", None) is None:  # older HFTokenizer: the attribute the chat frame reads
        out.chat_template = CHAT
    return out


def test_noise_haystack_is_the_repeated_text_in_context(tok):
    hay = haystack(tok, "noise")
    # a period's tokens, tiled, decode to the repeated text (rotated to start at a sentence), never a broken seam
    text = tok.decode(np.tile(hay.ids, 3))
    assert text.strip().startswith("The ") and NOISE.strip() in text
    ids, starts = hay.take(200, offset=7)
    assert len(ids) == 200 and starts[0] == 0 and starts[-1] == 200
    for s in starts[1:-1]:  # every inner start begins a sentence
        assert tok.decode(ids[s:s + 2]).strip()[0].isupper()


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_passkey_exact_length_depth_and_grading(tok, chat, depth):
    task = make_task("passkey", {"depth": depth}).with_tokenizer(tok, chat=chat)
    for length in (300, 777):
        ex = task.examples(3, 0, 2, length, "validation")[0]
        assert len(ex.ids) == length + 1  # prompt + answer + EOS fill the length exactly
        assert ex.ids[-1] == tok.eos_id and tok.decode(ex.ids[ex.prompt_len:]).strip() == ex.answer
        # the needle sits at the requested depth of the haystack, to within a sentence of noise
        piece = tok.encode(f"\nThe pass key is {ex.answer}. Remember it. {ex.answer} is the pass key.\n", bos=False)
        at = next(i for i in range(len(ex.ids)) if list(ex.ids[i:i + len(piece)]) == piece)
        instruction = tok.encode("There is an important info hidden inside a lot of irrelevant text. Find it and "
                                 "memorize them. I will quiz you about the important information there.\n", bos=False)
        start = list(ex.ids).index(instruction[0]) + len(instruction)
        before, after = at - start, ex.context_len - len(tok.encode("\n", bos=False)) - (at + len(piece))
        assert before >= 0 and after >= 0 and abs(before / (before + after) - depth) < 0.05
        assert task.score(ex, f" {ex.answer}.") == 1.0 and task.score(ex, " 12") == 0.0
    if chat:
        assert "<|im_start|>" not in ex.prompt  # special tokens are not shown, but they are in the ids
        assert tok.encode("<|im_start|>", bos=False)[0] in ex.ids[:3]
        assert tok.decode(ex.prompt_ids).endswith("assistant\nThe pass key is")


def test_niah_and_mqar_fit_and_grade_in_tokens(tok):
    niah = make_task("niah", {"num_keys": 3, "num_values": 2, "num_queries": 2}).with_tokenizer(tok)
    for ex in niah.examples(0, 0, 3, 500, "validation"):
        assert len(ex.ids) == 501
        assert len(ex.references) == 4  # two queried keys, two values each, every one in a needle of the prompt
        for ref in ex.references:
            assert f" is: {ref}." in ex.prompt
        assert niah.score(ex, ", ".join(ex.references)) == 1.0
        assert niah.score(ex, ex.references[0]) == 0.25
    mqar = make_task("mqar", {"filler_tokens": 50}).with_tokenizer(tok)
    ex = mqar.examples(0, 0, 1, 400, "validation")[0]
    assert mqar.score(ex, ex.references[0]) == 1.0 and ex.prompt.endswith(":")
    with pytest.raises(ConfigError, match="seq_len=40 is too short for data.task='niah'"):
        niah.examples(0, 0, 1, 40, "validation")


def test_examples_are_deterministic_and_mark_the_question(tok):
    task = make_task("passkey", {}).with_tokenizer(tok, chat=True)
    a, b = task.examples(5, 0, 2, 400, "validation"), task.examples(5, 0, 2, 400, "validation")
    assert all(np.array_equal(x.ids, y.ids) for x, y in zip(a, b))
    assert not np.array_equal(a[0].ids, task.examples(6, 0, 1, 400, "validation")[0].ids)
    ex = a[0]
    context, question = tok.decode(ex.prompt_ids[:ex.context_len]), tok.decode(ex.prompt_ids[ex.context_len:])
    assert ex.answer in context and ex.answer not in question
    assert question.startswith("What is the pass key?") and question.endswith("The pass key is")


@pytest.mark.parity
def test_chat_template_renders_as_transformers(tok):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok.file), bos_token="<|im_start|>",
                                                eos_token="<|im_end|>")
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] | trim }}\n"
                "{% else %}<{{ m['role'] }}>{{ m['content'] | tojson }}</{{ m['role'] }}>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Was ist \"grün\"?"}]
    for gen in (False, True):
        ours = render_chat(template, messages, bos_token="<|im_start|>", eos_token="<|im_end|>",
                           add_generation_prompt=gen)
        theirs = fast.apply_chat_template(messages, chat_template=template, tokenize=False,
                                          add_generation_prompt=gen)
        assert ours == theirs
    frame = ChatTemplate.from_tokenizer(tok)
    # this tokenizer's BOS is <|im_start|>: the frame lets the example's BOS id write it (the same ids)
    assert frame.has_bos and frame.head == "user\n" and frame.tail == "<|im_end|>\n<|im_start|>assistant\n"


def test_prose_windows_any_tokenizer(tok):
    task = make_task("prose", {}).with_tokenizer(tok)
    windows = task.examples(0, 0, 3, 256, "validation")
    # BOS as the tokenizer adds it: this tokenizer.json's post-processor adds none
    assert not tok.adds_bos and task.starts_with_bos is False
    assert all(len(w.ids) == 257 and w.ids[0] != tok.bos_id and w.loss_mask.all() for w in windows)
    forced = make_task("prose", {"bos": True}).with_tokenizer(tok).examples(0, 0, 3, 256, "validation")
    assert all(w.ids[0] == tok.bos_id and list(w.ids[1:]) == list(v.ids[:-1]) for w, v in zip(forced, windows))
    assert len({tuple(w.ids) for w in windows}) == 3
    again = task.examples(0, 0, 3, 256, "validation")
    assert all(np.array_equal(a.ids, b.ids) for a, b in zip(windows, again))
    train = set(map(tuple, (w.ids for w in task.examples(0, 0, 8, 256, "train"))))
    assert not train & {tuple(w.ids) for w in windows}
    assert any(word in tok.decode(windows[0].ids) for word in (" the ", " a ", " is "))  # English prose
    with pytest.raises(ConfigError, match="val_fraction=1.0 is invalid"):
        make_task("prose", {"val_fraction": 1.0})


def test_byte_level_tasks_refuse_no_tokenizer_but_corpus_does(tok):
    with pytest.raises(ConfigError, match=r"data\.task='corpus' builds byte-level examples"):
        make_task("corpus", {}).with_tokenizer(tok)
