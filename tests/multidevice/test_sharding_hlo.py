"""The compiled sharded decode step (pallas kernels per shard) moves no KV-cache buffer between devices: its only
collectives are all-reduces of activations (after the output projection and the MLP down projection, plus the
loop's "all rows done" flag). Read from the HLO text of the compiled decode loop."""

from __future__ import annotations

import re

import pytest

CASES = [[8, [2, 4]], [4, [1, 8]]]  # kv heads sharded; kv heads replicated 2x
NAMES = ["kv8_2x4", "kv4_1x8"]
COLLECTIVES = ("all-gather", "all-to-all", "ragged-all-to-all", "all-reduce", "collective-permute",
               "reduce-scatter", "collective-broadcast")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\(([^)]*)\)")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def shapes_of(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)]


def collectives(hlo: str) -> list[dict]:
    """Every collective instruction: op, result shapes, operand shapes (looked up by operand name)."""
    defs, found = {}, []
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, operands = m.groups()
        defs[name.lstrip("%")] = shapes_of(shape)
        base = op[:-len("-start")] if op.endswith("-start") else op
        if base in COLLECTIVES:
            found.append({"op": base, "line": line.strip()[:300], "result": shapes_of(shape),
                          "operands": [o.strip().lstrip("%") for o in operands.split(",") if o.strip()]})
    for c in found:
        c["operand_shapes"] = [s for o in c["operands"] for s in defs.get(o, [])]
    return found


@pytest.fixture(scope="module")
def compiled(run_worker, once):
    result = once("decode_hlo", lambda directory: run_worker("decode_hlo", impl="pallas", cases=CASES,
                                                             directory=str(directory))[0])
    for case in result.values():
        with open(case["hlo"]) as f:
            case["collectives"] = collectives(f.read())
    return result


@pytest.mark.parametrize("case", NAMES)
def test_sharding_decode_hlo_has_no_gather_or_all_to_all(compiled, case):
    bad = [c["line"] for c in compiled[case]["collectives"] if c["op"] != "all-reduce"]
    assert not bad, "collectives other than all-reduce in the decode step:\n" + "\n".join(bad)


@pytest.mark.parametrize("case", NAMES)
def test_sharding_decode_hlo_moves_no_cache_buffer(compiled, case):
    cache_shapes = {tuple(v) for buf in compiled[case]["cache"].values() for v in buf.values()}
    for c in compiled[case]["collectives"]:
        touched = {dims for _, dims in c["result"] + c["operand_shapes"]}
        assert not touched & cache_shapes, f"collective on a KV-cache-shaped buffer: {c['line']}"


@pytest.mark.parametrize("case", NAMES)
def test_sharding_decode_hlo_all_reduces_are_activations(compiled, case):
    got = compiled[case]
    activation = (got["batch_shard"], 1, got["d_model"])  # [b / data, 1 token, embed]
    rows = []
    for c in got["collectives"]:
        for dtype, dims in c["result"]:
            assert (dtype.startswith(("f", "bf")) and dims == activation) or (dtype == "pred" and dims == ()), \
                f"unexpected all-reduce: {c['line']}"
            rows.append(dims)
    # the row-parallel matmuls: attention output projection and MLP down projection (inside the layer scan)
    assert rows.count(activation) >= 2, [c["line"] for c in got["collectives"]]
