"""One node of a multi-node job: rendezvous at the master, run this node's workers, agree with the
other nodes on how the job ended.

:func:`run_node` runs one node of the job, every attempt of it (see ``rendezvous`` for the
protocol): join -> plan -> workers -> outcome -> verdict, again for each restart the master
decides. Node 0's launcher also runs the master (``run_master=True``), which must outlive every
node's verdict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Optional, TextIO

from prophet_tf.cluster import JOB_SEED_ENV
from prophet_tf.launch.rendezvous import Master, NodeLink, JoinFailed
from prophet_tf.launch.restarts import RestartPolicy
from prophet_tf.launch.workers import (EXIT_JOB_FAILED, Controls, Failure, JobSpec, Placement,
                                       reserve_ports, run_workers, with_job_seed)
from prophet_tf.preemption import EXIT_PREEMPTED

__all__ = ["run_node"]


def run_node(spec: JobSpec, controls: Controls, *, master: str, nnodes: int, node_rank: int,
             nproc: int, token: str, host: Optional[str] = None, base_port: Optional[int] = None,
             rdzv_timeout: float = 300.0, node_timeout: float = 10.0, run_master: bool = False,
             say: Callable[[str], None], stdout: Optional[TextIO] = None,
             stderr: Optional[TextIO] = None, policy: Optional[RestartPolicy] = None) -> int:
    """Runs this node's part of the job, every attempt of it; returns the job's exit status (the
    same on every node: the status of the failure the master named, 0 when every worker of every
    node succeeded).

    Args:
      spec: what every worker runs.
      controls: signals and deadline of this launcher (its stop event is set when the job must
        stop here).
      master: ``HOST:PORT`` of the master.
      nnodes, node_rank, nproc: the job's number of nodes, this node's rank, its number of workers.
      token: the job's shared secret (``PROPHET_JOB_TOKEN``).
      host: the address this node's workers listen on and are reached at; default: this
        machine's address towards the master.
      base_port: worker i of this node listens on ``base_port + i``; default: free ports, new
        ones for every attempt.
      rdzv_timeout: seconds to wait for the master and every other node.
      node_timeout: a node (or the master) not heard from for this long is lost.
      run_master: run the master here (node 0's launcher).
      say: writes one launcher message.
      policy: the restarts of the job (used by the master only: it decides for every node).
    """
    server: Optional[Master] = None
    if run_master:
        server = Master(master, nnodes, token, rdzv_timeout=rdzv_timeout, node_timeout=node_timeout,
                        stop_wait=spec.grace + 5.0, say=say, policy=policy)
        server.start()
    link = NodeLink(master, node_rank, nnodes, token, timeout=rdzv_timeout,
                    node_timeout=node_timeout, say=say)
    link.interrupted = lambda: controls.signals[0] if controls.signals else None
    controls.launcher = f"the launcher of node {node_rank}"
    try:
        round_, header = 0, None
        try:
            own_address, deadline = link.connect()
        except JoinFailed as e:
            return _rendezvous_failed(e, node_rank, server, say)
        host = host or own_address
        while True:
            try:
                ports = (contextlib.nullcontext(list(range(base_port, base_port + nproc)))
                         if base_port is not None else reserve_ports(nproc, host))
                with ports as chosen:
                    plan = link.join(chosen, host, deadline, round_)
            except JoinFailed as e:
                return _rendezvous_failed(e, node_rank, server, say)
            ranks = list(range(plan.first_rank, plan.first_rank + nproc))
            say(f"node {node_rank}: ranks {ranks[0]}..{ranks[-1]} of {plan.world_size} on {host}"
                + (f" (attempt {round_ + 1})" if round_ else ""))
            attempt_spec = spec
            if plan.job_seed is not None:
                attempt_spec = dataclasses.replace(spec, env=with_job_seed(spec.env, plan.job_seed)[0])

            def on_stop(reason: str, forward: Optional[int]) -> None:
                if forward is not None:
                    controls.signals.append(forward)  # forwarded as if this launcher got it
                controls.stop_reason = reason
                controls.stop.set()

            link.watch(on_stop)
            outcome = run_workers(attempt_spec, Placement(plan.addresses, ranks, plan.token),
                                  controls, stdout=stdout, stderr=stderr, say=say,
                                  log_header=header)
            if outcome.failure is not None and outcome.failure.node is None:
                outcome.failure.node = node_rank
            link.report(outcome.status, outcome.failure)
            verdict = link.wait_verdict(spec.grace + node_timeout + 10.0)
            if verdict is None or (link.lost and link.verdict is None):
                reason = link.lost or f"the master at {master} did not say how the job ended"
                if outcome.ok:
                    say(f"node {node_rank}: every worker here succeeded, but {reason}")
                    return 0
                own = outcome.failure.report() if outcome.failure is not None and not outcome.stopped else ""
                say(f"node {node_rank}: {reason}; stopped this node's workers" + (f". Here: {own}" if own else ""))
                return outcome.status if outcome.failure is not None else EXIT_JOB_FAILED
            status = int(verdict.get("status", EXIT_JOB_FAILED))
            failure = Failure.from_json(verdict["failure"]) if status != 0 and verdict.get("failure") else None
            restart = bool(verdict.get("restart")) and not controls.signals
            message = str(verdict.get("message") or "")
            # A worker's failure with its stderr; the master's message says the rest.
            if failure is not None and not (restart and failure.preempted) and (
                    failure.rank is not None or not message):
                where = f" on node {failure.node}" if failure.node is not None and failure.rank is not None else ""
                say(f"{'the attempt' if restart else 'the job'} failed: "
                    + failure.report(f"{where}; stopped every node's workers"))
            if message:
                say(message)
            if not restart:
                drawn = with_job_seed(spec.env, plan.job_seed)[1] if plan.job_seed is not None else None
                if status == EXIT_PREEMPTED and drawn is not None:
                    say(f"the job was preempted: run it again to resume it from its checkpoint, "
                        f"with {JOB_SEED_ENV}={drawn} on every node (this job's seed: an input "
                        "without a seed of its own then repeats its order)")
                return status
            # The master restarts the job: every node joins the next round.
            round_ = int(verdict["round"])
            header = f"[launch] attempt {round_ + 1} of the job (restart {round_})"
            link.next_round()
            controls.stop.clear()
            controls.stop_reason = ""
            backoff = float(verdict.get("backoff", 0.0))
            paused_until = time.monotonic() + backoff
            while time.monotonic() < paused_until and not controls.signals:
                time.sleep(min(0.05, paused_until - time.monotonic()))
            deadline = time.monotonic() + rdzv_timeout
    finally:
        if server is not None:
            # The master tells every node how the job ended before this launcher may exit.
            server.done.wait(rdzv_timeout if not server.done.is_set() and link.verdict is None
                             else spec.grace + node_timeout + 10.0)
            server.join(1.0)
            time.sleep(0.1)  # let the last verdicts leave the socket buffers
            server.close()
        link.close()


def _rendezvous_failed(e: JoinFailed, node_rank: int, server: Optional[Master],
                       say: Callable[[str], None]) -> int:
    say(f"node {node_rank}: {e}")
    failure = e.failure or Failure(EXIT_JOB_FAILED, f"node {node_rank}: {e}",
                                   node=node_rank, at=time.time())
    if server is not None:
        server.inject_failure(failure)  # the other nodes hear it at once
    return failure.status
