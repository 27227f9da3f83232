"""``lcx generate``: generate from a Hugging Face directory or an lcx model config, streaming tokens as they come."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lcx.config import CacheConfig, ConfigError, ModelConfig, load_model_config


def load_model(path: str, *, seed: int = 0, dtype: str | None = None) -> tuple[ModelConfig, dict, str]:
    """(config, params, source) from an HF checkpoint directory, a GGUF file (dequantized), an lcx run
    (``runs/NAME``, its ``train`` / ``finetune`` stage or a checkpoint directory: the latest checkpoint), or random
    weights for a YAML model config."""
    import dataclasses

    import jax

    from lcx.lm import load_weights
    from lcx.model import init_params

    p = Path(path)
    if p.is_file() and p.suffix.lower() != ".gguf":
        config = load_model_config(p)
        if dtype is not None:
            config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
        return config, init_params(config, jax.random.key(seed)), "random"
    if not p.exists():
        raise ConfigError(f"--model={path!r} does not exist: expected a Hugging Face checkpoint directory, a .gguf "
                          "file, an lcx run or a YAML model config")
    return load_weights(p, dtype=dtype, key="--model")  # the text-level API's loader (lcx.lm)


def _tokenizer(model_path: str, config: ModelConfig, setting: str = "auto"):
    """``(encode, decode)`` of the tokenizer ``--tokenizer`` names (``lcx.data.tokenizer``); ``auto``: the checkpoint's
    tokenizer.json, the tokenizer an lcx run recorded, or bytes for a YAML model config (random weights) - as
    ``lcx.load`` resolves it (``lcx.lm.auto_tokenizer``). A Hugging Face directory without tokenizer.json is an
    error, never a silent switch to bytes."""
    from lcx.data.tokenizer import resolve_tokenizer
    from lcx.lm import auto_tokenizer, encode_prompt

    if setting == "auto":
        setting = auto_tokenizer(model_path)
        if setting is None:
            raise ConfigError(f"--prompt needs a tokenizer: {model_path} has no tokenizer.json; pass --tokenizer PATH "
                              "(a tokenizer.json), --tokenizer bytes (a byte-level lcx model), or --ids")
    tok = resolve_tokenizer(setting, vocab_size=config.vocab_size, key="--tokenizer")
    return (lambda text: encode_prompt(tok, config, text)), tok.decode, tok


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate tokens from a model, streaming them",
                              description="Generate from a Hugging Face checkpoint directory or an lcx YAML model "
                                          "config (random weights, for trying settings).")
    p.add_argument("--model", required=True,
                   help="HF checkpoint directory, .gguf file, lcx run (runs/NAME) or YAML model config")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--ids", help="prompt token ids, comma separated")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-id", type=int, default=None, help="stop token (default: the model's eos_token_id)")
    p.add_argument("--dtype", default=None, help="parameter and compute dtype (default: the checkpoint's)")
    p.add_argument("--tokenizer", default="auto",
                   help="auto (the checkpoint's tokenizer.json or the run's recorded tokenizer), bytes, or a path to "
                        "a tokenizer.json")
    p.add_argument("--cache-policy", default="full")
    p.add_argument("--cache-budget", type=int, default=None)
    p.add_argument("--cache-dtype", default=None)
    p.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill call (default: auto)")
    p.add_argument("--cache-param", action="append", default=[], metavar="KEY=VALUE",
                   help="eviction policy parameter, e.g. --cache-param sinks=4 (repeatable)")
    p.add_argument("--speculative-draft", default=None, metavar="POLICY",
                   help="decode speculatively: draft with this cache policy (e.g. streaming, snapkv; 'full' with "
                        "--speculative-param kv_dtype=int8 for 8-bit codes) and verify against the cache above")
    p.add_argument("--speculative-param", action="append", default=[], metavar="KEY=VALUE",
                   help="the draft cache's settings, e.g. budget=256, sinks=4, compression=0.9 (repeatable)")
    p.add_argument("--speculative-k", type=int, default=4, help="draft tokens per verification (default 4)")
    p.add_argument("--speculative-confidence", type=float, default=None, metavar="P",
                   help="adaptive k: a row stops drafting once the draft gives its last token a probability below P "
                        "(default: always k)")
    p.add_argument("--speculative-min-context", default="auto",
                   help="decode plainly below this many prompt tokens (default auto: where drafting costs more than "
                        "it saves; 0: always speculate)")
    p.set_defaults(func=run)
    return p


def _policy_params(items: list[str], flag: str = "--cache-param") -> dict:
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{flag} {item!r} is invalid: expected KEY=VALUE, e.g. sinks=4")
        key, value = item.split("=", 1)
        out[key] = yaml.safe_load(value)
    return out


def run(args: argparse.Namespace) -> int:
    from lcx.engine import Generator
    from lcx.engine.sampling import SamplingConfig

    cache = CacheConfig(policy=args.cache_policy, budget=args.cache_budget, dtype=args.cache_dtype,
                        prefill_chunk=args.prefill_chunk, **_policy_params(args.cache_param))
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompt = None
    if args.ids is not None:
        try:
            prompt = [int(x) for x in args.ids.replace(" ", "").split(",") if x]
        except ValueError as err:
            raise ConfigError(f"--ids={args.ids!r} is invalid: expected comma-separated integers") from err
    config, params, source = load_model(args.model, seed=args.seed, dtype=args.dtype)
    if source == "random":
        print(f"lcx generate: {args.model} is a model config: using random weights (seed {args.seed})",
              file=sys.stderr)
    policy, inputs = cache.make_policy(), {}
    if prompt is not None:
        show = lambda ids: " ".join(str(i) for i in ids)  # noqa: E731
        if getattr(policy, "reconstructs", False) or (getattr(policy, "calibrates", False) and not policy.calibrated):
            raise ConfigError(f"--cache-policy {args.cache_policy} needs text in the model's tokens (a repeat prompt "
                              "or a calibration text): give --prompt, not --ids")
    else:
        from lcx.data.haystack import Frame
        from lcx.data.policy_inputs import policy_inputs

        encode, show, tok = _tokenizer(args.model, config, args.tokenizer)
        prompt = encode(args.prompt)
        inputs = policy_inputs(policy, Frame(tok))
    eos = args.eos_id if args.eos_id is not None else config.eos_token_id
    if args.speculative_draft is not None:
        code = _speculative(args, config, params, cache, sampling, eos, prompt, show)
        if code is not None:
            return code
    gen = Generator(config, params, max_new_tokens=args.max_new_tokens, cache=cache, sampling=sampling,
                    eos_id=eos, seed=args.seed, **inputs)
    _stream(gen.prefill([prompt]), show, gen.finished, lambda state: gen.decode(state, steps=1))
    return 0


def _stream(state, show, finished, advance):
    """Print row 0's text as ``advance`` (one decode call) extends it, until ``finished``; the last state."""
    shown = ""
    while True:
        done = finished(state)
        text = show(list(state.tokens[0, :int(state.n_generated[0])]))
        if not done:  # a trailing U+FFFD may be a multi-byte character still arriving: hold it back
            text = text.rstrip("\ufffd")
        if text.startswith(shown):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
        if done:
            break
        state = advance(state)
    sys.stdout.write("\n")
    return state


def _speculative(args, config, params, cache, sampling, eos, prompt, show) -> int | None:
    """``--speculative-draft``: the tokens as each verification emits them, then the acceptance on stderr; None
    where speculation does not pay for this prompt (the caller decodes plainly)."""
    from lcx.engine.spec_generator import SpeculativeGenerator
    from lcx.lm import as_speculative

    if args.speculative_k is None:
        raise ConfigError("--speculative-k is missing a value: draft tokens per verification, e.g. 4")
    draft = {"policy": args.speculative_draft, **_policy_params(args.speculative_param, "--speculative-param")}
    min_context = args.speculative_min_context
    min_context = int(min_context) if min_context.isdigit() else min_context
    spec = as_speculative({"draft": draft, "k": args.speculative_k, "min_context": min_context,
                           "confidence": args.speculative_confidence}, len(prompt), args.max_new_tokens)
    gen = SpeculativeGenerator(config, params, max_new_tokens=args.max_new_tokens, speculative=spec, cache=cache,
                               sampling=sampling, eos_id=eos, seed=args.seed)
    if not gen.pays([prompt]):
        print(f"lcx generate: a {len(prompt)}-token prompt decodes plainly (speculative.min_context="
              f"{spec.min_context!r}: drafting would cost more than it saves)", file=sys.stderr)
        return None
    state = _stream(gen.prefill([prompt]), show, lambda state: bool(state.done[0]),
                    lambda state: gen.decode(state, iterations=1))
    _, stats = gen.result(state)
    print(f"lcx generate: {stats.acceptance:.2f} tokens per verification ({int(stats.accepted.sum())} of "
          f"{int(stats.drafted.sum())} drafts accepted, k={spec.k}); draft KV {stats.draft_bytes} B", file=sys.stderr)
    return 0
