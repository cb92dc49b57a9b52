"""The OpenAI-compatible server (serving/): real HTTP requests to 127.0.0.1 on a free port, the tiny
target with its tokenizer and a random head in 3 slots. Staggered requests, streamed or not, give
what decoding each prompt alone gives; bad bodies are answered 400 naming the field; a full queue
429 and a draining server 503, with Retry-After."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers import TREE, random_prompts, spec_generate

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from eagle3_jax.checkpoints import Target, load_target  # noqa: E402
from eagle3_jax.checkpoints.heads import Head  # noqa: E402
from eagle3_jax.decoding.generate import DecodeOptions  # noqa: E402
from eagle3_jax.decoding.sampling import Sampling  # noqa: E402
from eagle3_jax.decoding.slots import SlotEngine  # noqa: E402
from eagle3_jax.prompts import encode_chat  # noqa: E402
from eagle3_jax.serving.api import Server, build_app  # noqa: E402
from eagle3_jax.serving.scheduler import Job, QueueFull, Scheduler  # noqa: E402

NEW = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Running:
    """uvicorn serving `app` on a thread at 127.0.0.1:port."""

    def __init__(self, app):
        self.port = _free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return
            time.sleep(0.05)
        raise AssertionError("the server did not start in 10 s")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def _post(srv, path, body, raw=None):
    """(status, headers, parsed JSON body or the SSE lines)."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url(path), data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read().decode()
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                return r.status, r.headers, [ln for ln in text.split("\n") if ln]
            return r.status, r.headers, json.loads(text)
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read().decode())


def _get(srv, path):
    with urllib.request.urlopen(srv.url(path), timeout=30) as r:
        return r.status, r.read().decode()


@pytest.fixture(scope="module")
def served(spec_setup, tiny_target_dir):
    params, cfg, dparams, dcfg, vocab = spec_setup
    target = load_target(tiny_target_dir)
    target = Target(params, cfg, target.tokenizer, target.path)  # the params spec_setup decodes
    head = Head(dparams, dcfg, vocab)
    opts = DecodeOptions("eagle3", NEW, TREE, eos_ids=(), max_context=256)
    engine = SlotEngine(target, head, opts, 3, max_logprobs=2)
    scheduler = Scheduler(engine, max_queue=8).start()
    srv = _Running(build_app(Server(scheduler, target.tokenizer, "tiny")))
    yield srv, target, head, scheduler
    srv.stop()
    scheduler.stop()


def _added(tokenizer, prompt, new) -> str:
    """What a completion's ids add to its prompt's text: its text as a completion (a word's
    space kept where decoding it alone would strip it)."""
    head = tokenizer.decode(prompt, skip_special_tokens=True)
    whole = tokenizer.decode(prompt + new, skip_special_tokens=True)
    assert whole.startswith(head)
    return whole[len(head) :]


def _alone(served, prompt, n):
    _, target, head, _ = served
    p, c, dp, dc, v = target.params, target.cfg, *head[:3]
    return spec_generate(p, c, dp, dc, v, [prompt], n, TREE, eos_ids=()).output_ids[0]


def test_health_models_and_staggered_requests_equal_decoding_alone(served):
    srv, target, _, scheduler = served
    assert _get(srv, "/health") == (200, '{"status":"ok"}')
    status, body = _get(srv, "/v1/models")
    assert json.loads(body)["data"][0]["id"] == "tiny"
    prompts = random_prompts(target.cfg.vocab_size, [5, 17, 9, 30, 3], seed=3)
    limits = [12, 30, 7, 20, 25]
    results = {}

    def ask(i):
        time.sleep(0.3 * i)  # arrivals spread over rounds; 5 requests for 3 slots
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": limits[i],
                "return_token_ids": True}  # fmt: skip
        results[i] = _post(srv, "/v1/completions", body)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for i in range(5):
        status, _, body = results[i]
        assert status == 200, body
        choice = body["choices"][0]
        alone = _alone(served, prompts[i], limits[i])
        assert choice["token_ids"] == alone, i
        assert choice["text"] == _added(target.tokenizer, prompts[i], alone)
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(prompts[i]), "completion_tokens": limits[i],
                                 "total_tokens": len(prompts[i]) + limits[i]}  # fmt: skip
    assert scheduler.busy() == 0 and scheduler.waiting() == 0
    _, text = _get(srv, "/metrics")
    assert f"eagle3_generation_tokens_total {float(sum(limits))}" in text
    assert 'eagle3_requests_total{finish_reason="length"} 5.0' in text
    assert "eagle3_prefix_cache_hit_tokens_total 0.0" in text  # no prefix cache here
    # a prefix cache's counts reach /metrics as they stand (a stand-in's, not a served run's;
    # it stays: counters only go up, and this engine, without chunks, never consults it)
    from eagle3_jax.decoding.slots import PrefixCache

    cache = PrefixCache(1)
    cache.query_tokens, cache.hit_tokens = 256, 64
    scheduler.engine.prefix = cache
    _, text = _get(srv, "/metrics")
    assert "eagle3_prefix_cache_query_tokens_total 256.0" in text
    assert "eagle3_prefix_cache_hit_tokens_total 64.0" in text


def test_streamed_chat_equals_whole_and_decoding_alone(served):
    srv, target, _, _ = served
    messages = [{"role": "user", "content": "w5 w9 w33 w41 w7"}]
    ids = encode_chat(target.tokenizer, messages)
    alone = _alone(served, ids, 14)
    body = {"messages": messages, "max_tokens": 14}
    status, _, whole = _post(srv, "/v1/chat/completions", body)
    assert status == 200 and whole["object"] == "chat.completion"
    text = whole["choices"][0]["message"]["content"]
    assert text == target.tokenizer.decode(alone, skip_special_tokens=True)
    assert whole["usage"]["prompt_tokens"] == len(ids)
    stream = dict(body, stream=True, stream_options={"include_usage": True})
    status, headers, lines = _post(srv, "/v1/chat/completions", stream)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 14


def test_each_request_samples_as_it_asks(served):
    """Two concurrent requests with their own settings: the greedy one (temperature 0) equals
    decoding alone, the sampled one (temperature 0.9, top_k 6, seed 5) equals decoding it alone
    with those settings and that seed; /metrics shows the tree."""
    srv, target, head, _ = served
    greedy_p, sampled_p = random_prompts(target.cfg.vocab_size, [8, 13], seed=21)
    results = {}

    def ask(i, body):
        time.sleep(0.2 * i)
        results[i] = _post(srv, "/v1/completions", body | {"return_token_ids": True})

    bodies = [{"prompt": greedy_p, "max_tokens": 16, "temperature": 0},
              {"prompt": sampled_p, "max_tokens": 16, "temperature": 0.9, "top_k": 6,
               "seed": 5}]  # fmt: skip
    threads = [threading.Thread(target=ask, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    p, c, dp, dc, v = target.params, target.cfg, *head[:3]
    assert results[0][2]["choices"][0]["token_ids"] == _alone(served, greedy_p, 16)
    alone = spec_generate(p, c, dp, dc, v, [sampled_p], 16, TREE, eos_ids=(), seed=5,
                          sampling=Sampling(0.9, 6, 1.0)).output_ids[0]  # fmt: skip
    assert results[1][2]["choices"][0]["token_ids"] == alone
    _, text = _get(srv, "/metrics")
    assert f"eagle3_tree_tokens {float(TREE.total_tokens)}" in text
    assert 'eagle3_tree_rounds_total{tree="3/3/9"}' in text


def test_n_choices_whole_and_streamed(served):
    """n = 3 greedy choices each equal decoding alone, with usage over all three; n = 2 sampled
    with seed 7 streamed: choice i equals decoding alone with seed 7 + i, and the streamed
    chunks, gathered by their index, equal the whole response. 4 choices for 3 slots: the last
    waits for one of the others' slot."""
    srv, target, head, scheduler = served
    prompt = random_prompts(target.cfg.vocab_size, [7], seed=17)[0]
    body = {"prompt": prompt, "max_tokens": 9, "n": 3, "return_token_ids": True}
    status, _, out = _post(srv, "/v1/completions", body)
    assert status == 200, out
    alone = _alone(served, prompt, 9)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["token_ids"] == alone for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 27
    sampled = {"prompt": prompt, "max_tokens": 9, "n": 4, "temperature": 0.9, "seed": 7,
               "return_token_ids": True}  # fmt: skip
    status, _, whole = _post(srv, "/v1/completions", sampled)
    p, c, dp, dc, v = target.params, target.cfg, *head[:3]
    for i, choice in enumerate(whole["choices"]):
        want = spec_generate(p, c, dp, dc, v, [prompt], 9, TREE, eos_ids=(), seed=7 + i,
                             sampling=Sampling(0.9, 0, 1.0)).output_ids[0]  # fmt: skip
        assert choice["token_ids"] == want, i
    status, _, lines = _post(srv, "/v1/completions", sampled | {"stream": True})
    chunks = [json.loads(ln[6:])["choices"] for ln in lines[:-1]]
    assert all(len(cs) == 1 for cs in chunks)
    for i, choice in enumerate(whole["choices"]):
        mine = [cs[0] for cs in chunks if cs[0]["index"] == i]
        assert [t for m in mine for t in m["token_ids"]] == choice["token_ids"]
        assert "".join(m["text"] for m in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == "length"
    status, _, out = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                                    "n": None, "seed": None})  # fmt: skip
    assert status == 200 and len(out["choices"]) == 1  # null: the default, as absent
    batch = {"prompt": [prompt, "w5 w9 w33"], "max_tokens": 9, "n": 2, "return_token_ids": True}
    status, _, out = _post(srv, "/v1/completions", batch)
    second = target.tokenizer("w5 w9 w33")["input_ids"]
    want = [alone, alone, *[_alone(served, second, 9)] * 2]  # prompt p's choice i: p * n + i
    assert [c["token_ids"] for c in out["choices"]] == want
    assert out["usage"]["prompt_tokens"] == len(prompt) + len(second)
    assert scheduler.busy() == 0 and scheduler.waiting() == 0


def test_stop_string_ends_the_request(served):
    srv, target, _, _ = served
    prompt = random_prompts(target.cfg.vocab_size, [8], seed=11)[0]
    alone = _alone(served, prompt, 20)
    text = _added(target.tokenizer, prompt, alone)
    stop = text.split()[5]
    want = text[: text.index(" " + stop)]  # up to its first occurrence
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 20, "stop": [" " + stop], "stream": stream}
        status, _, out = _post(srv, "/v1/completions", body)
        assert status == 200
        if stream:
            chunks = [json.loads(ln[6:]) for ln in out[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text, reason = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
        assert (text, reason) == (want, "stop")
    k = next(i for i in range(3, 20) if alone[i] not in alone[:i])  # vLLM's stop_token_ids
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 20, "stop_token_ids": [alone[k]],
                "return_token_ids": True, "stream": stream}  # fmt: skip
        status, _, out = _post(srv, "/v1/completions", body)
        choices = [json.loads(ln[6:])["choices"][0] for ln in out[:-1]] if stream else [
            out["choices"][0]]  # fmt: skip
        assert [t for c in choices for t in c["token_ids"]] == alone[: k + 1]
        assert choices[-1]["finish_reason"] == "stop"


def test_min_tokens_logit_bias_and_penalties_are_transformers_processing(served, hf_checkpoint):
    """min_tokens bars the stop token ids (and EOS) until then and holds stop strings back until
    their text ends past the first min_tokens tokens' (vLLM's rules); logit_bias (JSON's text
    keys) is what transformers' `sequence_bias` does, repetition_penalty its
    `repetition_penalty`: each greedy response equals transformers' `generate` with that
    processing."""
    import torch

    srv, target, _, _ = served
    model, _ = hf_checkpoint("llama")
    prompt = random_prompts(target.cfg.vocab_size, [8], seed=11)[0]
    alone = _alone(served, prompt, 20)
    k = next(i for i in range(3, 20) if alone[i] not in alone[:i])
    with torch.no_grad():
        ids = torch.tensor([prompt])
        held = model.generate(
            ids,
            max_new_tokens=20,
            min_new_tokens=k + 2,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=alone[k],
        )[0, len(prompt) :].tolist()
        biased = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                pad_token_id=0, eos_token_id=None,
                                sequence_bias={(alone[1],): -100.0, (7,): 0.5})  # fmt: skip
    body = {"prompt": prompt, "max_tokens": 20, "stop_token_ids": [alone[k]], "min_tokens": k + 2,
            "return_token_ids": True}  # fmt: skip
    out = _post(srv, "/v1/completions", body)[2]["choices"][0]
    assert out["token_ids"] == held and alone[k] not in held[: k + 2] and len(held) > k + 1
    body = {"prompt": prompt, "max_tokens": 12, "logit_bias": {str(alone[1]): -100, "7": 0.5},
            "return_token_ids": True}  # fmt: skip
    assert _post(srv, "/v1/completions", body)[2]["choices"][0]["token_ids"] == biased[
        0, len(prompt) :].tolist()  # fmt: skip
    with torch.no_grad():
        rep = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             pad_token_id=0, eos_token_id=None, repetition_penalty=1.3)  # fmt: skip
    body = {"prompt": prompt, "max_tokens": 12, "repetition_penalty": 1.3,
            "return_token_ids": True}  # fmt: skip
    assert _post(srv, "/v1/completions", body)[2]["choices"][0]["token_ids"] == rep[
        0, len(prompt) :].tolist()  # fmt: skip
    text = _added(target.tokenizer, prompt, alone)
    stop = " " + text.split()[5]  # its first match ends with token 5's text
    floor = len(_added(target.tokenizer, prompt, alone[:6]))
    at = text.find(stop, floor - len(stop) + 1)
    body = {"prompt": prompt, "max_tokens": 20, "stop": [stop], "min_tokens": 6}
    got = _post(srv, "/v1/completions", body)[2]["choices"][0]
    assert (got["text"], got["finish_reason"]) == ((text[:at], "stop") if at >= 0 else
                                                   (text, "length"))  # fmt: skip


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": [5, 6], "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [5, 6], "max_tokens": 31}, "max_tokens"),
        ({"prompt": [5] * 240, "max_tokens": 20}, "max_tokens"),
        ({"prompt": [5, 6], "temperature": 2.5}, "temperature"),
        ({"prompt": [5, 6], "temperature": "hot"}, "temperature"),
        ({"prompt": [5, 6], "top_p": 0}, "top_p"),
        ({"prompt": [5, 6], "top_k": 1.5}, "top_k"),
        ({"prompt": [5, 500]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [5], "stop": 3}, "stop"),
        ({"prompt": [5], "n": 9}, "n"),  # more than the queue holds
        ({"prompt": [[5, 6], [7]] * 3, "n": 2}, "n"),  # 12 choices
        ({"prompt": [[5, 6], []]}, "prompt[1]"),
        ({"prompt": ["w5", [5] * 240], "max_tokens": 20}, "max_tokens"),
        ({"prompt": [5], "seed": 2**63}, "seed"),
        ({"prompt": [5], "stream": "yes"}, "stream"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"prompt": [5], "logprobs": 3}, "logprobs"),  # the server keeps 2
        ({"prompt": [5], "logprobs": True}, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 1}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3},
            "top_logprobs",
        ),  # fmt: skip
        ({"prompt": [5], "echo": "yes"}, "echo"),
        ({"prompt": [5], "ignore_eos": 1}, "ignore_eos"),
        ({"prompt": [5], "stop_token_ids": [5, 500]}, "stop_token_ids"),
        ({"prompt": [5], "echo": 1}, "echo"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
        ({"prompt": [5], "best_of": 2}, "best_of"),
        ({"prompt": [5], "logit_bias": [5]}, "logit_bias"),
        ({"prompt": [5], "logit_bias": {"w5": 1}}, "logit_bias"),
        ({"prompt": [5], "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": [5], "logit_bias": {"500": 1}}, "logit_bias"),
        ({"prompt": [5], "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"prompt": [5], "min_tokens": -1}, "min_tokens"),
        ({"prompt": [5], "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"prompt": [5], "presence_penalty": "a"}, "presence_penalty"),
        ({"prompt": [5], "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": [5], "temperature": 10**400}, "temperature"),  # too large for a float
    ],
)
def test_bad_bodies_are_400_naming_the_field(served, body, param):
    srv = served[0]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, _, out = _post(srv, path, body)
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"


def test_logprobs_whole_and_streamed(served):
    """`logprobs` (the server keeps 2 alternatives): the completions' tokens, token_logprobs,
    top_logprobs and text_offset, and chat's content entries, streamed and whole alike, one per
    completion token; greedy, each token is its own most likely (the engine's values are checked
    against the target in test_serving_slots). A server that keeps none refuses, naming the
    flag."""
    srv, target, _, scheduler = served
    prompt = random_prompts(target.cfg.vocab_size, [9], seed=13)[0]
    body = {"prompt": prompt, "max_tokens": 10, "logprobs": 2, "return_token_ids": True}
    status, _, out = _post(srv, "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(choice["token_ids"]) == 10
    for x, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert x <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(x)
    ids = choice["token_ids"]
    assert lp["text_offset"] == [len(_added(target.tokenizer, prompt, ids[:j]))
                                 for j in range(len(ids))]  # fmt: skip
    status, _, lines = _post(srv, "/v1/completions", body | {"stream": True})
    chunks = [json.loads(ln[6:])["choices"][0] for ln in lines[:-1]]
    streamed = [x for c in chunks for x in c["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    assert [o for c in chunks for o in c["logprobs"]["text_offset"]] == lp["text_offset"]
    chat = {"messages": [{"role": "user", "content": "w5 w9 w33"}], "max_tokens": 8,
            "logprobs": True, "top_logprobs": 1}  # fmt: skip
    status, _, whole = _post(srv, "/v1/chat/completions", chat)
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 8
    assert all(len(c["top_logprobs"]) == 1 and c["top_logprobs"][0]["token"] == c["token"]
               and c["bytes"] == list(c["token"].encode()) for c in content)  # fmt: skip
    _, _, lines = _post(srv, "/v1/chat/completions", chat | {"stream": True})
    parts = [json.loads(ln[6:])["choices"][0] for ln in lines[1:-1]]
    assert [c for p in parts for c in p["logprobs"]["content"]] == content
    status, _, plain = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 3})
    assert plain["choices"][0]["logprobs"] is None
    opts = DecodeOptions("eagle3", NEW, TREE, eos_ids=(), max_context=256)
    none_kept = SlotEngine(target, served[2], opts, 1)  # built, never run
    other = _Running(build_app(Server(Scheduler(none_kept), target.tokenizer, "tiny")))
    try:
        status, _, out = _post(other, "/v1/completions", body)
        assert status == 400 and "--max-logprobs" in out["error"]["message"]
    finally:
        other.stop()


def test_echo_scores_the_prompt(served):
    """`echo` with logprobs (lm-eval's loglikelihood requests): the prompt's tokens first, the
    first with null, each other's log-probability that of the target's full forward over the
    prompt (70 tokens: two of the scoring's 64-position chunks), then the completion's; with
    max_tokens 0 the prompt alone, no slot taken. Without logprobs, the prompt's text first."""
    import jax
    import numpy as np

    from eagle3_jax.models import target as tgt

    srv, target, _, scheduler = served
    prompt = random_prompts(target.cfg.vocab_size, [70], seed=23)[0]
    logits = tgt.full_forward(target.params, np.array([prompt], np.int32), target.cfg).logits[0]
    want = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    text = target.tokenizer.decode(prompt, skip_special_tokens=True)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    status, _, out = _post(srv, "/v1/completions", body)
    assert status == 200, out
    choice, lp = out["choices"][0], out["choices"][0]["logprobs"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and len(lp["tokens"]) == 70
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = np.array(lp["token_logprobs"][1:])
    np.testing.assert_allclose(got, want[np.arange(69), prompt[1:]], rtol=1e-4, atol=1e-4)
    best = [target.tokenizer.decode([int(i)]) for i in np.argmax(want[:69], axis=-1)]
    assert [max(top, key=top.get) for top in lp["top_logprobs"][1:]] == best
    assert lp["text_offset"] == [len(target.tokenizer.decode(prompt[:j], skip_special_tokens=True))
                                 for j in range(70)]  # fmt: skip
    body = {"prompt": prompt[:9], "max_tokens": 4, "echo": True, "logprobs": 1,
            "return_token_ids": True}  # fmt: skip
    status, _, whole = _post(srv, "/v1/completions", body)
    choice, lp = whole["choices"][0], whole["choices"][0]["logprobs"]
    new = _alone(served, prompt[:9], 4)
    assert choice["token_ids"] == new and whole["usage"]["completion_tokens"] == 4
    head = target.tokenizer.decode(prompt[:9], skip_special_tokens=True)
    assert choice["text"] == target.tokenizer.decode(prompt[:9] + new, skip_special_tokens=True)
    assert len(lp["token_logprobs"]) == 13
    assert lp["tokens"][9:] == [target.tokenizer.decode([i]) for i in new]
    assert lp["text_offset"][9] == len(head)
    _, _, lines = _post(srv, "/v1/completions", body | {"stream": True})
    chunks = [json.loads(ln[6:])["choices"][0] for ln in lines[:-1]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert [x for c in chunks for x in c["logprobs"]["token_logprobs"]] == lp["token_logprobs"]
    assert [x for c in chunks for x in c["logprobs"]["text_offset"]] == lp["text_offset"]
    status, _, out = _post(srv, "/v1/completions", {"prompt": prompt[:9], "max_tokens": 4,
                                                    "echo": True})  # fmt: skip
    assert out["choices"][0]["text"] == choice["text"] and out["choices"][0]["logprobs"] is None
    assert scheduler.busy() == 0


def test_scoring_alone_takes_no_slot(served, monkeypatch):
    """An echoed prompt with max_tokens 0 is answered while every slot is busy: it waits for
    no slot."""
    srv, target, _, scheduler = served
    _slowed(monkeypatch, scheduler.engine)
    streams = [_stream_lines(srv, {"prompt": [5 + i, 6, 7], "max_tokens": 30}) for i in range(3)]
    for _, resp in streams:
        assert resp.readline().startswith(b"data: ")
    assert scheduler.busy() == 3
    body = {"prompt": [9, 8, 7, 6], "max_tokens": 0, "echo": True, "logprobs": 1}
    status, _, out = _post(srv, "/v1/completions", body)
    assert status == 200 and len(out["choices"][0]["logprobs"]["token_logprobs"]) == 4
    assert scheduler.busy() == 3  # the three still run
    for conn, _ in streams:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    for _ in range(100):
        if scheduler.busy() == 0:
            break
        time.sleep(0.1)
    assert scheduler.busy() == 0


def test_not_json_and_unknown_model(served):
    srv = served[0]
    status, _, out = _post(srv, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and "not JSON" in out["error"]["message"]
    status, _, out = _post(srv, "/v1/completions", {"model": "gpt-9", "prompt": [5]})
    assert status == 404 and out["error"]["param"] == "model"


def test_full_queue_429_and_draining_503(spec_setup, served):
    """A scheduler whose engine thread never started: its queue fills, then drains shut."""
    _, target, head, _ = served
    engine = served[3].engine
    idle = Scheduler(engine, max_queue=1)  # not started: nothing leaves the queue
    with pytest.raises(QueueFull):  # a request's choices queue together or not at all
        idle.submit(*(Job(c, [5], 3, 0, lambda ev: None) for c in "xy"))
    assert idle.waiting() == 0
    idle.submit(Job("a", [5], 3, 0, lambda ev: None))
    with pytest.raises(QueueFull):
        idle.submit(Job("b", [5], 3, 0, lambda ev: None))
    srv = _Running(build_app(Server(idle, target.tokenizer, "tiny")))
    try:
        status, headers, out = _post(srv, "/v1/completions", {"prompt": [5], "max_tokens": 3})
        assert status == 429 and headers["Retry-After"] == "1"
        assert out["error"]["type"] == "rate_limit_error"
        idle.draining = True
        status, headers, out = _post(srv, "/v1/completions", {"prompt": [5], "max_tokens": 3})
        assert status == 503 and headers["Retry-After"] == "1"
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(srv, "/health")
        assert e.value.code == 503
    finally:
        srv.stop()


def test_a_request_the_engine_cannot_admit_is_told_and_the_engine_goes_on(served):
    """An admission that raises (a seed past what a PRNG key takes, which the API refuses
    first) ends that request with an error event; the engine thread serves the next one."""
    srv, target, _, scheduler = served
    got = []
    scheduler.submit(Job("bad", [5, 6], 3, 2**70, got.append))
    for _ in range(100):
        if got:
            break
        time.sleep(0.05)
    assert got and got[0].finish_reason.startswith("error: OverflowError")
    assert scheduler.alive
    status, _, out = _post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3})
    assert status == 200 and out["usage"]["completion_tokens"] == 3


def test_a_round_that_loses_the_state_fails_its_requests_and_the_next_are_served(served,
                                                                                  monkeypatch):  # fmt: skip
    """A round that fails after its donated state is gone (a device fault): the running request
    is answered 500, the engine starts from an empty state, and the next request equals
    decoding its prompt alone."""
    import jax

    srv, target, _, scheduler = served
    engine = scheduler.engine
    step = engine.step

    def broken(*a, **k):
        monkeypatch.setattr(engine, "step", step)  # once
        jax.tree.map(lambda x: x.delete(), engine.state)
        raise RuntimeError("device fault")

    monkeypatch.setattr(engine, "step", broken)
    status, _, out = _post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 5})
    assert status == 500 and "device fault" in out["error"]["message"]
    assert scheduler.alive and not engine.state_lost() and engine.free_slots() == [0, 1, 2]
    prompt = [9, 8, 7]
    status, _, out = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                                    "return_token_ids": True})  # fmt: skip
    assert status == 200 and out["choices"][0]["token_ids"] == _alone(served, prompt, 6)


def _slowed(monkeypatch, engine, seconds=0.15):
    """Rounds that take at least `seconds`: a request still runs when the test acts on it."""
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow)


def _stream_lines(srv, body):
    """An open streamed request: (connection, response) to read SSE lines from."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def test_disconnect_frees_the_slot(served, monkeypatch):
    srv, target, _, scheduler = served
    _slowed(monkeypatch, scheduler.engine)
    before = scheduler.stats.finished["cancelled"]
    conn, resp = _stream_lines(srv, {"prompt": [5, 6, 7], "max_tokens": 30})
    assert resp.readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    for _ in range(100):  # 10 s at most
        if scheduler.busy() == 0 and scheduler.stats.finished["cancelled"] > before:
            break
        time.sleep(0.1)
    assert scheduler.busy() == 0 and scheduler.stats.finished["cancelled"] == before + 1
    assert scheduler.engine.free_slots() == [0, 1, 2]
    for _ in range(50):  # the stream's end is counted as cancelled in /metrics too
        if 'eagle3_requests_total{finish_reason="cancelled"}' in _get(srv, "/metrics")[1]:
            break
        time.sleep(0.1)
    assert 'eagle3_requests_total{finish_reason="cancelled"}' in _get(srv, "/metrics")[1]

    def cancelled() -> float:
        line = next(ln for ln in _get(srv, "/metrics")[1].splitlines()
                    if ln.startswith('eagle3_requests_total{finish_reason="cancelled"}'))  # fmt: skip
        return float(line.split()[-1])

    counted = cancelled()  # a whole (not streamed) request whose client leaves: counted so too
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 30}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        for _ in range(50):
            if scheduler.busy():
                break
            time.sleep(0.1)
    for _ in range(100):
        if cancelled() > counted and scheduler.busy() == 0:
            break
        time.sleep(0.1)
    assert cancelled() == counted + 1 and scheduler.busy() == 0
    assert 'finish_reason="none"' not in _get(srv, "/metrics")[1]


def test_shutdown_lets_a_running_stream_finish(served, monkeypatch):
    """What SIGTERM does (uvicorn's handler sets should_exit): no new connections, the running
    stream ends normally with all its tokens and [DONE]."""
    _, target, _, scheduler = served
    _slowed(monkeypatch, scheduler.engine)
    srv = _Running(build_app(Server(scheduler, target.tokenizer, "tiny")))
    prompt = [9, 8, 7, 6]
    conn, resp = _stream_lines(srv, {"prompt": prompt, "max_tokens": 20, "return_token_ids": True})
    first = resp.readline()
    srv.server.should_exit = True
    rest = resp.read().decode()
    conn.close()
    srv.thread.join(30)
    lines = [ln for ln in (first.decode() + rest).split("\n") if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == _alone(served, prompt, 20)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(OSError):
        _get(srv, "/health")


def test_serve_refuses_bad_flags_before_loading(capsys):
    from eagle3_jax.cli import serve

    assert serve.main(["--slots", "0"]) == 2
    assert serve.main(["--method", "vanilla", "--port", "70000"]) == 2
    assert "--port 70000" in capsys.readouterr().err
    assert serve.main(["--method", "vanilla", "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty 0.0" in capsys.readouterr().err
    assert serve.main(["--method", "vanilla", "--prefill-chunk", "-64"]) == 2
    assert "--prefill-chunk -64: give a multiple of 64" in capsys.readouterr().err
    assert serve.main(["--method", "vanilla", "--prefix-cache-mb", "64"]) == 2
    assert "with --prefill-chunk C" in capsys.readouterr().err
    assert serve.main(["--method", "vanilla", "--prefill-chunk", "64", "--prefix-cache-mb",
                       "inf"]) == 2  # fmt: skip
    assert "--prefix-cache-mb inf" in capsys.readouterr().err
    for bad, says in (("autox", "give auto or auto:TREE"), ("auto:2/3", "'2/3' is not a tree"),
                      ("1-2:9", "RANGE:TREE")):  # fmt: skip
        assert serve.main(["--tree-by-occupancy", bad]) == 2
        assert says in capsys.readouterr().err


def test_serving_benchmark_with_the_openai_client(served):
    """benchmarks/serving.py against the tiny server: every request streamed to its end, the
    text equal to decoding the prompt alone."""
    pytest.importorskip("openai")
    import asyncio

    from helpers import load_script

    srv, target, _, _ = served
    bench = load_script("benchmarks/serving.py")
    texts = ["w5 w9 w12", "w40 w41", "w7 w8 w9 w10"]
    out = asyncio.run(bench.run(srv.url("/v1"), texts, float("inf"), 10))
    s = out["summary"]
    assert s["requests"] == 3 and s["output_tokens"] == 30 and s["model"] == "tiny"
    for text, row in zip(texts, out["requests"]):
        ids = encode_chat(target.tokenizer, [{"role": "user", "content": text}])
        want = target.tokenizer.decode(_alone(served, ids, 10), skip_special_tokens=True)
        assert (row["text"], row["finish_reason"], row["completion_tokens"]) == (want, "length", 10)


def test_sigterm_drains_a_real_server_process(tiny_target_dir, tmp_path):
    """`python -m eagle3_jax serve` as its own process (the tiny target, plain rounds, one slot):
    SIGTERM while one stream runs and eleven wait for the slot (/metrics says so just before);
    new connections are refused (or answered 503), every stream ends with [DONE], and the
    process exits 0 within the drain timeout."""
    import http.client
    import os
    import signal
    import subprocess
    import sys

    port = _free_port()
    cmd = [sys.executable, "-m", "eagle3_jax", "serve", "--target", str(tiny_target_dir),
           "--method", "vanilla", "--slots", "1", "--max-context", "256",
           "--max-new-tokens", "240", "--port", str(port), "--drain-timeout", "20"]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        srv = type("Srv", (), {"port": port, "url": _Running.url})()
        for _ in range(1200):  # 120 s at most: the load and the round's compile
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if _get(srv, "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("no /health in 120 s")
        # twelve requests for one slot, all sent before any answer is read: the tiny model
        # decodes a request in a fraction of a second, so most still wait when the signal comes
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for _ in range(12)]
        for i, conn in enumerate(conns):
            body = {"prompt": [5 + i, 9, 12], "max_tokens": 240, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
        streams = [(conn, conn.getresponse()) for conn in conns[:1]]
        first = streams[0][1].readline()
        assert first.startswith(b"data: {")
        metrics = _get(srv, "/metrics")[1]
        in_flight = sum(float(ln.split()[-1]) for ln in metrics.splitlines()
                        if ln.startswith(("eagle3_requests_waiting ", "eagle3_requests_running ")))  # fmt: skip
        assert in_flight >= 2
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for _ in range(100):  # uvicorn closes its socket within a tick of the signal
            try:
                _get(srv, "/health")
                time.sleep(0.05)
            except OSError:
                break
        else:
            raise AssertionError("/health still answers 200 5 s after SIGTERM")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/v1/completions", json.dumps({"prompt": [5], "max_tokens": 4}),
                         {"Content-Type": "application/json"})  # fmt: skip
            assert conn.getresponse().status == 503
        except OSError:
            pass  # refused: uvicorn closed its socket
        streams += [(conn, conn.getresponse()) for conn in conns[1:]]  # the ones that waited
        for i, (conn, resp) in enumerate(streams):
            text = ((first if i == 0 else b"") + resp.read()).decode()
            conn.close()
            lines = [ln for ln in text.split("\n") if ln]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            last = json.loads(lines[-2][6:])["choices"][0]
            assert last["finish_reason"] in ("stop", "length")
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 20 + 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
    return kb / 1024


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="Linux only")
def test_memory_stays_flat_over_a_thousand_requests(served):
    """1,200 requests (whole and streamed, some cut short by a stop string, four clients at a
    time, every prompt bucket): the process's resident memory after the last 1,000 is within
    16 MB of what it was after the first 200 (everything compiled and warm by then), and no
    request is left anywhere in the scheduler or the engine."""
    import concurrent.futures

    srv, target, _, scheduler = served
    prompts = random_prompts(target.cfg.vocab_size, [3, 40, 70, 130, 200], seed=11)

    def one(i):
        body = {"prompt": prompts[i % len(prompts)], "max_tokens": 1 + i % 4,
                "stream": i % 2 == 0}  # fmt: skip
        if i % 7 == 0:
            body["stop"] = ["w"]
        status, _, out = _post(srv, "/v1/completions", body)
        assert status == 200, out

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(200)))
        _get(srv, "/metrics")
        before = _rss_mb()
        list(pool.map(one, range(200, 1200)))
    _get(srv, "/metrics")
    grown = _rss_mb() - before
    assert grown < 16, f"resident memory grew {grown:.1f} MB over 1,000 requests"
    assert scheduler.waiting() == 0 and scheduler.busy() == 0 and not scheduler._cancel
    assert scheduler.engine.busy() == 0
    assert len(scheduler.stats.ttft) == 0 and len(scheduler.stats.latency) == 0


@pytest.mark.slow
def test_the_shipped_model_served_equals_decoding_alone():
    """`serve`'s engine as `serve` builds it (the embedded SmolLM2-135M-Instruct, its shipped head,
    the measured tree choice, 3 slots) over real HTTP: three chat requests, streamed and whole,
    arriving while others run, each answer's token ids equal to decoding that prompt alone
    (`generate_ids`: decode.py's loop); /metrics counts the rounds by tree."""
    from eagle3_jax.cli import decode, decode_flags, serve
    from eagle3_jax.decoding.generate import DecodeOptions, generate_ids

    args = serve.parse_args(["--slots", "3", "--max-context", "512", "--max-new-tokens", "32"])
    serve.check(args)
    target, head, max_context = decode._load(args)
    engine = serve.build_engine(args, target, head, max_context)
    serve.warm(engine)
    scheduler = Scheduler(engine, max_queue=8).start()
    srv = _Running(build_app(Server(scheduler, target.tokenizer, "smollm2")))
    texts = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain speculative decoding in two sentences."]  # fmt: skip
    try:
        results = [None] * len(texts)

        def ask(i):
            time.sleep(0.3 * i)  # the later ones join while the first decodes
            body = {"messages": [{"role": "user", "content": texts[i]}], "max_tokens": 32,
                    "return_token_ids": True, "stream": i == 1}  # fmt: skip
            results[i] = _post(srv, "/v1/chat/completions", body)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = _get(srv, "/metrics")[1]
    finally:
        srv.stop()
        scheduler.stop()
    opts = DecodeOptions("eagle3", 32, decode_flags.tree_of(args), max_context=max_context)
    for i, (status, _, out) in enumerate(results):
        assert status == 200
        if i == 1:  # streamed: the ids of every chunk
            chunks = [json.loads(ln[6:]) for ln in out if ln.startswith("data: {")]
            got = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
        else:
            got = out["choices"][0]["token_ids"]
        ids = encode_chat(target.tokenizer, [{"role": "user", "content": texts[i]}])
        alone = generate_ids(target, head, [ids], opts).output_ids[0]
        assert got == alone, i
    assert "eagle3_tree_rounds_total{tree=" in metrics


@pytest.mark.slow
def test_http_sweep_interleaves_two_servers(tiny_target_dir, tmp_path):
    """benchmarks/serving.py --sweep over HTTP at a toy shape (the tiny target, prompt lookup
    standing in for EAGLE-3, 2 slots): both servers up side by side, each level run twice by
    each in alternating order, every greedy output equal to decoding alone, both servers exit 0
    on SIGTERM."""
    pytest.importorskip("openai")
    import os

    from helpers import load_script

    bench = load_script("benchmarks/serving.py")
    out = tmp_path / "sweep.json"
    serve_args = (f"--target {tiny_target_dir} --method pld --slots 2 --max-context 256 "
                  "--depth 3")  # fmt: skip
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    argv = ["--sweep", "--repeats", "2", "--concurrency", "1", "3", "--requests", "3",
            "--max-tokens", "6", "--bench", "gsm8k", "--serve-args", serve_args, "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    for name in ("eagle3", "plain"):
        run = result["runs"][name]
        assert run["exit_code"] == 0
        for level in run["levels"]:
            s = level["summary"]
            assert len(s["repeats"]) == 2 and s["requests"] == 6
            assert s["equal_to_alone"] == 6 and s["tree_rounds"]
    assert [len(r["pair_speedups"]) for r in result["table"]] == [2, 2]
