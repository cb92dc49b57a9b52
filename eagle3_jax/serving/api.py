"""The OpenAI-compatible HTTP front end over a `Scheduler`: /v1/completions, /v1/chat/completions
(streamed as server-sent events ending `data: [DONE]`, or whole), /v1/models, /health, /metrics.

Request bodies are checked field by field before anything is queued; a bad one is answered 400
with OpenAI's error body naming the field (`error.param`). A full queue is 429 and a draining
server 503, both with Retry-After. Each request's sampling settings (`temperature`, `top_p`,
`top_k`, `seed`; default the server's flags) are its own: the engine keeps them per slot, with no
compile per setting. Text comes from the target's tokenizer: the text of all of a request's ids
so far, decoded incrementally (`detokenize.IncrementalText`). A streamed delta is the new suffix;
an incomplete UTF-8 character, or what could be the start of a stop string, is held back until
it is complete. A client that goes away has its request cancelled: its slot is freed before the
next round. A completions request may give a list of prompts; each prompt's `n` choices are n
requests to the engine, all of a request's queued together (choice i samples from seed + i)
and streamed as their tokens come, each chunk naming its choice's index (prompt p's choice i
is p * n + i, as OpenAI numbers them).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from eagle3_jax.decoding.sampling import Penalties, Sampling
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.prompts import encode_chat
from eagle3_jax.serving.detokenize import IncrementalText
from eagle3_jax.serving.scheduler import Draining, Event, Job, QueueFull, Scheduler

FINISH = {"eos": "stop", "max_tokens": "length", "context": "length"}
RETRY_AFTER_S = 1


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def _first_of_each(pairs) -> dict:
    """{text: log-probability}, most likely first: two alternatives with one text (byte tokens
    that decode to U+FFFD) keep the likelier."""
    out: dict = {}
    for text, x in pairs:
        out.setdefault(text, x)
    return out


def _token_ids(value, vocab: int) -> bool:
    """Whether `value` is a list of token ids of a vocabulary of `vocab` (ints, not bools)."""
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in value
    )


def error(status: int, message: str, kind: str, param: str | None = None, headers=None):
    """OpenAI's error body."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


# ---------------------------------------------------------------------- request parsing


def _int(body: dict, name: str, default: int | None, low: int) -> int | None:
    v = body.get(name)
    if v is None:  # absent or null: the default
        v = default
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer", name)
    if v < low:
        raise BadRequest(f"{name} {v}: give {low} or more", name)
    return v


def _finite(v) -> bool:
    """Whether a JSON value is a finite number (not a boolean; an integer too large for a
    float is not)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of them", "stop")
    if len(stop) > 4:
        raise BadRequest("stop takes at most 4 strings", "stop")
    return stop


class Server:
    """The app's state: the scheduler, the tokenizer, the model's name and the metrics."""

    def __init__(self, scheduler: Scheduler, tokenizer, model_name: str):
        self.scheduler = scheduler
        self.engine = scheduler.engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())
        self._metrics()

    def _metrics(self) -> None:
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter("eagle3_requests", "requests ended, by finish reason",
                                  ["finish_reason"], registry=r)  # fmt: skip
        self.m_refused = Counter("eagle3_requests_refused", "requests refused, by HTTP status",
                                 ["status"], registry=r)  # fmt: skip
        self.m_prompt = Counter("eagle3_prompt_tokens", "prompt tokens admitted", registry=r)
        self.m_gen = Counter("eagle3_generation_tokens", "tokens generated", registry=r)
        self.m_rounds = Counter("eagle3_rounds", "speculative rounds run", registry=r)
        self.m_waiting = Gauge("eagle3_requests_waiting", "requests queued", registry=r)
        self.m_running = Gauge("eagle3_requests_running", "slots busy", registry=r)
        self.m_slots = Gauge("eagle3_slots", "slots in the engine", registry=r)
        self.m_tau = Gauge("eagle3_tau", "tokens per target pass over finished requests",
                           registry=r)  # fmt: skip
        self.m_ttft = Histogram("eagle3_time_to_first_token_seconds", "arrival to first token",
                                registry=r)  # fmt: skip
        self.m_latency = Histogram("eagle3_request_latency_seconds", "arrival to end", registry=r)
        self.m_tree = Gauge("eagle3_tree_tokens",
                            "tokens the current round's tree verifies, root included (1: plain)",
                            registry=r)  # fmt: skip
        self.m_tree_rounds = Counter("eagle3_tree_rounds", "rounds run, by tree", ["tree"],
                                     registry=r)  # fmt: skip
        self.m_prefix_query = Counter("eagle3_prefix_cache_query_tokens",
                                      "prompt tokens in whole chunks looked up in the prefix cache",
                                      registry=r)  # fmt: skip
        self.m_prefix_hit = Counter("eagle3_prefix_cache_hit_tokens",
                                    "of which restored from the prefix cache", registry=r)  # fmt: skip
        self._seen = {"rounds": 0, "prompt": 0, "gen": 0, "query": 0, "hit": 0}
        self._seen_trees: dict[str, int] = {}
        self.m_slots.set(self.engine.slots)

    def metrics_text(self) -> bytes:
        """Counters brought up to date from the scheduler's stats, then the exposition."""
        st, prefix = self.scheduler.stats, self.engine.prefix
        for key, metric, value in (("rounds", self.m_rounds, st.rounds),
                                   ("prompt", self.m_prompt, st.prompt_tokens),
                                   ("gen", self.m_gen, st.generated),
                                   ("query", self.m_prefix_query, prefix.query_tokens if prefix else 0),
                                   ("hit", self.m_prefix_hit, prefix.hit_tokens if prefix else 0)):  # fmt: skip
            metric.inc(value - self._seen[key])
            self._seen[key] = value
        for values, hist in ((st.ttft, self.m_ttft), (st.latency, self.m_latency)):
            while values:
                hist.observe(values.popleft())
        for name, n in list(self.engine.tree_rounds.items()):
            self.m_tree_rounds.labels(tree=name).inc(n - self._seen_trees.get(name, 0))
            self._seen_trees[name] = n
        tree = self.engine.current_tree or self.engine.schedule.trees()[0]
        self.m_tree.set(tree.total_tokens)
        self.m_waiting.set(self.scheduler.waiting())
        self.m_running.set(self.scheduler.busy())
        ended = sum(n for k, n in st.finished.items() if k != "cancelled")
        if ended and st.target_forwards:
            self.m_tau.set(st.generated / st.target_forwards)
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ bodies -> jobs

    def parse(self, body: Any, chat: bool) -> dict:
        """The checked request: prompt ids, max_tokens, seed, stop strings, stream flags."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object", None)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r}: this server serves {self.model_name!r}", "model",
                             status=404)  # fmt: skip
        if chat:
            prompts = [self._messages(body.get("messages"))]
        else:
            prompts = self._prompts(body.get("prompt"))
        n = _int(body, "n", 1, 1)
        if n * len(prompts) > self.scheduler.max_queue:
            raise BadRequest(f"n {n} x {len(prompts)} prompts: at most {self.scheduler.max_queue} "
                             "choices here (--max-queue)", "n")  # fmt: skip
        for name, served in (("best_of", 1), ("suffix", None)):
            if body.get(name) not in (None, served) and not chat:
                raise BadRequest(f"{name}: not served here", name)
        echo = False if chat else body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise BadRequest("echo must be true or false", "echo")
        sampling = self._sampling(body)
        names = ["max_tokens"] + (["max_completion_tokens"] if chat else [])
        given = [m for m in names if body.get(m) is not None]
        # 0 new tokens: the echoed prompt alone (its log-probabilities: scoring, as lm-eval does)
        wanted = _int(body, given[-1], None, 0 if echo else 1) if given else None
        max_tokens = []  # each prompt's: the given one, or all the room it has
        for i, prompt in enumerate(prompts):
            room = max(1, self.engine.max_tokens_for(len(prompt)))
            max_tokens.append(room if wanted is None else wanted)
            try:
                self.engine.check(prompt, max(1, max_tokens[-1]))
            except Eagle3Error as e:
                param = (given[-1] if given else "messages" if chat else
                         "prompt" if len(prompts) == 1 else f"prompt[{i}]")  # fmt: skip
                raise BadRequest(str(e), param) from None
        seed = _int(body, "seed", 0, 0)
        if seed >= 2**63:
            raise BadRequest(f"seed {seed}: give 0 .. 2**63 - 1", "seed")
        ignore_eos = body.get("ignore_eos")  # vLLM's extension
        if ignore_eos is not None and not isinstance(ignore_eos, bool):
            raise BadRequest("ignore_eos must be true or false", "ignore_eos")
        stop_ids = self._stop_ids(body)
        logit_bias = self._logit_bias(body)
        min_tokens = _int(body, "min_tokens", 0, 0)  # vLLM's extension
        for m in max_tokens:
            try:
                self.engine.check_processing(m, logit_bias, min_tokens, stop_ids, bool(ignore_eos),
                                             sampling.penalties)  # fmt: skip
            except Eagle3Error as e:
                param = next((p for p in ("logit_bias", "min_tokens") if p in str(e)), "logit_bias")
                raise BadRequest(str(e), param) from None
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be true or false", "stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
        return {
            "prompts": prompts,
            "chat": chat,
            "echo": bool(echo),
            "ignore_eos": bool(ignore_eos),
            "n": n,  # choices a prompt: choice p * n + i is prompt p's i-th
            "choices": n * len(prompts),
            "max_tokens": max_tokens,  # a prompt's
            "seed": seed,
            "sampling": sampling,
            "stop": _stop(body),
            "stop_ids": stop_ids,
            "logit_bias": logit_bias,
            "min_tokens": min_tokens,
            "stream": stream,
            "usage_chunk": bool(opts.get("include_usage")),
            "token_ids": bool(body.get("return_token_ids")),
            "logprobs": self._logprobs(body, chat),
        }

    def _stop_ids(self, body: dict) -> frozenset[int]:
        """vLLM's `stop_token_ids`: token ids that end a request once emitted (the id stays in
        the output; its text is decoding's, nothing for a special token)."""
        ids = body.get("stop_token_ids")
        if ids is None:
            return frozenset()
        vocab = self.engine.cfgs[0].vocab_size
        if not _token_ids(ids, vocab):
            raise BadRequest(f"stop_token_ids must be a list of token ids in 0..{vocab - 1}",
                             "stop_token_ids")  # fmt: skip
        return frozenset(ids)

    def _penalties(self, body: dict, default: Penalties) -> Penalties:
        """OpenAI's `presence_penalty` and `frequency_penalty` ([-2, 2]) and vLLM's
        `repetition_penalty` (> 0), each defaulting to the server's (`default`)."""
        values = {}
        for name, field in (("repetition_penalty", "repetition"),
                            ("frequency_penalty", "frequency"),
                            ("presence_penalty", "presence")):  # fmt: skip
            v = body.get(name)
            if v is None:
                v = getattr(default, field)
            if not _finite(v):
                raise BadRequest(f"{name} must be a number", name)
            values[field] = float(v)
            try:
                Penalties(**values)
            except Eagle3Error as e:
                raise BadRequest(str(e), name) from None
        return Penalties(**values)

    def _logit_bias(self, body: dict) -> dict[int, float]:
        """OpenAI's `logit_bias`: {token id (JSON keys are text): bias in [-100, 100]}, added to
        the target's logits before sampling (-100 bars a token, 100 all but forces it)."""
        given = body.get("logit_bias")
        if given is None:
            return {}
        if not isinstance(given, dict):
            raise BadRequest("logit_bias must be an object of token id: bias", "logit_bias")
        out = {}
        for key, v in given.items():
            try:
                i = int(key)
            except ValueError:
                raise BadRequest(f"logit_bias: key {key!r} is not a token id", "logit_bias"
                                 ) from None  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise BadRequest(f"logit_bias: {v!r} for token {key}: give a number in "
                                 "[-100, 100]", "logit_bias")  # fmt: skip
            out[i] = float(v)
        return out

    def _logprobs(self, body: dict, chat: bool) -> int | None:
        """How many alternatives each token's log-probability comes with (None: no
        log-probabilities): chat's `logprobs` (true/false) and `top_logprobs` (0..20), the
        completions' `logprobs` (0..20), at most the server's --max-logprobs."""
        if chat:
            wanted = body.get("logprobs")
            if wanted is not None and not isinstance(wanted, bool):
                raise BadRequest("logprobs must be true or false", "logprobs")
            top = body.get("top_logprobs")
            if top is not None and not wanted:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            k, name = (_int(body, "top_logprobs", 0, 0) if wanted else None), "top_logprobs"
        else:
            k, name = body.get("logprobs"), "logprobs"
            if k is not None:
                k = _int(body, "logprobs", 0, 0)
        if k is None:
            return None
        kept = self.engine.shape.logprobs
        if kept is None:
            raise BadRequest("logprobs: this server keeps none; start it with --max-logprobs N",
                             "logprobs")  # fmt: skip
        if k > min(kept, 20):
            raise BadRequest(f"{name} {k}: at most {min(kept, 20)} here (--max-logprobs)", name)
        return k

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def logprobs_body(self, chat: bool, lps, k: int) -> dict:
        """OpenAI's `logprobs` of a choice for its tokens' (id, log-probability, top
        alternatives, text offset): chat's {"content": [{token, logprob, bytes, top_logprobs}]},
        or the completions' {tokens, token_logprobs, top_logprobs, text_offset} (where each
        token's text starts in the choice's, as decoding the ids before it gives; an echoed
        prompt's first token has no log-probability: null)."""
        texts = [self.token_text(i) for i, _, _, _ in lps]
        tops = [None if alts is None else [(self.token_text(t), x) for t, x in alts[:k]]
                for _, _, alts, _ in lps]  # fmt: skip
        if chat:
            return {"content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": a, "logprob": x, "bytes": list(a.encode())}
                                  for a, x in top]}
                for t, (_, lp, _, _), top in zip(texts, lps, tops)
            ]}  # fmt: skip
        return {"tokens": texts, "token_logprobs": [lp for _, lp, _, _ in lps],
                "top_logprobs": [None if top is None else _first_of_each(top) for top in tops],
                "text_offset": [at for _, _, _, at in lps]}  # fmt: skip

    def _sampling(self, body: dict) -> Sampling:
        """The request's temperature (0: greedy; at most 2, OpenAI's range), top_p (0, 1], top_k
        (vLLM's extension; 0 or -1: off) and penalties (`_penalties`), each defaulting to the
        server's."""
        default = self.engine.opts.sampling
        values = {}
        for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
            v = body.get(name)
            if v is None:
                values[name] = getattr(default, name)
                continue
            if not _finite(v):
                raise BadRequest(f"{name} must be a number", name)
            if not low <= v <= high or (name == "top_p" and v == 0):
                span = "(0, 1]" if name == "top_p" else "[0, 2]"
                raise BadRequest(f"{name} {v} outside {span}", name)
            values[name] = float(v)
        top_k = body.get("top_k")
        if top_k is None:
            top_k = default.top_k
        elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise BadRequest("top_k must be an integer >= -1 (0 or -1: no top-k)", "top_k")
        return Sampling(values["temperature"], max(top_k, 0), values["top_p"],
                        self._penalties(body, default.penalties))  # fmt: skip

    def _messages(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise BadRequest(f"messages[{i}] needs a role: system, user or assistant",
                                 f"messages[{i}].role")  # fmt: skip
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = [p.get("text") for p in content if isinstance(p, dict)]
                content = "".join(p for p in parts if isinstance(p, str))
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be text", f"messages[{i}].content")
            clean.append({"role": m["role"], "content": content})
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer: use /v1/completions with token ids",
                             "messages")  # fmt: skip
        return encode_chat(self.tokenizer, clean)

    def _prompts(self, prompt) -> list[list[int]]:
        """A completions request's prompts: a string or token ids, or a list of them (a
        batch, one or more choices each)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) == 1:
                return [self._prompt(prompt[0], "prompt")]
            return [self._prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return [self._prompt(prompt, "prompt")]

    def _prompt(self, prompt, param: str) -> list[int]:
        if isinstance(prompt, str) and prompt:
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer: give the prompt as token ids",
                                 param)  # fmt: skip
            return [int(i) for i in self.tokenizer(prompt)["input_ids"]]
        vocab = self.engine.cfgs[0].vocab_size
        if (isinstance(prompt, list) and prompt
                and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)):  # fmt: skip
            if not _token_ids(prompt, vocab):
                raise BadRequest(f"{param}: token ids must be in 0..{vocab - 1}", param)
            return [int(i) for i in prompt]
        raise BadRequest(f"{param} must be a non-empty string or a list of token ids, or a list of "
                         "those", param)  # fmt: skip

    # ------------------------------------------------------------------ running one

    def submit(self, req: dict) -> list[tuple[Job, asyncio.Queue]]:
        """Queues the request's choices (n a prompt), all or none (`QueueFull`, `Draining`):
        (job, its events) each. A prompt's choice i samples from seed + i (the engine's key
        takes it modulo 2**32, as `decode.py --seed` does)."""
        loop = asyncio.get_running_loop()
        out = []
        for c in range(req["choices"]):
            p, i = divmod(c, req["n"])
            events: asyncio.Queue[Event] = asyncio.Queue()
            job = Job(uuid.uuid4().hex, req["prompts"][p], req["max_tokens"][p],
                      (req["seed"] + i) % 2**32,
                      lambda ev, q=events: loop.call_soon_threadsafe(q.put_nowait, ev),
                      sampling=req["sampling"],
                      score=req["echo"] and req["logprobs"] is not None,
                      ignore_eos=req["ignore_eos"], logit_bias=req["logit_bias"],
                      min_tokens=req["min_tokens"], stop_ids=req["stop_ids"])  # fmt: skip
            out.append((job, events))
        self.scheduler.submit(*(job for job, _ in out))
        return out

    async def run(self, req: dict, request: Request, job: Job, events: asyncio.Queue
                  ) -> AsyncIterator[tuple]:  # fmt: skip
        """Follows one submitted choice: yields (new text, new ids, OpenAI finish reason or None,
        the new ids' (id, log-probability, top alternatives, text offset) or None) as rounds
        produce them, an echoed prompt first (its text and log-probabilities, no new ids);
        cancels it when the consumer stops early (a disconnect)."""
        ids: list[int] = []
        # the text of ids; a completion's what it adds to its prompt's (its first space kept)
        decoded = IncrementalText(self.tokenizer, () if req["chat"] else job.prompt)
        lps: list = []  # the ids' (id, log-probability, top alternatives, text offset)
        sent, unsent = 0, 0  # characters sent; ids not yet sent with them
        hold = max((len(s) for s in req["stop"]), default=1) - 1
        done = False
        base = 0  # where the completion's text starts in the choice's (after an echoed prompt)
        echoed, offsets = IncrementalText(self.tokenizer), []
        floor = 0 if not req["min_tokens"] else None  # the text of the first min_tokens ids

        def push(new_ids: list[int]) -> str:  # `decoded.push`, noting `floor` on the way
            nonlocal floor
            need = req["min_tokens"] - len(decoded.ids)
            if floor is None and len(new_ids) >= need:
                # (a character still incomplete there is not yet text)
                floor = len(decoded.push(new_ids[:need]).rstrip("\ufffd"))
                new_ids = new_ids[need:]
            return decoded.push(new_ids)

        try:
            if req["echo"]:
                for i in job.prompt:
                    offsets.append(len(echoed.text))
                    echoed.push([i])
                base = len(echoed.text)
                if not job.score:  # the prompt's text now; with logprobs, once it is scored
                    yield echoed.text, [], None, None
            checked = time.monotonic()
            while not done:
                try:
                    ev = await asyncio.wait_for(events.get(), 1.0)
                except TimeoutError:
                    ev = None
                if time.monotonic() - checked > 1.0:  # a client gone, tokens flowing or not
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if ev is None:
                    continue
                if ev.prompt_logprobs is not None:  # the first token has none (OpenAI: null)
                    scored = [(job.prompt[0], None, None, 0)] + [
                        (i, lp, top, at) for i, (lp, top), at
                        in zip(job.prompt[1:], ev.prompt_logprobs, offsets[1:])
                    ]  # fmt: skip
                    yield echoed.text, [], None, scored
                    continue
                if ev.finish_reason and ev.finish_reason.startswith("error"):
                    raise RuntimeError(ev.finish_reason)
                if ev.finish_reason == "cancelled":
                    raise RuntimeError("cancelled by the server")
                new, reason = ev.new_ids, FINISH.get(ev.finish_reason)
                at = next((j for j, t in enumerate(new) if t in req["stop_ids"]), None)
                if at is not None:  # a stop token: emitted, and the request ends with it
                    new, reason = new[: at + 1], "stop"
                    self.scheduler.cancel(job.id)
                if req["logprobs"] is not None:  # each with its offset in the text
                    for id_, (lp, top) in zip(new, ev.logprobs or []):
                        lps.append((id_, lp, top, base + len(decoded.text)))
                        push([id_])
                ids += new
                text = push(ids[len(decoded.ids) :])
                # a stop string counts once it ends past the first min_tokens tokens' text
                found = [] if floor is None else [
                    i for i in (text.find(s, max(sent, floor - len(s) + 1)) for s in req["stop"])
                    if i >= 0
                ]  # fmt: skip
                cut = min(found, default=-1)
                if cut >= 0:
                    text, reason = text[:cut], "stop"
                    self.scheduler.cancel(job.id)
                end = len(text)
                if reason is None:  # hold back what a later token could still change
                    end -= hold
                    while end > sent and text[end - 1] == "\ufffd":
                        end -= 1
                done = reason is not None
                unsent += len(new)
                if end > sent or done:
                    new_lps = lps[len(lps) - unsent :] if req["logprobs"] is not None else None
                    yield text[sent : max(end, sent)], ids[len(ids) - unsent :], reason, new_lps
                    sent, unsent = max(end, sent), 0
        finally:
            if not done:
                self.scheduler.cancel(job.id)


def build_app(server: Server) -> FastAPI:
    """The FastAPI app over `server` (its scheduler started by the caller)."""
    app = FastAPI(title="eagle3_jax")

    def refuse(e: Exception) -> JSONResponse:
        if isinstance(e, BadRequest):
            server.m_refused.labels(str(e.status)).inc()
            kind = "invalid_request_error" if e.status == 400 else "not_found_error"
            return error(e.status, str(e), kind, e.param)
        if isinstance(e, QueueFull):
            server.m_refused.labels("429").inc()
            return error(429, f"{e}: retry later", "rate_limit_error",
                         headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        server.m_refused.labels("503").inc()
        return error(503, str(e), "service_unavailable",
                     headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return refuse(BadRequest(f"the body is not JSON: {e}"))
        try:
            req = server.parse(body, chat)
        except BadRequest as e:
            return refuse(e)
        if server.scheduler.draining:
            return refuse(Draining("the server is shutting down"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:  # queued now, so that 429/503 come back as a status, not inside a stream
            submitted = server.submit(req)
        except (QueueFull, Draining) as e:
            return refuse(e)
        choices = _merged([server.run(req, request, job, events) for job, events in submitted],
                          lambda: [server.scheduler.cancel(job.id) for job, _ in submitted])  # fmt: skip
        try:  # the first tokens, so that an engine error is a 500
            first = await anext(choices)
            if req["stream"]:
                return StreamingResponse(_sse(server, req, rid, chat, first, choices),
                                         media_type="text/event-stream")  # fmt: skip
            return await _whole(server, req, rid, chat, first, choices)
        except RuntimeError as e:
            server.m_requests.labels("error").inc(req["choices"])
            return error(500, str(e), "server_error")
        except StopAsyncIteration:  # every choice ended early: the client went away
            return error(500, "the client disconnected", "server_error")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created,
            "owned_by": "eagle3_jax", "max_model_len": server.engine.max_context,
        }]}  # fmt: skip

    @app.get("/health")
    async def health():
        if server.scheduler.draining or not server.scheduler.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _merged(gens: list[AsyncIterator[tuple]], cancel) -> AsyncIterator[tuple[int, tuple]]:
    """The items of a request's choices (`Server.run` each) as they come, as (choice index,
    item); the first error any raises is raised here. Closing this cancels every choice
    (`cancel()`: their jobs, whether or not their generators ever ran)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async for item in gen:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # handed to the consumer
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                left -= 1
                continue
            yield i, item
    finally:  # a disconnect, an error or the end (a job that ended ignores its cancel)
        cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(req: dict, completion_tokens: int) -> dict:
    p = sum(map(len, req["prompts"]))
    return {"prompt_tokens": p, "completion_tokens": completion_tokens,
            "total_tokens": p + completion_tokens}  # fmt: skip


def _choice(server, chat: bool, index: int, text: str, reason, ids, req, delta: bool,
            lps=None) -> dict:  # fmt: skip
    if chat and delta:
        body = {"delta": {"content": text}}
    elif chat:
        body = {"message": {"role": "assistant", "content": text}}
    else:
        body = {"text": text}
    out = {"index": index, **body, "logprobs": None, "finish_reason": reason}
    if req["logprobs"] is not None:
        out["logprobs"] = server.logprobs_body(chat, lps or [], req["logprobs"])
    if req["token_ids"]:
        out["token_ids"] = ids
    return out


async def _whole(server: Server, req, rid, chat, first, choices) -> JSONResponse:
    n = req["choices"]
    parts, ids, reasons = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
    lps: list[list] = [[] for _ in range(n)]
    item = first
    while item is not None:
        i, (text, new, why, new_lps) = item
        parts[i].append(text)
        ids[i] += new
        lps[i] += new_lps or []
        reasons[i] = why or reasons[i]
        item = await anext(choices, None)
    for reason in reasons:
        server.m_requests.labels(reason or "cancelled").inc()  # no reason: its client left
    out = [_choice(server, chat, i, "".join(parts[i]), reasons[i], ids[i], req, False, lps[i])
           for i in range(n)]  # fmt: skip
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": server.model_name, "choices": out,
        "usage": _usage(req, sum(map(len, ids))),
    })  # fmt: skip


async def _sse(server: Server, req, rid, chat, first, choices) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())
    generated = 0
    reasons: dict[int, str | None] = {}

    def chunk(out, usage=None) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": server.model_name,
                "choices": out}  # fmt: skip
        if usage is not None or req["usage_chunk"]:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    if chat:  # each choice's role first
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                      "finish_reason": None} for i in range(req["choices"])])  # fmt: skip
    try:
        item = first
        while item is not None:
            i, (text, new, reason, lps) = item
            generated += len(new)
            reasons[i] = reason
            yield chunk([_choice(server, chat, i, text, reason, new, req, True, lps)])
            item = await anext(choices, None)
    except RuntimeError as e:
        reasons = {i: reasons.get(i) or "error" for i in range(req["choices"])}
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
    finally:  # a disconnect lands here too: every choice is cancelled, and counted so
        await choices.aclose()
        for i in range(req["choices"]):
            server.m_requests.labels(reasons.get(i) or "cancelled").inc()
    if req["usage_chunk"]:
        yield chunk([], _usage(req, generated))
    yield "data: [DONE]\n\n"
