"""The serving loop with self-speculative decoding (``SpecServer``, what ``lcx serve --speculative-draft`` runs)
against the plain one (``Server``, the paged full cache), on a real checkpoint, requests arriving together.

    python experiments/bench/serve_speculative.py runs/models/SmolLM2-135M-Instruct --requests 4 --context 4096

``--requests`` greedy requests of ``--context`` prose tokens (``pydoc_data.topics``, each its own passage) and
``--new`` tokens each, all submitted at once to a server of ``--requests`` rows. Each server first runs one
throwaway request of the same shape (compiles its programs), then the timed batch: ``wall_s`` from submit to the
last token, ``decode_tok_s`` = tokens generated after each request's first / the time from the last first token to
the end (the phase where every row decodes). ``same``: every request's tokens equal the plain server's;
``accept``: tokens per verification of the speculative server. ``contiguous``: the same requests as one static batch
of ``lcx.Generator`` on a contiguous full cache, without speculation (the speculative server's layout, so the
layout's share of a difference is visible: the plain server reads a paged cache). Writes ``--out`` (CSV).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import jax

import lcx
from lcx.config import CacheConfig
from lcx.engine import Generator
from lcx.engine.server import Server
from lcx.engine.spec_server import SpecServer
from lcx.engine.speculative import SpeculativeConfig

sys.path.insert(0, str(Path(__file__).parent))
from speculative import draft_config, prose_prompts  # noqa: E402 - the benchmark beside it: same prompts, drafts

COLUMNS = ("server", "requests", "context", "new", "k", "wall_s", "decode_tok_s", "speedup", "same", "accept",
           "draft_tokens", "accepted_tokens")


def timed(server, prompts, new: int) -> tuple[dict, float, float]:
    """``(tokens per request, wall seconds, decode tokens/s)`` of ``prompts`` submitted at once."""
    firsts: dict[int, float] = {}
    start = time.perf_counter()
    ids = [server.submit(p, new, ignore_eos=True) for p in prompts]
    out = server.run(lambda request, token: firsts.setdefault(request, time.perf_counter()))
    end = time.perf_counter()
    decode_tokens = sum(len(out[i]) - 1 for i in ids)
    return [out[i] for i in ids], end - start, decode_tokens / (end - max(firsts.values()))


def contiguous(lm, prompts, new: int) -> tuple[list, float, float]:
    """The same requests as one static batch on a contiguous full cache (``lcx.Generator``): what the speculative
    server's rows are, without speculation - separates the layout's share of a difference from speculation's."""
    gen = Generator(lm.config, lm.params, max_new_tokens=new, eos_id=None)
    gen.result(gen.decode(gen.prefill(prompts[:1]), steps=2))  # compiles (one row: the prefill's chunk shape)
    start = time.perf_counter()
    state = gen.prefill(prompts)
    state = gen.decode(state, steps=1)
    jax.block_until_ready(state.tokens)
    first = time.perf_counter()
    result = gen.result(gen.decode(state))
    end = time.perf_counter()
    tokens = [result.tokens[i, :int(result.lengths[i])].tolist() for i in range(len(prompts))]
    return tokens, end - start, sum(len(t) - 1 for t in tokens) / (end - first)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--drafts", nargs="+", default=["streaming-1024-orig"])
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--segment", type=int, default=8)
    ap.add_argument("--out", default="docs/bench/data/serve_speculative.csv")
    args = ap.parse_args(argv)
    lm = lcx.load(args.model)
    prompts = prose_prompts(lm, args.requests + 1, args.context)
    warm, prompts = prompts[0], prompts[1:]
    max_len = args.context + args.new + 8
    settings = dict(max_num_seqs=args.requests, max_len=max_len, eos_id=lm.eos_id, segment=args.segment,
                    prefill_chunk=args.prefill_chunk)
    rows = []
    plain = Server(lm.config, lm.params, cache=CacheConfig(layout="paged"), **settings)
    timed(plain, [warm], args.new)
    want, wall, rate = timed(plain, prompts, args.new)
    rows.append(dict(server="plain", wall_s=wall, decode_tok_s=rate, speedup=1.0, same=True))
    print(f"plain: {wall:.1f} s, {rate:.2f} decode tok/s", flush=True)
    base = rate
    got, wall, rate = contiguous(lm, prompts, args.new)
    rows.append(dict(server="contiguous", wall_s=wall, decode_tok_s=rate, speedup=rate / base, same=got == want))
    print(f"contiguous (lcx.Generator, one static batch): {wall:.1f} s, {rate:.2f} decode tok/s "
          f"({rate / base:.2f}x), same={got == want}", flush=True)
    for name in args.drafts:
        spec = SpeculativeConfig(draft=draft_config(name, args.context), k=args.k, min_context=0)
        server = SpecServer(lm.config, lm.params, speculative=spec, **settings)
        timed(server, [warm], args.new)
        d0, a0 = server.drafted_tokens, server.accepted_tokens
        got, wall, rate = timed(server, prompts, args.new)
        drafted, accepted = server.drafted_tokens - d0, server.accepted_tokens - a0
        verifications = drafted // args.k
        rows.append(dict(server=name, wall_s=wall, decode_tok_s=rate, speedup=rate / base, same=got == want,
                         accept=(accepted + verifications) / max(verifications, 1), draft_tokens=drafted,
                         accepted_tokens=accepted))
        print(f"{name}: {wall:.1f} s, {rate:.2f} decode tok/s ({rate / base:.2f}x), same={got == want}, "
              f"accept={rows[-1]['accept']:.2f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for row in rows:
            full = dict(requests=args.requests, context=args.context, new=args.new, k=args.k) | row
            writer.writerow({c: (f"{v:.3f}" if isinstance(v, float) else v) for c, v in full.items() if c in COLUMNS})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
