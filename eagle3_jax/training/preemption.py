"""SIGTERM while training: finish the step in progress, checkpoint it, stop; `--resume` goes on.

A preemption notice (a Cloud TPU or spot VM's, SLURM's at the end of a job's time, Kubernetes'
before it evicts a pod) and a plain `kill` are a SIGTERM, followed by a SIGKILL a grace period
later (~30 s on Cloud TPU and GCE spot VMs). A run that died at the SIGKILL would lose every step
since its last checkpoint; a run that stops at the notice loses none.

* One process: `StopOnSigterm` installs its own SIGTERM handler around the training steps (the
  previous one is put back after them), which only notes the signal; the loop asks `due(step)`
  after each step and, when it is, saves that step's checkpoint and raises `Stopped`.
* Several processes (a pod, a multi-host job): every process must stop at the same step, since
  the checkpoint is written by all of them together, while the signal may reach one. JAX's
  preemption service (`distributed.initialize(preemption=True)`, which the training commands
  ask for) catches the SIGTERM in whichever process it reaches and agrees on a step with the
  others; `due(step)` is `multihost_utils.reached_preemption_sync_point(step)`, asked at every
  step by every process. Commands that do not train join without the service, so a SIGTERM ends
  them as it would any program.

Outside the steps (loading, data preparation, feature precomputation) SIGTERM ends one process
at once (what it wrote is resumable); in a multi-process run the notice is held by JAX and the
run stops at its first training step.
"""

from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils

from eagle3_jax.errors import Stopped


class StopOnSigterm:
    """Context manager around the training steps; `due(step)` says whether to stop after `step`
    (the same answer in every process of a run)."""

    def __init__(self):
        self.multi = jax.process_count() > 1
        self.noticed = False  # one process: a SIGTERM came
        self._previous = None
        self._installed = False

    def __enter__(self) -> StopOnSigterm:
        # signal handlers live in the main thread only; a run driven from another thread (rare)
        # keeps the default: SIGTERM ends it, as before
        if not self.multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _note(self, signum, frame) -> None:
        self.noticed = True

    def due(self, step: int) -> bool:
        if not self.multi:
            return self.noticed
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # joined without JAX's preemption service: SIGTERM ends the run
            return False


def stopped(step: int) -> Stopped:
    """The `Stopped` a run raises after `step`, that step's checkpoint saved."""
    return Stopped(
        f"stopped by SIGTERM after step {step}, its checkpoint saved: the run goes on from it "
        "with train.py --resume (ablate and the study scripts: the same command again)"
    )
