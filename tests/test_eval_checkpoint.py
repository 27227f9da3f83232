"""Evaluating a checkpoint without training: ``checkpoint:`` (an HF directory or a GGUF file) with its own tokenizer,
several tasks with their macro average, compression ratios, the one-shot (question excluded) protocol and
perplexity by position buckets."""

import json
import math

import numpy as np
import pytest
import yaml

from lcx.cache.base import CacheCapacityError
from lcx.config import CacheConfig, ConfigError
from lcx.data import make_task
from lcx.data.haystack import NOISE, prose_text
from lcx.data.tokenizer import HFTokenizer, resolve_tokenizer
from lcx.eval import one_shot
from lcx.eval.evaluate import retrieval_outputs, window_nll
from lcx.eval.paired import paired_table, read_outputs
from lcx.experiment import load_experiment, run

pytestmark = pytest.mark.parity

VOCAB = 512
CHAT = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def _bpe(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([prose_text()[:60_000], NOISE * 10], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT}))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random 2-layer Llama of the tokenizer's 512 ids, with its tokenizer.json and chat template."""
    from tests.conftest import random_hf_model

    path = tmp_path_factory.mktemp("hf")
    random_hf_model("llama", vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                    pad_token_id=None).save_pretrained(path)
    _bpe(path)
    return path


def _write(tmp_path, body: dict):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"runs_dir": str(tmp_path / "runs"), **body}))
    return path


@pytest.mark.slow
def test_checkpoint_ablate_in_its_own_tokens(hf_dir, tmp_path):
    """An HF checkpoint evaluated without training: its config is the model section (keys under model: override),
    its tokenizer builds the prompts, several tasks get a macro average, compressions and protocols are rows."""
    path = _write(tmp_path, {
        "name": "ckpt", "checkpoint": str(hf_dir), "stages": ["ablate"],
        "model": {"attention": {"impl": "xla"}, "max_position_embeddings": 384},
        "eval": {"tasks": ["niah_single_1", "passkey"], "lengths": [320], "samples": 1, "batch_size": 1},
        "ablate": {"policies": ["full", {"policy": "snapkv", "window": 8}], "compressions": [0.5],
                   "protocols": ["one_shot", "streaming"], "interval": 16, "prefill_chunk": 32}})
    cfg = load_experiment(path)
    assert (cfg.model.n_layers, cfg.model.vocab_size, cfg.model.d_model) == (2, VOCAB, 64)
    assert cfg.model.attention.impl == "xla" and cfg.model.max_position_embeddings == 384
    run(cfg, progress=False)
    out = tmp_path / "runs" / "ckpt" / "ablate"
    rows = list(__import__("csv").DictReader(open(out / "results.csv")))
    assert {(r["setting"], r["task"]) for r in rows} == {
        (s, t) for s in ("full", "snapkv @c=0.5 window=8 one-shot", "snapkv @c=0.5 window=8")
        for t in ("niah_single_1", "passkey")}
    assert {r["budget"] for r in rows if r["policy"] == "snapkv"} == {"160"}  # half of the 320-token cells
    md = (out / "results.md").read_text()
    assert "macro average" in md and "niah_single_1" in md and str(hf_dir) in md
    assert (out / "accuracy_vs_compression.png").is_file()
    # every prompt's generation and grade, one line each: the cell's value is their mean
    generations = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert sorted((g["setting"], g["task"], g["sample"]) for g in generations) == sorted(
        (r["setting"], r["task"], 0) for r in rows)
    for g in generations:
        cell = next(r for r in rows if (r["setting"], r["task"]) == (g["setting"], g["task"]))
        assert g["grade"] == float(cell["value"]) and g["length"] == 320 and g["depth"] is None
        assert isinstance(g["output"], str) and g["answer"]
    # which lcx.eval.paired compares prompt by prompt with the full cache
    table = paired_table(read_outputs([out / "outputs.jsonl"]), "full")
    assert {line.split(" | ")[0] for line in table.splitlines()[2:]} == {
        "| snapkv @c=0.5 window=8 one-shot", "| snapkv @c=0.5 window=8"}


@pytest.mark.slow
def test_one_shot_protocol_equals_prefill_when_nothing_is_evicted(hf_dir, monkeypatch):
    """Context prefilled, question teacher-forced: the next-token logits of prefilling the whole prompt, for the full
    cache and for a compressing policy whose budget holds every token; a budget that evicts changes them. The
    evaluation's one-shot path runs end to end, prefilling a haystack that two questions share once."""
    from lcx.engine import Generator
    from lcx.hf import load_hf

    config, params = load_hf(hf_dir)
    tok = resolve_tokenizer("auto", init_from=hf_dir, vocab_size=VOCAB)
    task = make_task("niah_single_1", {}).with_tokenizer(tok, chat=True)
    examples = task.examples(0, 0, 1, 320, "validation")
    prompts = [ex.prompt_ids for ex in examples]
    contexts = [ex.prompt_ids[:ex.context_len] for ex in examples]
    questions = np.stack([ex.prompt_ids[ex.context_len:] for ex in examples])

    def next_logits(cache, whole: bool, capacity=None):
        gen = Generator(config, params, max_new_tokens=len(questions[0]) + 4, cache=cache, capacity=capacity)
        if whole:
            return np.asarray(gen.prefill(prompts).logits)
        state, _ = gen.score(gen.prefill(contexts), questions)
        return np.asarray(state.logits)

    # the full cache: one capacity and prefill chunk for the whole prompt and the context, so one compiled prefill
    full, room = CacheConfig(prefill_chunk=64), len(prompts[0]) + len(questions[0]) + 4
    reference = next_logits(full, whole=True, capacity=room)
    np.testing.assert_allclose(next_logits(full, whole=False, capacity=room), reference, atol=2e-4, rtol=2e-4)
    roomy = CacheConfig(policy="snapkv", budget=320, window=8, interval=512, prefill_chunk=512)
    np.testing.assert_allclose(next_logits(roomy, whole=False), reference, atol=2e-4, rtol=2e-4)
    small = CacheConfig(policy="snapkv", budget=24, window=8, interval=512, prefill_chunk=512)
    assert np.abs(next_logits(small, whole=False) - reference).max() > 1e-2
    # two questions about one haystack: its context is prefilled (and compressed: KVzip, its repeat prompt in the
    # chat frame) once and forked, and the answers are those of prefilling it for each question
    shared = make_task("niah_single_1", {"questions_per_haystack": 2}).with_tokenizer(tok, chat=True)
    rec = shared.frame.reconstruction()
    # the BOS and chat header are not repeated; the reply opens after the instruction (specials decode to nothing)
    assert contexts[0][0] == tok.bos_id and tok.decode(contexts[0][1:rec.skip]) == "user\n"
    assert tok.decode(np.asarray(rec.suffix)) == "\nassistant\n" and len(rec.suffix) > 3
    zipped = CacheConfig(policy="kvzip", budget=24, interval=512, prefill_chunk=512, chunk=128)
    counts, alone = {}, {}
    _, outputs = retrieval_outputs(config, params, shared, length=320, depth=None, samples=2, batch_size=2, seed=0,
                                   cache=zipped, max_new_tokens=3, protocol="one_shot", counts=counts)
    assert len(outputs) == 2 and all(isinstance(o, str) for o in outputs)
    assert 0 < counts["prefilled_tokens"] < counts["prompt_tokens"]
    assert counts["held_kv_bytes"] == counts["kv_bytes"] > 0  # a contiguous cache holds its arrays after compressing
    monkeypatch.setattr(one_shot, "_runs", lambda prompts: [(i, 1) for i in range(len(prompts))])  # no sharing
    assert retrieval_outputs(config, params, shared, length=320, depth=None, samples=2, batch_size=2, seed=0,
                             cache=zipped, max_new_tokens=3, protocol="one_shot", counts=alone)[1] == outputs
    assert alone["prefilled_tokens"] == alone["prompt_tokens"] == counts["prompt_tokens"]
    # in pages: the same answers; after the compression the rows hold the kept slots' pages, not the prompt's
    paged, in_pages = {}, CacheConfig(**zipped.to_dict() | {"layout": "paged", "page_size": 16})
    assert retrieval_outputs(config, params, shared, length=320, depth=None, samples=2, batch_size=2, seed=0,
                             cache=in_pages, max_new_tokens=3, protocol="one_shot", counts=paged)[1] == outputs
    assert 0 < paged["held_kv_bytes"] < paged["kv_bytes"] / 4
    # a cache planned for a short generation refuses a longer continuation instead of dropping its writes
    short = Generator(config, params, max_new_tokens=4, cache=roomy)
    with pytest.raises(CacheCapacityError, match="planned for"):
        short.score(short.prefill(contexts), questions)


@pytest.mark.slow
def test_perplexity_buckets_split_one_pass(hf_dir, tmp_path):
    """Bucket rows are the perplexity of their positions, from one pass: their token-weighted log-mean is the
    window's."""
    tok = HFTokenizer(hf_dir)
    from lcx.hf import load_hf

    config, params = load_hf(hf_dir)
    task = make_task("prose", {}).with_tokenizer(tok)
    per_token = window_nll(config, params, task, length=128, samples=2, batch_size=2, seed=1234,
                           cache=CacheConfig(), prefix=16, per_token=True)
    whole = window_nll(config, params, task, length=128, samples=2, batch_size=2, seed=1234, cache=CacheConfig(),
                       prefix=16)  # the eval's default seed: the windows the experiment below scores
    assert per_token.shape == (2, 112)
    np.testing.assert_allclose(per_token.mean(axis=1), whole, rtol=1e-5)
    path = _write(tmp_path, {
        "name": "ppl", "checkpoint": str(hf_dir), "stages": ["ablate"], "model": {"attention": {"impl": "xla"}},
        "eval": {"task": "prose", "lengths": [128], "ppl_prefix": 16, "ppl_buckets": [32, 64, 128], "samples": 2,
                 "batch_size": 2},
        "ablate": {"policies": ["full"]}})
    run(load_experiment(path), progress=False)
    rows = list(__import__("csv").DictReader(open(tmp_path / "runs" / "ppl" / "ablate" / "results.csv")))
    assert [int(r["length"]) for r in rows] == [32, 64, 128]
    logs = [math.log(float(r["value"])) for r in rows]
    weights = np.asarray([16, 32, 64]) / 112
    assert abs(float(np.dot(weights, logs)) - float(np.mean(whole))) < 1e-4


@pytest.mark.slow
def test_generate_and_checkpoint_from_a_gguf_file(hf_dir, tmp_path, capsys, monkeypatch):
    """``checkpoint: X.gguf`` and ``lcx generate --model X.gguf``: the config, weights and tokenizer come from the
    file. Its evaluation with needle ``depths`` and perplexity on a folder of documents (``eval.perplexity: {task:
    documents}``) feeds the model prompts in the file's tokens: the passkey template, and pieces of the documents
    (a depth used to rebuild the task in lcx's byte ids; the documents config was refused at load)."""
    pytest.importorskip("gguf")
    import transformers

    from lcx.cli import main
    from lcx.engine import Generator
    from lcx.checkpoints.sources import load_source, source_kind
    from tests.test_gguf import write_gguf

    fed = []  # what every prefill of the evaluation fed the model
    prefill = Generator.prefill
    monkeypatch.setattr(Generator, "prefill", lambda self, ids, *a, **k: fed.append(ids) or prefill(self, ids, *a, **k))
    docs = tmp_path / "docs"
    docs.mkdir()
    text = prose_text()
    for i in range(4):
        (docs / f"{i}.txt").write_text(text[30_000 * i: 30_000 * i + 4_000])

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    gguf_path = tmp_path / "tiny.gguf"
    from tokenizers import Tokenizer

    write_gguf(gguf_path, model, "llama", tokenizer=Tokenizer.from_file(str(hf_dir / "tokenizer.json")))
    assert source_kind(gguf_path) == "gguf"
    config, params, info = load_source(gguf_path)
    assert info.fingerprint.startswith("sha256:") and config.n_layers == 2
    path = _write(tmp_path, {"name": "g", "checkpoint": str(gguf_path), "stages": ["eval"],
                             "model": {"attention": {"impl": "xla"}},
                             "eval": {"task": "passkey", "lengths": [160], "depths": [0.25, 0.75], "samples": 2,
                                      "batch_size": 2, "perplexity": {"task": "documents", "samples": 2,
                                                                      "batch_size": 2, "params": {"path": str(docs)}}}})
    cfg = load_experiment(path)
    assert cfg.model.vocab_size == VOCAB
    run(cfg, progress=False)
    out = tmp_path / "runs" / "g" / "eval"
    assert "passkey" in (out / "results.md").read_text()
    rows = list(__import__("csv").DictReader(open(out / "results.csv")))
    assert [(r["metric"], r["depth"]) for r in rows] == [("accuracy", "0.25"), ("accuracy", "0.75"),
                                                        ("perplexity", "")]
    assert 1 < float(rows[2]["value"]) < 4 * VOCAB
    tok = HFTokenizer(gguf_path)
    prompts = [tok.decode(ids) for batch in fed for ids in batch]
    passkeys = [p for p in prompts if "pass key" in p]
    assert len(passkeys) == 4 and all(p.endswith("What is the pass key? The pass key is") for p in passkeys)
    assert sorted({json.loads(g)["answer"] for g in (out / "outputs.jsonl").read_text().splitlines()}) == sorted(
        {p.split("The pass key is ")[1].split(".")[0] for p in passkeys})  # each graded answer was in its prompt
    windows = [p for p in prompts if "pass key" not in p]  # the documents' windows, up to the scored half
    assert len(windows) == 2 and all(w[10:60] in "".join(f.read_text() for f in sorted(docs.iterdir()))
                                     for w in windows)
    assert main(["generate", "--model", str(gguf_path), "--prompt", "The grass is", "--max-new-tokens", "4"]) == 0
    with pytest.raises(ConfigError, match="checkpoint='.*nowhere.gguf' does not exist"):
        load_experiment(_write(tmp_path, {"name": "x", "checkpoint": str(tmp_path / "nowhere.gguf"),
                                          "stages": ["eval"], "eval": {"task": "passkey"}}))
