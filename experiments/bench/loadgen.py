"""The field's load generator as a benchmark: guidellm 0.8.1 against ``lcx serve`` and ``transformers serve`` on one
local model, rounds alternated (lcx, transformers, lcx, transformers, ...), on two workloads.

Workloads (guidellm's synthetic chats, ``/v1/chat/completions``, streamed; ``--requests`` (16) at ``--concurrency``
(8) in flight; 64 new tokens each with ``ignore_eos``, as guidellm asks):

- ``unshared``: ``--prompt-tokens`` (256) of synthetic text per chat, no two alike (the chat template's opening -
  SmolLM2's default system prompt - is all they share);
- ``shared``: the same plus one system prompt of ``--prefix-tokens`` (256) shared by every chat (guidellm's
  ``prefix_tokens`` / ``prefix_count=1`` options of ``synthetic_text``).

Each round draws other prompts (guidellm's seed is 42 + the round), the same for both servers. Servers are started
once per workload (127.0.0.1, a free port) through ``serve.py``'s launchers - ``transformers serve`` as the issue's
tester ran it (no continuous batching unless ``--tf-cb``; offline, the local directory) - and stopped after it.
``lcx serve`` gets ``--warmup`` for the workload's prompt length as the server sees it (the chat template counted:
``--lcx-warmup auto``), ``JAX_LOG_COMPILES=1`` (the compiles during each run are counted from its log) and an empty
persistent compilation cache of its own (``LCX_CACHE_DIR``: a first start, whatever ran before). With
``--cold-rounds N`` (1) the first N rounds of ``unshared`` also run a fresh ``lcx serve`` without warm-up
(``lcx-cold``): what the warm-up buys.

Before each run the script waits until the 1-minute load average is below ``--max-load`` (1.0), polling every
``--load-poll`` (60) s up to ``--load-wait`` (2400) s, and records the load (other processes share the CPU). Every
run is bounded: guidellm's ``max_requests`` and ``max_duration`` constraints and a subprocess timeout.

guidellm runs from its own virtual environment, made once: ``--venv`` (runs/bench/loadgen-venv) with
``guidellm==0.8.1``; ``aiperf==0.13.0`` is installed there too if it installs cleanly (pip's dry run adds packages
and changes none of guidellm's, then ``pip check``), else skipped with the reason (``--no-aiperf``: not tried; it is
installed only: the runs are guidellm's). On 2026-12-05 it would have downgraded five of guidellm's packages
(huggingface_hub 2.4.0 -> 1.33.0, transformers 5.25.0 -> 5.24.0, ...): skipped.
guidellm reads the local model directory as its tokenizer (no hub is reached).

    python experiments/bench/loadgen.py               # unshared: 2 rounds + 1 without warm-up; shared: 1 round
    python experiments/bench/loadgen.py --workloads unshared --rounds 1 --cold-rounds 0 --requests 8

Output: progress on stderr; a Markdown table (per workload, round and server: requests ok / errored, output tokens/s,
requests/s, TTFT p50 / p99, ITL and TPOT p50, lcx's compiles during the run, the load before it; then lcx /
transformers per workload) on stdout and in ``--out`` (runs/bench/loadgen.json) with the commands, guidellm's
summaries, the machine and the loads. guidellm's own JSON and the server logs go next to it (``loadgen/``: the
``--out`` file's stem).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import serve  # experiments/bench/serve.py: the server commands, launchers and readiness probes

GUIDELLM = "guidellm==0.8.1"
AIPERF = "aiperf==0.13.0"
COMPILE_LINE = re.compile(r"Finished XLA compilation of (.*?) in ([0-9.e+-]+) s")


def log(msg: str) -> None:
    print(f"[loadgen {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------------
# transformers launcher (run in the server subprocess: serve.py's, plus the two request fields guidellm sends)
# --------------------------------------------------------------------------------------------------------------

def _patch_transformers_fields() -> None:
    """Serve two fields guidellm sends that transformers 5.2.0 does not: ``ignore_eos`` (vLLM's; refused with a 422
    "Unexpected keys") as ``min_new_tokens`` = the limit, so EOS cannot end an answer before it, and
    ``max_completion_tokens`` (accepted, then ignored: the model's default length) as ``max_tokens``. The model,
    the attention and the scheduling are untouched."""
    from transformers.cli import serve as tf_serve

    validate, make_config = tf_serve.Serve._validate_request, tf_serve.create_generation_config_from_req

    def _validate_request(self, request, *args, **kwargs):
        ignore_eos = request.pop("ignore_eos", None)
        if request.get("max_tokens") is None and request.get("max_completion_tokens") is not None:
            request["max_tokens"] = request["max_completion_tokens"]
        validate(self, request, *args, **kwargs)
        if ignore_eos:  # back after the check: the handler reads it from the same dict
            request["ignore_eos"] = True

    def create_generation_config_from_req(req, *args, **kwargs):
        config = make_config(req, *args, **kwargs)
        if req.get("ignore_eos") and config.max_new_tokens:
            config.min_new_tokens = config.max_new_tokens
        return config

    tf_serve.Serve._validate_request = _validate_request
    tf_serve.create_generation_config_from_req = create_generation_config_from_req


# --------------------------------------------------------------------------------------------------------------
# the load generator's environment
# --------------------------------------------------------------------------------------------------------------

def ensure_venv(venv: Path, aiperf: bool) -> dict:
    """The venv with guidellm (made once); aiperf tried on request. Returns what is installed and why not."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    if not (venv / "bin" / "guidellm").exists():
        log(f"making {venv} with {GUIDELLM} (once; minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, "install", GUIDELLM], check=True)
    version = subprocess.run([str(venv / "bin" / "guidellm"), "--version"], capture_output=True, text=True)
    status = {"guidellm": version.stdout.strip() or version.stderr.strip()[-200:], "aiperf": "not requested"}
    if aiperf:
        status["aiperf"] = "installed" if (venv / "bin" / "aiperf").exists() else install_cleanly(pip, AIPERF)
        log(f"aiperf: {status['aiperf']}")
    return status


def install_cleanly(pip: list[str], requirement: str) -> str:
    """Install ``requirement`` only if that adds packages and changes none guidellm uses (pip's dry-run report,
    then ``pip check``); else say why not."""
    report = subprocess.run([*pip, "install", "--dry-run", "--quiet", "--report", "-", requirement],
                            capture_output=True, text=True)
    if report.returncode != 0:
        return f"skipped: pip cannot install it: {report.stderr.strip()[-300:]}"
    listed = subprocess.run([x for x in pip if x != "-q"] + ["list", "--format", "json"], capture_output=True,
                            text=True)  # quiet, pip list prints nothing
    have = {x["name"].lower().replace("_", "-"): x["version"] for x in json.loads(listed.stdout)}
    changed = [f"{m['name']} {have[k]} -> {m['version']}" for item in json.loads(report.stdout)["install"]
               if (k := (m := item["metadata"])["name"].lower().replace("_", "-")) in have and have[k] != m["version"]]
    if changed:
        return f"skipped: it would change guidellm's environment ({', '.join(changed)})"
    done = subprocess.run([*pip, "install", requirement], capture_output=True, text=True)
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    if done.returncode != 0 or check.returncode != 0:
        return f"installed with problems: {(done.stderr + check.stdout).strip()[-300:]}"
    return "installed"


def guidellm_help(venv: Path) -> str:
    """``guidellm run --help`` (kept in the JSON: the flags this script passes are the ones it lists)."""
    out = subprocess.run([str(venv / "bin" / "guidellm"), "run", "--help"], capture_output=True, text=True)
    return out.stdout


# --------------------------------------------------------------------------------------------------------------
# load, prompt lengths
# --------------------------------------------------------------------------------------------------------------

def wait_for_idle(args) -> dict:
    """Wait until the 1-minute load average is below ``--max-load``; the loads seen and the seconds waited."""
    t0 = time.time()
    seen = []
    while True:
        load = os.getloadavg()
        seen.append(round(load[0], 2))
        if load[0] < args.max_load:
            break
        if time.time() - t0 + args.load_poll > args.load_wait:
            log(f"load {load[0]:.2f} still >= {args.max_load} after {time.time() - t0:.0f}s: running anyway")
            break
        log(f"load {load[0]:.2f} >= {args.max_load}: waiting {args.load_poll:.0f}s")
        time.sleep(args.load_poll)
    return {"load_1m": round(load[0], 2), "load_5m": round(load[1], 2), "waited_s": round(time.time() - t0),
            "idle": load[0] < args.max_load, "seen": seen}


def chat_lengths(model: Path, workload: dict) -> tuple[int, int | None]:
    """(prompt tokens as the server sees a chat of this workload, tokens every chat shares when it has a system
    prompt, else None): guidellm's text lengths plus what the chat template adds, measured on chats of one word."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))

    def ids(messages) -> list[int]:
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    word = len(tok("Hello", add_special_tokens=False)["input_ids"])
    system = [{"role": "system", "content": "Hello"}] if workload["prefix_tokens"] else []
    a, b = (ids(system + [{"role": "user", "content": t}]) for t in ("Hello", "Yes"))
    prompt = len(a) - word * (1 + len(system)) + workload["prompt_tokens"] + workload["prefix_tokens"]
    if not system:
        return prompt, None
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the system turn and the user turn's opening
    return prompt, common - word + workload["prefix_tokens"]


def warmup_spec(args, workload: dict) -> str | None:
    if args.lcx_warmup == "none":
        return None
    if args.lcx_warmup != "auto":
        return args.lcx_warmup
    prompt, shared = chat_lengths(args.model, workload)
    return f"{prompt}:{workload['output_tokens']}" + (f"@{shared}" if shared else "")


# --------------------------------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------------------------------

class Running:
    """A server subprocess started by ``serve.py``'s command and launcher, ready, with its model name."""

    def __init__(self, name: str, kind: str, args, out_dir: Path, extra: str = ""):
        self.name, self.kind, self.model_path = name, kind, str(args.model)
        self.port = serve.free_port()
        self.log_path = out_dir / f"{name}.log"
        ns = argparse.Namespace(model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                page_size=args.page_size, lcx_args=f"{args.lcx_args} {extra}".strip(),
                                tf_args=args.tf_args, tf_cb=args.tf_cb, tf_dtype=args.tf_dtype, tf_no_patch=False)
        cmd, plain, env = serve.server_command(kind, ns, self.port, out_dir / f"{name}_cache.json")
        if kind == "lcx":
            # each compile logged (counted per run), and an empty persistent compilation cache of its own: a first
            # start, not programs an earlier server of this benchmark left in ~/.cache/lcx/jax
            cache = out_dir / f"jax-cache-{name}-{time.strftime('%H%M%S')}"
            env = {**env, "JAX_LOG_COMPILES": "1", "LCX_CACHE_DIR": str(cache.resolve())}
        else:  # serve.py's launcher through this file, which adds the fields patch
            cmd = [cmd[0], str(Path(__file__).resolve()), *cmd[2:]]
        self.command, self.argv, self.env = shlex.join(plain), shlex.join(cmd), {**serve.OFFLINE_ENV, **env}
        log(f"[{name}] starting: {self.command}")
        t0 = time.time()
        self.proc = serve.start_server(cmd, env, self.log_path)
        self.base = f"http://127.0.0.1:{self.port}"
        try:
            self.model, self.model_source = asyncio.run(self._ready(args.startup_timeout))
        except Exception:
            self.stop(args.stop_timeout)
            raise
        self.startup_s = time.time() - t0
        self.warmup_line = next((ln for ln in self.log_lines() if "warm-up:" in ln), None)
        log(f"[{name}] ready after {self.startup_s:.0f}s, model {self.model!r}"
            + (f"; {self.warmup_line.strip()}" if self.warmup_line else ""))

    async def _ready(self, timeout: float):
        import httpx

        async with httpx.AsyncClient(timeout=30, headers={"Connection": "close"}) as probe:
            await serve.wait_ready(probe, self.base, self.proc, self.log_path, timeout)
            return await serve.model_name(probe, self.base, self.model_path)

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_lines(self, start: int = 0) -> list[str]:
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace").splitlines()

    def compiles_since(self, start: int) -> dict | None:
        if self.kind != "lcx":
            return None
        found = [(m.group(1), float(m.group(2))) for ln in self.log_lines(start) if (m := COMPILE_LINE.search(ln))]
        slow = sorted(found, key=lambda x: -x[1])[:5]
        return {"count": len(found), "seconds": round(sum(d for _, d in found), 2),
                "slowest": [f"{n} {d:.2f}s" for n, d in slow]}

    def stop(self, timeout: float) -> None:
        code = serve.stop_server(self.proc, timeout)
        log(f"[{self.name}] stopped (exit {code})")


# --------------------------------------------------------------------------------------------------------------
# guidellm
# --------------------------------------------------------------------------------------------------------------

def guidellm_command(args, server: Running, workload: dict, seed: int, out: Path) -> list[str]:
    data = f"kind=synthetic_text,prompt_tokens={workload['prompt_tokens']},output_tokens={workload['output_tokens']}"
    if workload["prefix_tokens"]:
        data += f",prefix_tokens={workload['prefix_tokens']},prefix_count=1"
    return [str(args.venv / "bin" / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={server.base},model={server.model},timeout={args.request_timeout}",
            "--profile", f"kind=concurrent,streams={args.concurrency}",
            "--constraint", f"kind=max_requests,count={args.requests}",
            "--constraint", f"kind=max_duration,seconds={args.max_duration}",
            "--tokenizer", f"kind=huggingface_auto,model={args.model.resolve()}",
            "--data", data, "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={out}", "--disable-progress"]


def pct(metric: dict, q: str) -> float | None:
    ok = (metric or {}).get("successful") or {}
    return (ok.get("percentiles") or {}).get(q)


def summarize(report: dict) -> dict:
    """The numbers of the table from guidellm's JSON (one benchmark)."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    out_tokens = (m["output_token_count"].get("successful") or {}).get("total_sum")
    errored = (bench.get("requests") or {}).get("errored") or []
    errors = [r.get("info", {}).get("error") or r.get("error") for r in errored][:3]
    return {"ok": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
            "duration_s": bench["duration"], "output_tokens": out_tokens,
            "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "requests_s": m["requests_per_second"]["successful"]["mean"],
            "ttft_p50_ms": pct(m["time_to_first_token_ms"], "p50"),
            "ttft_p99_ms": pct(m["time_to_first_token_ms"], "p99"),
            "itl_p50_ms": pct(m["inter_token_latency_ms"], "p50"),
            "tpot_p50_ms": pct(m["time_per_output_token_ms"], "p50"),
            "prompt_tokens_p50": pct(m["prompt_token_count"], "p50"), "first_errors": errors}


def run_guidellm(args, server: Running, workload: dict, rnd: int, out_dir: Path) -> dict:
    load = wait_for_idle(args)
    seed = 42 + rnd
    out = (out_dir / f"guidellm_{workload['name']}_r{rnd}_{server.name}.json").resolve()
    out.unlink(missing_ok=True)
    cmd = guidellm_command(args, server, workload, seed, out)
    log(f"[{server.name}] {workload['name']} round {rnd + 1}: guidellm (load {load['load_1m']})")
    start, t0 = server.log_size(), time.time()
    env = {**os.environ, **serve.OFFLINE_ENV}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout, env=env,
                              cwd=out_dir)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e)[-3000:]
    res = {"workload": workload["name"], "round": rnd + 1, "server": server.name, "seed": seed,
           "command": shlex.join(cmd), "rc": rc, "wall_s": round(time.time() - t0, 1), "load": load,
           "load_after_1m": round(os.getloadavg()[0], 2), "compiles": server.compiles_since(start),
           "json": str(out)}
    if out.exists():
        res["summary"] = summarize(json.loads(out.read_text()))
        s = res["summary"]
        log(f"[{server.name}] {s['ok']} ok / {s['errored']} errored, {s['output_tok_s']:.1f} tok/s, TTFT p50 "
            f"{s['ttft_p50_ms'] / 1000:.1f}s" + (f", {res['compiles']['count']} compiles" if res["compiles"] else ""))
    else:
        res["failed"] = f"guidellm rc {rc}, no JSON; output tail:\n{tail}"
        log(f"[{server.name}] FAILED: {res['failed'][:400]}")
    return res


# --------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------

def sec(ms) -> str:
    return "—" if ms is None else f"{ms / 1000:.2f}"


def table(runs: list[dict]) -> str:
    head = ("| workload | round | server | ok / err | out tok/s | req/s | TTFT p50 / p99 s | ITL p50 ms | TPOT p50 ms "
            "| compiles (s) | load |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        if "summary" not in r:
            rows.append(f"| {r['workload']} | {r['round']} | {r['server']} | failed |" + " |" * 7)
            continue
        s, c = r["summary"], r["compiles"]
        comp = "—" if c is None else f"{c['count']} ({c['seconds']:.0f})"
        rows.append(f"| {r['workload']} | {r['round']} | {r['server']} | {s['ok']} / {s['errored']} "
                    f"| {s['output_tok_s']:.1f} | {s['requests_s']:.2f} | {sec(s['ttft_p50_ms'])} / "
                    f"{sec(s['ttft_p99_ms'])} | {s['itl_p50_ms']:.0f} | {s['tpot_p50_ms']:.0f} | {comp} "
                    f"| {r['load']['load_1m']:.2f} |")
    return "\n".join(rows)


def ratios(runs: list[dict]) -> dict:
    """Per workload: lcx / transformers of throughput and TTFT p50, over the rounds both ran (mean of the rounds'
    values), with the goals' verdicts."""
    out = {}
    for wl in dict.fromkeys(r["workload"] for r in runs):
        by = {}
        for r in runs:
            if r["workload"] == wl and "summary" in r:
                by.setdefault(r["server"], []).append(r["summary"])
        if "lcx" not in by or "transformers" not in by:
            continue
        mean = lambda xs, k: statistics.fmean(x[k] for x in xs)  # noqa: E731
        tput = mean(by["lcx"], "output_tok_s") / mean(by["transformers"], "output_tok_s")
        ttft = mean(by["lcx"], "ttft_p50_ms") / mean(by["transformers"], "ttft_p50_ms")
        errors = sum(x["errored"] + x["incomplete"] for xs in by.values() for x in xs)
        out[wl] = {"throughput_ratio": round(tput, 2), "ttft_p50_ratio": round(ttft, 2), "errors": errors,
                   "goal_throughput_2x": tput >= 2, "goal_ttft_p50_le": ttft <= 1, "goal_no_errors": errors == 0}
    return out


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]}


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------

def workloads(args) -> list[dict]:
    base = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    table_ = {"unshared": {**base, "name": "unshared", "prefix_tokens": 0},
              "shared": {**base, "name": "shared", "prefix_tokens": args.prefix_tokens}}
    for name in args.workloads:
        if name not in table_:
            raise SystemExit(f"--workloads: {name!r} is not a workload (allowed: unshared, shared)")
    return [table_[n] for n in args.workloads]


def bench_workload(args, workload: dict, out_dir: Path) -> list[dict]:
    spec = warmup_spec(args, workload)
    workload["lcx_warmup"] = spec
    runs = []
    servers = {}
    try:
        wait_for_idle(args)
        servers["lcx"] = Running("lcx", "lcx", args, out_dir, f"--warmup {spec}" if spec else "")
        servers["transformers"] = Running("transformers", "transformers", args, out_dir)
        cold_rounds = args.cold_rounds if workload["name"] == "unshared" else 0
        for rnd in range(args.rounds if workload["name"] == "unshared" else args.shared_rounds):
            for name in ("lcx", "transformers"):
                runs.append(run_guidellm(args, servers[name], workload, rnd, out_dir))
            if rnd < cold_rounds:  # a fresh lcx without warm-up, its first requests paying the compiles
                wait_for_idle(args)
                cold = Running("lcx-cold", "lcx", args, out_dir)
                try:
                    runs.append(run_guidellm(args, cold, workload, rnd, out_dir))
                finally:
                    cold.stop(args.stop_timeout)
        for r in runs:
            srv = servers.get(r["server"])
            r.setdefault("server_command", srv.command if srv else None)
        workload["servers"] = {n: {"command": s.command, "argv": s.argv, "env": s.env, "model": s.model,
                                   "startup_s": round(s.startup_s, 1), "warmup": s.warmup_line}
                               for n, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop(args.stop_timeout)
    return runs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=serve.DEFAULT_MODEL, help="HF model directory (both servers)")
    p.add_argument("--workloads", default="unshared,shared", help="comma-separated: unshared, shared")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds of the unshared workload")
    p.add_argument("--shared-rounds", type=int, default=1, help="alternated rounds of the shared workload")
    p.add_argument("--cold-rounds", type=int, default=1, help="rounds of unshared with a fresh lcx without warm-up")
    p.add_argument("--requests", type=int, default=16, help="chats per run (guidellm max_requests)")
    p.add_argument("--concurrency", type=int, default=8, help="chats in flight (guidellm concurrent streams)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=256, help="the shared workload's system prompt")
    p.add_argument("--lcx-warmup", default="auto", help="lcx serve --warmup: auto (the workload's chat length), "
                   "none, or a spec")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--lcx-args", default="", help="extra arguments for lcx serve")
    p.add_argument("--tf-args", default="", help="extra arguments for transformers serve")
    p.add_argument("--tf-dtype", default="float32")
    p.add_argument("--tf-cb", action="store_true", help="transformers with continuous batching (patched as serve.py "
                   "does; default: without, as the issue's tester ran it)")
    p.add_argument("--max-load", type=float, default=1.0, help="run when the 1-minute load average is below this")
    p.add_argument("--load-wait", type=float, default=2400, help="seconds to wait for that at most, per run")
    p.add_argument("--load-poll", type=float, default=60, help="seconds between load checks")
    p.add_argument("--max-duration", type=int, default=600, help="guidellm max_duration per run (s)")
    p.add_argument("--request-timeout", type=int, default=600, help="guidellm per-request timeout (s)")
    p.add_argument("--run-timeout", type=int, default=900, help="seconds before a guidellm run is killed")
    p.add_argument("--startup-timeout", type=float, default=1200, help="seconds for a server to be ready "
                   "(the warm-up included)")
    p.add_argument("--stop-timeout", type=float, default=20)
    p.add_argument("--venv", type=Path, default=Path("runs/bench/loadgen-venv"))
    p.add_argument("--no-aiperf", dest="aiperf", action="store_false", help=f"do not try {AIPERF} (by default it "
                   "is installed in the venv if it installs cleanly)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/loadgen.json"))
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.venv = args.venv.resolve()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model} is not a model directory (no config.json): see docs/benchmarks.md")
    os.environ.update(serve.OFFLINE_ENV)
    out_dir = args.out.parent / args.out.stem  # guidellm's JSON and the server logs
    out_dir.mkdir(parents=True, exist_ok=True)
    tools = ensure_venv(args.venv, args.aiperf)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    t0 = time.time()
    runs, wls = [], workloads(args)
    for wl in wls:
        runs += bench_workload(args, wl, out_dir)
    report = {"date": started, "wall_s": round(time.time() - t0), "machine": machine(), "tools": tools,
              "argv": sys.argv, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "workloads": wls, "runs": runs, "ratios": ratios(runs), "guidellm_run_help": guidellm_help(args.venv)}
    args.out.write_text(json.dumps(report, indent=1))
    print(table(runs))
    for wl, r in report["ratios"].items():
        print(f"\n{wl}: lcx / transformers throughput {r['throughput_ratio']:.2f}x (goal >= 2: "
              f"{'met' if r['goal_throughput_2x'] else 'missed'}), TTFT p50 {r['ttft_p50_ratio']:.2f}x (goal <= 1: "
              f"{'met' if r['goal_ttft_p50_le'] else 'missed'}), errors {r['errors']}")
    print(f"\n{started}, {report['wall_s']} s; {report['machine']['cpu']} x {report['machine']['cores']}; "
          f"JSON: {args.out}")
    return 0 if all("summary" in r and not r["summary"]["errored"] for r in runs) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tf-launcher"]:
        _patch_transformers_fields()
        serve.tf_launcher(sys.argv[2:])
    sys.exit(main())
