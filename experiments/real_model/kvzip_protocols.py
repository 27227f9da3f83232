"""The KVzip contradiction of docs/real_model (e), crossed: the same chat passkey prompts through KVzip at one
budget with the question inside the compressed prompt (what ``lm.generate`` does) or read after the compression
(kvpress's protocol, the grid's ``one_shot``), and with a budget per KV head (lcx's default) or pooled over heads
(``head_budget: global``). Which difference turns 6-8/8 into 0/8?

    python experiments/real_model/kvzip_protocols.py runs/models/SmolLM2-135M-Instruct [--prompts 8]

The prompts are ``lm_kvzip_passkeys.py``'s (pydoc_data prose of ~1,024 tokens, a passkey at a random depth, the
question, in the chat template). "Question excluded" cuts each prompt where the question begins: the context is
prefilled and compressed, the rest (question, end of turn, the assistant header) is read into the compressed cache,
then the answer is decoded. Both protocols keep the same number of slots (the budget of the whole prompt at the
compression); ``kept`` reports, per layer and KV head, whether the last prompt token's slot survived.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import lcx
from lcx.data.haystack import Frame
from lcx.engine import Generator
from lcx.lm import at_compression

sys.path.insert(0, str(Path(__file__).parent))
from lm_kvzip_passkeys import passkey_texts  # noqa: E402

QUESTION = "What is the pass key?"


def split_at_question(tok, ids: list[int]) -> int:
    """The first token index whose prefix decodes to text containing the question's start."""
    lo, hi = 0, len(ids)
    while lo < hi:  # the shortest prefix that contains "What is"
        mid = (lo + hi) // 2
        if QUESTION[:7] in tok.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo - 2  # a token or two before, where the blank line ends the context


def grid_prompts(lm, config: str, samples: int):
    """The prompts, context lengths and keys of ``config``'s first retrieval cell, as its grid builds them."""
    from lcx.eval.cell_prompts import grid_tasks
    from lcx.eval.evaluate import cell_examples
    from lcx.experiment.config import load_experiment

    ev = load_experiment(config).eval
    task = next(iter(grid_tasks(ev, lm.tokenizer)[0].values()))
    examples = cell_examples(task, length=ev.lengths[0], depth=None, samples=samples, seed=ev.seed)
    return ([list(map(int, ex.prompt_ids)) for ex in examples], [ex.context_len for ex in examples],
            [ex.answer for ex in examples])


def run(lm, prompts, keys, cuts, *, budget_params: dict, excluded: bool, compression: float, new: int):
    """Passkeys found (list of bool) and the answers."""
    tails = [p[c:] for p, c in zip(prompts, cuts)]
    if excluded and len({len(t) for t in tails}) != 1:
        raise SystemExit(f"the question parts differ in length: {sorted({len(t) for t in tails})}")
    cache = at_compression({"policy": "kvzip", "compression": compression, **budget_params},
                           max(map(len, prompts)), new)
    extra = len(tails[0]) if excluded else 0
    gen = Generator(lm.config, lm.params, max_new_tokens=new + extra, cache=cache, eos_id=lm.eos_id,
                    reconstruction=Frame(lm.tokenizer, lm.chat_template).reconstruction())
    if excluded:
        state = gen.prefill([p[:c] for p, c in zip(prompts, cuts)])
        state, _ = gen.score(state, np.asarray(tails))
    else:
        state = gen.prefill(prompts)
    result = gen.result(gen.decode(state, steps=new))
    answers = [lm.tokenizer.decode([t for t in row[:n] if t != lm.eos_id]) for row, n in zip(result.tokens,
                                                                                          result.lengths)]
    return [k in a for k, a in zip(keys, answers)], answers, cache.budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--compression", type=float, default=0.75)
    parser.add_argument("--new", type=int, default=12)
    parser.add_argument("--grid", default=None, help="an experiment config: its first retrieval cell's prompts "
                        "(e.g. experiments/configs/smollm2_passkey_kvzip.yaml, docs/real_model (c)) instead")
    args = parser.parse_args()
    lm = lcx.load(args.model)
    if args.grid:
        prompts, cuts, keys = grid_prompts(lm, args.grid, args.prompts)
        what = f"{args.grid}'s prompts"
    else:
        texts, keys = passkey_texts(args.prompts, args.tokens, lm)
        prompts = [lm.encode(t, chat=True) for t in texts]
        cuts = [split_at_question(lm.tokenizer, p) for p in prompts]
        what = "chat prompts (lm_kvzip_passkeys.py's)"
    print(f"{args.model}: {len(prompts)} {what} of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
          f"kvzip at compression {args.compression}")
    print("| question | budget | passkeys found | wall s |\n|---|---|---:|---:|")
    for excluded in (False, True):
        for name, params in (("per KV head", {}),
                             ("global", {"head_budget": "global", "head_floor": 0.0, "head_cap": 8.0})):
            t0 = time.perf_counter()
            found, answers, budget = run(lm, prompts, keys, cuts, budget_params=params, excluded=excluded,
                                         compression=args.compression, new=args.new)
            where = "read after the compression" if excluded else "inside the compressed prompt"
            print(f"| {where} | {name} ({budget} slots) | {sum(found)}/{len(found)} | "
                  f"{time.perf_counter() - t0:.0f} |", flush=True)
            print(f"  answers: {answers}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
