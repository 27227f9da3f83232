"""Incident drills for ``lcx serve`` on one local model: a long prompt next to live streams, a prompt past the KV
budget, and ``kill -9`` with a restart on the same ``--kv-store``.

Every server is ``lcx serve MODEL --host 127.0.0.1 --port PORT --page-size 16 --log-level warning ...`` (PORT free),
started with ``JAX_LOG_COMPILES=1`` (``--no-log-compiles``: without) in a process group of its own, ready when
``GET /health`` answers 200, stopped with SIGTERM to its group, a second SIGTERM, then SIGKILL; every group started
is also killed on exit, on errors and on SIGINT / SIGTERM. Requests are greedy (temperature 0) chats over the OpenAI
API. Prose is ``pydoc_data.topics`` (whitespace collapsed) cut to a token count with the model's tokenizer. Every
request but the restart drill's conversation opens with a system message carrying a tag of its own (``Session
NNN.``): no two requests share a KV page, so prefix sharing plays no part (the chat template's default system
prompt would give every request the same first page). The XLA compilations a server logs in each measured window
are counted (a window that compiles measures the compiler; the warm-ups below are there to avoid it). Client-side
gaps are the times between streamed content chunks: lcx sends one chunk per token but publishes a decode segment's
tokens together, so most gaps are ~0 and the large ones are the time between segments - p99 is the number to read.

Scenarios (``--scenarios interference,incident,restart``):

1. interference - one server (``--cache-policy full``)::

       lcx serve MODEL --max-model-len 17408 --max-num-seqs 9 --kv-memory 1600MiB --segment 8 --prefill-chunk C
       # C in --chunks (default 256; e.g. --chunks 256,128: one server each)

   Warm-up: a prompt with the long prompt's length modulo C (its chunk widths), a stream's prompt alone (a
   restarted stream), then a prompt one chunk longer together with a stream's prompt (a restart during the long
   prefill). Then 8 greedy streaming chats (short prompts asking for long answers; ``max_tokens`` sized so that the
   8 and the long prompt fit the pool at once, at most ``--stream-max-tokens``; a stream that ends is restarted at
   once) run; after ``--settle-s`` the gaps are measured for ``--baseline-s`` (20) seconds, then one non-streaming
   chat with a ``--long-tokens`` (16384) token prompt and ``max_tokens`` 1 is sent and the gaps are measured from
   its send to its response (its latency is its TTFT). Reported: gap p50 / p99 baseline vs during, the ratio of the
   p99s (goal <= 2x), the mean ITL, the server's ``lcx_inter_token_latency_seconds`` p99 over each window (bucket
   interpolation), the long prompt's TTFT, compilations per window, and how long requests waited
   (``lcx_requests_waiting`` >= 1: the long prompt waiting for pages would be admission, not interference).

2. incident - one KV budget for every policy::

       lcx serve MODEL --max-model-len 17408 --max-num-seqs 5 --kv-memory 256MiB --segment 8 --prefill-chunk 256 \\
           --cache-policy P [--cache-param budget=1024]      # P in --policies: full,streaming,tova,snapkv,kvzip

   A rehearsal with other prompts first (the same traffic: 4 short streams of max_tokens 8, then under an evicting
   policy a prompt longer than the budget with the long prompt's length modulo its prefill chunk). The drill: 4
   greedy streams (``--short-max-tokens`` 200) run for ``--lead-s`` seconds after each has its first token, then a
   streaming chat with the ``--long-tokens`` prompt (``max_tokens`` ``--long-max-tokens``) arrives. Under ``full``
   it must be refused with a 400 at once (status, latency, message); under an evicting policy it is served in
   bounded pages (TTFT, answer, peak ``lcx_kv_pages_used`` / ``lcx_kv_bytes_used`` from ``/metrics`` every
   ``--metrics-interval`` s). A policy the server refuses at start (kvzip) is a row with its error line. For every
   policy: the short streams' finish reasons and gap p99 before / after the long prompt arrives.

3. restart - ``lcx serve MODEL --max-model-len 8192 --max-num-seqs 2 --segment 8 --prefill-chunk 256 --kv-store DIR``
   (DIR a fresh temporary directory unless ``--store-dir``): turn 1 (a system message of prose and a question,
   ``--conversation-tokens`` (4096) in all; non-streaming, max_tokens 16) gives answer A; a twin of turn 2 (the same
   lengths, other prose) is served; turn 2 (history + A + a new question) is streamed and the server's process
   group gets SIGKILL at its first content chunk. The server restarts on DIR; the twin is sent first (the first
   request after the restart: it reads its pages from DIR and compiles what that path needs), then turn 2
   (streaming, include_usage, max_tokens 16). The same twin, then turn 2, go to a fresh server on an empty store
   (cold prefill). Reported: prompt_tokens, cached_tokens, cached share (goal >= 90%), TTFT restarted / cold (goal
   <= 1/4), whether the two answers are identical (greedy: they must be), the store's size on disk.

Commands::

    python experiments/bench/serve_incident.py                                  # all three, full sizes
    python experiments/bench/serve_incident.py --scenarios interference --chunks 256,128
    python experiments/bench/serve_incident.py --scenarios incident --policies full,streaming,tova,snapkv,kvzip
    python experiments/bench/serve_incident.py --scenarios restart --conversation-tokens 4096
    # smoke (small sizes, ~8 minutes on 2 CPU cores):
    python experiments/bench/serve_incident.py --long-tokens 2048 --baseline-s 6 --settle-s 2 \\
        --interference-kv-memory 400MiB --interference-max-model-len 4096 --kv-memory 32MiB --budget 256 \\
        --short-max-tokens 40 --lead-s 1 --incident-max-model-len 4096 --conversation-tokens 1024 \\
        --restart-max-model-len 2048 --out runs/bench/serve_incident_smoke.json

Output: Markdown tables on stdout, progress on stderr, ``--out`` (runs/bench/serve_incident.json: arguments, exact
server commands, per-scenario results and per-request records; rewritten after each scenario). Server logs go next
to it (``<stem>_<scenario>_<name>.log``).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "runs/models/SmolLM2-135M-Instruct"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "TOKENIZERS_PARALLELISM": "false"}
T0 = time.perf_counter()
INTERVAL = 64  # lcx's cache.interval default: an evicting policy prefills at most this many tokens per step

LONG_QUESTION = "\n\nIn one sentence: what is the text above about?"
STREAM_TASKS = [  # greedy prompts that tend to run long (a stream that ends is restarted)
    "Count from 1 to 3000, writing every number in words, one per line.",
    "Write a very long story about a lighthouse keeper and a storm. Never stop writing.",
    "List every country of the world with its capital, then repeat the list in reverse order.",
    "Explain in great detail, step by step, how a compiler turns source code into machine code.",
    "Write a long poem about the sea, with at least one hundred verses.",
    "Describe the history of mathematics century by century, in as much detail as you can.",
    "Write out the multiplication tables from 1 to 20, every line in full.",
    "Write a detailed travel diary of a journey around the world, one long entry per day.",
]
SHORT_QUESTIONS = [
    "Name three uses of Python dictionaries and explain each briefly.",
    "Explain what a hash table is, in a few sentences.",
    "Give a short recipe for pancakes.",
    "Describe the water cycle briefly.",
]


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------------
# server processes
# --------------------------------------------------------------------------------------------------------------

class ServerError(RuntimeError):
    pass


_COMPILE = re.compile(r"Finished XLA compilation of (.+?) in ([0-9.]+) sec")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lcx_exe() -> list[str]:
    near = Path(sys.executable).parent / "lcx"
    if near.exists():
        return [str(near)]
    found = shutil.which("lcx")
    return [found] if found else [sys.executable, "-m", "lcx"]


class Server:
    """One ``lcx serve`` subprocess in its own process group (session); output to ``log_path``."""

    live: list[Server] = []  # every started server not yet reaped: killed by ``kill_all``

    def __init__(self, args, name: str, flags: list[str], log_path: Path):
        self.name, self.port, self.log_path = name, free_port(), log_path
        self.cmd = [*lcx_exe(), "serve", str(args.model), "--host", "127.0.0.1", "--port", str(self.port),
                    "--page-size", str(args.page_size), "--log-level", args.server_log_level, *flags,
                    *shlex.split(args.lcx_args)]
        self.env = {"JAX_LOG_COMPILES": "1"} if args.log_compiles else {}
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.done = False  # reaped and its group killed: never signal that id again
        self.startup_s: float | None = None
        self.model: str | None = None

    def start(self) -> Server:
        log(f"[{self.name}] starting: {shlex.join(self.cmd)}")
        with open(self.log_path, "wb") as out:  # a file, not a pipe: a full pipe would block the server
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **OFFLINE_ENV, **self.env}, start_new_session=True)
        Server.live.append(self)
        log(f"[{self.name}] pid {self.proc.pid} (its process group), log {self.log_path}")
        return self

    def signal_group(self, sig: int) -> None:
        if self.proc is None or self.done:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the session leader's pid is the group id
        except (ProcessLookupError, PermissionError):
            pass

    def kill9(self) -> int | None:
        """SIGKILL to the whole process group; returns the exit code."""
        self.signal_group(signal.SIGKILL)
        code = self.reap(30)
        self.done = self.proc.poll() is not None
        return code

    def stop(self, timeout: float) -> int | None:
        """SIGTERM (lcx drains: running requests finish), a second SIGTERM after half of ``timeout`` (exit now),
        SIGKILL after ``timeout``; the group always gets a final SIGKILL (children that outlive the leader)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout / 2)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout / 2)
                except subprocess.TimeoutExpired:
                    pass
        self.signal_group(signal.SIGKILL)
        code = self.reap(30)
        self.done = self.proc.poll() is not None
        return code

    def reap(self, timeout: float) -> int | None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        if self in Server.live and self.proc.poll() is not None:
            Server.live.remove(self)
        return self.proc.returncode

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(ln[-400:] for ln in lines[-n:])

    def error_line(self) -> str | None:
        """The CLI's one-line refusal (``lcx serve: error: ...``), if the log has one."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        found = re.findall(r"^lcx serve: error: .*$", text, re.M)
        return found[-1] if found else None

    def mark(self) -> int:
        """The log's size now: ``compiles`` counts what the server compiled between two marks."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def compiles(self, start: int, end: int | None = None) -> dict:
        """XLA compilations logged between two marks (``JAX_LOG_COMPILES=1``): count, seconds, the slowest."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                text = f.read(None if end is None else max(end - start, 0)).decode(errors="replace")
        except OSError:
            return {"count": None}
        found = [(name, float(t)) for name, t in _COMPILE.findall(text)]
        slow = sorted(found, key=lambda x: -x[1])[:5]
        return {"count": len(found), "seconds": round(sum(t for _, t in found), 3),
                "slowest": [[name[:80], round(t, 3)] for name, t in slow]}

    def plan_lines(self) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [ln[len("lcx serve: "):] for ln in text.splitlines() if ln.startswith("lcx serve: ")
                and "error" not in ln]

    async def wait_ready(self, client, timeout: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                self.kill9()  # whatever is left of its group
                raise ServerError(f"exited with code {self.proc.returncode} before it was ready; log tail "
                                  f"({self.log_path}):\n{self.tail()}")
            try:
                r = await client.get(self.base + "/health", timeout=5)
                if r.status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    break
            except Exception:  # noqa: BLE001 - connection refused while it starts
                pass
            await asyncio.sleep(0.5)
        else:
            raise ServerError(f"not ready after {timeout:.0f}s (GET /health); log tail ({self.log_path}):\n"
                              f"{self.tail()}")
        r = await client.get(self.base + "/v1/models", timeout=30)
        self.model = r.json()["data"][0]["id"]
        log(f"[{self.name}] ready after {self.startup_s:.1f}s (model {self.model!r})")
        return self.startup_s

    def record(self) -> dict:
        return {"name": self.name, "command": shlex.join(self.cmd), "log": str(self.log_path), "port": self.port,
                "startup_s": self.startup_s, "plan": self.plan_lines(), "env": self.env,
                "exit_code": None if self.proc is None else self.proc.returncode}


def kill_all() -> None:
    for server in list(Server.live):
        server.signal_group(signal.SIGKILL)
        server.reap(10)


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# --------------------------------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------------------------------

class Prose:
    """``pydoc_data.topics`` as one text, cut by tokens of the model's tokenizer (cycled when asked for more)."""

    def __init__(self, model: Path):
        from pydoc_data.topics import topics
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.text = "\n\n".join(" ".join(topics[k].split()) for k in sorted(topics))
        self.offsets = self.tok.encode(self.text, add_special_tokens=False).offsets
        self.n = len(self.offsets)

    def take(self, n: int, start: int = 0) -> str:
        """About ``n`` tokens of prose from token ``start`` on."""
        parts, at = [], start % self.n
        while n > 0:
            k = min(n, self.n - at)
            parts.append(self.text[self.offsets[at][0]: self.offsets[at + k - 1][1]])
            n, at = n - k, 0
        return "\n\n".join(parts)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)


def chat_body(model: str, messages: list[dict], max_tokens: int, stream: bool) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


_TAGS = iter(range(100, 1000))


def user(text: str) -> list[dict]:
    """A system message with a tag of its own (the same token count each time), then ``text`` as the user's: no
    two requests share a page (the chat template's default system prompt would give every request the same first
    page, and lcx pins a whole kept prefix for a request that shares one page of it), so each takes the prefill
    path, and the compiled shapes, of a fresh prompt."""
    return [{"role": "system", "content": f"Session {next(_TAGS)}. You are a helpful assistant."},
            {"role": "user", "content": text}]


def twin_text(prose: Prose, n: int, start: int = 40_000) -> str:
    """A prompt of about ``n`` tokens (with the long prompt's question) from prose the long prompt does not use."""
    return prose.take(max(n - prose.count(LONG_QUESTION), 1), start=start) + LONG_QUESTION


def shape_twin_length(length: int, step: int, at_least: int) -> int:
    """The smallest length >= ``at_least`` (and >= ``step``) congruent to ``length`` modulo ``step``: its prefill
    chunks have the widths of ``length``'s."""
    n = length % step or step
    while n < max(at_least, step):
        n += step
    return n


async def template_overhead(client, url: str, model: str, prose: Prose) -> int:
    """Prompt tokens the chat template and ``user``'s tagged system message add to a user message's text (one
    probe request; it also compiles the first programs)."""
    text = prose.take(64, start=50_000) + LONG_QUESTION
    r = await post_chat(client, url, chat_body(model, user(text), 1, False))
    if r["status"] != 200:
        raise ServerError(f"probe request failed: {r['error']} {r['message']}")
    return r["usage"]["prompt_tokens"] - prose.count(text)


# --------------------------------------------------------------------------------------------------------------
# client
# --------------------------------------------------------------------------------------------------------------

def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except Exception:  # noqa: BLE001 - not OpenAI's error body
        return raw.decode(errors="replace")[:1000]


async def stream_chat(client, url: str, body: dict, rec: dict, on_content=None) -> dict:
    """POST a streaming chat, filling ``rec`` as chunks arrive (``times``: perf_counter of each content chunk), so a
    cancelled task leaves what it saw. ``on_content(rec, content)`` after each content chunk."""
    rec.update(t_send=time.perf_counter(), status=None, error=None, message=None, finish_reason=None, usage=None,
               times=[], text="", t_done=None)
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                rec["message"] = _error_message(await resp.aread())
                rec["error"] = f"HTTP {resp.status_code}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if obj.get("error"):
                        rec["error"] = f"server error: {obj['error'].get('message')}"
                        break
                    if obj.get("usage"):
                        rec["usage"] = obj["usage"]
                    for choice in obj.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            rec["times"].append(now)
                            pieces.append(content)
                            if on_content is not None:
                                on_content(rec, content)
                        if choice.get("finish_reason"):
                            rec["finish_reason"] = choice["finish_reason"]
    except Exception as e:  # noqa: BLE001 - dropped connections (kill -9), timeouts
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        rec["t_done"] = time.perf_counter()
        rec["text"] = "".join(pieces)
    if rec["error"] is None and rec["finish_reason"] is None:
        rec["error"] = "stream ended without a finish_reason"
    rec["latency_s"] = rec["t_done"] - rec["t_send"]
    rec["ttft_s"] = rec["times"][0] - rec["t_send"] if rec["times"] else None
    return rec


async def post_chat(client, url: str, body: dict) -> dict:
    rec = {"status": None, "error": None, "message": None, "text": None, "usage": None, "finish_reason": None}
    t0 = time.perf_counter()
    try:
        r = await client.post(url, json=body)
        rec["status"] = r.status_code
        if r.status_code == 200:
            obj = r.json()
            rec.update(text=obj["choices"][0]["message"]["content"], usage=obj.get("usage"),
                       finish_reason=obj["choices"][0]["finish_reason"])
        else:
            rec["message"] = _error_message(r.content)
            rec["error"] = f"HTTP {r.status_code}"
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["latency_s"] = time.perf_counter() - t0
    return rec


def strip_times(rec: dict, t_origin: float) -> dict:
    """A JSON-friendly copy: times relative to ``t_origin``, rounded."""
    out = {k: v for k, v in rec.items() if k not in ("times", "t_send", "t_done")}
    out["t_send_s"] = round(rec["t_send"] - t_origin, 4) if rec.get("t_send") else None
    out["t_done_s"] = round(rec["t_done"] - t_origin, 4) if rec.get("t_done") else None
    out["chunk_times_s"] = [round(t - t_origin, 4) for t in rec.get("times", [])]
    return out


# --------------------------------------------------------------------------------------------------------------
# metrics and statistics
# --------------------------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            try:
                out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
            except ValueError:
                pass
    return out


def metric(samples, name: str, **labels) -> float | None:
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    return sum(found) if found else None


def buckets(samples, name: str) -> list[tuple[float, float]]:
    return sorted((float(lab["le"]), v) for n, lab, v in samples if n == name + "_bucket" and "le" in lab)


def hist_quantile(before, after, q: float) -> float | None:
    """The ``q``-th percentile of a histogram's observations between two scrapes (interpolated in its bucket)."""
    if not after:
        return None
    b0 = dict(before or [])
    delta = [(le, c - b0.get(le, 0.0)) for le, c in after]
    total = delta[-1][1]
    if total <= 0:
        return None
    rank, prev_le, prev_c = q / 100 * total, 0.0, 0.0
    for le, c in delta:
        if c >= rank:
            if math.isinf(le):
                return prev_le  # past the last finite bucket: its bound (a lower bound)
            return prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-12)
        prev_le, prev_c = le, c
    return None


def percentile(values, q: float) -> float | None:
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def gap_stats(recs: list[dict], t0: float, t1: float) -> dict:
    """Gaps between consecutive content chunks of each stream whose later chunk falls in (t0, t1]."""
    gaps, chunks, streams = [], 0, set()
    for rec in recs:
        times = rec.get("times") or []
        for a, b in zip(times, times[1:]):
            if t0 < b <= t1:
                gaps.append(b - a)
        n = sum(1 for t in times if t0 < t <= t1)
        chunks += n
        if n:
            streams.add(rec.get("stream", id(rec)))
    span = t1 - t0
    return {"window_s": span, "gaps": len(gaps), "chunks": chunks, "streams": len(streams),
            "gap_p50_s": percentile(gaps, 50), "gap_p90_s": percentile(gaps, 90),
            "gap_p99_s": percentile(gaps, 99), "gap_max_s": max(gaps) if gaps else None,
            "chunks_per_s": chunks / span if span > 0 else None,
            "mean_itl_s": span * len(streams) / chunks if chunks else None}


class Sampler:
    """Scrapes ``/metrics`` every ``interval`` seconds: KV pages / bytes, running / waiting (and keeps marks)."""

    def __init__(self, client, base: str, interval: float):
        self.client, self.base, self.interval = client, base, interval
        self.samples: list[dict] = []
        self.error: str | None = None

    async def scrape(self) -> list | None:
        try:
            r = await self.client.get(self.base + "/metrics", timeout=10)
            r.raise_for_status()
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
            return None
        parsed = parse_prometheus(r.text)
        self.samples.append({"t": time.perf_counter(), "pages_used": metric(parsed, "lcx_kv_pages_used"),
                             "bytes_used": metric(parsed, "lcx_kv_bytes_used"),
                             "pages_total": metric(parsed, "lcx_kv_pages_total"),
                             "running": metric(parsed, "lcx_requests_running"),
                             "waiting": metric(parsed, "lcx_requests_waiting")})
        return parsed

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.scrape()
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    def peak(self, key: str, t0: float = -math.inf, t1: float = math.inf) -> float | None:
        vals = [s[key] for s in self.samples if t0 <= s["t"] <= t1 and s[key] is not None]
        return max(vals) if vals else None

    def waiting(self, t0: float, t1: float) -> dict:
        """How long (about: sample spacing) ``lcx_requests_waiting`` was >= 1 between t0 and t1, and its max."""
        xs = [s for s in self.samples if t0 <= s["t"] <= t1 and s["waiting"] is not None]
        busy = sum(b["t"] - a["t"] for a, b in zip(xs, xs[1:]) if a["waiting"] >= 1)
        return {"seconds": round(busy, 3), "max": max((s["waiting"] for s in xs), default=None)}

    def series(self, t_origin: float) -> list[dict]:
        return [{**s, "t": round(s["t"] - t_origin, 3)} for s in self.samples]


async def wait_until(pred, timeout: float, what: str, poll: float = 0.1) -> None:
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout:
            raise ServerError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(poll)


def ms(x) -> str:
    return "—" if x is None else f"{1000 * x:.0f}" if x >= 0.1 else f"{1000 * x:.1f}"


def sec(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def mib(x) -> str:
    return "—" if x is None else f"{x / 2**20:.1f} MiB"


def cell(text, n: int = 90) -> str:
    text = "—" if text is None else " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= n else text[: n - 1] + "…"


def compiles(d: dict) -> str:
    c = d.get("compiles") or d
    return "—" if c.get("count") is None else f"{c['count']} ({c['seconds']:.1f} s)"


def md_table(head: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------------------
# scenario 1: interference
# --------------------------------------------------------------------------------------------------------------

async def interference_one(args, prose: Prose, chunk: int, out_dir: Path, stem: str) -> dict:
    import httpx

    flags = ["--max-model-len", str(args.interference_max_model_len), "--max-num-seqs",
             str(args.interference_max_num_seqs), "--kv-memory", args.interference_kv_memory,
             "--segment", str(args.segment), "--prefill-chunk", str(chunk), "--cache-policy", "full"]
    server = Server(args, f"interference_c{chunk}", flags, out_dir / f"{stem}_interference_c{chunk}.log")
    res: dict = {"prefill_chunk": chunk, "segment": args.segment, "streams": args.streams}
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    tasks: list[asyncio.Task] = []
    stop = asyncio.Event()
    try:
        server.start()
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client, \
                httpx.AsyncClient(timeout=30, headers={"Connection": "close"}) as probe:
            await server.wait_ready(probe, args.startup_timeout)
            url = server.base + "/v1/chat/completions"
            sampler = Sampler(probe, server.base, args.metrics_interval)
            pages_total = metric(await sampler.scrape() or [], "lcx_kv_pages_total")
            overhead = await template_overhead(client, url, server.model, prose)
            long_text = prose.take(args.long_tokens) + LONG_QUESTION
            long_len = prose.count(long_text) + overhead

            def stream_body(i: int, n: int, stream: bool = True) -> dict:
                return chat_body(server.model, user(STREAM_TASKS[i % len(STREAM_TASKS)]), n, stream)

            # warm-up (compiles what the windows would otherwise compile): a prompt with the long one's length
            # modulo the chunk alone (its chunk widths), a stream's prompt alone (a restarted stream), then a longer
            # such prompt together with a stream's prompt (a stream restarting while the long prompt is read)
            t = time.perf_counter()
            warm_len = shape_twin_length(long_len, chunk, chunk)

            def twin(n: int, start: int) -> dict:
                return chat_body(server.model, user(twin_text(prose, n - overhead, start)), 1, False)

            warm = [await post_chat(client, url, twin(warm_len, 40_000)),
                    await post_chat(client, url, stream_body(0, 4, stream=False))]
            warm += await asyncio.gather(post_chat(client, url, twin(warm_len + chunk, 45_000)),
                                         post_chat(client, url, stream_body(1, 4, stream=False)))
            errors = [r["error"] for r in warm if r["error"]]
            res["warmup"] = {"prompt_tokens": [(r["usage"] or {}).get("prompt_tokens") for r in warm],
                             "twin_target_tokens": warm_len, "seconds": time.perf_counter() - t, "errors": errors}
            log(f"[{server.name}] warm-up in {res['warmup']['seconds']:.1f}s (prompts of "
                f"{res['warmup']['prompt_tokens']} tokens; twin target {warm_len})"
                + (f"; errors {errors}" if errors else ""))
            # the streams' budget: every stream and the long prompt in the pool at once (no waiting for pages)
            page = args.page_size
            long_pages = -(-(long_len + 1) // page)
            stream_prompt = max(prose.count(x) for x in STREAM_TASKS) + overhead + 8
            slack = 4 + args.streams  # rounding; no request shares pages with another (``user``)
            per_stream = (int(pages_total) - long_pages - slack) // args.streams
            max_tokens = min(per_stream * page - stream_prompt, args.stream_max_tokens,
                             args.interference_max_model_len - stream_prompt)
            res.update(pages_total=pages_total, long_prompt_tokens_est=long_len, long_pages=long_pages,
                       slack_pages=slack, stream_max_tokens=max_tokens)
            if max_tokens < 32:
                raise ServerError(f"the pool ({pages_total} pages) leaves {max_tokens} new tokens per stream next to "
                                  f"a {long_len}-token prompt: raise --interference-kv-memory")
            log(f"[{server.name}] {args.streams} streams of max_tokens {max_tokens}; long prompt ~{long_len} tokens "
                f"({long_pages} of {pages_total:.0f} pages)")
            records: list[dict] = []

            async def worker(i: int) -> None:
                while not stop.is_set():
                    rec = {"stream": i}
                    records.append(rec)
                    await stream_chat(client, url, stream_body(i, max_tokens), rec)
                    if rec["error"] and not stop.is_set():
                        log(f"[{server.name}] stream {i} failed: {rec['error']} {rec.get('message') or ''}")
                        await asyncio.sleep(1.0)

            tasks = [asyncio.create_task(worker(i)) for i in range(args.streams)]
            await wait_until(lambda: len({r["stream"] for r in records if r.get("times")}) == args.streams,
                             args.request_timeout, "every stream's first token")
            await asyncio.sleep(args.settle_s)
            log(f"[{server.name}] baseline window {args.baseline_s:.0f}s")
            stop_mon = asyncio.Event()
            mon = asyncio.create_task(sampler.run(stop_mon))
            m0, c0 = await sampler.scrape(), server.mark()
            tb0 = time.perf_counter()
            await asyncio.sleep(args.baseline_s)
            tb1 = time.perf_counter()
            m1, c1 = await sampler.scrape(), server.mark()
            log(f"[{server.name}] sending the long prompt")
            tl0 = time.perf_counter()
            long = await post_chat(client, url, chat_body(server.model, user(long_text),
                                                          1, False))
            tl1 = time.perf_counter()
            m2, c2 = await sampler.scrape(), server.mark()
            stop_mon.set()
            await mon
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if long["status"] != 200:
                log(f"[{server.name}] long prompt failed: {long['error']} {long['message']}")
            base, during = gap_stats(records, tb0, tb1), gap_stats(records, tl0, tl1)
            hist = "lcx_inter_token_latency_seconds"
            b0, b1, b2 = (buckets(m or [], hist) for m in (m0, m1, m2))
            for stats, (x, y), (ca, cb), (ta, tz) in ((base, (b0, b1), (c0, c1), (tb0, tb1)),
                                                      (during, (b1, b2), (c1, c2), (tl0, tl1))):
                stats["server_itl_p50_s"] = hist_quantile(x, y, 50)
                stats["server_itl_p99_s"] = hist_quantile(x, y, 99)
                stats["compiles"] = server.compiles(ca, cb)
                stats["streams_started"] = sum(1 for r in records if ta < r.get("t_send", 0) <= tz)
            during["waiting"] = sampler.waiting(tl0, tl1)
            ratio = (during["gap_p99_s"] / base["gap_p99_s"]) if base["gap_p99_s"] and during["gap_p99_s"] else None
            res.update(baseline=base, during=during, p99_ratio=ratio, goal_p99_ratio=2.0, long=long,
                       long_ttft_s=long["latency_s"], kv_pages_peak=sampler.peak("pages_used"),
                       kv_bytes_peak=sampler.peak("bytes_used"),
                       stream_finishes=sorted(str(r.get("finish_reason")) for r in records),
                       stream_errors=[r["error"] for r in records if r.get("error")][:5],
                       records=[strip_times(r, tb0) for r in records], metrics=sampler.series(tb0),
                       windows_s={"baseline": [0.0, tb1 - tb0], "during": [tl0 - tb0, tl1 - tb0]})
            log(f"[{server.name}] gap p99 baseline {ms(base['gap_p99_s'])} ms, during {ms(during['gap_p99_s'])} ms "
                f"(x{ratio or float('nan'):.2f}); long prompt TTFT {long['latency_s']:.1f}s "
                f"(HTTP {long['status']}, prompt_tokens {(long['usage'] or {}).get('prompt_tokens')}); compiles "
                f"{base['compiles'].get('count')} / {during['compiles'].get('count')}")
    except ServerError as e:
        res["failed"] = str(e)
        log(f"[{server.name}] FAILED: {e}")
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        server.stop(args.stop_timeout)
        res["server"] = server.record()
    return res


async def scenario_interference(args, prose, out_dir, stem) -> dict:
    return {"runs": [await interference_one(args, prose, c, out_dir, stem) for c in args.chunks]}


def table_interference(res: dict) -> str:
    rows = []
    for r in res["runs"]:
        if r.get("failed"):
            rows.append([r["prefill_chunk"], r["segment"], f"failed: {cell(r['failed'], 80)}"] + ["—"] * 10)
            continue
        b, d = r["baseline"], r["during"]
        ok = r["p99_ratio"] is not None and r["p99_ratio"] <= r["goal_p99_ratio"]
        rows.append([r["prefill_chunk"], r["segment"], f"{b['streams']}/{r['streams']}",
                     f"{ms(b['gap_p50_s'])} / {ms(b['gap_p99_s'])}", f"{ms(d['gap_p50_s'])} / {ms(d['gap_p99_s'])}",
                     f"{r['p99_ratio']:.2f}x {'ok' if ok else 'MISSED'}" if r["p99_ratio"] else "—",
                     f"{ms(b['mean_itl_s'])} / {ms(d['mean_itl_s'])}",
                     f"{ms(b['server_itl_p99_s'])} / {ms(d['server_itl_p99_s'])}",
                     f"{sec(r['long_ttft_s'])} (HTTP {r['long']['status']})",
                     (r["long"].get("usage") or {}).get("prompt_tokens", "—"),
                     f"{ms(d['gap_max_s'])}", f"{compiles(b)} / {compiles(d)}",
                     f"{d['waiting']['seconds']:.1f} s (max {d['waiting']['max']})"])
    head = ["--prefill-chunk", "--segment", "streams", "gap p50/p99 ms baseline", "gap p50/p99 ms during",
            "p99 during/baseline (goal ≤2x)", "mean ITL ms base/during", "server ITL p99 ms base/during",
            "long TTFT s", "long prompt tok", "max gap during ms", "XLA compiles base/during",
            "requests waiting during"]
    return md_table(head, rows)


# --------------------------------------------------------------------------------------------------------------
# scenario 2: incident
# --------------------------------------------------------------------------------------------------------------

async def incident_one(args, prose: Prose, policy: str, out_dir: Path, stem: str) -> dict:
    import httpx

    flags = ["--max-model-len", str(args.incident_max_model_len), "--max-num-seqs", str(args.short_streams + 1),
             "--kv-memory", args.kv_memory, "--segment", str(args.segment), "--prefill-chunk",
             str(args.prefill_chunk), "--cache-policy", policy]
    params = [] if policy == "full" else [f"budget={args.budget}"]
    for p in params:
        flags += ["--cache-param", p]
    server = Server(args, f"incident_{policy}", flags, out_dir / f"{stem}_incident_{policy}.log")
    res: dict = {"policy": policy, "params": params}
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    shorts: list[asyncio.Task] = []
    try:
        server.start()
        async with httpx.AsyncClient(timeout=timeout) as client, \
                httpx.AsyncClient(timeout=30, headers={"Connection": "close"}) as probe:
            try:
                await server.wait_ready(probe, args.startup_timeout)
            except ServerError as e:
                if server.proc.poll() is None:
                    raise
                res["refused_at_start"] = server.error_line() or str(e).splitlines()[0]
                res["exit_code"] = server.proc.returncode
                log(f"[{server.name}] refused at start (exit {server.proc.returncode}): {res['refused_at_start']}")
                return res
            url = server.base + "/v1/chat/completions"
            sampler = Sampler(probe, server.base, args.metrics_interval)
            res["pages_total"] = metric(await sampler.scrape() or [], "lcx_kv_pages_total")
            overhead = await template_overhead(client, url, server.model, prose)
            long_text = prose.take(args.long_tokens) + LONG_QUESTION
            long_len = prose.count(long_text) + overhead

            def short_body(i: int, n: int) -> dict:
                return chat_body(server.model, user(SHORT_QUESTIONS[i % len(SHORT_QUESTIONS)]), n, True)

            async def shorts_then(long_body: dict | None, n_short: int, records: list[dict]):
                """The drill: the short streams, then (once each has its first token, plus --lead-s) the long."""
                tasks = [asyncio.create_task(stream_chat(client, url, short_body(i, n_short), rec))
                         for i, rec in enumerate(records)]
                shorts.extend(tasks)  # cancelled in ``finally`` if the drill fails
                await wait_until(lambda: all(r.get("times") or r.get("t_done") for r in records),
                                 args.request_timeout, "every short stream's first token")
                t_ready = time.perf_counter()
                await asyncio.sleep(args.lead_s)
                long: dict = {"running_at_arrival": sum(1 for r in records if not r.get("t_done"))}
                t_long = time.perf_counter()
                if long_body is not None:
                    await stream_chat(client, url, long_body, long)
                await asyncio.gather(*tasks)
                return t_ready, t_long, long

            # rehearsal (compiles what the drill would otherwise compile): the same shape of traffic, other prompts;
            # under eviction the long prompt's twin has its length modulo the prefill chunk and outgrows the budget
            t = time.perf_counter()
            twin = None
            if policy != "full":
                step = min(args.prefill_chunk, INTERVAL)
                n = shape_twin_length(long_len, step, min(long_len, args.budget + INTERVAL + 2 * step))
                twin = chat_body(server.model, user(twin_text(prose, n - overhead)), 2, True)
            warm = [{"stream": i} for i in range(args.short_streams)]
            _, _, warm_long = await shorts_then(twin, 8, warm)
            errors = [r["error"] for r in [*warm, warm_long] if r.get("error")]
            res["rehearsal"] = {"seconds": time.perf_counter() - t, "errors": errors,
                                "long_prompt_tokens": (warm_long.get("usage") or {}).get("prompt_tokens")}
            log(f"[{server.name}] rehearsal in {res['rehearsal']['seconds']:.1f}s"
                + (f" (twin of {res['rehearsal']['long_prompt_tokens']} tokens)" if twin else "")
                + (f"; errors {errors}" if errors else ""))
            res["pages_idle"] = metric(await sampler.scrape() or [], "lcx_kv_pages_used")
            # the drill
            records: list[dict] = [{"stream": i} for i in range(args.short_streams)]
            t_origin = time.perf_counter()
            mark0 = server.mark()
            stop_mon = asyncio.Event()
            mon = asyncio.create_task(sampler.run(stop_mon))
            long_body = chat_body(server.model, user(long_text), args.long_max_tokens, True)
            t_ready, tl0, long = await shorts_then(long_body, args.short_max_tokens, records)
            tl1 = long["t_done"]
            t_end = time.perf_counter()
            await sampler.scrape()
            stop_mon.set()
            await mon
            res["pages_after"] = metric(await sampler.scrape() or [], "lcx_kv_pages_used")
            before = gap_stats(records, t_ready, tl0)
            after = gap_stats(records, tl0, t_end)
            res.update(
                short_running_at_arrival=long["running_at_arrival"], long_prompt_tokens_est=long_len,
                long_status=long["status"], long_latency_s=long["latency_s"], long_ttft_s=long["ttft_s"],
                long_message=long["message"], long_error=long["error"], long_text=long["text"],
                long_finish=long["finish_reason"], long_usage=long["usage"],
                long_waiting=sampler.waiting(tl0, tl1), kv_pages_peak_during_long=sampler.peak("pages_used", tl0, tl1),
                kv_bytes_peak_during_long=sampler.peak("bytes_used", tl0, tl1),
                kv_pages_peak=sampler.peak("pages_used"), kv_bytes_peak=sampler.peak("bytes_used"),
                shorts_finish=[r["finish_reason"] for r in records], shorts_errors=[r["error"] for r in records],
                shorts_tokens=[(r["usage"] or {}).get("completion_tokens") for r in records],
                shorts_before=before, shorts_after=after, compiles_during_drill=server.compiles(mark0),
                metrics_error=sampler.error, long_record=strip_times(long, t_origin),
                records=[strip_times(r, t_origin) for r in records], metrics=sampler.series(t_origin))
            log(f"[{server.name}] long: HTTP {long['status']} after {long['latency_s']:.2f}s"
                + (f", TTFT {long['ttft_s']:.1f}s, {len(long['text'])} chars" if long["ttft_s"] else "")
                + (f": {long['message'][:200]}" if long["message"] else "")
                + f"; peak KV {res['kv_pages_peak_during_long']} pages; shorts {res['shorts_finish']}; "
                  f"compiles during the drill {res['compiles_during_drill'].get('count')}")
    except ServerError as e:
        res["failed"] = str(e)
        log(f"[{server.name}] FAILED: {e}")
    finally:
        for task in shorts:
            task.cancel()
        if shorts:
            await asyncio.gather(*shorts, return_exceptions=True)
        server.stop(args.stop_timeout)
        res["server"] = server.record()
    return res


async def scenario_incident(args, prose, out_dir, stem) -> dict:
    return {"kv_memory": args.kv_memory, "long_tokens": args.long_tokens, "budget": args.budget,
            "runs": [await incident_one(args, prose, p, out_dir, stem) for p in args.policies]}


def table_incident(res: dict) -> str:
    rows = []
    for r in res["runs"]:
        name = r["policy"] + (f" ({', '.join(r['params'])})" if r["params"] else "")
        if r.get("refused_at_start"):
            rows.append([name, f"refused at start: {cell(r['refused_at_start'], 240)}"] + ["—"] * 8)
            continue
        if r.get("failed"):
            rows.append([name, f"failed: {cell(r['failed'], 120)}"] + ["—"] * 8)
            continue
        served = r["long_status"] == 200 and not r["long_error"]
        waited = r["long_waiting"]["seconds"]
        outcome = (f"served: TTFT {sec(r['long_ttft_s'])} s, total {sec(r['long_latency_s'])} s"
                   + (f" (~{waited:.1f} s with requests waiting)" if waited else "") if served else
                   f"HTTP {r['long_status']} in {ms(r['long_latency_s'])} ms" + (f" ({r['long_error']})"
                                                                                 if r["long_status"] == 200 else ""))
        answer = cell(r["long_text"], 60) if served else cell(r["long_message"], 400)
        pages, nbytes, when = r["kv_pages_peak_during_long"], r["kv_bytes_peak_during_long"], ""
        if pages is None:  # no scrape while it was in flight (a refusal takes milliseconds): the whole drill's
            pages, nbytes, when = r["kv_pages_peak"], r["kv_bytes_peak"], " (whole drill)"
        kv = f"{pages:.0f} / {r['pages_total']:.0f} ({mib(nbytes)}){when}" if pages is not None else "—"
        finishes = r["shorts_finish"]
        ok = sum(1 for f in finishes if f)
        rows.append([name, f"{r['short_running_at_arrival']}", outcome, answer, kv,
                     f"{ok}/{len(finishes)} ({', '.join(sorted(set(str(f) for f in finishes)))})",
                     f"{ms(r['shorts_before']['gap_p99_s'])} / {ms(r['shorts_after']['gap_p99_s'])}",
                     (r["long_usage"] or {}).get("prompt_tokens", "—"), r["pages_after"],
                     compiles(r["compiles_during_drill"])])
    head = ["policy", "shorts running at arrival", "long prompt", "answer / message", "peak KV pages during long",
            "shorts finished", "shorts gap p99 ms before/after", "long prompt tok", "pages used after",
            "XLA compiles in drill"]
    return md_table(head, rows)


# --------------------------------------------------------------------------------------------------------------
# scenario 3: restart
# --------------------------------------------------------------------------------------------------------------

def store_size(path: Path) -> dict:
    files = [p for p in path.glob("*.kvp") if not p.name.startswith(".tmp-")]
    tmps = list(path.glob(".tmp-*"))
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files), "tmp_files": len(tmps)}


async def restart_flow(args, prose: Prose, out_dir: Path, stem: str, store: Path, cold_store: Path) -> dict:
    import httpx

    res: dict = {"store_dir": str(store), "cold_store_dir": str(cold_store)}
    head = "You are a helpful assistant. Answer briefly, using the reference below when it helps.\n\nReference:\n"
    twin_head = "Background notes for this chat follow; consult them if useful.\n\nNotes:\n"
    q1 = "\n\nWhat is the reference above mainly about? Answer in one short sentence."
    q2 = "Thanks. Now name one Python keyword that the reference mentions."
    n_sys = max(args.conversation_tokens - prose.count(q1) - 24, 16)
    system = head + prose.take(n_sys - prose.count(head), start=60_000)
    twin_system = twin_head + prose.take(n_sys - prose.count(twin_head), start=75_000)

    def flags(directory: Path) -> list[str]:
        return ["--max-model-len", str(args.restart_max_model_len), "--max-num-seqs", str(args.restart_max_num_seqs),
                "--segment", str(args.segment), "--prefill-chunk", str(args.prefill_chunk),
                "--kv-store", str(directory)]

    timeout = httpx.Timeout(args.request_timeout, connect=30)
    mt = args.turn_max_tokens
    servers = []

    async def measured(server, client, messages, label) -> dict:
        rec: dict = {}
        mark = server.mark()
        await stream_chat(client, server.base + "/v1/chat/completions", chat_body(server.model, messages, mt, True),
                          rec)
        await asyncio.sleep(0.2)  # the log's last lines
        usage = rec["usage"] or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        out = {"label": label, "status": rec["status"], "error": rec["error"], "message": rec["message"],
               "ttft_s": rec["ttft_s"], "latency_s": rec["latency_s"], "text": rec["text"],
               "finish_reason": rec["finish_reason"], "prompt_tokens": usage.get("prompt_tokens"),
               "cached_tokens": cached,
               "cached_share": cached / usage["prompt_tokens"] if cached is not None and usage.get("prompt_tokens")
               else None, "compiles": server.compiles(mark)}
        log(f"[{server.name}] {label}: TTFT {sec(rec['ttft_s'])}s, prompt {out['prompt_tokens']}, cached "
            f"{cached}; {rec['error'] or ''} {rec['text']!r:.80}")
        return out

    try:
        async with httpx.AsyncClient(timeout=timeout) as client, \
                httpx.AsyncClient(timeout=30, headers={"Connection": "close"}) as probe:
            # --- server A: turn 1, the twin, turn 2 killed at its first chunk
            a = Server(args, "restart_A", flags(store), out_dir / f"{stem}_restart_A.log").start()
            servers.append(a)
            await a.wait_ready(probe, args.startup_timeout)
            url = a.base + "/v1/chat/completions"
            turn1 = [{"role": "system", "content": system}, {"role": "user", "content": q1.strip()}]
            r1 = await post_chat(client, url, chat_body(a.model, turn1, mt, False))
            if r1["status"] != 200:
                raise ServerError(f"turn 1 failed: {r1['error']} {r1['message']}")
            answer_a = r1["text"]
            res["turn1"] = {"latency_s": r1["latency_s"], "usage": r1["usage"], "text": answer_a}
            log(f"[{a.name}] turn 1: {r1['usage']['prompt_tokens']} prompt tokens, {r1['latency_s']:.1f}s, "
                f"answer {answer_a!r:.80}")
            turn2 = [*turn1, {"role": "assistant", "content": answer_a}, {"role": "user", "content": q2}]
            twin2 = [{"role": "system", "content": twin_system}, *turn2[1:]]
            rt = await post_chat(client, url, chat_body(a.model, twin2, mt, False))
            res["twin_on_A"] = {"latency_s": rt["latency_s"], "usage": rt["usage"], "error": rt["error"]}
            log(f"[{a.name}] twin of turn 2: {(rt['usage'] or {}).get('prompt_tokens')} prompt tokens, "
                f"{rt['latency_s']:.1f}s")
            killed: dict = {}

            def kill_at_first(rec: dict, content: str) -> None:
                if not killed:
                    killed["t"] = time.perf_counter()
                    killed["first_chunk"] = content
                    a.signal_group(signal.SIGKILL)

            rk: dict = {}
            await stream_chat(client, url, chat_body(a.model, turn2, mt, True), rk, on_content=kill_at_first)
            code = a.kill9()  # the group had its SIGKILL at the first chunk: this reaps it
            res["killed"] = {"exit_code": code, "first_chunk": killed.get("first_chunk"),
                             "first_chunk_after_s": (killed["t"] - rk["t_send"]) if killed else None,
                             "chunks_seen": len(rk["times"]), "text_seen": rk["text"], "client_error": rk["error"],
                             "store_after_kill": store_size(store)}
            log(f"[{a.name}] SIGKILL at the first chunk of turn 2 ({len(rk['times'])} chunk(s) seen, {rk['text']!r}); "
                f"exit {code}; store {res['killed']['store_after_kill']}")
            if not killed:
                raise ServerError(f"turn 2 streamed no content before it ended: {rk['error']} {rk['message']}")
            # --- server B: restarted on the same store
            b = Server(args, "restart_B", flags(store), out_dir / f"{stem}_restart_B.log").start()
            servers.append(b)
            await b.wait_ready(probe, args.startup_timeout)
            res["restart_twin"] = await measured(b, client, twin2, "first request after restart (twin)")
            res["restart_turn2"] = await measured(b, client, turn2, "turn 2 after restart")
            b.stop(args.stop_timeout)
            res["store_after_restart"] = store_size(store)
            # --- server C: a fresh server with an empty store
            c = Server(args, "restart_cold", flags(cold_store), out_dir / f"{stem}_restart_cold.log").start()
            servers.append(c)
            await c.wait_ready(probe, args.startup_timeout)
            res["cold_twin"] = await measured(c, client, twin2, "cold twin (warm-up)")
            res["cold_turn2"] = await measured(c, client, turn2, "turn 2 cold")
            c.stop(args.stop_timeout)
            rt2, ct2 = res["restart_turn2"], res["cold_turn2"]
            res["ttft_ratio"] = rt2["ttft_s"] / ct2["ttft_s"] if rt2["ttft_s"] and ct2["ttft_s"] else None
            res["texts_identical"] = rt2["text"] == ct2["text"] and rt2["error"] is None and ct2["error"] is None
            res["seen_before_kill_is_prefix"] = bool(rk["text"]) and rt2["text"].startswith(rk["text"])
            res["goals"] = {"cached_share": 0.9, "ttft_ratio": 0.25}
    except ServerError as e:
        res["failed"] = str(e)
        log(f"[restart] FAILED: {e}")
    finally:
        for s in servers:
            s.stop(args.stop_timeout)
        res["servers"] = [s.record() for s in servers]
    return res


async def scenario_restart(args, prose, out_dir, stem) -> dict:
    if args.store_dir:
        store = Path(args.store_dir)
        if store.exists() and any(store.iterdir()):
            raise SystemExit(f"--store-dir {store} is not empty: the drill needs a fresh store")
        store.mkdir(parents=True, exist_ok=True)
    else:
        store = Path(tempfile.mkdtemp(prefix="lcx-incident-store-"))
    cold_store = Path(tempfile.mkdtemp(prefix="lcx-incident-cold-"))
    try:
        return await restart_flow(args, prose, out_dir, stem, store, cold_store)
    finally:
        if not args.keep_store:
            shutil.rmtree(cold_store, ignore_errors=True)
            if not args.store_dir:
                shutil.rmtree(store, ignore_errors=True)


def table_restart(res: dict) -> str:
    if res.get("failed") and "restart_turn2" not in res:
        return f"restart: failed: {res['failed']}"
    rows = []
    for key in ("restart_twin", "restart_turn2", "cold_twin", "cold_turn2"):
        r = res.get(key)
        if not r:
            continue
        share = "—" if r["cached_share"] is None else f"{100 * r['cached_share']:.1f}%"
        rows.append([r["label"], r["prompt_tokens"], r["cached_tokens"], share, sec(r["ttft_s"]),
                     cell(r["text"], 60), r["error"] or r["finish_reason"], compiles(r["compiles"])])
    table = md_table(["request", "prompt tok", "cached tok", "cached share (goal ≥90%)", "TTFT s", "answer",
                      "finish", "XLA compiles"], rows)
    rt2, k = res.get("restart_turn2") or {}, res.get("killed") or {}
    share = rt2.get("cached_share")
    ratio = res.get("ttft_ratio")
    lines = [table, "",
             f"- kill -9 at the first content chunk of turn 2: exit code {k.get('exit_code')}, "
             f"{k.get('chunks_seen')} chunk(s) seen ({k.get('text_seen')!r}); store after the kill: "
             f"{k.get('store_after_kill')}",
             f"- cached share after restart: {'—' if share is None else f'{100 * share:.1f}%'} "
             f"({'ok' if share is not None and share >= 0.9 else 'MISSED'}; goal ≥ 90%)",
             f"- TTFT restarted / cold: {'—' if ratio is None else f'{ratio:.3f}'} "
             f"({'ok' if ratio is not None and ratio <= 0.25 else 'MISSED'}; goal ≤ 0.25)",
             f"- answers identical (restarted vs cold, greedy): {res.get('texts_identical')}; text seen before the "
             f"kill is a prefix of the restarted answer: {res.get('seen_before_kill_is_prefix')}",
             f"- store on disk after the restart's requests: {res.get('store_after_restart')} "
             f"({mib((res.get('store_after_restart') or {}).get('bytes'))})"]
    if res.get("failed"):
        lines.append(f"- failed: {res['failed']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------

SCENARIOS = {"interference": (scenario_interference, table_interference),
             "incident": (scenario_incident, table_incident),
             "restart": (scenario_restart, table_restart)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--scenarios", default="interference,incident,restart",
                   help="comma-separated: interference, incident, restart")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF model directory")
    p.add_argument("--out", default="runs/bench/serve_incident.json", help="JSON results (logs go next to it)")
    p.add_argument("--long-tokens", type=int, default=16384, help="tokens of prose in the long prompt")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--segment", type=int, default=8, help="lcx --segment (decode steps between admissions)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="lcx --prefill-chunk (incident, restart)")
    p.add_argument("--lcx-args", default="", help="extra arguments for every lcx serve")
    p.add_argument("--server-log-level", default="warning", help="lcx serve --log-level")
    p.add_argument("--log-compiles", action=argparse.BooleanOptionalAction, default=True,
                   help="start servers with JAX_LOG_COMPILES=1 and count the XLA compilations in each window")
    g = p.add_argument_group("interference")
    g.add_argument("--chunks", default="256", help="comma-separated --prefill-chunk values, one run each")
    g.add_argument("--streams", type=int, default=8)
    g.add_argument("--interference-max-num-seqs", type=int, default=9)
    g.add_argument("--interference-max-model-len", type=int, default=17408)
    g.add_argument("--interference-kv-memory", default="1600MiB")
    g.add_argument("--stream-max-tokens", type=int, default=8192,
                   help="cap on the streams' max_tokens (else sized to the pool next to the long prompt)")
    g.add_argument("--baseline-s", type=float, default=20.0, help="seconds of the baseline window")
    g.add_argument("--settle-s", type=float, default=3.0, help="seconds after every stream's first token")
    g = p.add_argument_group("incident")
    g.add_argument("--kv-memory", default="256MiB", help="the one KV budget of every policy")
    g.add_argument("--policies", default="full,streaming,tova,snapkv,kvzip", help="comma-separated policies")
    g.add_argument("--budget", type=int, default=1024, help="--cache-param budget= of the evicting policies")
    g.add_argument("--incident-max-model-len", type=int, default=17408)
    g.add_argument("--short-streams", type=int, default=4)
    g.add_argument("--short-max-tokens", type=int, default=200)
    g.add_argument("--long-max-tokens", type=int, default=32, help="max_tokens of the long prompt (its answer)")
    g.add_argument("--lead-s", type=float, default=3.0, help="seconds the short streams run before the long one")
    g = p.add_argument_group("restart")
    g.add_argument("--conversation-tokens", type=int, default=4096, help="tokens of the first turn (system + question)")
    g.add_argument("--restart-max-model-len", type=int, default=8192)
    g.add_argument("--restart-max-num-seqs", type=int, default=2)
    g.add_argument("--turn-max-tokens", type=int, default=16)
    g.add_argument("--store-dir", default=None, help="the --kv-store directory (must be empty; default: a temp dir)")
    g.add_argument("--keep-store", action="store_true", help="keep the store directories")
    g = p.add_argument_group("timing")
    g.add_argument("--metrics-interval", type=float, default=0.2, help="seconds between /metrics scrapes")
    g.add_argument("--startup-timeout", type=float, default=600)
    g.add_argument("--request-timeout", type=float, default=3600)
    g.add_argument("--stop-timeout", type=float, default=20, help="seconds from SIGTERM to SIGKILL")
    args = p.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario(s) {bad}; allowed: {', '.join(SCENARIOS)}")
    args.chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    return args


async def amain(args) -> int:
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model} is not a model directory (no config.json)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prose = Prose(args.model)
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "argv": sys.argv,
              "scenarios": {}}
    for name in args.scenarios:
        log(f"=== scenario {name}")
        run, _ = SCENARIOS[name]
        report["scenarios"][name] = await run(args, prose, out.parent, out.stem)
        out.write_text(json.dumps(report, indent=1, default=str))
    for name, res in report["scenarios"].items():
        print(f"\n## {name}\n")
        print(SCENARIOS[name][1](res))
    print(f"\nJSON: {out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    atexit.register(kill_all)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt as e:
        log(f"interrupted ({e or 'SIGINT'}): stopping every server started")
        return 130
    finally:
        kill_all()


if __name__ == "__main__":
    sys.exit(main())
