"""Multi-device tests run their scenarios (``worker.py``) in subprocesses with fake CPU devices: XLA_FLAGS must be
set before jax starts, and the pytest process has already started it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def worker_env(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LCX_", "JAX_COORDINATOR", "JAX_NUM_PROC",
                                                                     "JAX_PROCESS_ID"))}
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f)
    env.update(XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(), JAX_PLATFORMS="cpu",
               JAX_DEFAULT_MATMUL_PRECISION="highest",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(extra)
    return env


def start(scenario: str, args: dict, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), scenario, json.dumps(args)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, what: str, expect_result: bool = True) -> tuple[dict | None, str]:
    """Wait for ``proc``; return (its RESULT json or None, its stderr); fail with the stderr tail on error."""
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{what} timed out after {TIMEOUT_S}s; stderr tail:\n{err[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} exited with {proc.returncode}; stderr tail:\n{err[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if expect_result and not lines:
        pytest.fail(f"{what} printed no RESULT line; stdout:\n{out[-2000:]}\nstderr tail:\n{err[-2000:]}")
    return (json.loads(lines[-1][len("RESULT "):]) if lines else None), err


@pytest.fixture(scope="session")
def spawn():
    """``spawn(scenario, devices=8, env={...}, **args)`` starts a worker and returns ``wait() -> (result, stderr)``
    (result None for processes other than 0 of a multi-process run), so several can run at once."""
    def begin(scenario: str, devices: int = 8, env: dict[str, str] | None = None, **args):
        what = f"worker {scenario} {args} on {devices} devices {env or ''}"
        proc = start(scenario, args, worker_env(devices, **(env or {})))
        process_id = (env or {}).get("LCX_PROCESS_ID", "0")
        return lambda: finish(proc, what, expect_result=process_id == "0")

    return begin


@pytest.fixture(scope="session")
def once(tmp_path_factory):
    """``once(key, make)``: ``make(directory)`` (a JSON result; ``directory`` for its files) computed by one
    pytest-xdist worker of this session and read back by the others. A module's tests split over two workers would
    otherwise each start the same multi-device scenario (a module-scoped fixture is per worker): that doubled the
    slowest scenarios' cost in the suite. A file lock in the directory the session's workers share orders them."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each worker's own

    def get(key: str, make):
        path = root / f"once-{key}.json"
        with open(root / f"once-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():  # a make that failed wrote nothing: the next worker tries (and fails) again
                directory = root / f"once-{key}"
                directory.mkdir(exist_ok=True)
                path.write_text(json.dumps(make(directory)))
            return json.loads(path.read_text())

    return get


@pytest.fixture(scope="session")
def run_worker(spawn):
    """``run_worker(scenario, devices=8, **args) -> (result dict, stderr)`` in one fresh process."""
    def run(scenario: str, devices: int = 8, **args):
        return spawn(scenario, devices, **args)()

    return run


def pytest_collection_modifyitems(items):
    # Each test here starts 8-device processes (jax and lcx imported, programs compiled for a mesh): all of them are
    # outside the fast tier. tests/test_context_parallel.py and tests/test_sharding_rules.py cover the same code on one
    # device there.
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.multidevice)
            item.add_marker(pytest.mark.slow)
