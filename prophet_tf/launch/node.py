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
from typing import Callable, Optional, TextIO, Union

from prophet_tf.cluster import ELASTIC_ENV, JOB_SEED_ENV
from prophet_tf.launch.elastic import (DEFAULT_JOIN_WAIT_S, DEFAULT_REJOIN_WAIT_S, ElasticMaster,
                                       NodeRange, checkpoint_wait)
from prophet_tf.launch.rendezvous import Master, NodeLink, JoinFailed
from prophet_tf.launch.restarts import RestartPolicy
from prophet_tf.launch.standby import StandbyPool
from prophet_tf.launch.workers import (EXIT_JOB_FAILED, Controls, Failure, JobSpec, Placement,
                                       preemption_signal, reserve_ports, run_workers,
                                       with_death_stub, with_job_seed, worker_envs)
from prophet_tf.preemption import EXIT_PREEMPTED

__all__ = ["run_node"]


def run_node(spec: JobSpec, controls: Controls, *, master: str, nnodes: Union[int, NodeRange],
             node_rank: Optional[int], nproc: int, token: str, host: Optional[str] = None,
             base_port: Optional[int] = None, rdzv_timeout: float = 300.0,
             node_timeout: float = 10.0, run_master: bool = False,
             say: Callable[[str], None], stdout: Optional[TextIO] = None,
             stderr: Optional[TextIO] = None, policy: Optional[RestartPolicy] = None,
             join_wait: float = DEFAULT_JOIN_WAIT_S,
             rejoin_wait: float = DEFAULT_REJOIN_WAIT_S) -> int:
    """Runs this node's part of the job, every attempt of it; returns the job's exit status (the
    same on every node: the status of the failure the master named, 0 when every worker of every
    node succeeded).

    Args:
      spec: what every worker runs.
      controls: signals and deadline of this launcher (its stop event is set when the job must
        stop here).
      master: ``HOST:PORT`` of the master.
      nnodes, node_rank, nproc: the job's number of nodes (a ``NodeRange`` for an elastic job),
        this node's rank (None in an elastic job: the master assigns one), its number of workers.
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
      join_wait, rejoin_wait: an elastic job's master: how long the first formation waits for
        more nodes once MIN are there, and how long the job waits for a node to take the place
        of one it lost (see ``prophet_tf.launch.elastic``).
    """
    nodes = nnodes if isinstance(nnodes, NodeRange) else NodeRange(nnodes, nnodes, False)
    if nodes.elastic:  # an attempt of one worker must resume step-exactly too
        spec = dataclasses.replace(spec, env={**spec.env, ELASTIC_ENV: "1"})
    server: Optional[Master] = None
    if run_master:
        if nodes.elastic:
            server = ElasticMaster(master, nodes, token, rdzv_timeout=rdzv_timeout,
                                   node_timeout=node_timeout, stop_wait=spec.grace + 5.0, say=say,
                                   policy=policy, join_wait=join_wait, rejoin_wait=rejoin_wait,
                                   checkpoint_wait=checkpoint_wait(spec, node_timeout),
                                   own_node=node_rank)
        else:
            server = Master(master, nodes.max, token, rdzv_timeout=rdzv_timeout,
                            node_timeout=node_timeout, stop_wait=spec.grace + 5.0, say=say,
                            policy=policy)
        server.start()
    link = NodeLink(master, node_rank, nodes.spec, token, timeout=rdzv_timeout,
                    node_timeout=node_timeout, say=say)
    link.interrupted = lambda: controls.signals[0] if controls.signals else None
    controls.launcher = f"the launcher of node {node_rank if node_rank is not None else '?'}"
    # How long the verdict may take once this node's workers ended: in an elastic job the others'
    # may still be writing the coordinated checkpoint (a master that is lost is noticed sooner).
    verdict_wait = spec.grace + node_timeout + 10.0
    if nodes.elastic:
        verdict_wait = checkpoint_wait(spec, node_timeout) + spec.grace + 10.0
    # An elastic job forms again with new workers at any time: they start ahead, imports done.
    standby = StandbyPool(spec.preload, with_death_stub) if nodes.elastic and spec.preload else None
    try:
        round_, header = 0, None
        if standby is not None:
            standby.fill(worker_envs(nproc, ["127.0.0.1:0"] * nproc, "", spec.env, spec.threads),
                         delay_s=0.0)
        if standby is not None and not run_master:
            # This node joins once its workers could start training: a node that arrives while
            # the job trains stops it only when its own workers are ready. At most half the
            # rendezvous timeout, which the master counts from its own start (the node running
            # the master joins at once: the master waits anyway).
            began = time.monotonic()
            say(f"{_named(node_rank)}: starting {nproc} worker interpreter(s) with "
                f"{','.join(spec.preload)} imported (--preload); joining the job once they are ready")
            ready = standby.wait_ready(nproc, rdzv_timeout / 2, cancelled=lambda: bool(controls.signals))
            say(f"{_named(node_rank)}: worker interpreter(s) {'ready' if ready else 'still starting'} "
                f"after {time.monotonic() - began:.1f} s; joining the job")
        try:
            own_address, deadline = link.connect()
        except JoinFailed as e:
            return _rendezvous_failed(e, link.node_rank, server, say)
        host = host or own_address
        while True:
            try:
                ports = (contextlib.nullcontext(list(range(base_port, base_port + nproc)))
                         if base_port is not None else reserve_ports(nproc, host))
                with ports as chosen:
                    plan = link.join(chosen, host, deadline, round_)
            except JoinFailed as e:
                return _rendezvous_failed(e, link.node_rank, server, say)
            node_rank = link.node_rank
            controls.launcher = f"the launcher of node {node_rank}"
            ranks = list(range(plan.first_rank, plan.first_rank + nproc))
            say(f"node {node_rank}: ranks {ranks[0]}..{ranks[-1]} of {plan.world_size} on {host}"
                + (f" (attempt {plan.round + 1})" if plan.round else ""))
            attempt_spec = spec
            if plan.job_seed is not None:
                attempt_spec = dataclasses.replace(spec, env=with_job_seed(spec.env, plan.job_seed)[0])

            def on_stop(reason: str, forward: Optional[int], checkpoint: bool) -> None:
                controls.stop_reason = reason
                # The master asks for the coordinated checkpoint: this node's workers get their
                # own preemption signal (without one they cannot checkpoint: they are stopped).
                ask = preemption_signal(attempt_spec) if checkpoint else None
                if ask is not None:
                    controls.checkpoint = ask  # the workers stop by themselves
                    return
                if forward is not None:
                    controls.signals.append(forward)  # forwarded as if this launcher got it
                controls.stop.set()

            link.watch(on_stop)
            outcome = run_workers(attempt_spec, Placement(plan.addresses, ranks, plan.token),
                                  controls, stdout=stdout, stderr=stderr, say=say,
                                  log_header=header, standby=standby)
            if outcome.failure is not None and outcome.failure.node is None:
                outcome.failure.node = node_rank
            link.report(outcome.status, outcome.failure)
            verdict = link.wait_verdict(verdict_wait)
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
            if verdict.get("restart") and controls.signals:
                return 128 + controls.signals[0]  # interrupted meanwhile: this node leaves
            if not restart:
                drawn = with_job_seed(spec.env, plan.job_seed)[1] if plan.job_seed is not None else None
                if status == EXIT_PREEMPTED and drawn is not None and not verdict.get("left"):
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
            controls.checkpoint = None
            backoff = float(verdict.get("backoff", 0.0))
            paused_until = time.monotonic() + backoff
            while time.monotonic() < paused_until and not controls.signals:
                time.sleep(min(0.05, paused_until - time.monotonic()))
            deadline = time.monotonic() + rdzv_timeout
    finally:
        if standby is not None:
            standby.close()
        if server is not None:
            # The master tells every node how the job ended before this launcher may exit.
            server.done.wait(rdzv_timeout if not server.done.is_set() and link.verdict is None
                             else spec.grace + node_timeout + 10.0)
            server.join(1.0)
            time.sleep(0.1)  # let the last verdicts leave the socket buffers
            server.close()
        link.close()


def _named(node_rank: Optional[int]) -> str:
    return f"node {node_rank}" if node_rank is not None else "this node"


def _rendezvous_failed(e: JoinFailed, node_rank: int, server: Optional[Master],
                       say: Callable[[str], None]) -> int:
    say(f"node {node_rank}: {e}")
    failure = e.failure or Failure(EXIT_JOB_FAILED, f"node {node_rank}: {e}",
                                   node=node_rank, at=time.time())
    if server is not None:
        server.inject_failure(failure)  # the other nodes hear it at once
    return failure.status
