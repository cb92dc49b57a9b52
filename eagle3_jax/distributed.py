"""Joining a multi-process JAX run: a TPU pod, a SLURM or Open MPI job, or processes started by hand.

Every command line calls `initialize()` first (before anything touches a JAX device):

* With `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES` and
  `JAX_PROCESS_ID` in the environment, it joins that cluster (a cluster JAX detects fills in
  whichever of them is unset).
* Otherwise, where JAX detects a cluster (a Cloud TPU pod slice; a SLURM job step; an Open MPI
  `mpirun`) of more than one process, it joins it with JAX's detected address, count and id.
* Otherwise (one process, none of these) it does nothing.

A process that cannot reach the coordinator, or a coordinator the other processes do not join,
within `timeout_s` (default `EAGLE3_JAX_DISTRIBUTED_TIMEOUT`, else 300 s) ends with one line
naming the address and exit status 2. JAX itself aborts the process with a C++ stack trace there
(jax 0.10: `client.connect()` fails with DEADLINE_EXCEEDED and LOG(FATAL)s), so a process that is
not the coordinator first waits for the coordinator's port to accept connections (an
`Eagle3Error`), and a watchdog ends the process with that one line before JAX's own deadline.
See docs/multihost.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import sys
import threading
import time
import warnings

import jax
import numpy as np

# JAX's cluster detection (what jax.distributed.initialize uses), its client, its backends
from jax._src import clusters, xla_bridge
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils

from eagle3_jax.errors import Eagle3Error

ADDRESS = "JAX_COORDINATOR_ADDRESS"
COUNT = "JAX_NUM_PROCESSES"
ID = "JAX_PROCESS_ID"
TIMEOUT = "EAGLE3_JAX_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
EXIT_STATUS = 2  # what the command lines return for an Eagle3Error


def detected_cluster():
    """The cluster environment JAX detects here (its `ClusterEnv` class), or None. Opt-in
    methods (mpi4py) are left out, as JAX leaves them out; Kubernetes without its client package
    is not a cluster (JAX warns about it; the warning is silenced here)."""
    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                present = env.is_env_present()
            except Exception:  # a detector that cannot run here (e.g. no metadata server)
                present = False
        if present:
            return env
    return None


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise Eagle3Error(f"{name}={value!r}: give an integer") from None


def _timeout(timeout_s: float | None) -> float:
    if timeout_s is not None:
        return float(timeout_s)
    value = os.environ.get(TIMEOUT, "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        return float(value)
    except ValueError:
        raise Eagle3Error(f"{TIMEOUT}={value!r}: give seconds") from None


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise Eagle3Error(f"{ADDRESS}={address!r}: give HOST:PORT, e.g. 10.0.0.1:1234")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Returns once the coordinator's port at `address` accepts a connection; an Eagle3Error
    naming the address after `timeout_s` seconds (process 0 may start a little later)."""
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as e:
            if time.monotonic() + 0.25 >= deadline:
                raise Eagle3Error(
                    f"cannot reach the JAX coordinator at {address} within {timeout_s:g} s "
                    f"({e.strerror or e}): start process 0 there, or check {ADDRESS}"
                ) from None
            time.sleep(0.25)


def _watchdog(message: str, seconds: float) -> threading.Event:
    """Ends the process with `message` (one line, exit status 2) unless the returned event is
    set within `seconds`: JAX's own failure there is an abort with a stack trace."""
    done = threading.Event()

    def watch():
        if not done.wait(seconds):
            sys.stderr.write(f"error: {message}\n")
            sys.stderr.flush()
            os._exit(EXIT_STATUS)

    threading.Thread(target=watch, name="eagle3-distributed-watchdog", daemon=True).start()
    return done


def _from_cluster(env, address, count, pid, timeout: float) -> tuple:
    """(address, count, pid) with what the environment variables left unset read from the
    detected cluster (`env`: SLURM, a TPU pod, ...)."""
    try:
        if count is None:
            count = env.get_process_count()
        if pid is None:
            pid = env.get_process_id()
        if address is None:
            port = os.environ.get("JAX_COORDINATOR_PORT")
            address = env.get_coordinator_address(
                timeout_secs=int(timeout), override_coordinator_port=port
            )
    except Exception as e:
        raise Eagle3Error(
            f"{env.__name__}: cannot read this job's coordinator, process count and id "
            f"({e}); set {ADDRESS}, {COUNT} and {ID}"
        ) from None
    return address, count, pid


def initialize(timeout_s: float | None = None) -> bool:
    """Joins the cluster this process was launched in (see the module docstring); True when it
    did (or had already), False for a single process. Call before any JAX computation.

    JAX's preemption service is left off: it would catch SIGTERM in every process and hold it
    until the program asked for a sync point, which only training does, and its sync point can
    miss a resumed run (training/preemption.py, which agrees on a stop step itself)."""
    if jax.distributed.is_initialized():
        return True
    address = os.environ.get(ADDRESS, "").strip() or None
    count, pid = _int_env(COUNT), _int_env(ID)
    env = detected_cluster()
    if address is None and count is None and pid is None and env is None:
        return False
    timeout = _timeout(timeout_s)
    if env is not None and None in (address, count, pid):
        address, count, pid = _from_cluster(env, address, count, pid, timeout)
    if count == 1 and not pid:
        return False  # one process: nothing to join
    missing = [n for n, v in ((ADDRESS, address), (COUNT, count), (ID, pid)) if v is None]
    if missing:
        raise Eagle3Error(
            f"a multi-process run needs {ADDRESS}, {COUNT} and {ID} (no cluster detected); "
            f"{', '.join(missing)} unset"
        )
    if count < 1 or not 0 <= pid < count:
        raise Eagle3Error(f"{ID}={pid} with {COUNT}={count}: give an id in 0..{count - 1}")
    _host_port(address)
    if xla_bridge.backends_are_initialized():
        raise Eagle3Error(
            "eagle3_jax.distributed.initialize() must run before any JAX computation "
            "(a device was already used in this process)"
        )
    start = time.monotonic()
    if pid != 0:
        wait_for_coordinator(address, timeout)
    left = max(1.0, timeout - (time.monotonic() - start))
    message = (
        f"the JAX coordinator at {address} (this process, 0 of {count}) was not joined by all "
        f"{count} processes within {timeout:g} s: start every process with the same "
        f"{ADDRESS} and {COUNT}"
        if pid == 0
        else f"cannot join the JAX coordinator at {address} (process {pid} of {count}) within "
        f"{timeout:g} s: check that every process uses the same {ADDRESS} and {COUNT}"
    )
    done = _watchdog(message, left)
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=count,
            process_id=pid,
            initialization_timeout=int(left) + 30,  # past the watchdog's: it speaks first
        )
    except (RuntimeError, ValueError) as e:
        raise Eagle3Error(f"joining the JAX coordinator at {address}: {e}") from None
    finally:
        done.set()
    return True


BARRIER_TIMEOUT_S = 24 * 3600.0  # process 0 may tokenise a large dataset while the others wait
_barriers = itertools.count()
_apart_depth = 0  # > 0 inside primary_first / from_primary blocks


@contextlib.contextmanager
def _apart():
    """Marks a block each process runs on its own, at its own time (see `share`)."""
    global _apart_depth
    _apart_depth += 1
    try:
        yield
    finally:
        _apart_depth -= 1


def share() -> tuple[int, int]:
    """(processes, this process's index) that a data job (regeneration, feature precompute, the
    evaluation harness) splits its work between: every process of the run when all of them call
    the job together, as a command line does. (1, 0) with one process, and inside a
    `primary_first` or `from_primary` block, where each process runs the job on its own (process
    0 alone first): a collective there would wait for processes that never come."""
    if jax.process_count() == 1 or _apart_depth:
        return 1, 0
    return jax.process_count(), jax.process_index()


def all_gather(name: str, value, timeout_s: float = BARRIER_TIMEOUT_S, wait: bool = True):
    """Every process's `value` (small and JSON-able: counts, a status), in process order, on every
    process; a barrier too. With one process, `[value]`. Every process must call it, in the same
    order as the other collectives; `wait=False` only posts this process's value (a process that
    failed, on its way out: see `failure`) and returns None."""
    if jax.process_count() == 1:
        return [value] if wait else None
    client = jax_distributed.global_state.client
    key = f"eagle3_jax/{next(_barriers)}/{name}"
    client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
    if not wait:
        return None
    ms = int(timeout_s * 1000)
    return [
        json.loads(client.blocking_key_value_get(f"{key}/{i}", ms))
        for i in range(jax.process_count())
    ]


def failure(e: BaseException) -> dict:
    """What a process that failed in shared work posts to `all_gather` (with wait=False) before it
    re-raises: the others finish their own share (kept for a resumed run), then raise
    `check_gathered`'s error naming it, instead of waiting for it for ever."""
    text = str(e) if isinstance(e, Eagle3Error) else f"{type(e).__name__}: {e}"
    return {"eagle3_jax_error": text or type(e).__name__}


def check_gathered(parts: list) -> list:
    """`parts` from `all_gather`, or an Eagle3Error naming the first process that posted a
    `failure`."""
    for i, p in enumerate(parts):
        if isinstance(p, dict) and "eagle3_jax_error" in p:
            raise Eagle3Error(f"process {i} stopped: {p['eagle3_jax_error']}")
    return parts


def to_host(tree):
    """`jax.device_get` of a tree of arrays some of which may span other processes' devices (a
    batch laid over a mesh's `data` axis across hosts): those leaves are gathered from every
    process first (`process_allgather`), so in a multi-process run every process calls it with
    the same tree, in the same order as its other collectives. With one process, `jax.device_get`."""
    if jax.process_count() == 1:
        return jax.device_get(tree)

    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(fetch, tree)


def is_primary() -> bool:
    """Process 0: the one that writes what a run writes once (metrics, heads, data files)."""
    return jax.process_index() == 0


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Every process waits here until all have arrived (the coordination service's barrier, no
    device work); nothing with one process. Every process must pass the same barriers in the
    same order."""
    if jax.process_count() == 1:
        return
    client = jax_distributed.global_state.client
    client.wait_at_barrier(f"eagle3_jax/{next(_barriers)}/{name}", int(timeout_s * 1000))


@contextlib.contextmanager
def primary_first(name: str, timeout_s: float = BARRIER_TIMEOUT_S):
    """Process 0 runs the block first (writing the files it makes), then the others run it (and
    find those files there): every process gets the same result, and only process 0 writes.
    Where process 0 fails in the block, the others raise an Eagle3Error with its message
    instead of waiting for it. With one process, just the block."""
    if jax.process_count() == 1:
        yield
        return
    client = jax_distributed.global_state.client
    key = f"eagle3_jax/{next(_barriers)}/{name}"
    if is_primary():
        try:
            with _apart():
                yield
        except BaseException as e:
            text = str(e) if isinstance(e, Eagle3Error) else f"{type(e).__name__}: {e}"
            client.key_value_set(key, "error " + text)
            raise
        client.key_value_set(key, "ok")
        return
    status = client.blocking_key_value_get(key, int(timeout_s * 1000))
    if status != "ok":
        raise Eagle3Error(f"process 0 stopped: {status.removeprefix('error ')}")
    with _apart():
        yield


def from_primary(name: str, compute, timeout_s: float = BARRIER_TIMEOUT_S):
    """`compute()` on process 0 alone, its result (JSON-able) handed to every process: one
    decision (a plan, a measurement) that all processes then act on alike. An error on process 0
    reaches the others as an Eagle3Error with its message. With one process, just `compute()`."""
    if jax.process_count() == 1:
        return compute()
    client = jax_distributed.global_state.client
    key = f"eagle3_jax/{next(_barriers)}/{name}"
    if is_primary():
        try:
            with _apart():
                value = compute()
        except BaseException as e:
            text = str(e) if isinstance(e, Eagle3Error) else f"{type(e).__name__}: {e}"
            client.key_value_set(key, "error " + text)
            raise
        client.key_value_set(key, "ok " + json.dumps(value))
        return value
    status = client.blocking_key_value_get(key, int(timeout_s * 1000))
    if not status.startswith("ok "):
        raise Eagle3Error(f"process 0 stopped: {status.removeprefix('error ')}")
    return json.loads(status[3:])
