"""The engine thread: a FIFO queue of requests in front of a `SlotEngine`, rounds run back to back
while any slot is busy.

Between rounds the thread frees the slots of cancelled requests, admits waiting requests into the
free slots (their prefill written into the slot's rows), then runs one round over all slots and
hands each request its new tokens through the `deliver` callback it came with (called on this
thread: the server passes one that hops onto its event loop). JAX is only ever called from this
thread. `submit` refuses with `QueueFull` past `max_queue` waiting requests and with `Draining`
once `drain` began.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.slots import SlotEngine
from eagle3_jax.errors import Eagle3Error

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests wait than the queue holds (the server answers 429)."""


class Draining(Exception):
    """The server is shutting down and takes no new requests (503)."""


class Event(NamedTuple):
    """What a request is told: new token ids, and why it ended ("eos", "max_tokens", "context",
    "cancelled" or "error: ...") once it has."""

    new_ids: list[int]
    finish_reason: str | None
    target_forwards: int = 0
    logprobs: list | None = None  # one (log-probability, top alternatives) a new id (slots.Update)
    prompt_logprobs: list | None = None  # the same for the prompt's ids after its first (echo)


def _failed(e: Exception) -> Event:
    """The event that ends a request the engine failed: the server answers it 500."""
    return Event([], f"error: {type(e).__name__}: {e}")


@dataclasses.dataclass
class Job:
    """One request as the engine thread sees it."""

    id: str
    prompt: list[int]
    max_tokens: int
    seed: int
    deliver: Callable[[Event], None]
    # temperature, top-k, top-p, penalties (None: the engine's default)
    sampling: Sampling | None = None
    score: bool = False  # the prompt's log-probabilities first (`SlotEngine.score`: echo)
    ignore_eos: bool = False  # EOS emitted and decoding goes on (vLLM's request setting)
    # the target's logits processed before sampling (`SlotEngine.admit`): {token id: bias}, and
    # EOS and `stop_ids` barred until min_tokens tokens are out
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    first_token: float | None = None
    slot: int | None = None


class Stats:
    """Counters the server exports (read under no lock: ints and floats, torn reads harmless)."""

    def __init__(self):
        self.rounds = 0
        self.admitted = 0
        self.finished: collections.Counter = collections.Counter()
        self.generated = 0
        self.prompt_tokens = 0
        self.target_forwards = 0
        # seconds, drained by the metrics exporter; the newest 4,096 kept while nobody scrapes
        self.ttft: collections.deque[float] = collections.deque(maxlen=4096)
        self.latency: collections.deque[float] = collections.deque(maxlen=4096)


class Scheduler:
    """The queue and the engine thread over `engine` (see the module docstring)."""

    def __init__(self, engine: SlotEngine, max_queue: int = 64, idle_wait_s: float = 0.05):
        self.engine = engine
        self.max_queue = max_queue
        self.idle_wait_s = idle_wait_s
        self.stats = Stats()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}  # slot -> job
        self._cancel: set[str] = set()
        self._cv = threading.Condition()
        self._stop = False
        self.draining = False
        self._thread = threading.Thread(target=self._loop, name="eagle3-engine", daemon=True)

    # ------------------------------------------------------------------ any thread

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def waiting(self) -> int:
        return len(self._waiting)

    def busy(self) -> int:
        return len(self._running)

    def submit(self, *jobs: Job) -> None:
        """Queues `jobs` (their prompts and max_tokens already checked: `engine.check`), all or
        none: a request's n choices wait together."""
        with self._cv:
            if self.draining or self._stop:
                raise Draining("the server is shutting down")
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue holds "
                                f"{self.max_queue})")  # fmt: skip
            self._waiting.extend(jobs)
            self._cv.notify()

    def cancel(self, job_id: str) -> None:
        """Drops a request (its client went away, or a stop string ended it): a waiting one never
        runs, a running one's slot is freed before the next round."""
        with self._cv:
            self._cancel.add(job_id)
            self._cv.notify()

    def drain(self, timeout_s: float) -> bool:
        """Takes no new requests and waits until every queued and running one has ended (or
        `timeout_s`); True when they all did."""
        with self._cv:
            self.draining = True
            self._cv.notify()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not self._waiting and not self._running:
                return True
            time.sleep(0.02)
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as e:  # the engine cannot go on (its state could not be rebuilt)
            log.exception("the engine thread stopped")
            with self._cv:
                self.draining = True
            for job in list(self._waiting) + list(self._running.values()):
                job.deliver(_failed(e))
            self._waiting.clear()
            self._running.clear()
            return
        for job in list(self._waiting) + list(self._running.values()):
            job.deliver(Event([], "cancelled"))

    def _serve(self) -> None:
        while True:
            with self._cv:
                if self._stop:
                    return
                self._apply_cancels()
                admit, free = [], self.engine.free_slots()
                # in arrival order; a prompt to score alone (echo, max_tokens 0) takes no slot
                scores = [j for j in self._waiting if j.max_tokens == 0]
                rest = collections.deque(j for j in self._waiting if j.max_tokens != 0)
                while rest and len(admit) < len(free):
                    admit.append(rest.popleft())
                self._waiting = rest
                if not admit and not scores and not self._running:
                    self._cv.wait(self.idle_wait_s)
                    continue
            for job in scores:
                self._admit(job, None)
            for job, slot in zip(admit, free):
                self._admit(job, slot)
            if self._running:
                self._round()

    def _apply_cancels(self) -> None:
        if not self._cancel:
            return
        self._waiting = collections.deque(j for j in self._waiting if j.id not in self._cancel)
        for slot, job in list(self._running.items()):
            if job.id in self._cancel:
                self.engine.release(slot)
                del self._running[slot]
                self.stats.finished["cancelled"] += 1
        self._cancel.clear()

    def _admit(self, job: Job, slot: int | None) -> None:
        """Scores the prompt if asked (an event of its own), then prefills it into `slot`; a
        request for no new tokens (max_tokens 0: echo alone; slot None) ends there."""
        try:
            if job.score:
                job.deliver(Event([], None, prompt_logprobs=self.engine.score(job.prompt)))
            if job.max_tokens == 0:
                job.deliver(Event([], "max_tokens"))
                self.stats.finished["max_tokens"] += 1
                self.stats.prompt_tokens += len(job.prompt)
                return
            self.engine.admit(job.id, job.prompt, job.max_tokens, job.seed, slot=slot,
                              sampling=job.sampling, ignore_eos=job.ignore_eos,
                              logit_bias=job.logit_bias, min_tokens=job.min_tokens,
                              stop_ids=job.stop_ids)  # fmt: skip
        except Exception as e:  # checked at submit; a refusal here is a bug, told to the client
            if not isinstance(e, Eagle3Error):
                log.exception("admitting request %s failed", job.id)
            try:
                if self.engine.state_lost():  # the running requests' rows went with it
                    self._fail_running(e)
            finally:
                job.deliver(_failed(e))
                self.stats.finished["error"] += 1
            return
        job.slot = slot
        self._running[slot] = job
        self.stats.admitted += 1
        self.stats.prompt_tokens += len(job.prompt)

    def _fail_running(self, e: Exception) -> None:
        """Ends every running request with the error and starts the engine's state afresh, so
        that the requests after them are served (a failed call may have consumed the state; if
        the new one cannot be built either, `_loop` ends every request and the thread)."""
        jobs = list(self._running.values())
        self._running.clear()
        try:  # the state first, so that whoever is told finds the engine serving again
            self.engine.reset()
        finally:
            for job in jobs:
                job.deliver(_failed(e))
                self.stats.finished["error"] += 1

    def _round(self) -> None:
        try:
            before = self.engine.rounds
            updates = self.engine.step()
            self.stats.rounds += self.engine.rounds - before
        except Exception as e:  # the state is unknown now: end every running request
            log.exception("round failed")
            self._fail_running(e)
            return
        now = time.monotonic()
        for u in updates:
            job = self._running.get(u.slot)
            if job is None or job.id != u.request:
                continue
            if u.new_ids and job.first_token is None:
                job.first_token = now
                self.stats.ttft.append(now - job.arrived)
            self.stats.generated += len(u.new_ids)
            if u.finish_reason is not None:
                del self._running[u.slot]
                self.stats.finished[u.finish_reason] += 1
                self.stats.target_forwards += u.target_forwards
                self.stats.latency.append(now - job.arrived)
            job.deliver(Event(u.new_ids, u.finish_reason, u.target_forwards, u.logprobs))
