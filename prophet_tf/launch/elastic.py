"""Elastic jobs (``prophetrun --nnodes MIN:MAX``): the job goes on with the nodes it has.

The master of an elastic job (:class:`ElasticMaster`, run by node 0's launcher or by the ``-H``
launcher) forms the job from the nodes present and forms it again, from the last checkpoint,
whenever its membership changes:

- **start**: once MIN nodes joined, it waits ``join_wait`` seconds more for others (at once when
  MAX are there), then sends the plan: ranks node by node in node-rank order;
- **a node is lost** (its launcher's connection closed: killed; or nothing heard from it for
  ``--node-timeout``: hung or cut off) **or leaves** (its launcher got SIGTERM: preempted): every
  other node stops its workers and the job forms again without it, after waiting
  ``rejoin_wait`` seconds for a node to take its place. After a SIGTERM the workers stopped
  together at one step and wrote the coordinated checkpoint (the leaving node's workers asked
  for it; the others are asked too), so the next attempt continues at that step; after a loss
  it continues from the last save of ``BackupAndRestore``;
- **a node arrives** while the job runs: it waits; every worker is asked for the coordinated
  checkpoint (the preemption signal, SIGTERM), stops at one step and writes it, and the job forms
  again with the new node. A node that arrives when the job has MAX nodes waits for a place;
- **fewer than MIN nodes** within ``--rdzv-timeout``: the job ends with
  :data:`EXIT_TOO_FEW_NODES`, naming the nodes it had and what it waited for.

A change of membership is not a restart (it does not count against ``--max-restarts``); a worker
that fails while every node is there is one, and the restart policy decides as in a job of fixed
size. The node running the master must stay: when its launcher is interrupted or lost, the job
ends as a job of fixed size does (``-H`` runs the master outside the worker nodes).

What the program sees of a change of N: every worker of the new attempt starts afresh with the
new ``TF_CONFIG`` (a new world size and token, the same ``$PROPHET_JOB_SEED``) and resumes from
the checkpoint; the global batch is the script's, each worker's share of it changes, and the
position in the data is exact in global batches (see docs/multi-machine.md, "Elastic jobs").
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Union

from prophet_tf.launch.rendezvous import HEARTBEAT_S, Connection, Master
from prophet_tf.launch.restarts import RestartPolicy, describe
from prophet_tf.launch.workers import (CAUSE_INTERRUPTED, CAUSE_LOST, CAUSE_WORKER,
                                       EXIT_JOB_FAILED, Failure, JobSpec, preemption_signal,
                                       preemption_wait)

__all__ = ["NodeRange", "parse_nnodes", "ElasticMaster", "EXIT_TOO_FEW_NODES",
           "DEFAULT_JOIN_WAIT_S", "DEFAULT_REJOIN_WAIT_S", "checkpoint_wait"]

#: Exit status of an elastic job that had fewer than MIN nodes for longer than --rdzv-timeout
#: (sysexits' EX_UNAVAILABLE).
EXIT_TOO_FEW_NODES = 69
#: Seconds the first formation waits for more nodes once MIN are present (torchrun's last call).
DEFAULT_JOIN_WAIT_S = 30.0
#: Seconds a job that lost a node waits for another to take its place before it forms again
#: with fewer.
DEFAULT_REJOIN_WAIT_S = 0.0


@dataclasses.dataclass(frozen=True)
class NodeRange:
    """``--nnodes``: a fixed number of nodes (``N``), or an elastic range (``MIN:MAX``)."""

    min: int
    max: int
    elastic: bool

    @property
    def spec(self) -> Union[int, str]:
        """What a node's join carries (every node of the job must give the same)."""
        return f"{self.min}:{self.max}" if self.elastic else self.min

    def __str__(self) -> str:
        return str(self.spec)


def parse_nnodes(text: Union[str, int]) -> NodeRange:
    """``"4"`` -> 4 nodes; ``"2:4"`` -> an elastic job of 2 to 4 nodes. ValueError names what is
    wrong."""
    value = str(text).strip()
    low, sep, high = value.partition(":")
    try:
        lo = int(low)
        hi = int(high) if sep else lo
    except ValueError:
        raise ValueError(f"--nnodes {value!r} is not N or MIN:MAX (e.g. --nnodes 2 or "
                         "--nnodes 2:4)") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"--nnodes {value!r}: need 1 <= MIN <= MAX")
    return NodeRange(lo, hi, bool(sep))


def checkpoint_wait(spec: JobSpec, node_timeout: float) -> float:
    """How long an elastic master waits for every node's workers to stop at the coordinated
    checkpoint: their preemption grace period (from the environment they get), then more."""
    sig = preemption_signal(spec)
    wait = preemption_wait(spec, sig) if sig is not None else None
    return (wait if wait is not None else spec.grace) + node_timeout + 10.0


@dataclasses.dataclass
class _Change:
    """How the membership of an ended attempt changed."""

    lost: list  # (conn, why)
    leaving: list  # (conn, failure): its launcher got a signal
    grew: bool


class ElasticMaster(Master):
    """The master of an elastic job (see the module docstring).

    Args (besides :class:`~prophet_tf.launch.rendezvous.Master`'s):
      nodes: the job's ``NodeRange`` (elastic).
      join_wait: seconds the first formation waits for more nodes once MIN are present.
      rejoin_wait: seconds a job that lost nodes waits for others to take their place.
      checkpoint_wait: how long the nodes may take to stop their workers at the coordinated
        checkpoint (their preemption grace period and more).
      own_node: the node whose launcher runs this master (its loss ends the job), or None.
    """

    def __init__(self, address: str, nodes: NodeRange, token: str, *, rdzv_timeout: float,
                 node_timeout: float, stop_wait: float, say, policy: Optional[RestartPolicy] = None,
                 job_seed: Optional[int] = None, join_wait: float = DEFAULT_JOIN_WAIT_S,
                 rejoin_wait: float = DEFAULT_REJOIN_WAIT_S, checkpoint_wait: float = 60.0,
                 own_node: Optional[int] = None) -> None:
        super().__init__(address, nodes.max, token, rdzv_timeout=rdzv_timeout,
                         node_timeout=node_timeout, stop_wait=stop_wait, say=say, policy=policy,
                         job_seed=job_seed)
        self.nodes = nodes
        self.join_wait = max(0.0, join_wait)
        self.rejoin_wait = max(0.0, rejoin_wait)
        self.checkpoint_wait = max(stop_wait, checkpoint_wait)
        self.own_node = own_node
        self._running = False
        self._growing: list[int] = []  # the nodes whose arrival asked for the checkpoint

    # -- the loop -----------------------------------------------------------------------------
    def _serve(self) -> dict:
        round_, expected, departed = 0, [], 0
        while True:
            formed = self._form(round_, expected, departed)
            if formed.get("t") != "formed":
                return formed
            self._growing = []
            self._running = True
            try:
                failures = self._supervise()
            finally:
                self._running = False
            members = [c for c in self._conns if c.member]
            if not failures:
                return self._finish(None, members, status=0)
            change = self._change(members)
            blocking = self._blocking(failures)
            if blocking is not None or not (change.lost or change.leaving or change.grew):
                decision = self.policy.decide(failures if blocking is None
                                              else [blocking] + [f for f in failures if f is not blocking])
                if not decision.restart:
                    named = blocking or failures[0]
                    return self._finish(named, members, message=decision.message,
                                        status=self._final_status([named] + failures))
                round_ += 1
                self._end(failures[0], message=decision.message, restart_round=round_, to=members)
                expected, departed = members, 0
                continue
            round_ += 1
            survivors = [c for c in members if not c.closed
                         and all(c is not x for x, _ in change.leaving)]
            message = self._change_message(change, failures, survivors)
            self.say(f"master: {message}")
            for c, failure in change.leaving:
                self._tell(c, {"t": "verdict", "status": failure.status, "failure": None,
                               "left": True, "message": f"node {c.node} left the job ({failure.description}); "
                                          "the other nodes go on without it"})
                c.stage = "left"  # its connection closing next is no loss
            for c in survivors:
                self._tell(c, {"t": "verdict", "status": 0, "failure": None, "restart": True,
                               "round": round_, "backoff": 0.0, "message": message})
            expected, departed = survivors, len(change.lost) + len(change.leaving)

    def _change(self, members: Sequence[Connection]) -> _Change:
        lost, leaving = [], []
        for c in members:
            if not c.closed and c.outcome is None:
                self._lose(c, f"it did not say how its workers ended within "
                              f"{self.stop_wait:g} s of the others")
            if c.closed:
                lost.append((c, c.lost_why or "its connection closed"))
                continue
            failure = c.outcome.get("failure") if c.outcome else None
            if failure and failure.get("cause") == CAUSE_INTERRUPTED and c.node != self.own_node:
                leaving.append((c, Failure.from_json(failure)))
        return _Change(lost, leaving, bool(self._growing))

    def _blocking(self, failures: Sequence[Failure]) -> Optional[Failure]:
        """A failure that ends the job whatever the membership: the master's own node lost or
        interrupted, the -H launcher interrupted, a --timeout, a worker that could not start."""
        for f in failures:
            if f.cause == CAUSE_WORKER:
                continue
            if f.cause in (CAUSE_LOST, CAUSE_INTERRUPTED) and f.node is not None \
                    and f.node != self.own_node:
                continue  # a node lost or leaving: the others go on
            return f
        return None

    def _change_message(self, change: _Change, failures: Sequence[Failure],
                        survivors: Sequence[Connection]) -> str:
        parts = [f"{c.describe()} was lost: {why}" for c, why in change.lost]
        stopped = next((f for f in failures if f.preempted), None)
        for c, failure in change.leaving:
            parts.append(f"node {c.node} left the job: {describe(failure)}")
        if change.grew:
            parts.append(f"node(s) {', '.join(map(str, self._growing))} arrived")
        where = ("the last checkpoint (the last save of BackupAndRestore, or the checkpoint "
                 "the attempt started from)")
        if not change.lost and stopped is not None:
            where = f"the coordinated checkpoint ({describe(stopped).split('; ', 1)[-1]})"
        left = ", ".join(str(c.node) for c in survivors) or "none"
        return ("; ".join(parts) + f". The job forms again (nodes {left} and any that arrive; "
                f"--nnodes {self.nodes}) and continues from {where}")

    def _finish(self, failure: Optional[Failure], members: Sequence[Connection], status: int,
                message: str = "") -> dict:
        """The job ends: its verdict to the nodes of the attempt, and to the nodes that waited
        to enter it."""
        waiting = [c for c in self._joined() if not c.member]
        if failure is None:
            verdict = self._end(None, to=members)
        else:
            verdict = self._end(failure, message=message, status=status, to=members)
        note = ("the job ended before this node entered it" if status == 0 else
                f"the job ended (status {status}) before this node entered it")
        for c in waiting:
            self._tell(c, {"t": "verdict", "status": status, "failure": None, "message": note})
        return verdict

    # -- forming --------------------------------------------------------------------------------
    def _form(self, round_: int, expected: Sequence[Connection], departed: int) -> dict:
        """Forms round ``round_`` from the nodes present: ``expected`` are the nodes of the last
        attempt that go on; ``departed`` nodes left it."""
        self._round = round_
        for c in self._joined():
            if not c.member:
                c.round = round_  # nodes waiting to enter join this round
        start = time.monotonic()
        deadline = start + self.rdzv_timeout + (self.policy.backoff_s if round_ else 0.0)
        enough_since: Optional[float] = None
        next_ping = 0.0
        while True:
            for f in self._take_injected():
                if f.cause != CAUSE_LOST:
                    return self._end(f, abort=True)
            now = time.monotonic()
            if now >= next_ping:  # a node waiting for a place waits as long as it hears the master
                for c in self._joined():
                    self._tell(c, {"t": "ping"})
                next_ping = now + HEARTBEAT_S
            for c in self._joined():
                if now - c.last_heard > self.node_timeout:
                    self._lose(c, f"nothing heard from its launcher for {self.node_timeout:g} s")
            present = sorted((c for c in self._joined() if c.round == round_), key=lambda c: c.node)
            outstanding = [c for c in expected if not c.closed and c.round != round_]
            ready = False
            if len(present) >= self.nodes.max:
                ready = True
            elif len(present) >= self.nodes.min and not outstanding:
                if round_ == 0:
                    enough_since = enough_since or now
                    ready = now >= enough_since + self.join_wait
                else:
                    ready = departed == 0 or now >= start + self.rejoin_wait
            if not ready and now >= deadline:
                if len(present) < self.nodes.min:
                    return self._end(Failure(EXIT_TOO_FEW_NODES, self._too_few(present, round_),
                                             at=time.time()), abort=True)
                for c in outstanding:
                    self._lose(c, f"it did not join again within {self.rdzv_timeout:g} s")
                ready = True
            if ready:
                chosen = present[:self.nodes.max]
                clash = self._address_clash(chosen)
                if clash:
                    return self._end(Failure(EXIT_JOB_FAILED, clash, at=time.time()), abort=True)
                self._send_plans(chosen, round_)
                return {"t": "formed"}
            self._poll(min(0.1, max(0.0, deadline - now)), forming=True)

    def _too_few(self, present: Sequence[Connection], round_: int) -> str:
        had = ", ".join(c.describe() for c in present) or "none"
        text = (f"fewer than {self.nodes.min} node(s) (--nnodes {self.nodes}) for "
                f"{self.rdzv_timeout:g} s (--rdzv-timeout) "
                + ("at the start" if round_ == 0 else "after the job lost nodes")
                + f"; present: {had}. Start more nodes with --master {self.address}, the same "
                "--nnodes and PROPHET_JOB_TOKEN, or lower MIN")
        if self._rejected_total:
            text += "; rejected meanwhile: " + "; ".join(self._rejected)
        return text

    def _formed_text(self, nodes: Sequence[dict]) -> str:
        workers = sum(n["nproc"] for n in nodes)
        return f"master: the job forms with {len(nodes)} node(s), {workers} worker(s): "

    def _waiting_for(self) -> list[int]:
        return []

    # -- joining ------------------------------------------------------------------------------
    def _admits_while_running(self) -> bool:
        return True

    def _admit(self, c: Connection, fields: dict) -> dict:
        node = fields.get("node_rank")
        if node is None:
            taken = {x.node for x in self._joined()}
            node = next(i for i in range(1, len(taken) + 2) if i not in taken)
        c.node = node
        running = self._running
        c.round = self._round + 1 if running else self._round
        if running:
            self._grow(c)
        return {"node_rank": node, "pending": running}

    def _announce_join(self, c: Connection, fields: dict, extra: dict) -> None:
        self._tell(c, {"t": "joined", "waiting_for": [], **extra})
        state = ("; it enters the job at the next checkpoint" if extra.get("pending") else "")
        self.say(f"master: {c.describe()} joined with {len(fields['ports'])} worker(s){state}")

    def _grow(self, c: Connection) -> None:
        """A node arrived while the job runs: every worker stops at one step and checkpoints,
        and the job forms again with it (unless the job has MAX nodes: it waits for a place)."""
        members = [x for x in self._conns if x.member and not x.closed]
        if len(members) >= self.nodes.max:
            self.say(f"master: the job has {len(members)} node(s), its maximum (--nnodes "
                     f"{self.nodes}): node {c.node} waits for a place")
            return
        self._growing.append(c.node)
        if self._stopping_until is not None:
            return  # the attempt is ending anyway: it joins the next
        reason = (f"node {c.node} arrived: every worker stops at one step and checkpoints, and "
                  "the job forms again with it")
        self.say(f"master: {reason}")
        for x in members:
            if x.outcome is None:
                self._tell(x, {"t": "stop", "reason": reason, "checkpoint": True})
        self._stopping_until = time.monotonic() + self.checkpoint_wait

    def _join_problem(self, f: dict, rejoining: Optional[Connection] = None) -> Optional[tuple[str, str]]:
        node = f.get("node_rank")
        if f.get("nnodes") != self.nodes.spec:
            return (f"you were started with --nnodes {f.get('nnodes')}, the master with "
                    f"{self.nodes}: start every node with the same --nnodes",
                    f"--nnodes {f.get('nnodes')}, expected {self.nodes}")
        if node is not None and (not isinstance(node, int) or node < 0):
            return (f"--node-rank {node} is not a number >= 0", f"node rank {node}")
        if self._malformed_join(f):
            return ("your join lacks its host or ports", "a malformed join")
        if rejoining is not None:
            if f.get("round") != self._round:
                return (f"the master is at round {self._round}, you at {f.get('round')}",
                        f"round {f.get('round')}, expected {self._round}")
            if node != rejoining.node:
                return (f"you joined as node {rejoining.node}, not {node}",
                        f"node {rejoining.node} rejoining as {node}")
        taken = [c for c in self._joined() if c.node == node and c is not rejoining]
        if node is not None and taken:
            return (f"node rank {node} is already taken by {taken[0].peer} (if that node is gone, "
                    f"the master drops it within --node-timeout {self.node_timeout:g} s; or "
                    "leave out --node-rank: the master then assigns one)",
                    f"node rank {node} already taken by {taken[0].peer}")
        return None

    # -- losing nodes -------------------------------------------------------------------------
    def _lose(self, c: Connection, why: str) -> None:
        if c.closed:
            return
        c.lost_why = why
        self.say(f"master: {c.describe()} was lost: {why}")
        if c.member and self._running and c.outcome is None:
            super()._lose(c, why)  # the attempt stops (the others' workers cannot go on)
        else:
            self._drop(c, counted=False)

    def _stop_message(self, first: Failure) -> tuple[dict, float]:
        if first.cause == CAUSE_INTERRUPTED and first.node is not None and first.node != self.own_node:
            # A node's launcher got a signal: that node is leaving (preempted). Its workers asked
            # every worker for the coordinated checkpoint; the others' are asked as well, and the
            # job forms again without it from that step.
            reason = f"{first.description}: that node leaves the job"
            return ({"t": "stop", "reason": reason, "checkpoint": True},
                    self.checkpoint_wait)
        return super()._stop_message(first)
