"""Serving benchmark: ``lcx serve`` against ``transformers serve`` over the OpenAI chat API, on one local model.

For each server in ``--servers`` (``lcx,transformers``) the script starts the server as a subprocess on 127.0.0.1
(a free port), waits for ``GET /health`` to answer 200, sends ``--warmup`` requests (not measured), runs the
workload, scrapes ``/metrics`` while it runs, and stops the server (SIGTERM to its process group, then SIGKILL).

Workload (same for every server, deterministic): ``--requests`` (64) chats, each a shared system prompt of
``--system-tokens`` (1000) tokens of English prose (``pydoc_data.topics``) and a distinct short question;
``max_tokens`` drawn in ``--max-tokens-range`` (32,128) with ``--seed``; temperature 0; ``stream=True`` with
``stream_options={"include_usage": true}``; ``--in-flight`` (8) requests at once. The ``model`` field is the first id
``GET /v1/models`` lists, else the model path.

Measured per request: time to first content token (TTFT), the gaps between streamed content chunks, the tokens
generated (``usage.completion_tokens`` when the server streams usage, else the generated text re-tokenized with the
model's tokenizer: the ``count`` column says which) and the text. Overall: generated tokens per second of wall time,
TTFT / chunk-gap / time-per-output-token (TPOT, per request ``(t_last - t_first) / (tokens - 1)``) p50 and p99,
tokens per chunk (above 1: the server sends several tokens per chunk, so chunk gaps are not inter-token latencies;
use TPOT), peak KV bytes, peak server RSS, and how many greedy texts agree between the servers (special tokens such
as ``<|im_end|>`` stripped before comparing).

Peak KV: lcx from ``/metrics`` (max of ``lcx_kv_bytes_used`` if present, else max ``lcx_kv_pages_used`` times a
page-bytes metric if one is exported; every ``lcx_*`` metric's max is kept in the JSON). transformers exposes no
metrics; the launcher below samples its paged cache's used blocks (``kv_used_bytes_peak`` in the JSON; the cache is
preallocated, ``kv_preallocated_bytes``).

Server commands (PORT is a free port; ``--lcx-args`` / ``--tf-args`` append arguments)::

    lcx serve MODEL --host 127.0.0.1 --port PORT --max-num-seqs 8 --max-model-len 4096 --page-size 16
    transformers serve --continuous-batching --device cpu --dtype float32 --host 127.0.0.1 --port PORT \\
        --force-model MODEL --model-timeout -1 --log-level warning

transformers 5.2.0 continuous-batching *streaming* is broken, three ways: ``GenerationOutput.generated_tokens`` is
the live list the generation thread keeps appending to (a placeholder ``-1`` included), so the server streams
repeated or ``-1`` tokens and dies with ``StreamInput must be either an integer or a list of integers``; results of
other requests are re-queued behind newer ones, so a stream can see its tokens out of order; and a stream stops as
soon as its request is neither waiting nor active (``request_is_cancelled``), which drops the tail of a request that
finished before its reader caught up (no ``finish_reason``). Unless ``--tf-no-patch``, the transformers server is
started through this file (``python serve.py --tf-launcher serve ...``, same arguments), which fixes the three (a copy
of the token list per result; a per-request demultiplexer instead of the re-queueing; a stream ends on its
FINISHED/FAILED result or an explicit cancel) and samples the cache's used blocks; the model, the attention and the
scheduling are untouched. ``--tf-no-cb`` uses the server's other path (one ``generate`` thread per request, no
batching; it streams words, several tokens per chunk).

    python experiments/bench/serve.py                                      # both servers, 64 requests
    python experiments/bench/serve.py --servers transformers --requests 4 --in-flight 2 \\
        --system-tokens 200 --max-tokens-range 8,16                        # quick check
    python experiments/bench/serve.py --servers lcx --lcx-args "--dtype bfloat16"

Output: a Markdown table on stdout and ``--out`` (runs/bench/serve.json): arguments, exact commands, workload,
per-server summaries and per-request records, and the text comparison. Server logs go next to it
(``serve_<server>.log``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "runs/models/SmolLM2-135M-Instruct"
SPECIAL_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "TOKENIZERS_PARALLELISM": "false"}


# --------------------------------------------------------------------------------------------------------------
# transformers launcher (run in the server subprocess)
# --------------------------------------------------------------------------------------------------------------

def _patch_transformers_cb() -> None:
    """Fix the two output-delivery bugs of transformers 5.2.0 continuous-batching streaming (see the docstring)."""
    from transformers.generation.continuous_batching import continuous_api, requests as cb_requests

    original = cb_requests.RequestState.to_generation_output

    def to_generation_output(self):
        out = original(self)
        out.generated_tokens = list(out.generated_tokens)  # a snapshot, not the list the generator keeps appending to
        return out

    cb_requests.RequestState.to_generation_output = to_generation_output
    import queue

    done = (cb_requests.RequestStatus.FINISHED, cb_requests.RequestStatus.FAILED)

    def request_id_iter(self, request_id):
        pending = self.__dict__.setdefault("_bench_pending", collections.defaultdict(collections.deque))
        lock = self.__dict__.setdefault("_bench_lock", threading.Lock())
        try:
            while self._generation_thread is not None and self._generation_thread.is_alive():
                with lock:
                    result = pending[request_id].popleft() if pending.get(request_id) else None
                if result is None:
                    try:
                        result = self.output_queue.get(block=True, timeout=0.1)
                    except queue.Empty:
                        result = None
                    if result is not None and result.request_id != request_id:
                        with lock:
                            pending[result.request_id].append(result)
                        result = None
                if result is not None:
                    yield result
                    if result.status in done:
                        return
                elif self.batch_processor is not None:
                    if request_id in self.batch_processor.scheduler._requests_to_cancel:
                        return
        finally:
            with lock:
                pending.pop(request_id, None)

    continuous_api.ContinuousBatchingManager.request_id_iter = request_id_iter


def _sample_transformers_cache(path: str, interval: float = 0.02) -> None:
    """Track the peak number of used blocks of every PagedAttentionCache; write it to ``path`` as JSON."""
    from transformers.generation.continuous_batching import cache as cb_cache

    caches = []
    original_init = cb_cache.PagedAttentionCache.__init__

    def init(self, *a, **k):
        original_init(self, *a, **k)
        caches.append(self)

    cb_cache.PagedAttentionCache.__init__ = init

    def loop():
        peak, last = 0, None
        while True:
            time.sleep(interval)
            if not caches:
                continue
            cache = caches[-1]
            used = cache.num_blocks - cache.get_num_free_blocks()
            peak = max(peak, used)
            tensors = list(cache.key_cache) + list(cache.value_cache)
            total = sum(t.numel() * t.element_size() for t in tensors)
            per_block = total // (cache.num_blocks + 2)  # the cache holds two padding blocks
            state = {"num_blocks": cache.num_blocks, "block_size": cache.block_size,
                     "max_batch_tokens": cache.max_batch_tokens, "kv_bytes_per_block": per_block,
                     "kv_preallocated_bytes": total, "kv_used_blocks_peak": peak,
                     "kv_used_bytes_peak": peak * per_block, "dtype": str(cache.dtype)}
            if state != last:
                tmp = path + ".tmp"
                Path(tmp).write_text(json.dumps(state))
                os.replace(tmp, path)
                last = state

    threading.Thread(target=loop, name="bench-cache-sampler", daemon=True).start()


def tf_launcher(argv: list[str]) -> None:
    if os.environ.get("LCX_BENCH_TF_PATCH") == "1":
        _patch_transformers_cb()
    if os.environ.get("LCX_BENCH_TF_STATS"):
        _sample_transformers_cache(os.environ["LCX_BENCH_TF_STATS"])
    from transformers.cli.transformers import main

    sys.argv = ["transformers", *argv]
    sys.exit(main())


# --------------------------------------------------------------------------------------------------------------
# workload
# --------------------------------------------------------------------------------------------------------------

def load_tokenizer(model: Path):
    path = model / "tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return lambda text: tok.encode(text, add_special_tokens=False)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model))
    return lambda text: hf(text, add_special_tokens=False, return_offsets_mapping=True)


def count_tokens(encode, text: str) -> int:
    enc = encode(text)
    return len(enc.ids) if hasattr(enc, "ids") else len(enc["input_ids"])


def build_workload(args, encode) -> dict:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    prose = "\n\n".join(" ".join(topics[k].split()) for k in keys)  # whitespace collapsed: plain prose
    head = "You are a helpful assistant. Answer briefly, using the reference below when it helps.\n\nReference:\n"
    budget = max(args.system_tokens - count_tokens(encode, head), 1)
    enc = encode(prose)
    offsets = enc.offsets if hasattr(enc, "offsets") else enc["offset_mapping"]
    if len(offsets) < budget:
        raise SystemExit(f"the prose has only {len(offsets)} tokens, fewer than --system-tokens")
    system = head + prose[: offsets[budget - 1][1]]
    rng = random.Random(args.seed)
    lo, hi = args.max_tokens_range
    reqs = []
    for i in range(args.requests):
        topic = keys[i % len(keys)].replace("-", " ")
        question = f"Question {i + 1}: in two sentences, what does the reference say about {topic!r}?"
        reqs.append({"index": i, "question": question, "max_tokens": rng.randint(lo, hi)})
    warmup = [{"index": -1 - i, "question": f"Warm-up {i + 1}: name one Python keyword.", "max_tokens": 16}
              for i in range(args.warmup)]
    return {"system": system, "system_tokens": count_tokens(encode, system), "requests": reqs, "warmup": warmup}


# --------------------------------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    near = Path(sys.executable).parent / name
    return str(near) if near.exists() else (shutil.which(name) or name)


def server_command(name: str, args, port: int, stats_path: Path) -> tuple[list[str], list[str], dict]:
    """(argv to run, the plain equivalent command, extra environment)."""
    model = str(args.model)
    if name == "lcx":
        cmd = [_exe("lcx"), "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
               "--page-size", str(args.page_size), *shlex.split(args.lcx_args)]
        return cmd, cmd, {}
    if name == "transformers":
        serve = ["serve", "--continuous-batching" if args.tf_cb else "--no-continuous-batching",
                 "--device", "cpu", "--dtype", args.tf_dtype, "--host", "127.0.0.1", "--port", str(port),
                 "--force-model", model, "--model-timeout", "-1", "--log-level", "warning",
                 *shlex.split(args.tf_args)]
        plain = [_exe("transformers"), *serve]
        env = {"LCX_BENCH_TF_STATS": str(stats_path), "LCX_BENCH_TF_PATCH": "0" if args.tf_no_patch else "1"}
        return [sys.executable, str(Path(__file__).resolve()), "--tf-launcher", *serve], plain, env
    raise SystemExit(f"unknown server {name!r} (lcx, transformers)")


class ServerError(RuntimeError):
    pass


def log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    lines = [ln[-400:] for ln in lines if "Loading weights" not in ln]  # skip progress-bar noise
    return "\n".join(lines[-n:])


def start_server(cmd: list[str], env_extra: dict, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, **OFFLINE_ENV, **env_extra}
    log = open(log_path, "wb")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    finally:
        log.close()


def stop_server(proc: subprocess.Popen, timeout: float) -> int | None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    return proc.returncode


async def wait_ready(client, base: str, proc: subprocess.Popen, log_path: Path, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise ServerError(f"server exited with code {proc.returncode} before it was ready; log tail "
                              f"({log_path}):\n{log_tail(log_path)}")
        try:
            r = await client.get(base + "/health", timeout=5)
            if r.status_code == 200:
                return time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - connection refused etc. while starting
            pass
        await asyncio.sleep(0.5)
    raise ServerError(f"server not ready after {timeout:.0f}s (GET /health); log tail ({log_path}):\n"
                      f"{log_tail(log_path)}")


async def model_name(client, base: str, fallback: str) -> tuple[str, str]:
    try:
        r = await client.get(base + "/v1/models", timeout=30)
        data = r.json().get("data") if r.status_code == 200 else None
        if data:
            return data[0]["id"], "GET /v1/models"
        return fallback, f"model path (GET /v1/models: HTTP {r.status_code}, {len(data or [])} models)"
    except Exception as e:  # noqa: BLE001
        return fallback, f"model path (GET /v1/models failed: {type(e).__name__})"


# --------------------------------------------------------------------------------------------------------------
# client
# --------------------------------------------------------------------------------------------------------------

async def chat(client, url: str, model: str, system: str, req: dict, encode, t_origin: float) -> dict:
    body = {"model": model, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": req["question"]}],
            "max_tokens": req["max_tokens"], "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    rec = {"index": req["index"], "max_tokens": req["max_tokens"], "error": None, "finish_reason": None,
           "usage": None}
    times, pieces = [], []
    t_send = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec["error"] = f"HTTP {resp.status_code}: {text[:500]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        rec["error"] = f"unparsable chunk: {data[:300]}"
                        break
                    if obj.get("error"):
                        rec["error"] = f"server error: {str(obj['error'])[:500]}"
                        break
                    if obj.get("usage"):
                        rec["usage"] = obj["usage"]
                    for choice in obj.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            times.append(now)
                            pieces.append(content)
                        if choice.get("finish_reason"):
                            rec["finish_reason"] = choice["finish_reason"]
    except Exception as e:  # noqa: BLE001 - httpx errors, dropped connections
        rec["error"] = f"{type(e).__name__}: {e}"
    t_done = time.perf_counter()
    if rec["error"] is None and rec["finish_reason"] is None:
        rec["error"] = "stream ended without a finish_reason"
    text = "".join(pieces)
    usage_tokens = (rec["usage"] or {}).get("completion_tokens")
    tokens = usage_tokens if usage_tokens is not None else (count_tokens(encode, text) if text else 0)
    rec.update(text=text, tokens=tokens, token_count="usage" if usage_tokens is not None else "tokenizer",
               chunks=len(pieces), start_s=t_send - t_origin, latency_s=t_done - t_send,
               ttft_s=(times[0] - t_send) if times else None,
               chunk_times_s=[round(t - t_send, 6) for t in times])
    gaps = [b - a for a, b in zip(times, times[1:])]
    rec["chunk_gaps_s"] = [round(g, 6) for g in gaps]
    rec["tpot_s"] = (times[-1] - times[0]) / (tokens - 1) if len(times) >= 2 and tokens > 1 else None
    return rec


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of the samples of every metric (over its label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


class Monitor:
    """Polls /metrics (lcx_* maxima) and the server's RSS (process group) while the workload runs."""

    def __init__(self, client, base: str, pid: int, interval: float):
        self.client, self.base, self.pid, self.interval = client, base, pid, interval
        self.metrics_max: dict[str, float] = {}
        self.metrics_last: dict[str, float] = {}
        self.metrics_status: str | None = None
        self.scrapes = 0
        self.rss_peak = 0

    def rss(self) -> int:
        try:
            import psutil

            p = psutil.Process(self.pid)
            return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
        except Exception:  # noqa: BLE001 - psutil missing or process gone
            return 0

    async def scrape(self) -> None:
        self.rss_peak = max(self.rss_peak, self.rss())
        if self.metrics_status not in (None, "ok"):
            return
        try:
            r = await self.client.get(self.base + "/metrics", timeout=10)
        except Exception as e:  # noqa: BLE001
            self.metrics_status = f"GET /metrics failed: {type(e).__name__}"
            return
        if r.status_code != 200:
            self.metrics_status = f"GET /metrics: HTTP {r.status_code}"
            return
        self.metrics_status = "ok"
        self.scrapes += 1
        for name, value in parse_prometheus(r.text).items():
            if name.startswith("lcx_"):
                self.metrics_last[name] = value
                self.metrics_max[name] = max(value, self.metrics_max.get(name, value))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.scrape()
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
        await self.scrape()

    def kv(self) -> dict:
        mx = self.metrics_max
        page_bytes = next((mx[k] for k in ("lcx_kv_page_bytes", "lcx_kv_bytes_per_page") if k in mx), None)
        pages = mx.get("lcx_kv_pages_used")
        if "lcx_kv_bytes_used" in mx:
            peak, how = mx["lcx_kv_bytes_used"], "max lcx_kv_bytes_used"
        elif pages is not None and page_bytes is not None:
            peak, how = pages * page_bytes, "max lcx_kv_pages_used x page bytes"
        else:
            peak, how = None, "n/a"
        return {"kv_bytes_peak": peak, "kv_bytes_source": how, "kv_pages_used_peak": pages}


# --------------------------------------------------------------------------------------------------------------
# statistics and reporting
# --------------------------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if not r["error"]]
    tokens = sum(r["tokens"] for r in ok)
    chunks = sum(r["chunks"] for r in ok)
    gaps = [g for r in ok for g in r["chunk_gaps_s"]]
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok]
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok), "wall_s": wall,
        "generated_tokens": tokens, "throughput_tok_s": tokens / wall if wall > 0 else None,
        "token_count": sorted({r["token_count"] for r in ok}),
        "chunks": chunks, "tokens_per_chunk": tokens / chunks if chunks else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "chunk_gap_p50_s": percentile(gaps, 50), "chunk_gap_p99_s": percentile(gaps, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "latency_p50_s": percentile([r["latency_s"] for r in ok], 50),
        "finish_reasons": dict(collections.Counter(str(r["finish_reason"]) for r in ok)),
        "first_errors": [r["error"] for r in records if r["error"]][:3],
    }


def normalize(text: str) -> str:
    for tok in SPECIAL_TOKENS:
        text = text.replace(tok, "")
    return text


def compare(a: list[dict], b: list[dict]) -> dict:
    same, diffs = 0, []
    for ra, rb in zip(a, b):
        if ra["error"] or rb["error"]:
            diffs.append({"index": ra["index"], "first_diff_char": None, "note": "error"})
            continue
        ta, tb = normalize(ra["text"]), normalize(rb["text"])
        if ta == tb:
            same += 1
            continue
        pos = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        diffs.append({"index": ra["index"], "first_diff_char": pos, "len_a": len(ta), "len_b": len(tb),
                      "a": ta[max(0, pos - 20): pos + 40], "b": tb[max(0, pos - 20): pos + 40]})
    return {"compared": min(len(a), len(b)), "identical": same, "differing": diffs}


def ms(x) -> str:
    return "—" if x is None else f"{1000 * x:.0f}" if x >= 0.1 else f"{1000 * x:.1f}"


def mib(x) -> str:
    return "n/a" if not x else f"{x / 2**20:.1f} MiB"


def table(results: dict) -> str:
    head = ("| server | ok | wall s | gen tok | tok/s | TTFT p50/p99 ms | chunk gap p50/p99 ms | TPOT p50/p99 ms "
            "| tok/chunk | count | peak KV | peak RSS |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, res in results.items():
        if res.get("failed"):
            rows.append(f"| {name} | failed: {res['failed'].splitlines()[0][:80]} |" + " |" * 10)
            continue
        s = res["summary"]
        kv = mib(res["kv"]["kv_bytes_peak"])
        rows.append(
            f"| {name} | {s['ok']}/{s['requests']} | {s['wall_s']:.1f} | {s['generated_tokens']} "
            f"| {s['throughput_tok_s']:.1f} | {ms(s['ttft_p50_s'])} / {ms(s['ttft_p99_s'])} "
            f"| {ms(s['chunk_gap_p50_s'])} / {ms(s['chunk_gap_p99_s'])} | {ms(s['tpot_p50_s'])} / "
            f"{ms(s['tpot_p99_s'])} | {s['tokens_per_chunk'] or 0:.2f} | {','.join(s['token_count'])} | {kv} "
            f"| {mib(res['rss_peak_bytes'])} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------

async def bench_server(name: str, args, work: dict, encode, out_dir: Path) -> dict:
    import httpx

    port = free_port()
    stem = Path(args.out).stem
    log_path = out_dir / f"{stem}_{name}.log"
    stats_path = out_dir / f"{stem}_{name}_cache.json"
    stats_path.unlink(missing_ok=True)
    cmd, plain, env_extra = server_command(name, args, port, stats_path)
    res = {"command": shlex.join(cmd), "equivalent_command": shlex.join(plain), "env": {**OFFLINE_ENV, **env_extra},
           "port": port, "log": str(log_path)}
    print(f"[{name}] starting: {shlex.join(plain)}", file=sys.stderr)
    proc = start_server(cmd, env_extra, log_path)
    base = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=args.in_flight + 8, max_keepalive_connections=args.in_flight + 8)
    try:
        # probes and /metrics on their own client, without keep-alive: a server that fails a probe (transformers
        # answers GET /v1/models with a 500 when there is no hub cache) drops the connection a next request would reuse
        timeout = httpx.Timeout(args.request_timeout, connect=10)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client, \
                httpx.AsyncClient(timeout=30, headers={"Connection": "close"}) as probe:
            res["startup_s"] = await wait_ready(probe, base, proc, log_path, args.startup_timeout)
            res["model"], res["model_source"] = await model_name(probe, base, str(args.model))
            print(f"[{name}] ready after {res['startup_s']:.1f}s, model={res['model']!r}", file=sys.stderr)
            url = base + "/v1/chat/completions"
            sem = asyncio.Semaphore(args.in_flight)

            async def limited(req, t_origin):
                async with sem:
                    return await chat(client, url, res["model"], work["system"], req, encode, t_origin)

            if work["warmup"]:
                t = time.perf_counter()
                # one request alone first: transformers creates its batching manager on the first request, and
                # concurrent first requests race to create it
                warm = [await limited(work["warmup"][0], t)]
                warm += await asyncio.gather(*(limited(r, t) for r in work["warmup"][1:]))
                res["warmup_s"] = time.perf_counter() - t
                res["warmup_errors"] = [r["error"] for r in warm if r["error"]]
                if len(res["warmup_errors"]) == len(warm):
                    raise ServerError(f"every warm-up request failed: {res['warmup_errors'][0]}\nlog tail "
                                      f"({log_path}):\n{log_tail(log_path)}")
                print(f"[{name}] warm-up {res['warmup_s']:.1f}s", file=sys.stderr)
            monitor = Monitor(probe, base, proc.pid, args.metrics_interval)
            stop = asyncio.Event()
            mon_task = asyncio.create_task(monitor.run(stop))
            t0 = time.perf_counter()
            records = await asyncio.gather(*(limited(r, t0) for r in work["requests"]))
            wall = time.perf_counter() - t0
            stop.set()
            await mon_task
            res["summary"] = summarize(records, wall)
            res["kv"] = monitor.kv()
            res["metrics_status"] = monitor.metrics_status
            res["metrics_scrapes"] = monitor.scrapes
            res["lcx_metrics_max"] = monitor.metrics_max
            res["lcx_metrics_last"] = monitor.metrics_last
            res["rss_peak_bytes"] = monitor.rss_peak
            res["records"] = records
            s = res["summary"]
            print(f"[{name}] {s['ok']}/{s['requests']} ok in {wall:.1f}s, {s['throughput_tok_s']:.1f} tok/s"
                  + (f"; first error: {s['first_errors'][0]}" if s["first_errors"] else ""), file=sys.stderr)
    except ServerError as e:
        res["failed"] = str(e)
        print(f"[{name}] FAILED: {e}", file=sys.stderr)
    finally:
        res["exit_code"] = stop_server(proc, args.stop_timeout)
    if stats_path.exists():  # the transformers launcher's cache sampler
        cache = json.loads(stats_path.read_text())
        res["transformers_cache"] = cache
        if "kv" in res:
            res["kv"].update(kv_bytes_peak=cache["kv_used_bytes_peak"],
                             kv_bytes_source="launcher: peak used paged-cache blocks x bytes per block")
    return res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="lcx,transformers", help="comma-separated: lcx, transformers")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF model directory")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--in-flight", type=int, default=8, help="requests in flight at once")
    p.add_argument("--system-tokens", type=int, default=1000, help="tokens of the shared system prompt")
    p.add_argument("--max-tokens-range", default="32,128", help="LO,HI: max_tokens drawn per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests before measuring (default: in-flight)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="lcx --max-num-seqs")
    p.add_argument("--max-model-len", type=int, default=4096, help="lcx --max-model-len")
    p.add_argument("--page-size", type=int, default=16, help="lcx --page-size")
    p.add_argument("--lcx-args", default="", help="extra arguments for lcx serve")
    p.add_argument("--tf-args", default="", help="extra arguments for transformers serve")
    p.add_argument("--tf-dtype", default="float32", help="transformers serve --dtype (float32, bfloat16, auto)")
    p.add_argument("--tf-no-cb", dest="tf_cb", action="store_false",
                   help="transformers without continuous batching (a generate thread per request)")
    p.add_argument("--tf-no-patch", action="store_true",
                   help="run transformers' CB streaming unpatched (5.2.0: its streams break)")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds to wait for GET /health")
    p.add_argument("--request-timeout", type=float, default=600, help="seconds per request")
    p.add_argument("--stop-timeout", type=float, default=20, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--metrics-interval", type=float, default=0.25, help="seconds between /metrics scrapes")
    p.add_argument("--out", default="runs/bench/serve.json", help="JSON results (server logs go next to it)")
    args = p.parse_args(argv)
    lo, hi = (int(x) for x in args.max_tokens_range.split(","))
    if not 1 <= lo <= hi:
        p.error("--max-tokens-range wants LO,HI with 1 <= LO <= HI")
    args.max_tokens_range = (lo, hi)
    if args.warmup is None:
        args.warmup = args.in_flight
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    return args


async def amain(args) -> int:
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model} is not a model directory (no config.json)")
    encode = load_tokenizer(args.model)
    work = build_workload(args, encode)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lo, hi = args.max_tokens_range
    total = sum(r["max_tokens"] for r in work["requests"])
    print(f"workload: {args.requests} requests, system prompt {work['system_tokens']} tokens, max_tokens {lo}..{hi} "
          f"(sum {total}), {args.in_flight} in flight, {args.warmup} warm-up", file=sys.stderr)
    results = {}
    for name in args.servers:
        results[name] = await bench_server(name, args, work, encode, out.parent)
    done = [n for n in results if "records" in results[n]]
    comparison = {}
    for other in done[1:]:
        comparison[f"{done[0]} vs {other}"] = compare(results[done[0]]["records"], results[other]["records"])
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "argv": sys.argv, "workload": {"system_tokens": work["system_tokens"], "system": work["system"],
                                             "requests": work["requests"], "warmup": work["warmup"]},
              "servers": results, "comparison": comparison}
    out.write_text(json.dumps(report, indent=1))
    print(table(results))
    for name, res in results.items():
        if "kv" in res:
            print(f"\n{name}: KV peak from {res['kv']['kv_bytes_source']}; /metrics: {res['metrics_status']}; "
                  f"model {res['model']!r} ({res['model_source']}); command: {res['command']}")
    for key, c in comparison.items():
        firsts = [d["first_diff_char"] for d in c["differing"]]
        print(f"\n{key}: {c['identical']}/{c['compared']} greedy texts identical; first differing character of "
              f"the others: {firsts}")
    print(f"\nJSON: {out}")
    return 0 if all("records" in r and not r["summary"]["errors"] for r in results.values()) else 1


def main(argv=None) -> int:
    return asyncio.run(amain(parse_args(argv)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tf-launcher"]:
        tf_launcher(sys.argv[2:])
    sys.exit(main())
