"""``lcx serve`` across processes (``lcx.engine.lockstep``): 2 processes x 4 CPU devices (jax.distributed, gloo)
serve one tensor-parallel Server over all 8 devices - process 0 takes the requests and broadcasts them before each
step, process 1 follows the same steps - and give one device's greedy tokens. A cancel from ``on_token`` (what a
stop string does) is deferred to the step's end on every process: the request streams nothing more and is not
returned."""

from __future__ import annotations

import pytest

from tests.multidevice.test_sharding_multihost import _free_port


@pytest.fixture(scope="module")
def served(spawn, once):
    def make(directory):
        port = _free_port()
        hosts = [spawn("serve_lockstep", 4, env={"LCX_COORDINATOR": f"127.0.0.1:{port}", "LCX_NUM_PROCESSES": "2",
                                                 "LCX_PROCESS_ID": str(i)}) for i in range(2)]
        return [wait() for wait in hosts][0][0]

    return once("serve_lockstep", make)


def test_serve_lockstep_spans_both_processes(served):
    assert (served["processes"], served["devices"], served["mesh"]["model"]) == (2, 8, 8)


def test_serve_lockstep_tokens_equal_one_device(served):
    assert served["tokens"] == served["ref_tokens"]


def test_serve_lockstep_cancel_from_on_token_ends_the_request(served):
    stopped = served["stopped"]
    assert stopped["streamed"] == 2 and not stopped["in_result"] and stopped["cancelled"] == [stopped["id"]]


def test_lockstep_refuses_the_wrong_process():
    from lcx.engine.lockstep import follow

    with pytest.raises(RuntimeError, match="follow runs on processes 1"):
        follow(None)


# --------------------------------------------------------------------------------------------------- over HTTP
def test_lcx_serve_across_two_processes_answers_as_one(tmp_path):
    """``lcx serve --tensor-parallel-size 2`` in 2 processes x 1 CPU device: process 0 answers over HTTP (concurrent
    greedy completions, one ended by a stop string) what a one-process ``lcx serve`` answers; SIGTERM on process 0
    drains it, and the follower returns when it closes."""
    import signal
    import subprocess
    import sys
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    import lcx
    from lcx.service.config import ServeConfig
    from tests.multidevice.conftest import ROOT, worker_env
    from tests.test_service import Running
    from tests.tiny_chat_model import write_model

    model = write_model(tmp_path / "tiny")
    port, coordinator = _free_port(), _free_port()
    flags = ["--max-model-len", "256", "--page-size", "8", "--max-num-seqs", "4", "--served-model-name", "tiny"]
    procs, logs = [], []
    for i in range(2):
        logs.append(tmp_path / f"process{i}.log")
        env = worker_env(1, LCX_COORDINATOR=f"127.0.0.1:{coordinator}", LCX_NUM_PROCESSES="2", LCX_PROCESS_ID=str(i))
        with open(logs[-1], "wb") as log:  # a file, not a pipe: a full pipe would block the server
            procs.append(subprocess.Popen([sys.executable, "-m", "lcx", "serve", str(model), "--host", "127.0.0.1",
                                           "--port", str(port), "--tensor-parallel-size", "2", "--log-level",
                                           "warning", *flags], stdout=log, stderr=subprocess.STDOUT, env=env,
                                          cwd=ROOT))
    tail = lambda: "\n".join(f"--- process {i}:\n{p.read_text(errors='replace')[-3000:]}"  # noqa: E731
                             for i, p in enumerate(logs))
    requests = [dict(prompt=p, max_tokens=6) for p in ("hello there", "the cache", "a long context", "one")]
    try:
        deadline = time.monotonic() + 180
        while True:
            assert all(p.poll() is None for p in procs), f"a process exited before serving:\n{tail()}"
            assert time.monotonic() < deadline, f"process 0 not ready in 180 s:\n{tail()}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

        def ask(base: str, body: dict) -> dict:
            r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda b: ask(f"http://127.0.0.1:{port}", b), requests))
        one = Running(ServeConfig(model=str(model), port=_free_port(), max_num_seqs=4, max_model_len=256,
                                  page_size=8, served_model_name="tiny"), lcx.load(model))
        try:
            ref = [ask(one.base, b) for b in requests]
            stop = ref[0]["text"][2:4]  # ends the first answer in its middle: a cancel from on_token
            stopped_ref = ask(one.base, dict(requests[0], stop=[stop]))
        finally:
            one.uv.should_exit = True
            one.thread.join(10)
            one.service.close()
        stopped = ask(f"http://127.0.0.1:{port}", dict(requests[0], stop=[stop]))
        assert [(c["text"], c["finish_reason"]) for c in got] == [(c["text"], c["finish_reason"]) for c in ref]
        assert (stopped["text"], stopped["finish_reason"]) == (stopped_ref["text"], "stop")
        procs[0].send_signal(signal.SIGTERM)  # drains, closes the lockstep: the follower returns
        codes = [p.wait(timeout=60) for p in procs]
        assert codes == [0, 0], tail()
        assert "process 0 closed after" in logs[1].read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
