"""lm-evaluation-harness through ``lcx serve`` against lm-eval's own ``hf`` model, on the same weights and items.

A small multiple-choice task (``ITEMS``: general-knowledge questions, four choices each, written here so no dataset
hub is needed) runs twice with lm-eval (the installed version; the test extra pins 0.4.13):

1. ``--model local-completions`` against ``lcx serve MODEL`` (a subprocess on 127.0.0.1; lm-eval's remote tokenizer
   on ``/tokenizer_info`` + ``/tokenize``; log-likelihoods from ``echo`` + ``logprobs``), and
2. ``--model hf`` (transformers, float32 on the CPU) on the same HF directory.

Printed: accuracy of each, the largest per-choice log-likelihood difference, how many items pick the same choice.

    python experiments/bench/lm_eval_parity.py runs/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ITEMS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Water freezes at a temperature of", ["50 degrees Celsius", "10 degrees Celsius", "0 degrees Celsius",
                                           "100 degrees Celsius"], 2),
    ("The author of Romeo and Juliet is", ["Charles Dickens", "Jane Austen", "Mark Twain", "William Shakespeare"], 3),
    ("The chemical symbol for gold is", ["Au", "Ag", "Fe", "Pb"], 0),
    ("A week has", ["five days", "seven days", "nine days", "ten days"], 1),
    ("The opposite of hot is", ["warm", "bright", "cold", "loud"], 2),
    ("Bees make", ["milk", "silk", "wool", "honey"], 3),
    ("The sun rises in the", ["east", "west", "north", "south"], 0),
    ("The number after nine is", ["eight", "ten", "eleven", "seven"], 1),
    ("Ice is frozen", ["air", "sand", "water", "oil"], 2),
    ("The color of a clear daytime sky is", ["green", "red", "yellow", "blue"], 3),
    ("A baby cat is called a", ["kitten", "puppy", "calf", "foal"], 0),
    ("The Pacific is an", ["island", "ocean", "desert", "mountain"], 1),
    ("People breathe in", ["nitrogen only", "helium", "oxygen", "carbon monoxide"], 2),
    ("The capital of Japan is", ["Beijing", "Seoul", "Bangkok", "Tokyo"], 3),
    ("Two plus two equals", ["four", "five", "three", "six"], 0),
    ("The Moon orbits the", ["Sun directly", "Earth", "Mars", "Jupiter"], 1),
    ("Spiders have", ["six legs", "four legs", "eight legs", "ten legs"], 2),
    ("The tallest animal is the", ["elephant", "horse", "lion", "giraffe"], 3),
]
TASK = """task: lcx_parity_mc
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
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": "none",
           "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lm_eval(args: list[str], out: Path, env: dict) -> list[dict]:
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "lm_eval", *args, "--tasks", "lcx_parity_mc", "--include_path",
                          str(out.parent / "task"), "--output_path", str(out), "--log_samples"], env=env,
                         capture_output=True, text=True, timeout=3600)
    if run.returncode:
        raise SystemExit(f"lm_eval failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    print(f"  lm_eval {args[1]}: {time.monotonic() - t0:.0f} s", flush=True)
    samples = [json.loads(line) for f in out.rglob("samples_*.jsonl") for line in f.open()]
    return sorted(samples, key=lambda s: s["doc_id"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="an HF directory (lcx serve and transformers both load it)")
    p.add_argument("--out", default="runs/bench/lm_eval_parity", help="work directory (results.json in it)")
    args = p.parse_args()
    work = Path(args.out).resolve()
    (work / "task").mkdir(parents=True, exist_ok=True)
    docs = work / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"question": q, "choices": [" " + c for c in cs], "answer": a})
                              for q, cs, a in ITEMS))
    (work / "task" / "parity.yaml").write_text(TASK.format(docs=docs))
    env = os.environ | OFFLINE | {"HF_HOME": str(work / "hf")}
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "lcx", "serve", args.model, "--port", str(port),
                               "--max-model-len", "512", "--served-model-name", "m"],
                              stdout=open(work / "serve.log", "w"), stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"lcx serve did not start: see {work / 'serve.log'}")
            time.sleep(1)
        served = lm_eval(["--model", "local-completions", "--model_args",
                          f"base_url=http://127.0.0.1:{port}/v1/completions,model=m,num_concurrent=1,max_retries=1"],
                         work / "lcx", env)
    finally:
        server.terminate()
        server.wait(30)
    hf = lm_eval(["--model", "hf", "--model_args", f"pretrained={Path(args.model).resolve()},dtype=float32",
                  "--device", "cpu", "--batch_size", "1"], work / "hf_model", env)
    diffs, same, acc = [], 0, {"lcx serve": 0, "hf": 0}
    for a, b in zip(served, hf):
        la = [float(r[0]) for r in a["filtered_resps"]]
        lb = [float(r[0]) for r in b["filtered_resps"]]
        diffs += [abs(x - y) for x, y in zip(la, lb)]
        same += la.index(max(la)) == lb.index(max(lb))
        acc["lcx serve"] += float(a["acc"])
        acc["hf"] += float(b["acc"])
    n = len(served)
    result = {"items": n, "choices": len(diffs), "max_abs_loglikelihood_diff": max(diffs),
              "mean_abs_loglikelihood_diff": sum(diffs) / len(diffs), "same_choice": same,
              "accuracy": {k: v / n for k, v in acc.items()}}
    (work / "results.json").write_text(json.dumps(result, indent=2))
    print("| model | accuracy |\n|---|---|")
    for k, v in result["accuracy"].items():
        print(f"| lm-eval {'local-completions -> lcx serve' if k == 'lcx serve' else 'hf (transformers)'} | "
              f"{v:.0%} ({int(acc[k])}/{n}) |")
    print(f"per-choice log-likelihood: max |diff| {result['max_abs_loglikelihood_diff']:.2e}, mean "
          f"{result['mean_abs_loglikelihood_diff']:.2e} over {len(diffs)} choices; same pick on {same}/{n} items")


if __name__ == "__main__":
    main()
