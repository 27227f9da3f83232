"""Eviction buys throughput at equal KV memory: ``lcx serve`` under one ``--kv-memory`` with the full cache and with
evicting / quantized caches, on long prompts - requests/s, tokens/s, TTFT - and the accuracy each keeps, scored by
lm-evaluation-harness through the server on a RULER-style task, paired against the full cache item by item.

Prompts: RULER's ``niah_single_2`` (lcx.data.ruler: a number hidden in prose, asked after it) at ``--seq-len``
(4096) tokens in the model's chat frame, rendered to text with the special tokens (it re-encodes to the same ids).
The KV memory is ``--kv-rows`` (4) full rows of ``--seq-len`` + ``--out-tokens`` tokens (``lcx.plan.serving``'s
bytes), the same for every policy:

- ``full``: the float cache; ``int4``: the full policy with 4-bit pages (``--kv-dtype int4``);
- ``streaming``: sinks + the newest tokens, budget ``(1 - --compression) x seq-len``, evicting as it reads
  (interval 256: prefill chunks of 256);
- ``snapkv``, ``tova``, ``kvzip``: one-shot - the whole prompt read, compressed once to that budget (``interval`` =
  max-model-len - budget), then the row reserves only what it can still fill (``lcx.engine.prompt_end``); KVzip's
  reconstruction passes run in the server after the prompt.

Per policy one server (127.0.0.1, a free port), then:

1. accuracy: ``lm_eval --model local-completions`` (the installed lm-eval; the test extra pins 0.4.13) on
   ``--items`` prompts, ``num_concurrent`` = ``--max-num-seqs``, greedy, 32 new tokens, RULER's string match
   (``utils.py`` beside the task) - it also compiles the server's programs for these shapes;
2. load: ``--requests`` (8) streamed ``/v1/completions`` of the same prompts' token ids, all sent at once,
   ``--out-tokens`` (128) each with ``ignore_eos``: wall time, requests/s, output tokens/s, TTFT p50 / p90, the
   most requests running at once and the most KV pages in use (``/metrics``), and the compiles during it (the
   server's ``JAX_LOG_COMPILES`` log; the lm-eval run before compiled most shapes - an untimed warm-up load would
   double the cost: a 4k-token prompt takes ~25 s to prefill on a 2-core CPU).

Accuracy intervals: each policy's score minus the full cache's on the same items, a paired bootstrap (10,000
resamples, seed 0) 95% interval. Results: ``--out`` (runs/bench/equal_memory)/results.json and a Markdown table.

    python experiments/bench/equal_memory.py runs/models/SmolLM2-135M-Instruct
    python experiments/bench/equal_memory.py MODEL --policies full,streaming --items 8 --requests 4  # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

import serve  # experiments/bench/serve.py: launching, readiness, /metrics parsing

TASK = """task: lcx_equal_memory_niah
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["<|im_end|>", "\\n\\n"]
  max_gen_toks: 32
  do_sample: false
  temperature: 0.0
process_results: !function utils.process_results
metric_list:
  - metric: score
    aggregation: mean
    higher_is_better: true
"""
UTILS = '''def process_results(doc, results):
    """RULER's string_match_all: the share of the references found in the output, case-insensitive."""
    out = results[0].lower()
    return {"score": sum(r.lower() in out for r in doc["references"]) / len(doc["references"])}
'''
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": "none",
           "TOKENIZERS_PARALLELISM": "false"}
POLICIES = ("full", "streaming", "snapkv", "tova", "kvzip", "int4")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def policy_flags(name: str, budget: int, max_len: int) -> list[str]:
    """``lcx serve`` flags of one row of the table."""
    if name == "full":
        return []
    if name == "int4":
        return ["--kv-dtype", "int4", "--page-size", "64"]  # a page holds whole key groups (kv_group 64)
    interval = 256 if name == "streaming" else max_len - budget  # one-shot: nothing evicted after the prompt
    return ["--cache-policy", name, "--cache-param", f"budget={budget}", "--cache-param", f"interval={interval}"]


def build_items(model: Path, seq_len: int, count: int, work: Path) -> list[dict]:
    """The task's prompts as text (special tokens written out) and ids; checks that the text re-encodes to them."""
    from tokenizers import Tokenizer

    import lcx
    from lcx.data.task import make_task
    from lcx.lm import encode_prompt

    lm = lcx.load(str(model))
    raw = Tokenizer.from_file(str(model / "tokenizer.json"))
    task = make_task("niah_single_2", {}).with_tokenizer(lm.tokenizer, chat=True)
    items = []
    for i, e in enumerate(task.examples(0, 0, count, seq_len, "validation")):
        ids = e.ids[:e.prompt_len].tolist()
        text = raw.decode(ids, skip_special_tokens=False)
        if encode_prompt(lm.tokenizer, lm.config, text) != ids:
            raise SystemExit(f"item {i}: its text does not re-encode to its ids")
        items.append({"prompt": text, "ids": ids, "answer": e.answer, "references": list(e.references)})
    (work / "docs.jsonl").write_text("\n".join(json.dumps({k: it[k] for k in ("prompt", "answer", "references")})
                                               for it in items))
    return items


def kv_memory(model: Path, rows: int, max_len: int) -> int:
    """Bytes of ``rows`` full float rows of ``max_len`` tokens (the planner's pages)."""
    import lcx
    from lcx.plan.serving import serve_plan

    lm = lcx.load(str(model))
    plan = serve_plan(lm.config, lcx.CacheConfig(layout="paged"), max_num_seqs=rows, max_model_len=max_len)
    return plan.pages * plan.page_bytes


def lm_eval(base: str, concurrency: int, work: Path, out: Path, env: dict) -> tuple[list[float], float]:
    """Per-item scores (in item order) and lm-eval's wall time."""
    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         f"base_url={base}/v1/completions,model=m,num_concurrent={concurrency},max_retries=1,tokenizer_backend=none,"
         "timeout=3600", "--tasks", "lcx_equal_memory_niah", "--include_path", str(work / "task"),
         "--output_path", str(out), "--log_samples"], env=env, capture_output=True, text=True, timeout=7200)
    if run.returncode:
        raise RuntimeError(f"lm_eval failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    samples = [json.loads(line) for f in out.rglob("samples_*.jsonl") for line in f.open()]
    return [float(s["score"]) for s in sorted(samples, key=lambda s: s["doc_id"])], time.monotonic() - t0


async def one_request(client, base: str, ids: list[int], out_tokens: int, t0: float) -> dict:
    body = {"model": "m", "prompt": ids, "max_tokens": out_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    first, tokens, error = None, 0, None
    try:
        async with client.stream("POST", base + "/v1/completions", json=body, timeout=3600) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"])[:200]
                if chunk.get("choices") and first is None:
                    first = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return {"ttft_s": first, "end_s": time.perf_counter() - t0, "tokens": tokens, "error": error}


async def load(base: str, proc, items: list[dict], args, out_tokens: int) -> dict:
    async with httpx.AsyncClient() as client:
        monitor = serve.Monitor(client, base, proc.pid, 0.5)
        stop = asyncio.Event()
        watch = asyncio.create_task(monitor.run(stop))
        t0 = time.perf_counter()
        prompts = [items[i % len(items)]["ids"] for i in range(args.requests)]
        records = await asyncio.gather(*(one_request(client, base, p, out_tokens, t0) for p in prompts))
        wall = time.perf_counter() - t0
        stop.set()
        await watch
    ok = [r for r in records if not r["error"]]
    ttft = [r["ttft_s"] for r in ok]
    mx = monitor.metrics_max
    return {"requests": len(records), "errors": len(records) - len(ok), "wall_s": wall,
            "requests_per_s": len(ok) / wall, "output_tok_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_s": serve.percentile(ttft, 50), "ttft_p90_s": serve.percentile(ttft, 90),
            "running_max": mx.get("lcx_requests_running"), "kv_pages_used_max": mx.get("lcx_kv_pages_used"),
            "kv_pages_total": mx.get("lcx_kv_pages_total"), "kv_bytes_used_max": mx.get("lcx_kv_bytes_used"),
            "first_errors": [r["error"] for r in records if r["error"]][:3]}


def compiles(log_path: Path, since: int) -> int:
    text = log_path.read_text(errors="replace")[since:]
    return text.count("Finished XLA compilation") or text.count("Compiling ")


def bench_policy(name: str, args, items: list[dict], work: Path, memory: int, budget: int) -> dict:
    port = serve.free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = work / f"serve-{name}.log"
    cmd = [sys.executable, "-m", "lcx", "serve", str(args.model), "--port", str(port), "--served-model-name", "m",
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_len), "--kv-memory",
           str(memory), *policy_flags(name, budget, args.max_len)]
    log(f"{name}: {' '.join(cmd[3:])}")
    proc = serve.start_server(cmd, {"JAX_LOG_COMPILES": "1", **OFFLINE}, log_path)
    try:
        asyncio.run(_ready(base, proc, log_path))
        env = os.environ | OFFLINE | {"HF_HOME": str(work / "hf")}
        scores, eval_s = lm_eval(base, args.max_num_seqs, work, work / f"lm_eval-{name}", env)
        log(f"{name}: accuracy {np.mean(scores):.0%} over {len(scores)} items ({eval_s:.0f} s)")
        mark = len(log_path.read_text(errors="replace"))
        result = asyncio.run(load(base, proc, items, args, args.out_tokens))
        result["compiles_during_load"] = compiles(log_path, mark)
        log(f"{name}: {result['requests_per_s']:.3f} req/s, {result['output_tok_s']:.2f} tok/s, TTFT p50 "
            f"{result['ttft_p50_s']:.1f} s, running max {result['running_max']}, errors {result['errors']}")
    finally:
        serve.stop_server(proc, 60)
    return {"policy": name, "flags": policy_flags(name, budget, args.max_len), "scores": scores,
            "accuracy": float(np.mean(scores)), "lm_eval_s": eval_s, **result}


async def _ready(base: str, proc, log_path: Path) -> None:
    async with httpx.AsyncClient() as client:
        await serve.wait_ready(client, base, proc, log_path, 900)


def paired_interval(a: list[float], b: list[float], resamples: int = 10_000) -> tuple[float, float, float]:
    """mean(a - b) and its paired bootstrap 95% interval."""
    d = np.asarray(a) - np.asarray(b)
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, d.size, (resamples, d.size))].mean(axis=1)
    return float(d.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def table(results: list[dict]) -> str:
    full = next((r for r in results if r["policy"] == "full"), None)
    lines = ["| policy | serve flags | req/s | out tok/s | vs full | TTFT p50 / p90 s | rows at once | KV pages max / "
             "pool | accuracy | minus full (95% CI) | compiles in load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['output_tok_s'] / full['output_tok_s']:.2f}x" if full else "-"
        diff = "-"
        if full and r is not full:
            m, lo, hi = paired_interval(r["scores"], full["scores"])
            diff = f"{m:+.0%} ({lo:+.0%} .. {hi:+.0%})"
        n = len(r["scores"])
        lines.append(f"| {r['policy']} | `{' '.join(r['flags']) or '(none)'}` | {r['requests_per_s']:.3f} | "
                     f"{r['output_tok_s']:.2f} | {ratio} | {r['ttft_p50_s']:.1f} / {r['ttft_p90_s']:.1f} | "
                     f"{r['running_max']:.0f} | {r['kv_pages_used_max']:.0f} / {r['kv_pages_total']:.0f} | "
                     f"{r['accuracy']:.0%} ({round(r['accuracy'] * n)}/{n}) | {diff} | {r['compiles_during_load']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="an HF directory (lcx serve loads it; its tokenizer.json renders prompts)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--seq-len", type=int, default=4096, help="prompt tokens (the task's examples)")
    p.add_argument("--out-tokens", type=int, default=128, help="new tokens per load request")
    p.add_argument("--items", type=int, default=16, help="lm-eval items")
    p.add_argument("--requests", type=int, default=8, help="load requests, all sent at once")
    p.add_argument("--kv-rows", type=int, default=4, help="the KV memory, in full rows of seq-len + out-tokens")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--compression", type=float, default=0.75, help="share of the prompt an evicting policy drops")
    p.add_argument("--out", type=Path, default=Path("runs/bench/equal_memory"))
    args = p.parse_args(argv)
    names = args.policies.split(",")
    if unknown := [n for n in names if n not in POLICIES]:
        raise SystemExit(f"--policies: unknown {unknown} (allowed: {', '.join(POLICIES)})")
    work = args.out.resolve()
    (work / "task").mkdir(parents=True, exist_ok=True)
    args.max_len = -(-(args.seq_len + args.out_tokens + 8) // 16) * 16
    budget = round((1 - args.compression) * args.seq_len)
    items = build_items(args.model, args.seq_len, max(args.items, 1), work)
    (work / "task" / "task.yaml").write_text(TASK.format(docs=work / "docs.jsonl"))
    (work / "task" / "utils.py").write_text(UTILS)
    memory = kv_memory(args.model, args.kv_rows, args.max_len)
    log(f"{len(items)} prompts of {len(items[0]['ids'])} tokens; KV memory {memory:,} bytes ({args.kv_rows} full "
        f"rows of {args.max_len}); budget {budget}")
    results_path = work / "results.json"
    done = {r["policy"]: r for r in json.loads(results_path.read_text())["results"]} if results_path.exists() else {}
    for name in names:
        if name in done:
            log(f"{name}: kept from {results_path}")
            continue
        done[name] = bench_policy(name, args, items, work, memory, budget)
        results_path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "kv_memory": memory,
                                            "budget": budget, "results": list(done.values())}, indent=2))
    md = table([done[n] for n in names])
    (work / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
