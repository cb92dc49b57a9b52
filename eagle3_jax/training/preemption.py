"""SIGTERM while training: finish the step in progress, checkpoint it, stop; `--resume` goes on.

A preemption notice (a Cloud TPU or spot VM's, SLURM's at the end of a job's time, Kubernetes'
before it evicts a pod) and a plain `kill` are a SIGTERM, followed by a SIGKILL a grace period
later (~30 s on Cloud TPU and GCE spot VMs). A run that died at the SIGKILL would lose every step
since its last checkpoint; a run that stops at the notice loses none.

`StopOnSigterm` installs a SIGTERM handler around the training steps (the one before is put back
after them), which only notes the signal. After each step the loop asks `due(step)`; when it is,
it saves that step's checkpoint and raises `Stopped`. In a run of several processes (a pod, a
multi-host job) the signal may reach one of them, while the checkpoint is written by all of them
together: `due` is then every process's note gathered (`process_allgather` of one flag, every
step), so all of them stop after the same step. A signal that comes during the last step or the
final export stops the run after its head is written.

Outside the steps (loading, data preparation, feature precomputation, an `ablate` cell's
evaluation) a SIGTERM ends the process at once, as it would any program; what it wrote resumes.
JAX's own preemption service, which would catch SIGTERM in every process of a multi-process run
and hold it until the program asked for a sync point, is turned off (`distributed.initialize`):
its agreed step is the largest step any process last asked about plus one, so a notice that came
before a resumed run's first step named a step the run had already passed, and was lost.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from eagle3_jax.errors import Stopped


class StopOnSigterm:
    """Context manager around the training steps; `due(step)` says whether to stop after `step`
    (the same answer in every process of a run: call it in every process at the same steps)."""

    def __init__(self):
        self.multi = jax.process_count() > 1
        self.noticed = False  # a SIGTERM reached this process
        self._previous = None
        self._installed = False

    def __enter__(self) -> StopOnSigterm:
        # signal handlers live in the main thread only; a run driven from another thread (rare)
        # keeps the default: SIGTERM ends it, as before
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            # a handler installed outside Python reads as None: the default is what can be put back
            previous = signal.SIG_DFL if self._previous is None else self._previous
            signal.signal(signal.SIGTERM, previous)
            self._installed = False

    def _note(self, signum, frame) -> None:
        self.noticed = True

    def due(self, step: int) -> bool:
        if not self.multi:
            return self.noticed
        flags = multihost_utils.process_allgather(np.int32(self.noticed))
        return bool(np.any(np.asarray(flags)))


def stopped(step: int) -> Stopped:
    """The `Stopped` a run raises after `step`, that step's checkpoint saved."""
    return Stopped(
        f"stopped by SIGTERM after step {step}, its checkpoint saved: the run goes on from it "
        "with train.py --resume (ablate and the study scripts: the same command again)"
    )


def finished(step: int) -> Stopped:
    """The `Stopped` a run raises when the signal came during its last step or export."""
    return Stopped(
        f"stopped by SIGTERM during the last step ({step}): the run finished and its head is "
        "exported (ablate and the study scripts go on with the same command)"
    )
