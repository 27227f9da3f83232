"""``lcx serve`` in-process on 127.0.0.1, driven by the real ``openai`` client and ``httpx``: the endpoints and their
wire format, greedy tokens equal to offline generation, per-request seeds, stop strings, bad input (4xx naming the
field, the server healthy after), the API key, idempotency keys, 64 concurrent streams, clients that disconnect, and
pages back to the baseline after each."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest

import lcx
from lcx.data.haystack import NOISE
from lcx.service.app import build_service, create_app, encode_chat
from lcx.service.config import ServeConfig
from tests.tiny_chat_model import write_model

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

MAX_LEN = 512
SYSTEM = NOISE[:600]  # ~150 tokens: whole pages shared by every chat below


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A service on a uvicorn thread; ``url`` is its ``/v1`` base."""

    def __init__(self, config: ServeConfig, lm, guarded: bool = False):
        from lcx.service.run import uvicorn_config

        self.service = build_service(config, lm)
        uv_config = uvicorn_config(self.service, "127.0.0.1", config.port, "warning") if guarded else \
            uvicorn.Config(create_app(self.service), host="127.0.0.1", port=config.port, log_level="warning")
        self.uv = uvicorn.Server(uv_config)
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        self.base = f"http://127.0.0.1:{config.port}"
        self.url = self.base + "/v1"
        deadline = time.monotonic() + 30
        while not self.uv.started:
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start in 30 s")
            time.sleep(0.02)

    def client(self, **kwargs):
        return openai.OpenAI(base_url=self.url, api_key=kwargs.pop("api_key", "none"), max_retries=0, timeout=60,
                             **kwargs)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def settled(self, timeout: float = 20.0) -> dict[str, float]:
        """The metrics once nothing runs or waits (the engine publishes them after each step)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["lcx_requests_running"] == 0 and m["lcx_requests_waiting"] == 0 and self.service.engine.idle) \
                    or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def kept_pages(self) -> int:
        """Pages the kept prefixes hold (what may stay in use once every request has ended)."""
        return len(set().union(*(p.pages for p in self.service.server.prefixes.entries.values())))

    def stop(self):
        self.uv.should_exit = True
        self.thread.join(10)
        self.service.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("service") / "tiny")


@pytest.fixture(scope="module")
def lm(model_dir):
    return lcx.load(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, lm):
    running = Running(ServeConfig(model=str(model_dir), port=_free_port(), max_num_seqs=4, max_model_len=MAX_LEN,
                                  page_size=8, segment=4, prefill_chunk=64, served_model_name="tiny"), lm)
    yield running
    running.stop()


def _offline(lm, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of ``ids`` generated alone (EOS ends them)."""
    out = lcx.generate(lm.config, lm.params, [ids], max_new_tokens=n, eos_id=lm.eos_id)
    return out.tokens[0, :int(out.lengths[0])].tolist()


def _chat(user: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# --------------------------------------------------------------------------------------------------- wire format
@pytest.mark.slow
def test_completions_and_chat_equal_offline_greedy_streamed_or_not(server, lm):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.base + "/health", timeout=5).json() == {"status": "ok"}
    prompt = "Here we go. There and back"
    ids = lm.encode(prompt)
    want = _offline(lm, ids, 12)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == lm.tokenizer.decode(want)
    assert r.choices[0].finish_reason == ("stop" if want[-1] == lm.eos_id else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    # the same prompt as token ids
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0).choices[0].text == \
        r.choices[0].text

    messages = _chat("Say hi, user and assistant.")
    chat_ids = encode_chat(server.service, [_M(m["role"], m["content"]) for m in messages])
    rendered = lm.tokenizer.encode(lcx.data.haystack.render_chat(lm.tokenizer.chat_template, messages,
                                                                 add_generation_prompt=True), bos=False)
    assert chat_ids == rendered  # the template rendered as transformers renders it (its BOS text is the BOS id)
    want = _offline(lm, chat_ids, 10)
    c = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == lm.tokenizer.decode(want)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.choices[0].finish_reason
    usage = chunks[-1].usage  # the last chunk: no choices, the usage
    assert not chunks[-1].choices and usage.completion_tokens == len(want)
    # the system prompt's whole pages were kept by the first chat: the second read them
    assert usage.prompt_tokens_details.cached_tokens >= (len(lm.tokenizer.encode(SYSTEM, bos=False)) // 8 - 1) * 8
    # the raw stream: OpenAI's SSE framing, ending with [DONE]
    with httpx.stream("POST", server.url + "/completions", timeout=30,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    assert s.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == \
        lm.tokenizer.decode(_offline(lm, ids, 5))
    m = server.settled()
    assert m["lcx_kv_pages_used"] == server.kept_pages() and m["lcx_prompt_tokens_cached_total"] > 0
    for name in ("lcx_kv_pages_total", "lcx_prompt_tokens_total", "lcx_generation_tokens_total",
                 "lcx_time_to_first_token_seconds_count", "lcx_inter_token_latency_seconds_count"):
        assert m[name] > 0, name


@pytest.mark.slow
def test_a_seeded_request_gives_the_same_text_alone_and_in_a_crowd(server):
    client = server.client()
    body = dict(model="tiny", prompt="The grass is", max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    alone = client.completions.create(**body).choices[0].text

    async def crowd():
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
        others = [aclient.completions.create(model="tiny", prompt=f"Noise {i} " * (i + 1), max_tokens=16,
                                             temperature=1.0, seed=i) for i in range(5)]
        out = await asyncio.gather(aclient.completions.create(**body), *others)
        await aclient.close()
        return out[0].choices[0].text

    assert asyncio.run(crowd()) == alone
    other = client.completions.create(**{**body, "seed": 8}).choices[0].text
    assert other != alone  # the seed matters (12 sampled tokens of a 320-token vocabulary)


# --------------------------------------------------------------------------------------------------- the harness
def _lm_eval_loglikelihood(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness 0.4.13's ``LocalCompletionsAPI.parse_logprobs``, as it reads an answer."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))))
    return res


def test_echo_logprobs_score_batched_id_prompts_as_lm_score_does_from_cache_too(server, lm):
    texts = [SYSTEM[:200] + " and the answer is yes", SYSTEM[:200] + " or maybe not"]
    ids = [lm.encode(t) for t in texts]
    ctx = len(lm.encode(SYSTEM[:200]))
    body = {"model": "tiny", "prompt": ids, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}  # what lm-eval's local-completions sends for loglikelihood requests
    first = httpx.post(server.url + "/completions", json=body, timeout=60).json()  # scored without the server
    two = body | {"max_tokens": 2}  # generated by the server, then scored
    httpx.post(server.url + "/completions", json=two, timeout=60)
    again = httpx.post(server.url + "/completions", json=two, timeout=60).json()  # prefix pages kept: cached
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for a, b in zip(first["choices"], again["choices"]):  # the greedy token, by either path
        assert a["logprobs"]["tokens"][:-1] == b["logprobs"]["tokens"][:-2]
        assert abs(a["logprobs"]["token_logprobs"][-1] - b["logprobs"]["token_logprobs"][-2]) < 1e-5
    want = lm.score(texts)
    for b, x, ref in zip(again["choices"], ids, want):  # pages from the prefix cache: the same log-probabilities
        np.testing.assert_allclose(b["logprobs"]["token_logprobs"][1:len(x)], ref, atol=1e-5)
    out = first  # lm-eval's request, as it reads the answer
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice, x, text, ref in zip(out["choices"], ids, texts, want):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(x) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:len(x)], ref, atol=1e-5)
        assert choice["text"].startswith(text) and "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        greedy = lp["token_logprobs"][-1]  # the generated token is the argmax: lm-eval's is_greedy holds
        assert greedy == max(lp["top_logprobs"][-1].values())
    scored = _lm_eval_loglikelihood(out, [ctx, ctx])
    for (total, _), ref in zip(scored, want):
        assert abs(total - float(np.sum(ref[ctx - 1:]))) < 1e-4
    only = httpx.post(server.url + "/completions", timeout=60, json={"model": "tiny", "prompt": texts[0],
                                                                     "max_tokens": 0, "echo": True,
                                                                     "logprobs": 0}).json()
    assert only["choices"][0]["text"] == texts[0] and only["usage"]["completion_tokens"] == 0
    np.testing.assert_allclose(only["choices"][0]["logprobs"]["token_logprobs"][1:], want[0], atol=1e-5)


def test_chat_logprobs_and_completion_limits(server, lm):
    client = server.client()
    r = client.chat.completions.create(model="tiny", messages=_chat("Say hi."), max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and "".join(c.token for c in content) == \
        r.choices[0].message.content
    for c in content:  # greedy: each token is its position's most likely
        assert len(c.top_logprobs) == 3 and c.logprob == c.top_logprobs[0].logprob
    r = client.completions.create(model="tiny", prompt="Here we go", temperature=0,
                                  extra_body={"max_completion_tokens": 5})
    assert r.usage.completion_tokens == 5  # not the default 16


def test_tokenizer_endpoints_have_vllms_shapes(server, lm):
    text = "Say hi, user and assistant"
    r = httpx.post(server.base + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=10).json()
    assert r["tokens"] == lm.tokenizer.encode(text, bos=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LEN
    r2 = httpx.post(server.base + "/tokenize", json={"model": "tiny", "prompt": text}, timeout=10).json()
    assert r2["tokens"] == lm.encode(text)  # the tokenizer's own BOS setting
    chat = httpx.post(server.base + "/tokenize", json={"messages": _chat("x")}, timeout=10).json()
    assert chat["tokens"] == encode_chat(server.service, [_M(m["role"], m["content"]) for m in _chat("x")])
    back = httpx.post(server.base + "/detokenize", json={"tokens": r["tokens"]}, timeout=10).json()
    assert back == {"prompt": text}
    info = httpx.get(server.base + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == lm.tokenizer.chat_template
    for path, body in (("/detokenize", {"tokens": [10 ** 6]}), ("/tokenize", {}), ("/tokenize", {"prompt": 5})):
        bad = httpx.post(server.base + path, json=body, timeout=10)
        assert bad.status_code == 400, bad.text


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    result = {}

    def post():  # ~1 MB of text: seconds of tokenization, then refused as too long
        result["r"] = httpx.post(server.url + "/completions", timeout=60,
                                 json={"model": "tiny", "prompt": "and again " * 100_000})

    thread = threading.Thread(target=post)
    thread.start()
    waits = []
    while thread.is_alive():
        t0 = time.monotonic()
        assert httpx.get(server.base + "/health", timeout=10).status_code == 200
        waits.append(time.monotonic() - t0)
    thread.join()
    assert result["r"].status_code == 400 and "--max-model-len" in result["r"].json()["error"]["message"]
    assert len(waits) > 3 and max(waits) < 1.0, waits  # other clients were answered meanwhile


def test_a_declared_oversized_body_is_refused_unread(server):
    with socket.create_connection(("127.0.0.1", server.service.config.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 999999999999\r\n\r\n{")
        head = sock.recv(4096).decode("latin-1")
    assert head.startswith("HTTP/1.1 413") and "max-body-bytes" in head


def test_stop_strings_end_the_text_before_them(server, lm):
    client = server.client()
    full = client.completions.create(model="tiny", prompt="Here we go", max_tokens=24, temperature=0).choices[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]  # a stop string the greedy text contains
    cut = client.completions.create(model="tiny", prompt="Here we go", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="Here we go", max_tokens=24, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == text[:text.find(stop)]
    assert server.settled()["lcx_kv_pages_used"] == server.kept_pages()


# --------------------------------------------------------------------------------------------------- bad input
BAD = [  # (body or raw text, status, what the message names)
    ('{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    ('[1, 2]', 400, "must be a JSON object"),
    ({"model": "nope", "prompt": "x"}, 404, "model='nope' does not exist"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "logprobs": 1, "stream": True}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": "tiny", "prompt": "x", "max_completion_tokens": MAX_LEN}, 400, "max_completion_tokens"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "suffix": "end"}, 400, "suffix"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"model": "tiny", "prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": "tiny", "prompt": "x", "seed": 2 ** 64}, 400, "seed"),
    ({"model": "tiny", "prompt": [[5, 6]] * 65}, 400, "at most 64"),
    ({"model": "n" * 5000, "prompt": "x"}, 404, "does not exist"),
    ('{"model": "tiny", "prompt": "\\ud800 x"}', 400, "unpaired surrogate"),
    ('{"model": "tiny", "prompt": ' + "[" * 5000 + "]" * 5000 + "}", 400, "nested too deeply"),
    ('{"model": "tiny", "prompt": ' + "[" * 40 + "]" * 40 + "}", 400, "nested too deeply"),
    ('{"model": "tiny", "prompt": "x", "seed": ' + "9" * 4400 + "}", 400, "not valid JSON"),
    ({"model": "tiny", "prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
    ({"model": "tiny", "prompt": "x", "stop": ["a" * 300]}, 400, "stop"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": [5, 100000]}, 400, "prompt token id 100000"),
    ({"model": "tiny", "prompt": "and again " * 400}, 400, "--max-model-len"),
    ({"model": "tiny"}, 400, "prompt"),
]


@pytest.mark.parametrize("body,status,names", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_completions_get_a_4xx_naming_the_field(server, body, status, names):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else \
        {"json": body}
    r = httpx.post(server.url + "/completions", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert names in error["message"] or names == error["param"], error
    assert len(error["message"]) < 1000  # nothing the client sent is echoed in full
    assert httpx.get(server.base + "/health", timeout=5).status_code == 200


def test_bad_chats_get_a_4xx_naming_the_field(server):
    for body, names in (({"model": "tiny", "messages": []}, "messages"),
                        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages"),
                        ({"model": "tiny", "messages": "hello"}, "messages"),
                        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                         "max_tokens"),
                        ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                         "messages")):
        r = httpx.post(server.url + "/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == names, r.text
        assert "not supported" not in r.json()["error"]["message"]  # a text part with a non-string text is no type
    with pytest.raises(openai.BadRequestError, match="top_p"):
        server.client().chat.completions.create(model="tiny", messages=_chat("x"), top_p=2.0)
    assert httpx.get(server.base + "/v1/nothing", timeout=5).status_code == 404
    assert httpx.get(server.base + "/health", timeout=5).status_code == 200


# --------------------------------------------------------------------------------------------------- idempotency
def test_an_idempotency_key_gives_the_same_completion_generated_once(server):
    body = {"model": "tiny", "prompt": "Say hi", "max_tokens": 20, "temperature": 1.0}
    before = server.settled()
    finished = lambda m: sum(v for k, v in m.items() if k.startswith("lcx_requests_finished_total"))  # noqa: E731

    async def twice():
        async with httpx.AsyncClient(timeout=60) as client:
            headers = {"Idempotency-Key": "retry-1"}
            return await asyncio.gather(*[client.post(server.url + "/completions", json=body, headers=headers)
                                          for _ in range(3)])

    first = [r.json() for r in asyncio.run(twice())]
    later = httpx.post(server.url + "/completions", json=body, headers={"Idempotency-Key": "retry-1"}, timeout=60)
    assert all(r == first[0] for r in first[1:] + [later.json()])  # same id, same text, same usage
    assert finished(server.settled()) == finished(before) + 1  # generated once
    other = httpx.post(server.url + "/completions", json={**body, "max_tokens": 3},
                       headers={"Idempotency-Key": "retry-1"}, timeout=60)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    # a streamed retry replays the same text
    streamed = server.client().completions.create(**body, stream=True, extra_headers={"Idempotency-Key": "retry-1"})
    chunks = list(streamed)
    assert {ch.id for ch in chunks} == {first[0]["id"]}
    assert "".join(ch.choices[0].text for ch in chunks) == first[0]["choices"][0]["text"]


# --------------------------------------------------------------------------------------------------- load and faults
@pytest.mark.slow
def test_64_concurrent_streams_finish_with_offline_tokens_and_return_every_page(server, lm):
    users = [f"Question {i}: " + NOISE[i * 7:i * 7 + 20 + i] for i in range(64)]
    limits = [4 + i % 9 for i in range(64)]

    async def one(client, user, limit):
        stream = await client.chat.completions.create(model="tiny", messages=_chat(user), max_tokens=limit,
                                                      temperature=0, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def load():
        client = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
        out = await asyncio.gather(*[one(client, u, n) for u, n in zip(users, limits)])
        await client.close()
        return out

    texts = asyncio.run(load())
    service = server.service
    for user, limit, text in zip(users[::9], limits[::9], texts[::9]):  # offline references for a sample
        ids = encode_chat(service, [_M("system", SYSTEM), _M("user", user)])
        assert text == lm.tokenizer.decode(_offline(lm, ids, limit)), user
    m = server.settled()
    assert m["lcx_requests_running"] == 0 and m["lcx_kv_pages_used"] == server.kept_pages()
    assert service.server.committed == 0 and np.all(np.asarray(service.server.state.table) == -1)


class _M:
    def __init__(self, role, content):
        self.role, self.content = role, content

    def text(self):
        return self.content


@pytest.mark.slow
def test_clients_that_disconnect_cancel_their_requests_and_return_their_pages(server):
    before = server.settled()
    cancelled = lambda m: m.get('lcx_requests_finished_total{reason="cancelled"}', 0.0)  # noqa: E731

    async def drop_after_two_chunks(client, i):
        body = {"model": "tiny", "messages": _chat(f"Tell me more {i}"), "max_tokens": 400, "temperature": 0,
                "stream": True}
        async with client.stream("POST", server.url + "/chat/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 2:
                    return  # closes the connection mid-stream

    async def drill():
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*[drop_after_two_chunks(client, i) for i in range(16)])
            try:  # a non-streaming client that gives up before its answer
                await client.post(server.url + "/completions", timeout=0.1,
                                  json={"model": "tiny", "prompt": "x", "max_tokens": 400, "temperature": 0})
            except httpx.TimeoutException:
                pass

    asyncio.run(drill())
    deadline = time.monotonic() + 30
    while cancelled(server.metrics()) < cancelled(before) + 17 and time.monotonic() < deadline:
        time.sleep(0.1)
    m = server.settled()
    assert cancelled(m) == cancelled(before) + 17
    assert m["lcx_kv_pages_used"] == server.kept_pages() and server.service.server.committed == 0


def test_a_non_streaming_client_that_leaves_while_tokens_flow_is_cancelled():
    """The wait for a non-streaming answer notices a client gone within a poll, however fast text events come (it
    looked only when none came for 50 ms, so a request whose tokens kept flowing ran to its end for nobody)."""
    from lcx.service.serving import DISCONNECT_POLL, await_done as _await_done
    from lcx.service.engine import Generation

    class Engine:
        cancelled = []

        def cancel(self, gen):
            self.cancelled.append(gen)

    class Service:
        engine = Engine()

    class Gone:  # a client that has disconnected
        async def is_disconnected(self):
            return True

    async def drill():
        gen = Generation(kind="completion", prompt=[1], max_tokens=10 ** 6, sampling=None, seed=None, stops=[],
                         loop=asyncio.get_running_loop())

        async def flow():  # a text event every 5 ms, never done
            while True:
                gen._publish(("text", "x"))
                await asyncio.sleep(0.005)

        feeder = asyncio.create_task(flow())
        start = time.monotonic()
        try:
            answered = await asyncio.wait_for(_await_done(Service(), [gen], Gone()), 5)
        finally:
            feeder.cancel()
        return answered, time.monotonic() - start, gen

    answered, waited, gen = asyncio.run(drill())
    assert answered is False and waited < 10 * DISCONNECT_POLL
    assert Service.engine.cancelled == [gen]  # nobody else waits for it: cancelled, its pages return


def test_the_api_key_is_required_when_set(model_dir, lm):
    running = Running(ServeConfig(model=str(model_dir), port=_free_port(), max_num_seqs=2, max_model_len=MAX_LEN,
                                  page_size=8, segment=4, prefill_chunk=64, api_key="sesame"), lm)
    try:
        with pytest.raises(openai.AuthenticationError):
            running.client(api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
        assert httpx.post(running.url + "/completions", json={"model": "tiny", "prompt": "x"},
                          timeout=10).status_code == 401
        r = running.client(api_key="sesame").completions.create(model=str(model_dir), prompt="x", max_tokens=2)
        assert r.usage.completion_tokens >= 1
        for path in ("/openapi.json", "/tokenizer_info"):  # every path but /health and /metrics
            assert httpx.get(running.base + path, timeout=10).status_code == 401
        assert httpx.get(running.base + "/health", timeout=10).status_code == 200
        lower = httpx.post(running.base + "/tokenize", json={"prompt": "x"}, timeout=10,
                           headers={"authorization": "bearer sesame"})  # the scheme in any case (RFC 7235)
        assert lower.status_code == 200, lower.text
    finally:
        running.stop()


def test_int4_pages_serve_the_offline_int4_tokens(model_dir, lm, tmp_path):
    """``lcx serve --kv-dtype int4``: the pool holds bit-packed pages (each row's float window beside it, off the
    budget), and a greedy completion is the offline int4 cache's; a page store with it is refused at start."""
    params = (("kv_group", 8), ("kv_residual", 8))
    config = ServeConfig(model=str(model_dir), port=_free_port(), max_num_seqs=2, max_model_len=MAX_LEN, page_size=8,
                         segment=4, prefill_chunk=64, kv_dtype="int4", cache_params=params)
    running = Running(config, lm)
    try:
        prompt = NOISE[:300]
        r = running.client().completions.create(model=str(model_dir), prompt=prompt, max_tokens=12, temperature=0)
        ids = lm.encode(prompt)
        out = lcx.generate(lm.config, lm.params, [ids], max_new_tokens=12, eos_id=lm.eos_id,
                           cache=lcx.CacheConfig(kv_dtype="int4", kv_group=8, kv_residual=8,
                                                 prefill_chunk=running.service.server.chunk))
        assert r.choices[0].text == lm.tokenizer.decode(out.tokens[0, :int(out.lengths[0])].tolist())
        assert running.service.plan.row_bytes > 0 and running.service.server.state.k.dtype == np.uint8
    finally:
        running.stop()
    with pytest.raises(lcx.config.ConfigError, match=r"--kv-store with --kv-dtype int4"):
        build_service(ServeConfig(model=str(model_dir), kv_dtype="int4", page_size=64, kv_store=str(tmp_path)), lm)


@pytest.mark.slow
def test_a_prompt_the_budget_can_never_hold_is_refused_naming_a_policy_and_others_go_on(model_dir, lm):
    # the incident: a KV budget of 12 pages of 8 tokens (96 tokens), a long prompt arriving among short requests
    page = lcx.CacheConfig(layout="paged", page_size=8).kind(lm.config).page_nbytes()
    running = Running(ServeConfig(model=str(model_dir), port=_free_port(), max_num_seqs=2, max_model_len=MAX_LEN,
                                  page_size=8, segment=4, prefill_chunk=64, kv_memory=12 * page), lm)
    try:
        client = running.client()
        long = " ".join(str(i) for i in range(100))  # digits: ~290 tokens of this tokenizer, 3x the budget
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt=long, max_tokens=8)
        message = err.value.body["message"]
        assert "the server's KV budget is 12 pages" in message and "--cache-policy streaming" in message
        assert "bytes of KV cache" in message
        short = client.completions.create(model="tiny", prompt="Here we go", max_tokens=8, temperature=0)
        assert short.usage.completion_tokens >= 1
    finally:
        running.stop()
    # the same budget under streaming: the long prompt is served in bounded pages
    budget = 48
    streaming = Running(ServeConfig(model=str(model_dir), port=_free_port(), max_num_seqs=2, max_model_len=MAX_LEN,
                                    page_size=8, segment=4, prefill_chunk=16, kv_memory=12 * page,
                                    cache_policy="streaming", cache_params=(("budget", budget), ("interval", 16))),
                        lm)
    try:
        r = streaming.client().completions.create(model="tiny", prompt=long, max_tokens=8, temperature=0)
        assert r.usage.prompt_tokens > 12 * 8 and r.usage.completion_tokens >= 1
        peak = int(streaming.service.server.state.peak)
        assert peak <= 2 * -(-(budget + 16) // 8)  # two rows of budget + interval slots at most
    finally:
        streaming.stop()


def test_half_sent_connections_are_capped_and_closed_and_others_are_served(model_dir, lm):
    config = ServeConfig(model=str(model_dir), port=_free_port(), max_num_seqs=1, max_model_len=64, page_size=8,
                         max_connections=4, header_timeout=0.5, served_model_name="tiny")
    running = Running(config, lm, guarded=True)
    try:
        socks = [socket.create_connection(("127.0.0.1", config.port), timeout=5) for _ in range(6)]
        start = time.monotonic()
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head never finished
        closed_at = []
        for sock in socks:
            sock.settimeout(5)
            try:  # closed by the server, never answered (a reset: it closed with our head unread)
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
            closed_at.append(time.monotonic() - start)
            sock.close()
        assert max(closed_at) < 3
        assert httpx.get(running.base + "/health", timeout=5).json() == {"status": "ok"}
    finally:
        running.stop()
