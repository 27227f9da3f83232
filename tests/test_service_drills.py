"""Operational drills of ``lcx serve`` as a real process driven by the real ``openai`` client: ``kill -9`` in the
middle of a stream and a restart on the same ``--kv-store`` (the stored pages are served, and give the tokens a
recomputation gives), a corrupt store (truncated and bit-flipped page files are detected, deleted or rewritten whole,
and never served), a ``SIGTERM`` drain (new requests 503, the running stream finishes, the process exits 0), and the
pool back to its baseline after every drill on a server that stays up (cancelled streams, dropped connections, stop
strings, more requests than rows).

Each server is a subprocess (``python -m lcx serve``) on the tiny chat model of ``tests/tiny_chat_model.py``; they
share one persistent compilation cache, and the servers that survive a test are module-scoped.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
import httpx  # noqa: E402  (openai's own dependency)

from lcx.data.haystack import NOISE  # noqa: E402
from lcx.engine.kv_store import DIGEST, MAGIC, SUFFIX, chain  # noqa: E402

PAGE = 8
MAX_MODEL_LEN = 512
NAME = "tiny"
READY_TIMEOUT = 90.0  # seconds: a cold compilation cache makes the first start slow
SETTLE_TIMEOUT = 10.0  # seconds for the metrics to show a finished / cancelled request gone

SYSTEM = (NOISE * 12).strip()  # ~300 tokens of prose
FIRST_TURN = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hi."}]
NEW_TURN = {"role": "user", "content": "Here we go again."}


# --------------------------------------------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """One ``lcx serve`` subprocess; ``start`` returns at once, ``wait_ready`` polls ``/health``."""

    def __init__(self, model_dir: Path, workdir: Path, name: str, env: dict, *flags: str):
        self.name, self.port = name, _free_port()
        self.log_path = workdir / f"{name}.log"
        self.cmd = [sys.executable, "-m", "lcx", "serve", str(model_dir), "--host", "127.0.0.1", "--port",
                    str(self.port), "--max-model-len", str(MAX_MODEL_LEN), "--page-size", str(PAGE),
                    "--max-num-seqs", "4", "--served-model-name", NAME, "--log-level", "warning", *flags]
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> ServeProcess:
        with open(self.log_path, "wb") as log:  # a file, not a pipe: a full pipe would block the server
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server {self.name} exited with {self.proc.returncode} before it was ready:\n"
                                     f"{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server {self.name} not ready after {timeout:.0f} s:\n{self.tail()}")

    def client(self, timeout: float = 60.0):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {name or name{labels}: value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([A-Za-z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$", line)
            if m and not line.startswith("#"):
                out[m.group(1)] = float(m.group(2))
        return out

    def settle(self, pages: float | None = None, timeout: float = SETTLE_TIMEOUT) -> dict[str, float]:
        """The metrics once no request runs or waits (and, given ``pages``, the pool holds that many pages again)
        - the gauges are read off the serving loop after each of its steps, so they lag the HTTP answer a bit."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["lcx_requests_running"] == 0 and m["lcx_requests_waiting"] == 0
            if idle and (pages is None or m["lcx_kv_pages_used"] == pages):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server {self.name} did not return to its baseline ({pages} pages, nothing "
                                     f"running) within {timeout} s: running={m['lcx_requests_running']} waiting="
                                     f"{m['lcx_requests_waiting']} pages={m['lcx_kv_pages_used']}\n{self.tail()}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"server {self.name} still running {timeout} s after signal {sig}:\n{self.tail()}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("drills")


@pytest.fixture(scope="module")
def model_dir(workdir) -> Path:
    from tests.tiny_chat_model import write_model

    return write_model(workdir / "model")


@pytest.fixture(scope="module")
def env(workdir) -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    # one persistent compilation cache for every server of the module (tests/conftest.py names one shared by the
    # whole suite; a run without it gets one of the module's own), so each restart reads its programs back
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "lcx-tests-jax-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def spawn(model_dir, workdir, env):
    """``spawn(name, *flags)``: a started (not yet ready) server, killed at the module's end whatever happened."""
    started: list[ServeProcess] = []

    def _spawn(name: str, *flags: str) -> ServeProcess:
        server = ServeProcess(model_dir, workdir, name, env, *flags).start()
        started.append(server)
        return server

    yield _spawn
    for server in started:
        try:
            server.stop(signal.SIGKILL, timeout=10)
        except AssertionError:
            pass


@pytest.fixture(scope="module")
def reference(spawn) -> ServeProcess:
    """A server with no ``--kv-store`` (an empty host store): every prompt it sees first is recomputed."""
    return spawn("reference").wait_ready()


# --------------------------------------------------------------------------------------------------- helpers
def chat(server: ServeProcess, messages, max_tokens: int = 8, **kw):
    return server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens,
                                                   temperature=0, **kw)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def whole_pages(n_prompt: int) -> int:
    """The prompt tokens a request of ``n_prompt`` can read from pages: the whole pages of all but its last."""
    return (n_prompt - 1) // PAGE * PAGE


def kvp_valid(path: Path) -> bool:
    """``path`` is a whole page file of its own key (its name): magic, header, payload of the recorded size, and
    the digest of all of it keyed by the key."""
    data = path.read_bytes()
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8 + DIGEST:
        return False
    body = data[:-DIGEST]
    if hashlib.blake2b(body, digest_size=DIGEST, key=bytes.fromhex(path.stem)).digest() != data[-DIGEST:]:
        return False
    (size,) = struct.unpack_from("<Q", body, len(MAGIC))
    try:
        header = json.loads(body[len(MAGIC) + 8:len(MAGIC) + 8 + size])
    except ValueError:
        return False
    return len(body) - len(MAGIC) - 8 - size == header["nbytes"]


def page_files(store: Path) -> list[Path]:
    return sorted(p for p in store.glob(f"*{SUFFIX}") if not p.name.startswith(".tmp-"))


# --------------------------------------------------------------------------------------------------- drill 1
@pytest.fixture(scope="module")
def kill_drill(spawn, workdir, request) -> dict:
    """Server A answers a long conversation's first turn, then streams its second turn and is killed (SIGKILL)
    after two chunks; server B restarts on the same store and answers the second turn again. Returns what was
    seen (B stays up, for the corruption drill)."""
    store = workdir / "store"
    a = spawn("A", "--kv-store", str(store))
    ref = request.getfixturevalue("reference")  # starts while A starts
    a.wait_ready()
    out: dict = {"store": store, "streamed_cached": None}

    first = chat(a, FIRST_TURN)
    out["first"] = first
    out["files_after_first"] = len(page_files(store))
    second_turn = FIRST_TURN + [{"role": "assistant", "content": first.choices[0].message.content}, NEW_TURN]
    out["second_turn"] = second_turn

    before = a.metrics()["lcx_prompt_tokens_cached_total"]
    stream = a.client().chat.completions.create(model=NAME, messages=second_turn, max_tokens=150, temperature=0,
                                                stream=True)
    pieces, finish, error = [], None, None
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if len(pieces) == 2:
                    # what the store gave the second turn: the first turn's prompt + answer pages
                    out["streamed_cached"] = int(a.metrics()["lcx_prompt_tokens_cached_total"] - before)
                    os.kill(a.pid, signal.SIGKILL)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
    except (httpx.HTTPError, openai.APIError) as err:  # the connection dies with the server
        error = err
    out["streamed"], out["stream_finish"], out["stream_error"] = "".join(pieces), finish, error
    out["a_returncode"] = a.stop(signal.SIGKILL, timeout=10)
    out["a_log"] = a.tail()
    out["files_after_kill"] = page_files(store)
    out["tmp_files_after_kill"] = sorted(p.name for p in store.glob(".tmp-*"))

    b = spawn("B", "--kv-store", str(store)).wait_ready()
    out["b"] = b
    out["restarted"] = chat(b, second_turn)
    out["b_pages"] = b.settle()["lcx_kv_pages_used"]
    out["again"] = chat(b, second_turn)  # read from the prefix B kept this time
    out["b_after_again"] = b.settle(pages=out["b_pages"])
    out["recomputed"] = chat(ref, second_turn)
    return out


@pytest.mark.slow
def test_kill9_mid_stream_then_restart_serves_stored_pages(kill_drill):
    d = kill_drill
    first, restarted, recomputed = d["first"], d["restarted"], d["recomputed"]
    n1, c1 = first.usage.prompt_tokens, first.usage.completion_tokens
    n2 = restarted.usage.prompt_tokens
    print(f"\nfirst turn: {n1} prompt tokens, cached {cached(first)}; second turn streamed on A: "
          f"{d['streamed_cached']}/{n2} cached; after kill -9 and restart: {cached(restarted)}/{n2} cached "
          f"({cached(restarted) / n2:.3f}); again on B: {cached(d['again'])}/{n2}; temporary files left by the kill: "
          f"{len(d['tmp_files_after_kill'])}; B idle holds {d['b_pages']:.0f} pages")
    assert n1 > 300 and cached(first) == 0  # a fresh store
    # the first turn's whole pages of prompt + answer (all but the last token: never fed back) are on disk
    assert d["files_after_first"] == (n1 + c1 - 1) // PAGE
    # the stream was cut by the kill, not finished
    assert d["stream_finish"] is None and d["stream_error"] is not None, (
        f"the stream ended ({d['stream_finish']}) before SIGKILL: the drill killed an idle server\n{d['a_log']}")
    # the second turn starts with the first's prompt: at least its whole pages come back (here the answer's too)
    assert d["streamed_cached"] >= whole_pages(n1)
    assert d["a_returncode"] == -signal.SIGKILL
    # whole files or none: every page file the killed process left is intact
    bad = [p.name for p in d["files_after_kill"] if not kvp_valid(p)]
    assert not bad, f"torn page files after kill -9: {bad}"
    # the restarted server read every whole page of the second turn's prompt (stored when A finished reading it)
    assert cached(restarted) == whole_pages(n2) and cached(restarted) >= 0.9 * n2
    assert restarted.usage.prompt_tokens == recomputed.usage.prompt_tokens == n2
    assert cached(recomputed) == 0
    # stored pages give the tokens recomputation gives
    text = restarted.choices[0].message.content
    assert text == recomputed.choices[0].message.content
    assert restarted.choices[0].finish_reason == recomputed.choices[0].finish_reason
    # A streamed the same tokens before it died
    assert text.startswith(d["streamed"]) or d["streamed"].startswith(text), (text, d["streamed"])
    # B again: the same answer from its kept prefix, and the pool back where it was
    assert d["again"].choices[0].message.content == text and cached(d["again"]) == whole_pages(n2)
    assert d["b_pages"] <= whole_pages(n2) // PAGE  # what B holds when idle: at most the prefix it kept
    assert d["b_after_again"]["lcx_kv_pages_used"] == d["b_pages"]


# --------------------------------------------------------------------------------------------------- drill 2
def _store_keys(model_dir: Path, prompts: dict) -> dict[str, list[str]]:
    """The page keys the server's store gives each prompt (its namespace: the weights and the cache settings)."""
    import lcx
    from lcx.service.config import ServeConfig, store_namespace

    lm = lcx.load(str(model_dir))
    namespace = store_namespace(lm.params, ServeConfig(model=str(model_dir), page_size=PAGE).cache(), lm.config)
    return {k: chain(namespace, np.asarray(p, np.int32), PAGE) for k, p in prompts.items()}


@pytest.mark.slow
def test_corrupt_store_files_are_recomputed_never_served(kill_drill, spawn, model_dir):
    store, b = kill_drill["store"], kill_drill["b"]
    rng = np.random.default_rng(7)
    prompts = {"x": rng.integers(3, 300, 100).tolist(), "y": rng.integers(3, 300, 100).tolist()}
    bad_page = {"x": 3, "y": 5}  # x's file truncated, y's bit-flipped

    def complete(server, prompt):
        return server.client().completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)

    before = {k: complete(b, p) for k, p in prompts.items()}
    keys = _store_keys(model_dir, prompts)
    for k, p in prompts.items():
        assert cached(before[k]) == 0  # new prompts
        files = [store / f"{key}{SUFFIX}" for key in keys[k][:whole_pages(len(p)) // PAGE]]
        assert all(f.is_file() for f in files), "the store's page keys are not chain(store_namespace(...)): " \
                                                "update _store_keys"
    assert b.stop(signal.SIGKILL, timeout=10) == -signal.SIGKILL

    x_file = store / f"{keys['x'][bad_page['x']]}{SUFFIX}"
    y_file = store / f"{keys['y'][bad_page['y']]}{SUFFIX}"
    sizes = {x_file: x_file.stat().st_size, y_file: y_file.stat().st_size}
    x_file.write_bytes(x_file.read_bytes()[:sizes[x_file] // 2])
    data = bytearray(y_file.read_bytes())
    data[-DIGEST - 8:-DIGEST] = bytes(v ^ 0xFF for v in data[-DIGEST - 8:-DIGEST])  # the payload: only the digest tells
    y_file.write_bytes(bytes(data))
    assert not kvp_valid(x_file) and not kvp_valid(y_file)

    d = spawn("D", "--kv-store", str(store)).wait_ready()
    after = {k: complete(d, p) for k, p in prompts.items()}
    print("\ncorrupt store: " + "; ".join(f"{k}: cached {cached(after[k])}/{after[k].usage.prompt_tokens} (intact "
                                          f"store: {whole_pages(len(prompts[k]))})" for k in prompts)
          + f"; bad files now: {['rewritten' if f.exists() else 'deleted' for f in (x_file, y_file)]}")
    for k in prompts:
        assert after[k].choices[0].text == before[k].choices[0].text, f"prompt {k}: a bad page was served"
        # the pages before the bad one are read, the rest recomputed
        assert cached(after[k]) == bad_page[k] * PAGE < whole_pages(len(prompts[k]))
    # the bad files were deleted on reading, then written again whole when the prompt was recomputed
    for f in (x_file, y_file):
        assert not f.exists() or (kvp_valid(f) and f.stat().st_size == sizes[f]), f.name
    bad = [p.name for p in page_files(store) if not kvp_valid(p)]
    assert not bad, f"bad page files left in the store: {bad}"

    baseline = d.settle()["lcx_kv_pages_used"]
    assert baseline <= sum(whole_pages(len(p)) // PAGE for p in prompts.values())  # at most the kept prefixes
    again = {k: complete(d, p) for k, p in prompts.items()}  # from the prefixes D kept
    for k, p in prompts.items():
        assert again[k].choices[0].text == before[k].choices[0].text
        assert cached(again[k]) == whole_pages(len(p))
    d.settle(pages=baseline)


# --------------------------------------------------------------------------------------------------- drill 4
@pytest.mark.slow
def test_pages_return_to_baseline_after_cancels_stops_and_crowds(reference):
    server = reference
    messages = [{"role": "user", "content": "There and back again, here we go."}]
    before = server.settle()["lcx_kv_pages_used"]
    warm = chat(server, messages, max_tokens=8)
    text = warm.choices[0].message.content
    m = server.settle()
    baseline, finished = m["lcx_kv_pages_used"], m
    assert baseline <= before + whole_pages(warm.usage.prompt_tokens) // PAGE  # at most the prefix it kept
    reasons = ("cancelled", "length", "stop")

    def delta(now):
        return {r: now.get(f'lcx_requests_finished_total{{reason="{r}"}}', 0)
                - finished.get(f'lcx_requests_finished_total{{reason="{r}"}}', 0) for r in reasons}

    # a stream whose client goes away after two chunks
    with httpx.Client(timeout=30.0) as http:
        with http.stream("POST", f"{server.url}/v1/chat/completions",
                         json={"model": NAME, "messages": messages, "max_tokens": 400, "temperature": 0,
                               "stream": True}) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content"' in line and '"content": ""' not in line:
                    chunks += 1
                    if chunks == 2:
                        break
    now = server.settle(pages=baseline)
    assert delta(now)["cancelled"] == 1, delta(now)
    finished = now

    # a non-streaming client that gives up (read timeout): the server notices and cancels, or it had finished
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/chat/completions", timeout=httpx.Timeout(30.0, read=0.05),
                   json={"model": NAME, "messages": messages, "max_tokens": 400, "temperature": 0})
    now = server.settle(pages=baseline)
    assert delta(now)["cancelled"] + delta(now)["length"] == 1, delta(now)
    finished = now

    # a stop string ends the request early (cancelled inside the serving loop, its pages returned)
    at = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    stopped = chat(server, messages, max_tokens=8, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:text.find(stop)]
    now = server.settle(pages=baseline)
    assert delta(now)["stop"] == 1, delta(now)

    # more requests than rows (4): the rest wait, every one gets the tokens of running it alone
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: chat(server, messages, max_tokens=8), range(6)))
    assert [a.choices[0].message.content for a in answers] == [text] * 6
    server.settle(pages=baseline)


# --------------------------------------------------------------------------------------------------- drill 3
@pytest.mark.slow
def test_sigterm_drains_running_stream_refuses_new_and_exits_zero(spawn):
    # one decode step per segment: the stream lasts long enough to watch the drain
    server = spawn("drain", "--segment", "1").wait_ready()
    messages = [{"role": "user", "content": "Here we go."}]
    lines, refused, running_at_refusal = [], None, None
    with httpx.Client(timeout=60.0) as http:
        with http.stream("POST", f"{server.url}/v1/chat/completions",
                         json={"model": NAME, "messages": messages, "max_tokens": 480, "temperature": 0,
                               "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if refused is None and '"content"' in line and '"content": ""' not in line:
                    os.kill(server.pid, signal.SIGTERM)
                    deadline = time.monotonic() + 10
                    while http.get(f"{server.url}/health").status_code != 503:
                        assert time.monotonic() < deadline, "SIGTERM did not start a drain"
                        time.sleep(0.01)
                    try:
                        server.client(timeout=10).chat.completions.create(model=NAME, messages=messages,
                                                                           max_tokens=4, temperature=0)
                    except openai.APIStatusError as err:
                        refused = err
                    running_at_refusal = server.metrics()["lcx_requests_running"]
    assert refused is not None, "a new request was served while draining"
    assert refused.status_code == 503
    body = refused.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["message"]
    assert running_at_refusal == 1, "the stream had ended before the new request was refused"
    # the stream went on to its end
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] in ("length", "stop"), last
    content = [json.loads(x[6:])["choices"][0]["delta"].get("content") for x in lines[:-1]]
    assert sum(1 for c in content if c) > 2
    # and the process exits by itself, successfully
    try:
        code = server.proc.wait(30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server did not exit within 30 s of draining:\n{server.tail()}") from None
    assert code == 0, f"the drained server exited with {code}:\n{server.tail()}"
