"""Text in, text out: ``lcx.load(path)`` -> ``LM``, a model with its tokenizer.

    lm = lcx.load("runs/models/SmolLM2-135M-Instruct")     # an HF directory, a .gguf file or an lcx run
    lm.generate(["The capital of France is"], max_new_tokens=8)               -> ["...", ...]
    lm.generate("Hi!", chat=True, cache={"policy": "kvzip", "budget": 256})  -> "..."
    lm.score(["Some text."], cache="full")                                   -> [float32 array [n - 1]]

What the token-level API leaves to the caller is done here: the tokenizer that belongs to the checkpoint (the same
resolution as ``lcx generate``, whose helpers live here), BOS and the chat template, EOS, decoding only the new
tokens, and the inputs some cache policies need in the model's tokens - KVzip's repeat prompt and DuoAttention's
calibration text (``lcx.data.policy_inputs``) - built from the tokenizer. Generators are kept per setting
(``LM.generator``) and reused across calls; their compiled programs are shared anyway (``lcx.engine.programs``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from lcx.cache.config import CacheConfig
from lcx.config_base import ConfigError
from lcx.engine.state import is_int
from lcx.model.config import ModelConfig

MAX_GENERATORS = 8  # generators an LM keeps (LRU): a sweep over many settings must not hold every policy's state
CACHE_FORMS = "None (the full cache), a lcx.CacheConfig, a dict of its fields or a policy name such as 'full'"


# --------------------------------------------------------------------------------------------------- loading
def load_weights(path: str | Path, *, dtype: str | None = None,
                 key: str = "path") -> tuple[ModelConfig, dict, str]:
    """``(config, params, kind)`` of a Hugging Face directory (``hf``), a GGUF file (``gguf``, dequantized) or an lcx
    run / stage / checkpoints directory (``lcx``: its latest checkpoint); anything else is a ``ConfigError`` naming
    ``key``. ``dtype``: the parameter and compute dtype of an HF / GGUF model, the compute dtype of an lcx run
    (default: the checkpoint's)."""
    from lcx.checkpoints import hf

    p = Path(path).expanduser()
    # HF directories and GGUF files load without the training stack (orbax imports torch where installed: seconds
    # of every `lcx.load`); only an lcx run needs it
    if p.is_dir() and (p / "config.json").is_file():
        return (*hf.load_hf(p, dtype=dtype), "hf")
    if p.is_file() and p.suffix.lower() == ".gguf":
        return (*hf.load_gguf(p, dtype=dtype), "gguf")
    if not p.is_dir():  # nothing an lcx run can be
        what = "does not exist" if not p.exists() else "is a file but not a .gguf"
        raise ConfigError(f"{key}={str(path)!r} {what}: expected a Hugging Face directory (config.json + "
                          "safetensors), a .gguf file, or an lcx run / stage / checkpoints directory")
    from lcx.checkpoints.sources import source_kind
    from lcx.train.checkpoint import load_checkpoint, run_checkpoint

    source_kind(p, key)  # raises for anything but an lcx run, naming key
    config, params = load_checkpoint(run_checkpoint(p))
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    return config, params, "lcx"


def auto_tokenizer(path: str | Path) -> str | None:
    """What the tokenizer setting ``auto`` means for the model at ``path``: the directory's tokenizer.json (an HF
    checkpoint), the file itself (a GGUF: the tokenizer in its metadata), the tokenizer an lcx run recorded (bytes
    when it recorded none: such runs predate tokenizers), bytes for anything else (a YAML model config: random
    weights). None for an HF directory without tokenizer.json: an error for the caller to word, never a silent
    switch to bytes."""
    from lcx.data.tokenizer import BYTES, run_tokenizer

    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return str(p) if (p / "tokenizer.json").is_file() else None
    if p.is_file() and p.suffix.lower() == ".gguf":
        return str(p)
    if p.is_dir():
        from lcx.train.checkpoint import run_checkpoint

        stage = run_checkpoint(p) or p  # runs/NAME -> the stage whose checkpoint is loaded
        return run_tokenizer(stage) or BYTES
    return BYTES


def encode_prompt(tokenizer, config: ModelConfig, text: str, chat=None) -> list[int]:
    """The prompt ids of ``text``: BOS when the tokenizer adds one (``adds_bos``: a GGUF's ``add_bos_token``, a
    tokenizer.json's post-processor, always for lcx's byte tokenizer - ``lcx.data.tokenizer.prompt_bos``) and it
    is in the model's vocabulary, then the text; with ``chat`` (a ``lcx.data.haystack.ChatTemplate``) the text as
    the user's message of the template, the reply opened, BOS only where the template writes it. Pieces are encoded
    one by one, as ``Frame`` builds a task's prompt, so KVzip's repeat prompt of the same frame
    (``Frame.reconstruction``, which skips the BOS and chat header) lines up with them."""
    from lcx.data.tokenizer import prompt_bos

    in_vocab = tokenizer.bos_id is not None and tokenizer.bos_id < config.vocab_size
    if chat is None:
        return list(tokenizer.encode(text, bos=in_vocab and prompt_bos(tokenizer)))
    # the template's own BOS text, whatever the tokenizer adds to plain text (transformers renders it as text)
    head = [tokenizer.bos_id] if in_vocab and chat.has_bos else []
    return head + [i for piece in (chat.head, text, chat.tail) for i in tokenizer.encode(piece, bos=False)]


def encode_chat(tokenizer, messages: Sequence[Mapping], *, add_generation_prompt: bool = True) -> list[int]:
    """A conversation (``{"role": ..., "content": ...}`` mappings) rendered with the tokenizer's chat template as
    transformers renders it, the reply opened when ``add_generation_prompt``; the template's BOS text becomes the BOS
    id. A ``ConfigError`` when the tokenizer has no template; a template that refuses the messages raises jinja2's
    ``TemplateError``."""
    from lcx.data.haystack import render_chat, token_text

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError("the tokenizer has no chat template (none in its tokenizer_config.json / "
                          "chat_template.jinja or GGUF metadata): encode the prompt as text")
    bos = token_text(tokenizer, tokenizer.bos_id) or ""
    text = render_chat(template, [{"role": m["role"], "content": m["content"]} for m in messages], bos_token=bos,
                       eos_token=token_text(tokenizer, tokenizer.eos_id) or "",
                       add_generation_prompt=add_generation_prompt)
    head = []
    if bos and text.startswith(bos):
        head, text = [tokenizer.bos_id], text[len(bos):]
    return head + list(tokenizer.encode(text, bos=False))


def special_tokens(tokenizer) -> dict[str, str | None]:
    """The text of the tokenizer's ``bos`` / ``eos`` / ``pad`` tokens (None where it has none or cannot say)."""
    from lcx.data.haystack import token_text

    return {name: token_text(tokenizer, getattr(tokenizer, f"{name}_id", None)) for name in ("bos", "eos", "pad")}


def as_cache(cache, key: str = "cache") -> CacheConfig:
    """A ``CacheConfig`` from ``cache``: None (the full cache), a ``CacheConfig``, a mapping of its fields and policy
    parameters (a YAML ``cache:`` section) or a policy name."""
    if cache is None:
        return CacheConfig()
    if isinstance(cache, CacheConfig):
        return cache
    if isinstance(cache, str):
        return CacheConfig(policy=cache)  # an evicting policy without a budget is refused there, naming cache.budget
    if isinstance(cache, Mapping):
        if not all(isinstance(k, str) for k in cache):
            raise ConfigError(f"{key}={dict(cache)!r:.100} is invalid: its keys must be CacheConfig field names or "
                              "policy parameters (strings)")
        return CacheConfig.from_mapping(cache, prefix=key)
    raise ConfigError(f"{key}={cache!r:.100} is invalid: must be {CACHE_FORMS}")


def at_compression(cache, length: int, room: int):
    """``cache`` with a ``compression`` entry (a dict: the share of a prompt's tokens the policy evicts, in (0, 1))
    resolved for prompts of up to ``length`` tokens and ``room`` tokens after them, as an ablation grid's
    ``one_shot`` cell does (``lcx.eval.config.Setting``): the budget ``round((1 - c) x length)`` (or the policy's own
    notion of it: DuoAttention's head share), the whole prompt seen before the one compression, nothing evicted after
    it. Anything else is returned unchanged."""
    if not isinstance(cache, Mapping) or "compression" not in cache:
        return cache
    from lcx.eval.config import Setting

    rest = {k: v for k, v in cache.items() if k != "compression"}
    c = cache["compression"]
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < 1:
        raise ConfigError(f"cache.compression={c!r} is invalid: must be a number in (0, 1), the share of the "
                          "prompt's tokens evicted")
    if "budget" in rest or rest.get("policy", "full") == "full":
        raise ConfigError("cache.compression is invalid with " + ("cache.budget: give one of them" if "budget" in rest
                                                                   else "the full cache: name an evicting policy"))
    return Setting(spec=tuple(rest.items()), compression=float(c), protocol="one_shot").cache(length, room=room)


def as_speculative(speculative, length: int, room: int):
    """A ``SpeculativeConfig`` from ``speculative``: None, a ``SpeculativeConfig`` or a mapping ``{"draft": cache,
    "k": 4}`` whose draft takes every form of ``cache`` - a ``compression`` entry resolved for prompts of up to
    ``length`` tokens (``at_compression``)."""
    from lcx.engine.speculative import SpeculativeConfig

    if speculative is None or isinstance(speculative, SpeculativeConfig):
        return speculative
    if not isinstance(speculative, Mapping):
        raise ConfigError(f"speculative={speculative!r:.100} is invalid: must be None, a lcx.SpeculativeConfig or a "
                          "mapping {'draft': {'policy': 'streaming', 'budget': 256}, 'k': 4}")
    data = dict(speculative)
    if "draft" in data:
        data["draft"] = as_cache(at_compression(data["draft"], length, room), key="speculative.draft")
    return SpeculativeConfig.from_mapping(data)


def _texts(texts, key: str = "texts") -> tuple[list[str], bool]:
    """``(texts as a list, whether one string was given)``."""
    if isinstance(texts, str):
        return [texts], True
    if isinstance(texts, (list, tuple)) and texts and all(isinstance(t, str) for t in texts):
        return list(texts), False
    raise ConfigError(f"{key}={texts!r:.100} is invalid: must be a string or a non-empty list of strings "
                      "(token ids go to lcx.generate / lcx.Generator)")


# --------------------------------------------------------------------------------------------------- the model
class LM:
    """A model (``config``, ``params``) with its ``tokenizer`` (``encode(text)`` / ``decode(ids)``): text in, text
    out. ``lcx.load(path)`` builds one; ``LM(config, params, tokenizer)`` wraps any."""

    def __init__(self, config: ModelConfig, params, tokenizer, *, source: str | None = None):
        self.config, self.params, self.tokenizer, self.source = config, params, tokenizer, source
        self._generators: collections.OrderedDict = collections.OrderedDict()

    def __repr__(self) -> str:
        from lcx.data.tokenizer import describe

        return (f"LM({self.source or 'in memory'}: {self.config.family}, {self.config.n_layers} layers, vocab "
                f"{self.config.vocab_size}; tokenizer {describe(self.tokenizer)})")

    @property
    def eos_id(self) -> int | None:
        """Where generation stops - the tokenizer's EOS, else the model config's."""
        eos = self.tokenizer.eos_id
        return eos if eos is not None and eos < self.config.vocab_size else self.config.eos_token_id

    @functools.cached_property
    def chat_template(self):
        """The tokenizer's chat template split around the user's message (``lcx.data.haystack.ChatTemplate``)."""
        from lcx.data.haystack import ChatTemplate
        from lcx.data.tokenizer import describe

        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"chat=True needs a chat template, and {describe(self.tokenizer)} has none (none in "
                              "its tokenizer_config.json / chat_template.jinja or GGUF metadata); pass chat=False")
        return ChatTemplate.from_tokenizer(self.tokenizer)

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """The prompt ids ``generate`` feeds the model for ``text`` (``encode_prompt``)."""
        if not isinstance(chat, bool):
            raise ConfigError(f"chat={chat!r} is invalid: must be True (apply the chat template) or False")
        if not isinstance(text, str):
            raise ConfigError(f"text={text!r:.80} is invalid: must be a string")
        return encode_prompt(self.tokenizer, self.config, text, self.chat_template if chat else None)

    def generator(self, max_new_tokens: int, cache=None, *, seed: int = 0, chat: bool = False):
        """The ``lcx.Generator`` ``generate`` uses for these settings, created once and reused (the ``MAX_GENERATORS``
        used last are kept): its EOS the tokenizer's, and the inputs a cache policy needs built from the tokenizer
        (KVzip's repeat prompt, DuoAttention's calibration text; ``lcx.data.policy_inputs``) - in the chat frame
        when ``chat``."""
        from lcx.data.haystack import Frame
        from lcx.data.policy_inputs import policy_inputs
        from lcx.engine import Generator

        cache = as_cache(cache)
        if not is_int(seed):
            raise ConfigError(f"seed={seed!r} is invalid: must be an integer")
        if not isinstance(chat, bool):
            raise ConfigError(f"chat={chat!r} is invalid: must be True (the chat frame) or False")
        policy = cache.make_policy()
        framed = policy.observes.reconstructs or (policy.observes.calibrates and not policy.calibrated)
        # the chat flag changes a generator only through those inputs: without them both share one
        key = (max_new_tokens, json.dumps(cache.to_dict(), sort_keys=True, default=repr), int(seed), chat and framed)
        gen = self._generators.get(key)
        if gen is None:
            inputs = policy_inputs(policy, Frame(self.tokenizer, self.chat_template if chat else None))
            gen = Generator(self.config, self.params, max_new_tokens=max_new_tokens, cache=cache, eos_id=self.eos_id,
                            seed=int(seed), **inputs)
            self._generators[key] = gen
            while len(self._generators) > MAX_GENERATORS:
                self._generators.popitem(last=False)[1].close()
        self._generators.move_to_end(key)
        return gen

    def _prompts(self, texts: list[str], chat: bool) -> list[list[int]]:
        prompts = [self.encode(t, chat=chat) for t in texts]
        empty = next((i for i, p in enumerate(prompts) if not p), None)
        if empty is not None:
            raise ConfigError(f"texts[{empty}]={texts[empty]!r} encodes to no tokens (the tokenizer adds no BOS): "
                              "give at least one token of text")
        return prompts

    def generate(self, texts: str | Sequence[str], max_new_tokens: int = 64, cache=None, temperature: float = 0.0,
                 top_p: float | None = None, seed: int = 0, chat: bool = False, *,
                 top_k: int | None = None, speculative=None) -> list[str] | str:
        """The continuation of each text: ``list[str]``, the decoded new tokens only, up to ``max_new_tokens`` or the
        tokenizer's EOS (not included). One string in gives one string out.

        ``cache``: None (the full cache), a ``CacheConfig``, a dict of its fields and policy parameters (``{"policy":
        "snapkv", "budget": 256, "window": 16}``) or a policy name (``"full"``; an evicting policy needs a budget, so
        a dict). A dict may give ``compression`` (the share of the prompt evicted, e.g. ``{"policy": "kvzip",
        "compression": 0.75}``) instead of a budget: the cache is sized for the longest prompt, sees all of it and
        compresses once (``at_compression``). ``temperature`` 0 is greedy; ``top_p`` / ``top_k`` restrict sampling.
        ``seed``: as ``lcx.generate``'s - text i samples with the seed folded with i, so a call gives the tokens
        ``lcx.generate(config, params, [lm.encode(t) for t in texts], ..., seed=seed, eos_id=lm.eos_id)`` gives.
        ``chat``: each text is the user's message of the tokenizer's chat template, the assistant's reply opened.
        All texts run as one batch. ``speculative``: draft with a compressed cache and verify against ``cache``
        (``lcx.SpeculativeConfig`` or ``{"draft": {"policy": "streaming", "budget": 256, "sinks": 4}, "k": 4}``; the
        draft may give ``compression``): the same greedy text, faster at long context."""
        from lcx.engine.sampling import SamplingConfig

        texts, single = _texts(texts)
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        prompts = self._prompts(texts, chat)
        longest = max(len(p) for p in prompts)
        cache = at_compression(cache, longest, max_new_tokens)
        spec = as_speculative(speculative, longest, max_new_tokens)
        result = spec and self._speculative(spec, prompts, max_new_tokens, cache, sampling, seed, chat)
        if result is None:  # no draft, or one that does not pay for prompts this short (SpeculativeConfig.pays)
            gen = self.generator(max_new_tokens, cache, seed=seed, chat=chat)
            try:
                result = gen.result(gen.decode(gen.prefill(prompts, sampling=[sampling] * len(prompts))))
            finally:
                gen.close()  # host resources of the request (a memory tier's store): the state is not kept
        outputs = []
        for tokens, n in zip(result.tokens, result.lengths):
            tokens = tokens[:int(n)]
            if len(tokens) and tokens[-1] == self.eos_id:
                tokens = tokens[:-1]
            outputs.append(self.tokenizer.decode(tokens))
        return outputs[0] if single else outputs

    def _speculative(self, spec, prompts, max_new_tokens: int, cache, sampling, seed: int, chat: bool):
        """``generate``'s tokens with a draft (``lcx.engine.spec_generator``; a KVzip draft's repeat prompt from this
        tokenizer), or None where it does not pay."""
        from lcx.data.haystack import Frame
        from lcx.data.policy_inputs import policy_inputs
        from lcx.engine.spec_generator import SpeculativeGenerator

        if not is_int(seed):
            raise ConfigError(f"seed={seed!r} is invalid: must be an integer")
        inputs = policy_inputs(spec.draft.make_policy(), Frame(self.tokenizer, self.chat_template if chat else None))
        gen = SpeculativeGenerator(self.config, self.params, max_new_tokens=max_new_tokens, speculative=spec,
                                   cache=as_cache(cache), eos_id=self.eos_id, seed=int(seed),
                                   reconstruction=inputs.get("reconstruction"))
        if not gen.pays(prompts):
            return None
        result, stats = gen.generate(prompts, sampling=[sampling] * len(prompts))
        return dataclasses.replace(result, speculative=stats)

    def score(self, texts: str | Sequence[str], cache=None, *, prefix: int = 1) -> list[np.ndarray] | np.ndarray:
        """Log-probabilities (natural log) of each text's tokens under a cache policy: for the prompt ids ``x`` of a
        text (``encode``: BOS first when the tokenizer adds one, so the text's first token is scored too; without
        it the first token is prefilled, not scored), a float32 array ``[len(x) - prefix]`` whose entry j is
        ``log p(x[prefix + j] | x[:prefix + j])``; a list, one array per text (one string in: one array out). Sum it
        for the text's log-likelihood; ``exp(-mean)`` is perplexity.

        The first ``prefix`` tokens are prefilled, the rest teacher-forced through the cache (``Generator.score``: the
        eviction schedule of decoding, as ``lcx.eval`` measures perplexity). ``cache`` as in ``generate``; a policy
        that compresses once after the prompt (KVzip) compresses the ``prefix`` only. All texts run as one batch."""
        texts, single = _texts(texts)
        if not is_int(prefix) or prefix < 1:
            raise ConfigError(f"prefix={prefix!r} is invalid: must be a positive integer (tokens prefilled before "
                              "the scored ones)")
        ids = self._prompts(texts, chat=False)
        short = next((i for i, x in enumerate(ids) if len(x) <= prefix), None)
        if short is not None:
            raise ConfigError(f"texts[{short}]={texts[short]!r:.60} has {len(ids[short])} tokens: score needs more "
                              f"than prefix={prefix} (the prefilled tokens are not scored)")
        width = max(len(x) for x in ids) - prefix
        gen = self.generator(width, at_compression(cache, prefix, width))
        rest = np.full((len(ids), width), self.tokenizer.pad_id or 0, np.int32)  # rows end at their own length
        for row, x in zip(rest, ids):
            row[:len(x) - prefix] = x[prefix:]
        try:
            _, logprobs = gen.score(gen.prefill([x[:prefix] for x in ids]), rest)
        finally:
            gen.close()
        out = [np.asarray(lp[:len(x) - prefix], np.float32) for lp, x in zip(logprobs, ids)]
        return out[0] if single else out


def load(path: str | Path, *, tokenizer: str = "auto", dtype: str | None = None) -> LM:
    """An ``LM`` from a Hugging Face directory, a ``.gguf`` file (dequantized) or an lcx run / stage / checkpoints
    directory (its latest checkpoint).

    ``tokenizer``: ``auto`` - the checkpoint's tokenizer.json, the GGUF's own, or the one an lcx run recorded
    (bytes for runs that recorded none; an HF directory without tokenizer.json is an error) -, ``bytes`` (lcx's
    byte tokenizer) or a path (a tokenizer.json, a directory holding one, or a .gguf). It must fit the model's
    vocabulary. ``dtype``: see ``load_weights``."""
    from lcx.data.tokenizer import resolve_tokenizer

    # refused before the weights are read (seconds for a real checkpoint)
    allowed = "must be 'auto', 'bytes' or a path to a tokenizer.json, a directory holding one or a .gguf file"
    if not isinstance(tokenizer, str) or not tokenizer:
        raise ConfigError(f"tokenizer={tokenizer!r} is invalid: {allowed}")
    if tokenizer not in ("auto", "bytes") and not Path(tokenizer).expanduser().exists():
        raise ConfigError(f"tokenizer={tokenizer!r} does not exist: {allowed}")
    setting = auto_tokenizer(path) if tokenizer == "auto" else tokenizer
    if setting is None:
        raise ConfigError(f"tokenizer='auto' found none: {path} is a Hugging Face directory without tokenizer.json; "
                          "pass tokenizer=PATH (a tokenizer.json or a directory holding one) or tokenizer='bytes' "
                          "(a byte-level lcx model)")
    config, params, kind = load_weights(path, dtype=dtype, key="path")
    tok = resolve_tokenizer(setting, vocab_size=config.vocab_size, key="tokenizer")
    return LM(config, params, tok, source=f"{kind} {path}")


__all__ = ["CACHE_FORMS", "LM", "MAX_GENERATORS", "as_cache", "at_compression", "auto_tokenizer", "encode_chat",
           "encode_prompt", "load", "load_weights", "special_tokens"]
