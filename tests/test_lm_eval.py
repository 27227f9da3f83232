"""lm-evaluation-harness (pinned 0.4.13, the test extra) scores a multiple-choice task through ``lcx serve`` as a user
runs it: ``lm_eval --model local-completions`` in its own process against a server on 127.0.0.1, its remote tokenizer
on ``/tokenizer_info`` + ``/tokenize``, its log-likelihood requests as ``echo`` + ``logprobs`` on token ids. Every
choice's log-likelihood equals ``lcx.LM.score``'s on the same tokens, and the accuracy is the one those give."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import lcx
from lcx.service.config import ServeConfig
from tests.test_service import Running, _free_port
from tests.tiny_chat_model import write_model

pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")

DOCS = [{"question": f"Question {i}: which way do we go?", "choices": [" here", " there and back", " again"],
         "answer": i % 3} for i in range(3)]
TASK = """task: lcx_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.mark.slow
def test_lm_eval_multiple_choice_through_lcx_serve_equals_lm_score(tmp_path):
    model_dir = write_model(tmp_path / "tiny")
    lm = lcx.load(model_dir)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps(d) for d in DOCS))
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "tiny_mc.yaml").write_text(TASK.format(docs=docs))
    config = ServeConfig(model=str(model_dir), port=_free_port(), max_num_seqs=2, max_model_len=256, page_size=8,
                         segment=4, prefill_chunk=64, served_model_name="tiny")
    running = Running(config, lm)
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
                        "OPENAI_API_KEY": "none"}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"base_url={running.url}/completions,model=tiny,num_concurrent=1,max_retries=1",
             "--tasks", "lcx_tiny_mc", "--include_path", str(tmp_path / "task"), "--output_path",
             str(tmp_path / "out"), "--log_samples"], env=env, capture_output=True, text=True, timeout=400)
    finally:
        running.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Using remote tokenizer backend" in run.stderr + run.stdout  # it found /tokenizer_info and /tokenize
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_*.jsonl") for line in f.open()]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(DOCS)))
    correct = []
    for s in samples:
        doc = DOCS[s["doc_id"]]
        ctx = lm.tokenizer.encode(doc["question"], bos=False)
        want = []
        for choice in doc["choices"]:  # lm-eval's pair: the context, then " " + the choice (its target delimiter)
            whole = lm.tokenizer.encode(doc["question"] + " " + choice, bos=False)
            assert whole[:len(ctx)] == ctx
            want.append(float(np.sum(lm.score(doc["question"] + " " + choice)[len(ctx) - 1:])))
        got = [float(r[0]) for r in s["filtered_resps"]]
        np.testing.assert_allclose(got, want, atol=1e-4)
        correct.append(int(np.argmax(want)) == doc["answer"])
        assert float(s["acc"]) == float(correct[-1])
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert results["results"]["lcx_tiny_mc"]["acc,none"] == pytest.approx(np.mean(correct))
