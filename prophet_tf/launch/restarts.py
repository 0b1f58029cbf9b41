"""Restarts of a job (``--max-restarts N``): which ended attempts run again, and when to stop.

After an attempt that a worker ended (a preemption, status 75, or any other failure) every worker
is restarted, on fresh ports with a fresh worker token and the same ``$PROPHET_JOB_SEED``; the
unchanged program resumes from its checkpoint (``BackupAndRestore``, or the strategy's own in
``$PROPHET_CHECKPOINT_DIR``). The launcher (in a job of several nodes, the master: every node
restarts together) does not restart when:

- a launcher got a signal: the machine is going away. It forwarded the signal to the workers (a
  preemption: they checkpoint) and exits with 75 when every worker wrote its checkpoint;
- the job's ``--timeout`` passed, a worker could not be started, or the job failed outside any
  worker (the rendezvous, a node or the master lost);
- the same failure came twice, a bug rather than a fault: the same place in ``model.fit`` with the
  same error (the worker's ``prophet_tf: failed: rank R at epoch E step S: error`` line), or,
  outside ``fit``, the same worker ending with the same status and the same last line of stderr.
  Deaths by SIGKILL, SIGTERM, SIGINT or SIGHUP come from outside (``kill -9``, the OOM killer, a
  scheduler) and never count as a repeat; nor do preemptions;
- the N restarts are used up.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Optional, Sequence

from prophet_tf import preemption
from prophet_tf.launch.workers import CAUSE_INTERRUPTED, CAUSE_WORKER, Failure

__all__ = ["RestartPolicy", "Decision", "signature", "describe"]

# Deaths that come from outside the program: they say nothing about where it was.
_EXTERNAL_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What follows an ended attempt: ``restart`` or not, and what the launcher says (empty
    when restarts are off and there is nothing to add)."""

    restart: bool
    message: str


def signature(failure: Failure) -> Optional[tuple]:
    """What makes two failures "the same failure at the same place"; None for failures that
    never count as a repeat (preemptions, deaths by an outside signal, failures outside a
    worker)."""
    if failure.cause != CAUSE_WORKER or failure.preempted:
        return None
    fit = preemption.parse_failure(failure.fit_failure) if failure.fit_failure else None
    if fit is not None:  # any rank: a bug fails every worker at the same step
        return ("fit", fit.epoch, fit.step, fit.error)
    if failure.status in tuple(128 + int(s) for s in _EXTERNAL_SIGNALS):
        return None
    last = next((line.strip() for line in reversed(failure.tail) if line.strip()), "")
    return ("worker", failure.rank, failure.status, last)


def describe(failure: Failure) -> str:
    """One line: what ended the attempt (where a preemption stopped and its checkpoint, where a
    fit failed)."""
    report = preemption.parse_report(failure.preempted) if failure.preempted else None
    if report is not None and failure.cause == CAUSE_WORKER:
        who = f" ({failure.received})" if failure.received else ""
        if report.epoch is None:
            return f"the job was preempted{who}; the workers stopped outside model.fit (no checkpoint)"
        return (f"the job was preempted{who}; every worker stopped at epoch {report.epoch} step "
                f"{report.step} (checkpoint: {report.checkpoint or 'none'})")
    fit = preemption.parse_failure(failure.fit_failure) if failure.fit_failure else None
    if fit is not None:
        return (f"{failure.description}; its model.fit failed at epoch {fit.epoch} step "
                f"{fit.step}: {fit.error}")
    return failure.description


class RestartPolicy:
    """Counts the restarts of one job and decides after each ended attempt.

    Args:
      max_restarts: how many times the job may be restarted (0: never).
      backoff_s: seconds between an ended attempt and the next one.
    """

    def __init__(self, max_restarts: int = 0, backoff_s: float = 0.0) -> None:
        if max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
        if backoff_s < 0:
            raise ValueError(f"--restart-backoff must be >= 0, got {backoff_s}")
        self.max_restarts = int(max_restarts)
        self.backoff_s = float(backoff_s)
        self.restarts = 0
        self._seen: dict[tuple, int] = {}  # signature -> the attempt it ended

    @property
    def attempt(self) -> int:
        """The number of the current attempt, from 1."""
        return self.restarts + 1

    def decide(self, failures: Sequence[Failure]) -> Decision:
        """After an attempt that did not succeed. ``failures[0]`` is the failure the launcher
        names (the first); the others are every other node's (several nodes): a restart needs
        all of them to be worker failures."""
        if self.max_restarts == 0 or not failures:
            return Decision(False, "")
        failure = failures[0]
        attempt = self.attempt
        what = describe(failure)
        blocking = next((f for f in failures if f.cause != CAUSE_WORKER), None)
        if blocking is not None:
            why = blocking.description
            if blocking.cause == CAUSE_INTERRUPTED:
                why += " (the machine is going away; run the job again to resume it)"
            return Decision(False, f"attempt {attempt} ended: {why}; not restarting")
        key = signature(failure)
        if key is not None and key in self._seen:
            return Decision(False, f"attempt {attempt} ended: {what}. Not restarting: attempt "
                            f"{self._seen[key]} failed the same way at the same place (a bug, "
                            f"not a fault); exiting with status {failure.status}")
        if key is not None:
            self._seen[key] = attempt
        if self.restarts >= self.max_restarts:
            return Decision(False, f"attempt {attempt} ended: {what}. Not restarting: the "
                            f"{self.max_restarts} restart(s) of --max-restarts are used up; "
                            f"exiting with status {failure.status}")
        self.restarts += 1
        pause = f" in {self.backoff_s:g} s" if self.backoff_s > 0 else ""
        return Decision(True, f"attempt {attempt} ended: {what}. Restarting every worker{pause} "
                        f"(restart {self.restarts} of at most {self.max_restarts})")
