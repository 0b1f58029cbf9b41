"""The rendezvous of a multi-node job: every node's launcher meets the master's, which assigns the
ranks node by node, hands out the job's addresses and a fresh worker token, and decides how the
job ended.

Run on every node::

    prophetrun --nnodes 2 --node-rank R --master HOST:PORT -n K train.py

The launcher of node 0 runs the master (listening on ``HOST:PORT``) besides its own node; the
``-H`` form runs it in the launcher that starts the nodes over ssh.

Protocol (TCP; each message is a 4-byte big-endian length and a JSON object):

- node -> master ``hello`` (protocol name, version, nonce_n); master -> node ``challenge``
  (nonce_m, its MAC) or ``reject`` (reason);
- node -> master ``join`` (its MAC over the nonces and the join fields: node rank, nnodes, round,
  number of workers, the host and ports its workers will use); master -> node ``joined`` or
  ``reject``;
- once every node joined: master -> node ``plan`` (world size, every worker's address, the first
  rank of this node, a fresh nonce from which every node derives the same worker token);
- node -> master ``ping`` every second once it joined; master -> node ``ping`` every second while
  the workers run. Node -> master ``outcome`` when its workers ended; master -> node ``stop`` when
  another node failed (with the signal to forward to the workers when a launcher was interrupted,
  or, in an elastic job, the signal that asks them for the coordinated checkpoint); master ->
  node ``verdict`` (status and the failure named, the same for every node, and whether the job
  restarts) at the end of the attempt; ``abort`` when the rendezvous itself failed;
- restarts (``--max-restarts``, decided by the master with ``restarts.RestartPolicy``): a verdict
  with ``restart`` names the next round; every node stops its workers, and joins that round over
  its open connection (a ``join`` with fresh ports, MAC'ed as the first); the master sends a new
  plan (a fresh nonce, hence a fresh worker token) once every node rejoined. A node that leaves
  meanwhile ends the job.

MACs are HMAC-SHA256 under ``PROPHET_JOB_TOKEN`` (every node's launcher needs the same secret;
it never travels), so a stranger cannot join. Before a connection has proven the token nothing it
sends ends or stalls the rendezvous: it is rejected with the reason (a misconfigured node fails
at once), and the master keeps waiting for the real node, naming what it rejected if that node
never comes. The workers get ``HMAC(token, nonce)`` as their job token: a fresh one per attempt.

Elastic jobs (``--nnodes MIN:MAX``, ``prophet_tf.launch.elastic``): a node may join while the
job runs (it waits for the next formation; its ``joined`` says so and may assign its node
rank), and every formation plans the nodes present; a node lost or leaving is no failure of the
job.

The join and the plan carry the attempt's round number (0, then one more per restart); a
launcher that is not part of the job cannot join a later round. The plan also carries the job's
seed (``$PROPHET_JOB_SEED``, drawn by the master once per job unless a node's user set it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import selectors
import signal
import socket
import struct
import threading
import time
from typing import Any, Callable, Optional, Sequence

from prophet_tf.launch.restarts import RestartPolicy
from prophet_tf.launch.workers import (CAUSE_INTERRUPTED, CAUSE_LOST, EXIT_JOB_FAILED, Failure,
                                       draw_job_seed, format_address)
from prophet_tf.preemption import EXIT_PREEMPTED

__all__ = ["Master", "NodeLink", "Plan", "RendezvousError", "worker_token", "parse_master",
           "PROTOCOL", "VERSION"]

PROTOCOL = "prophet_tf rendezvous"
VERSION = 1
HANDSHAKE_TIMEOUT_S = 5.0
HEARTBEAT_S = 1.0
_MAX_UNAUTHENTICATED_BYTES = 4096  # a stranger cannot make the master buffer more
_MAX_MESSAGE_BYTES = 1 << 20
_MAX_PENDING = 256
_REJECTED_NAMED = 4
_SEND_TIMEOUT_S = 2.0


class RendezvousError(Exception):
    """The rendezvous cannot be done (bad address, port in use, ...): a usage-level error."""


def parse_master(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6: ``[addr]:port``) -> (host, port); raises RendezvousError."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RendezvousError(f"--master {address!r} is not HOST:PORT with a port in 1..65535, "
                              "e.g. --master 10.0.0.1:29400")
    return host.strip("[]"), int(port)


def worker_token(job_token: str, nonce: str) -> str:
    """The workers' job token of one attempt: every node derives it from the shared secret."""
    return hmac.new(job_token.encode(), b"prophet_tf worker token\0" + nonce.encode(),
                    hashlib.sha256).hexdigest()


def _mac(token: str, label: str, *parts: str) -> str:
    return hmac.new(token.encode(), "\0".join((f"prophet_tf rendezvous: {label}",) + parts).encode(),
                    hashlib.sha256).hexdigest()


def _canonical(fields: dict) -> str:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def _send(sock: socket.socket, message: dict) -> bool:
    data = json.dumps(message).encode()
    try:
        sock.sendall(struct.pack(">I", len(data)) + data)
        return True
    except OSError:
        return False


class _Inbox:
    """Splits a byte stream into messages; refuses lengths beyond ``limit``."""

    def __init__(self, limit: int) -> None:
        self.buf = bytearray()
        self.limit = limit

    def feed(self, data: bytes) -> list[dict]:
        self.buf += data
        out = []
        while len(self.buf) >= 4:
            (length,) = struct.unpack(">I", self.buf[:4])
            if length > self.limit:
                raise ValueError(f"a message of {length} bytes (at most {self.limit} here)")
            if len(self.buf) < 4 + length:
                if len(self.buf) > self.limit + 4:
                    raise ValueError("too much data")
                break
            body = bytes(self.buf[4:4 + length])
            del self.buf[:4 + length]
            message = json.loads(body.decode("utf-8"))
            if not isinstance(message, dict):
                raise ValueError("not a JSON object")
            out.append(message)
        return out


def _is_hex(value: Any, chars: int) -> bool:
    return isinstance(value, str) and len(value) == chars and all(c in "0123456789abcdef" for c in value)


# ------------------------------------------------------------------------------------------------
# The master


@dataclasses.dataclass
class Connection:
    """The master's record of one connection: a launcher that says hello, joins, and is a node of
    the job (or waits to enter an elastic one)."""

    sock: socket.socket
    peer: str
    opened: float
    inbox: _Inbox
    stage: str = "hello"  # hello -> join -> joined
    round: int = 0        # the last round it joined
    nonce_n: str = ""
    nonce_m: str = ""
    node: Optional[int] = None
    fields: dict = dataclasses.field(default_factory=dict)
    last_heard: float = 0.0
    outcome: Optional[dict] = None
    closed: bool = False
    #: In the attempt that runs (its plan was sent); elastic jobs also hold nodes waiting to join.
    member: bool = False
    lost_why: str = ""  # why the master gave it up

    def describe(self) -> str:
        host = self.fields.get("hostname") or ""
        return f"node {self.node} ({self.peer}{', ' + host if host else ''})"


class Master:
    """The master of the rendezvous and the job's referee (runs on its own thread).

    Args:
      address: ``HOST:PORT`` to listen on (every node's ``--master``). When HOST is not an address
        of this machine the master listens on every interface of that port.
      nnodes: number of nodes.
      token: the job's shared secret.
      rdzv_timeout: seconds the rendezvous waits for every node.
      node_timeout: a node not heard from for this long is lost.
      stop_wait: after a failure, how long to wait for every node's outcome before naming one.
      say: writes one launcher message.
      policy: decides whether an attempt a worker ended is restarted (default: never).
      job_seed: the job's seed every plan carries (default: a fresh one).
    """

    def __init__(self, address: str, nnodes: int, token: str, *, rdzv_timeout: float,
                 node_timeout: float, stop_wait: float, say: Callable[[str], None],
                 policy: Optional[RestartPolicy] = None, job_seed: Optional[int] = None) -> None:
        self.host, self.port = parse_master(address)
        self.nnodes = nnodes
        self.token = token
        self.rdzv_timeout = rdzv_timeout
        self.node_timeout = node_timeout
        self.stop_wait = stop_wait
        self.say = say
        self.policy = policy if policy is not None else RestartPolicy(0)
        self.job_seed = job_seed if job_seed is not None else draw_job_seed()
        self._round = 0
        self.verdict: Optional[dict] = None
        self.done = threading.Event()
        self._conns: list[Connection] = []
        self._rejected: list[str] = []
        self._rejected_total = 0
        self._dropped = 0
        self._injected: list[Failure] = []
        self._stopping_until: Optional[float] = None  # the attempt is ending: outcomes until then
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._listener = self._listen()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._thread: Optional[threading.Thread] = None

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def _listen(self) -> socket.socket:
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except socket.gaierror as e:
            raise RendezvousError(f"--master host {self.host!r} does not resolve: {e}") from None
        last: Optional[OSError] = None
        for family, _, _, _, sockaddr in infos + [(socket.AF_INET6, 0, 0, "", ("::", self.port))]:
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                s.bind(sockaddr)
                s.listen(128)
                s.setblocking(False)
                if sockaddr[0] == "::":
                    self.say(f"master: {self.host} is not an address of this machine; listening on "
                             f"every interface, port {self.port}")
                return s
            except OSError as e:
                s.close()
                last = e
                if e.errno == 98:  # EADDRINUSE
                    break
        if last is not None and last.errno == 98:
            raise RendezvousError(
                f"the master's port {self.port} is in use on this machine (another job's master, "
                "or a stale launcher?): choose another --master port")
        raise RendezvousError(f"the master cannot listen on {self.address}: {last}")

    # -- public -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prophet-rendezvous", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def inject_failure(self, failure: Failure) -> None:
        """Reports a failure seen outside the rendezvous (e.g. a node's ssh exited): the job
        stops as if that node had failed."""
        with self._lock:
            self._injected.append(failure)

    def close(self) -> None:
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.sock.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._sel.close()

    # -- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.verdict = self._serve()
        except Exception as e:  # a bug here must still end every node
            self.verdict = self._end(Failure(EXIT_JOB_FAILED, f"the master failed: "
                                             f"{type(e).__name__}: {e}", at=time.time()))
        finally:
            self.done.set()

    def _serve(self) -> dict:
        deadline = time.monotonic() + self.rdzv_timeout
        round_ = 0
        while True:
            formed = self._rendezvous(deadline, round_)
            if formed.get("t") != "formed":
                return formed
            failures = self._supervise()
            if not failures:
                return self._end(None)
            decision = self.policy.decide(failures)
            if not decision.restart:
                return self._end(failures[0], message=decision.message,
                                 status=self._final_status(failures))
            round_ += 1
            self._end(failures[0], message=decision.message, restart_round=round_)
            for c in self._joined():
                c.outcome = None
            deadline = time.monotonic() + self.policy.backoff_s + self.rdzv_timeout

    def _final_status(self, failures: Sequence[Failure]) -> int:
        """The named failure's status, or 75 when a launcher was interrupted and every node's
        workers then stopped for the preemption (the job can be resumed)."""
        first = failures[0]
        outcomes = [c.outcome for c in self._joined() if c.member and c.outcome is not None]
        if first.cause == CAUSE_INTERRUPTED and outcomes and all(
                int(o.get("status", 1)) == EXIT_PREEMPTED for o in outcomes):
            return EXIT_PREEMPTED
        return first.status

    def _rendezvous(self, deadline: float, round_: int) -> dict:
        self._round = round_
        while True:
            injected = self._take_injected()
            if injected:
                return self._end(injected[0], abort=True)
            joined = [c for c in self._joined() if c.round == round_]
            if len(joined) == self.nnodes:
                clash = self._address_clash(joined)
                if clash:
                    return self._end(Failure(EXIT_JOB_FAILED, clash, at=time.time()), abort=True)
                self._send_plans(joined, round_)
                return {"t": "formed"}
            now = time.monotonic()
            if now >= deadline:
                return self._end(Failure(EXIT_JOB_FAILED, self._missing_message(joined),
                                         at=time.time()), abort=True)
            self._poll(min(0.1, deadline - now), forming=True)

    def _stop_message(self, first: Failure) -> tuple[dict, float]:
        """What every node still running is told once the attempt fails (``first``: the failure
        named), and how long to wait for their outcomes then."""
        where = f" on node {first.node}" if first.rank is not None else ""
        stop = {"t": "stop", "reason": first.description + where}
        if first.cause == CAUSE_INTERRUPTED and first.status > 128:
            # A launcher was interrupted (the -H launcher, say): every node forwards the
            # signal, a preemption for the workers, so that they checkpoint.
            stop["forward"] = first.status - 128
        return stop, self.stop_wait

    def _supervise(self) -> list[Failure]:
        """Watches one attempt until every node's outcome came (or the wait after a failure
        ended); returns the failures, the first (the one named) first, none on success."""
        self._stopping_until = None
        failures: list[Failure] = []
        next_ping = 0.0
        while True:
            now = time.monotonic()
            if now >= next_ping:
                for c in self._joined():
                    if not _send(c.sock, {"t": "ping"}):
                        self._lose(c, "the connection to its launcher broke")
                next_ping = now + HEARTBEAT_S
            self._poll(0.1, forming=False)
            new: list[Failure] = self._take_injected()
            nodes = [c for c in self._conns if c.member]
            for c in self._conns:
                if c.node is None or c.stage != "joined":
                    continue
                if c.outcome is None and not c.closed and now - c.last_heard > self.node_timeout:
                    self._lose(c, f"nothing heard from its launcher for {self.node_timeout:g} s "
                                  "(its host hung or the network between them failed)")
                if c.member and c.outcome is not None and c.outcome.get("counted") is None:
                    c.outcome["counted"] = True
                    if c.outcome.get("failure"):
                        f = Failure.from_json(c.outcome["failure"])
                        f.node = c.node
                        new.append(f)
            failures.extend(new)
            if failures and self._stopping_until is None:
                stop, wait = self._stop_message(min(failures, key=lambda f: f.at))
                for c in nodes:
                    if not c.closed and c.outcome is None:
                        _send(c.sock, stop)
                self._stopping_until = time.monotonic() + wait
            settled = all(c.outcome is not None or c.closed for c in nodes)
            if settled or (self._stopping_until is not None
                           and time.monotonic() >= self._stopping_until):
                if not failures and all(c.outcome is not None and int(c.outcome.get("status", 1)) == 0
                                        for c in nodes):
                    return []
                if not failures:
                    failures.append(Failure(EXIT_JOB_FAILED, "a node's launcher ended without an "
                                            "outcome", at=time.time()))
                return sorted(failures, key=lambda f: f.at)

    def _lose(self, c: Connection, why: str) -> None:
        if c.closed:
            return
        c.closed = True
        with contextlib.suppress(Exception):
            self._sel.unregister(c.sock)
        with contextlib.suppress(OSError):
            c.sock.close()
        if c.outcome is None:
            self.inject_failure(Failure(EXIT_JOB_FAILED, f"{c.describe()} was lost: {why}",
                                        node=c.node, at=time.time(), cause=CAUSE_LOST))

    def _take_injected(self) -> list[Failure]:
        with self._lock:
            out, self._injected = self._injected, []
        return out

    def _end(self, failure: Optional[Failure], abort: bool = False, message: str = "",
             status: Optional[int] = None, restart_round: Optional[int] = None,
             to: Optional[Sequence[Connection]] = None) -> dict:
        """Tells every node (or those in ``to``) how the attempt ended (``abort``: the
        rendezvous failed; ``restart_round``: the job goes on with that round; ``message``: the
        restart decision)."""
        if failure is None:
            verdict = {"t": "verdict", "status": 0, "failure": None}
        else:
            verdict = {"t": "abort" if abort else "verdict",
                       "status": failure.status if status is None else status,
                       "failure": failure.to_json()}
        if message:
            verdict["message"] = message
        if restart_round is not None:
            verdict.update(restart=True, round=restart_round, backoff=self.policy.backoff_s)
        for c in (self._conns if to is None else to):
            if c.node is not None and c.stage == "joined" and not c.closed:
                _send(c.sock, verdict)
        return verdict

    def _joined(self) -> list[Connection]:
        return sorted((c for c in self._conns if c.stage == "joined" and not c.closed),
                      key=lambda c: c.node)

    def _address_clash(self, joined: Sequence[Connection]) -> str:
        seen: dict[str, int] = {}
        for c in joined:
            for port in c.fields["ports"]:
                address = format_address(c.fields["host"], port)
                if address in seen:
                    return (f"nodes {seen[address]} and {c.node} both put a worker on {address}: "
                            "give each node on one host its own --base-port (or none: each node "
                            "then picks free ports)")
                seen[address] = c.node
        return ""

    def _formed_text(self, nodes: Sequence[dict]) -> str:
        return "master: every node joined; "

    def _send_plans(self, joined: Sequence[Connection], round_: int) -> None:
        addresses: list[str] = []
        first: dict[int, int] = {}
        for c in joined:
            first[c.node] = len(addresses)
            addresses += [format_address(c.fields["host"], p) for p in c.fields["ports"]]
        nonce = secrets.token_hex(16)
        nodes = [{"node": c.node, "host": c.fields["host"], "hostname": c.fields.get("hostname", ""),
                  "nproc": len(c.fields["ports"]), "first_rank": first[c.node]} for c in joined]
        for c in self._conns:
            c.member = False
        for c in joined:
            c.member = True
            c.outcome = None
            c.last_heard = time.monotonic()
            _send(c.sock, {"t": "plan", "round": round_, "world_size": len(addresses),
                           "addresses": addresses, "first_rank": first[c.node], "nonce": nonce,
                           "nodes": nodes, "job_seed": self.job_seed})
        self.say(self._formed_text(nodes) + ", ".join(
            f"node {n['node']} ({n['host']}): ranks {n['first_rank']}..{n['first_rank'] + n['nproc'] - 1}"
            for n in nodes))

    def _missing_message(self, joined: Sequence[Connection]) -> str:
        present = {c.node for c in joined}
        missing = [r for r in range(self.nnodes) if r not in present]
        text = (f"node(s) {', '.join(map(str, missing))} never joined the rendezvous at "
                f"{self.address} within {self.rdzv_timeout:g} s (joined: "
                + (", ".join(f"{c.node} ({c.peer})" for c in joined) or "none")
                + "): are they started with --nnodes "
                f"{self.nnodes}, their own --node-rank, --master {self.address} and the same "
                "PROPHET_JOB_TOKEN, and can they reach this port?")
        if self._rejected_total:
            text += "; rejected meanwhile: " + "; ".join(self._rejected)
            if self._rejected_total > len(self._rejected):
                text += f"; and {self._rejected_total - len(self._rejected)} more"
        if self._dropped:
            text += f"; {self._dropped} connection(s) that did not speak the rendezvous dropped"
        return text

    # -- connections --------------------------------------------------------------------------
    def _poll(self, timeout: float, forming: bool) -> None:
        for key, _ in self._sel.select(max(0.0, timeout)):
            if key.data is None:
                self._accept()
            else:
                self._readable(key.data, forming)
        now = time.monotonic()
        for c in self._conns:
            if c.stage != "joined" and not c.closed and now - c.opened > HANDSHAKE_TIMEOUT_S:
                self._drop(c, counted=True)
        self._conns = [c for c in self._conns if not (c.closed and c.stage != "joined")]

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            pending = [c for c in self._conns if c.stage != "joined" and not c.closed]
            if len(pending) >= _MAX_PENDING:
                self._drop(min(pending, key=lambda c: c.opened), counted=True)
            sock.settimeout(_SEND_TIMEOUT_S)
            peer = format_address(addr[0], addr[1])
            c = Connection(sock, peer, time.monotonic(), _Inbox(_MAX_UNAUTHENTICATED_BYTES))
            self._conns.append(c)
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _drop(self, c: Connection, counted: bool) -> None:
        if counted:
            self._dropped += 1
        c.closed = True
        with contextlib.suppress(Exception):
            self._sel.unregister(c.sock)
        with contextlib.suppress(OSError):
            c.sock.close()

    def _reject(self, c: Connection, to_node: str, what: str) -> None:
        """Tells a connection that cannot join why, and remembers it for the timeout message."""
        _send(c.sock, {"t": "reject", "reason": to_node})
        claimed = f" (claiming node {c.fields.get('node_rank')})" if c.fields.get("node_rank") is not None else ""
        self.say(f"master: rejected a connection from {c.peer}{claimed}: {what}")
        if len(self._rejected) < _REJECTED_NAMED:
            self._rejected.append(f"{c.peer}{claimed}, {what}")
        self._rejected_total += 1
        self._drop(c, counted=False)

    def _readable(self, c: Connection, forming: bool) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return
        except OSError:
            data = b""
        if not data:
            if c.stage == "joined":
                self._connection_closed(c, forming)
            else:
                self._drop(c, counted=c.stage == "hello")
            return
        try:
            messages = c.inbox.feed(data)
        except (ValueError, UnicodeDecodeError):
            if c.stage == "joined":
                self._lose(c, "it sent a malformed message")
            else:
                self._drop(c, counted=True)
            return
        for m in messages:
            if c.closed:
                return
            self._message(c, m, forming)

    def _connection_closed(self, c: Connection, forming: bool) -> None:
        """The connection of a node that had joined closed (its launcher exited or was killed)."""
        if forming and self._round > 0:
            self._lose(c, "its launcher's connection closed while the job restarted")
        elif forming:
            self.say(f"master: {c.describe()} left before every node joined")
            self._drop(c, counted=False)
            c.stage = "left"
        else:
            self._lose(c, "its launcher's connection closed (it was killed or exited)")

    def _admits_while_running(self) -> bool:
        """Whether a launcher may join while the job runs (an elastic job's new node)."""
        return False

    def _admit(self, c: Connection, fields: dict) -> dict:
        """Makes an authenticated, accepted join a node of the rendezvous; returns what the
        ``joined`` answer adds."""
        c.node = fields["node_rank"]
        c.round = fields["round"]
        return {}

    def _message(self, c: Connection, m: dict, forming: bool) -> None:
        kind = m.get("t")
        if c.stage == "hello":
            if kind != "hello" or m.get("proto") != PROTOCOL or not _is_hex(m.get("nonce"), 64):
                return self._drop(c, counted=True)
            if m.get("version") != VERSION:
                return self._reject(c, f"the master speaks rendezvous version {VERSION}, you "
                                    f"{m.get('version')}: install the same prophet_tf on every node",
                                    f"rendezvous version {m.get('version')}, expected {VERSION}")
            if not forming and not self._admits_while_running():
                return self._reject(c, "the job has already formed (every node joined): this "
                                    "launcher is not part of it", "the job had already formed")
            c.nonce_n = m["nonce"]
            c.nonce_m = secrets.token_hex(32)
            _send(c.sock, {"t": "challenge", "nonce": c.nonce_m,
                           "mac": _mac(self.token, "master", c.nonce_n, c.nonce_m)})
            c.stage = "join"
            return None
        if c.stage == "join":
            fields = m.get("fields")
            if kind != "join" or not isinstance(fields, dict) or not isinstance(m.get("mac"), str):
                return self._drop(c, counted=True)
            c.fields = fields
            expected = _mac(self.token, "node", c.nonce_n, c.nonce_m, _canonical(fields))
            if not hmac.compare_digest(expected, m["mac"]):
                c.fields = {"node_rank": fields.get("node_rank")} if isinstance(
                    fields.get("node_rank"), int) else {}
                return self._reject(c, "job token mismatch: the master could not verify your proof "
                                    "of the job token; PROPHET_JOB_TOKEN must be identical on "
                                    "every node", "job token mismatch")
            problem = self._join_problem(fields)
            if problem:
                return self._reject(c, problem[0], problem[1])
            extra = self._admit(c, fields)
            c.stage = "joined"
            c.last_heard = time.monotonic()
            c.inbox.limit = _MAX_MESSAGE_BYTES
            self._announce_join(c, fields, extra)
            return None
        # joined
        c.last_heard = time.monotonic()
        if kind == "outcome" and not forming and c.outcome is None:
            c.outcome = {"status": int(m.get("status", 1)), "failure": m.get("failure")}
        elif kind == "join" and forming:
            self._rejoin(c, m)
        return None

    def _announce_join(self, c: Connection, fields: dict, extra: dict) -> None:
        """Answers an accepted join and says so."""
        present = {x.node for x in self._joined()}
        waiting = [r for r in range(self.nnodes) if r not in present]
        _send(c.sock, {"t": "joined", "waiting_for": waiting, **extra})
        self.say(f"master: {c.describe()} joined with {len(fields['ports'])} worker(s)"
                 + (f"; waiting for node(s) {', '.join(map(str, waiting))}" if waiting else ""))

    def _rejoin(self, c: Connection, m: dict) -> None:
        """A node of the job joins the round of a restart (its new ports) over its connection."""
        fields = m.get("fields")
        if not isinstance(fields, dict) or not isinstance(m.get("mac"), str) or \
                not hmac.compare_digest(_mac(self.token, "node", c.nonce_n, c.nonce_m,
                                             _canonical(fields)), m["mac"]):
            return self._lose(c, "its join of the restarted round could not be verified")
        problem = self._join_problem(fields, rejoining=c)
        if problem:
            _send(c.sock, {"t": "reject", "reason": problem[0]})
            return self._lose(c, f"its join of the restarted round was refused: {problem[1]}")
        c.fields = fields
        c.round = fields["round"]
        _send(c.sock, {"t": "joined", "waiting_for": self._waiting_for()})

    def _waiting_for(self) -> list[int]:
        """The nodes the rendezvous of this round still waits for."""
        present = {x.node for x in self._joined() if x.round == self._round}
        return [r for r in range(self.nnodes) if r not in present]

    @staticmethod
    def _malformed_join(f: dict) -> bool:
        ports = f.get("ports")
        return (not isinstance(f.get("host"), str) or not f["host"] or not isinstance(ports, list)
                or not ports or not all(isinstance(p, int) and 0 < p < 65536 for p in ports))

    def _tell(self, c: Connection, message: dict) -> bool:
        """Sends one message to a node."""
        return _send(c.sock, message)

    def _join_problem(self, f: dict, rejoining: Optional[Connection] = None) -> Optional[tuple[str, str]]:
        """(what the node is told, what the master remembers) when the join cannot be accepted
        (``rejoining``: the connection of a node of the job joining a restarted round)."""
        node = f.get("node_rank")
        if f.get("nnodes") != self.nnodes:
            return (f"you were started with --nnodes {f.get('nnodes')}, the master with "
                    f"{self.nnodes}: start every node with the same --nnodes",
                    f"--nnodes {f.get('nnodes')}, expected {self.nnodes}")
        if not isinstance(node, int) or not 0 <= node < self.nnodes:
            return (f"--node-rank {node} is outside 0..{self.nnodes - 1}",
                    f"node rank {node}, expected 0..{self.nnodes - 1}")
        if self._malformed_join(f):
            return ("your join lacks its host or ports", "a malformed join")
        if f.get("round") != self._round:
            return (f"the master is at round {self._round} (restarts of the job), you at "
                    f"{f.get('round')}" + (": this launcher is not part of the job" if
                                           rejoining is None and self._round else ""),
                    f"round {f.get('round')}, expected {self._round}")
        if rejoining is not None and node != rejoining.node:
            return (f"you joined as node {rejoining.node}, not {node}",
                    f"node {rejoining.node} rejoining as {node}")
        taken = [c for c in self._joined() if c.node == node and c is not rejoining]
        if taken:
            return (f"node rank {node} is already taken by {taken[0].peer}: did two nodes get the "
                    "same --node-rank?", f"node rank {node} already taken by {taken[0].peer}")
        return None


# ------------------------------------------------------------------------------------------------
# A node's side


@dataclasses.dataclass
class Plan:
    """What the master decided for one attempt, as one node sees it."""

    round: int
    world_size: int
    addresses: list[str]
    first_rank: int
    token: str
    nodes: list[dict]
    job_seed: Optional[int] = None


class NodeLink:
    """One node launcher's connection to the master.

    Once connected it pings the master every second (on a thread of its own, until closed), so
    that the master tells a node that is alive from one that hung or was cut off at any time.

    Args:
      master: ``HOST:PORT`` of the master.
      node_rank, nnodes: this node's place: its rank (None in an elastic job: the master assigns
        one) and the job's number of nodes (``N``, or ``"MIN:MAX"`` for an elastic job).
      token: the job's shared secret.
      timeout: seconds to reach the master and for the rendezvous to complete.
      node_timeout: the master is lost when nothing is heard from it for this long.
      say: writes one launcher message.
    """

    def __init__(self, master: str, node_rank: Optional[int], nnodes: Any, token: str, *,
                 timeout: float, node_timeout: float, say: Callable[[str], None]) -> None:
        self.master = master
        self.host, self.port = parse_master(master)
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.token = token
        self.timeout = timeout
        self.node_timeout = node_timeout
        self.say = say
        self.sock: Optional[socket.socket] = None
        self.verdict: Optional[dict] = None
        self.got_verdict = threading.Event()
        self._inbox = _Inbox(_MAX_MESSAGE_BYTES)
        self._queue: list[dict] = []
        self._thread: Optional[threading.Thread] = None
        self._closing = False
        self._send_lock = threading.Lock()
        self._broken = False  # a send failed: the connection is gone
        self._pinger: Optional[threading.Thread] = None
        self.lost = ""
        #: The master's answer to the last join: this node waits to enter a running job.
        self.pending = False
        #: Returns a signal number when the launcher was interrupted (checked while waiting).
        self.interrupted: Callable[[], Optional[int]] = lambda: None

    # -- joining ------------------------------------------------------------------------------
    def connect(self) -> tuple[str, float]:
        """Connects and proves the token to the master (and the master to us). Returns this
        machine's address as the master sees it, and the deadline of the rendezvous."""
        deadline = time.monotonic() + self.timeout
        attempts, problem = 0, ""
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.05, min(5.0, left)))
                break
            except socket.gaierror as e:
                problem, pause = f"{self.host} does not resolve ({e})", 1.0
            except socket.timeout:
                problem, pause = "no answer to the connection request (a firewall, a wrong address, or the host is down)", 0.0
            except ConnectionRefusedError:
                problem, pause = "connection refused: nothing listens there (yet)", 0.25
            except OSError as e:
                problem, pause = str(e), 0.5
            self._check_interrupted()
            if time.monotonic() + pause >= deadline:
                raise JoinFailed(f"could not reach the master at {self.master} within "
                                 f"{self.timeout:g} s ({attempts} attempt(s); last problem: {problem}): "
                                 "is node 0's launcher started with the same --master, and is that "
                                 "port reachable from here?")
            time.sleep(pause)
        sock.settimeout(_SEND_TIMEOUT_S)
        self.sock = sock
        nonce_n = secrets.token_hex(32)
        self._post({"t": "hello", "proto": PROTOCOL, "version": VERSION, "nonce": nonce_n})
        reply = self._receive(min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT_S), "its challenge")
        if reply.get("t") == "reject":
            raise JoinFailed(f"the master at {self.master} rejected this node: {reply.get('reason')}")
        if reply.get("t") != "challenge" or not _is_hex(reply.get("nonce"), 64):
            raise JoinFailed(f"{self.master} did not answer as a prophet_tf master: is --master the "
                             "address of node 0's launcher?")
        master_proved = hmac.compare_digest(
            _mac(self.token, "master", nonce_n, reply["nonce"]), str(reply.get("mac", "")))
        self._nonces = (nonce_n, reply["nonce"])
        self._master_proved = master_proved
        return sock.getsockname()[0], deadline

    def _post(self, message: dict) -> bool:
        """Sends one message (the pinger sends too: one message at a time)."""
        if self.sock is None:
            return False
        with self._send_lock:
            ok = _send(self.sock, message)
        if not ok:
            self._broken = True
        return ok

    def _start_pinger(self) -> None:
        if self._pinger is not None:
            return

        def ping() -> None:
            while not self._closing and not self._broken:
                self._post({"t": "ping"})
                time.sleep(HEARTBEAT_S)

        self._pinger = threading.Thread(target=ping, name="prophet-node-ping", daemon=True)
        self._pinger.start()

    def join(self, nproc_ports: Sequence[int], host: str, deadline: float, round_: int = 0) -> Plan:
        """Joins round ``round_`` (0, then the round a restart verdict names) with the given
        ports and waits until every node joined (or the rendezvous failed)."""
        assert self.sock is not None
        fields = {"node_rank": self.node_rank, "nnodes": self.nnodes, "round": round_, "host": host,
                  "ports": list(nproc_ports), "hostname": socket.gethostname(), "pid": os.getpid()}
        self._post({"t": "join", "fields": fields,
                    "mac": _mac(self.token, "node", *self._nonces, _canonical(fields))})
        reply = self._receive(min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT_S),
                              "its answer to the join", allow_ping=True)
        if not self._master_proved:
            raise JoinFailed(f"job token mismatch: the master at {self.master} could not prove that it "
                             "holds this job's token: PROPHET_JOB_TOKEN must be identical on every node"
                             + (f" (it says: {reply.get('reason')})" if reply.get("t") == "reject" else ""))
        if reply.get("t") == "reject":
            raise JoinFailed(f"the master at {self.master} rejected this node: {reply.get('reason')}")
        if reply.get("t") != "joined":
            raise JoinFailed(f"the master at {self.master} answered the join with {reply.get('t')!r}")
        self._start_pinger()
        if isinstance(reply.get("node_rank"), int):
            self.node_rank = reply["node_rank"]  # assigned by an elastic job's master
        self.pending = bool(reply.get("pending"))
        waiting = reply.get("waiting_for") or []
        if self.pending:
            self.say(f"joined the master at {self.master} as node {self.node_rank}; the job is "
                     "running: this node enters it at its next checkpoint (every worker stops at "
                     "one step and checkpoints, and the job forms again with this node)")
        elif waiting:
            self.say(f"joined the master at {self.master}; waiting for node(s) "
                     f"{', '.join(map(str, waiting))}")
        while True:
            # A little past our own deadline: a master that started before us gives up first, and
            # its message (naming the missing nodes and what it rejected) says more than ours.
            if self.pending:  # waits for a place in the running job, as long as the master is there
                message = self._receive(time.monotonic() + self.node_timeout, "a place in the job",
                                        allow_ping=True, idle_timeout=self.node_timeout)
            else:
                message = self._receive(deadline + HANDSHAKE_TIMEOUT_S, "the other nodes",
                                        allow_ping=True)
            if message.get("t") == "plan":
                seed = message.get("job_seed")
                return Plan(round=int(message["round"]), world_size=int(message["world_size"]),
                            addresses=[str(a) for a in message["addresses"]],
                            first_rank=int(message["first_rank"]),
                            token=worker_token(self.token, str(message["nonce"])),
                            nodes=list(message.get("nodes", [])),
                            job_seed=int(seed) if isinstance(seed, int) else None)
            if message.get("t") == "verdict" and not message.get("failure"):
                # An elastic job ended while this node waited to enter it.
                raise JoinFailed(str(message.get("message") or "the job ended before this node "
                                  "entered it"), Failure(int(message.get("status", 0)), "",
                                                         node=self.node_rank))
            if message.get("t") in ("abort", "verdict"):
                failure = message.get("failure") or {}
                raise JoinFailed(f"the rendezvous failed at the master: {failure.get('description')}",
                                 Failure.from_json(failure) if failure else None)

    def _check_interrupted(self) -> None:
        sig = self.interrupted()
        if sig is not None:
            name = signal.Signals(sig).name
            raise JoinFailed(f"the launcher got {name} during the rendezvous",
                             Failure(128 + sig, f"the launcher of node {self.node_rank} got {name}",
                                     node=self.node_rank, at=time.time(), cause=CAUSE_INTERRUPTED))

    def _receive(self, deadline: float, what: str, allow_ping: bool = False,
                 idle_timeout: Optional[float] = None) -> dict:
        """The next message (pings skipped with ``allow_ping``) before ``deadline``; with
        ``idle_timeout``, the deadline is instead that long after the last message (a node that
        waits to enter a running job waits as long as the master is there)."""
        assert self.sock is not None
        while True:
            while self._queue:
                m = self._queue.pop(0)
                if idle_timeout is not None:
                    deadline = time.monotonic() + idle_timeout
                if allow_ping and m.get("t") == "ping":
                    continue
                return m
            self._check_interrupted()
            left = deadline - time.monotonic()
            if left <= 0:
                if idle_timeout is not None:
                    raise JoinFailed(f"lost the master at {self.master} while this node waited to "
                                  f"enter the job: nothing heard for {idle_timeout:g} s")
                raise JoinFailed(f"the rendezvous did not complete within {self.timeout:g} s: waited "
                              f"for {what} from the master at {self.master}")
            self.sock.settimeout(min(left, 1.0))
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError as e:
                data, error = b"", e
            else:
                error = None
            if not data:
                raise JoinFailed(f"the master at {self.master} closed the connection while this node "
                                 f"waited for {what}" + (f" ({error})" if error else "")
                                 + ": node 0's launcher exited or gave up; see its output")
            try:
                self._queue.extend(self._inbox.feed(data))
            except (ValueError, UnicodeDecodeError) as e:
                raise JoinFailed(f"the master at {self.master} sent a malformed message ({e})") from None

    # -- while the workers run ----------------------------------------------------------------
    def watch(self, on_stop: Callable[[str, Optional[int], bool], None]) -> None:
        """Listens to the master on a thread until the verdict of the attempt;
        ``on_stop(reason, forward, checkpoint)`` when the job must stop here (another node failed,
        or the master was lost; ``forward``: a signal to forward to the workers, a launcher was
        interrupted; ``checkpoint``: the workers are to stop at the coordinated checkpoint, at
        which an elastic job forms again without a node that leaves or with one that arrived)."""
        assert self.sock is not None

        def signal_number(value: Any) -> Optional[int]:
            return int(value) if isinstance(value, int) and 0 < value < 65 else None

        def handle(messages: list[dict], state: dict) -> None:
            for m in messages:
                if m.get("t") == "stop" and not state["stopped"]:
                    state["stopped"] = True
                    checkpoint = m.get("checkpoint") is True
                    reason = str(m.get("reason"))
                    on_stop(reason if checkpoint else f"another node failed: {reason}",
                            signal_number(m.get("forward")), checkpoint)
                elif m.get("t") in ("verdict", "abort"):
                    self.verdict = m
                    self.got_verdict.set()

        def loop() -> None:
            sock = self.sock
            last_heard = time.monotonic()
            state = {"stopped": False}
            queued, self._queue = self._queue, []
            handle(queued, state)
            while not self.got_verdict.is_set():
                now = time.monotonic()
                if self._broken and not self._closing:
                    reason = f"lost the master at {self.master}: the connection broke"
                    break
                if now - last_heard > self.node_timeout:
                    reason = (f"lost the master at {self.master}: nothing heard for "
                              f"{self.node_timeout:g} s")
                    break
                sock.settimeout(0.2)
                try:
                    data = sock.recv(65536)
                except socket.timeout:
                    continue
                except OSError:
                    data = b""
                if not data:
                    reason = (f"lost the master at {self.master}: its connection closed (node 0's "
                              "launcher was killed or exited)")
                    break
                last_heard = time.monotonic()
                try:
                    messages = self._inbox.feed(data)
                except (ValueError, UnicodeDecodeError):
                    reason = f"lost the master at {self.master}: it sent a malformed message"
                    break
                handle(messages, state)
            else:
                return
            if not self._closing:
                self.lost = reason
                on_stop(reason, None, False)
            self.got_verdict.set()

        self._thread = threading.Thread(target=loop, name="prophet-node-link", daemon=True)
        self._thread.start()

    def report(self, status: int, failure: Optional[Failure]) -> None:
        """Tells the master how this node's workers ended."""
        self._post({"t": "outcome", "status": status,
                    "failure": failure.to_json() if failure else None})

    def wait_verdict(self, timeout: float) -> Optional[dict]:
        """The master's verdict (None if the master was lost or did not answer in time)."""
        self.got_verdict.wait(timeout)
        return self.verdict

    def next_round(self) -> None:
        """After a verdict that restarts the job: the connection is ours again (the watching
        thread has ended) for the join of the next round."""
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        self.verdict = None
        self.got_verdict.clear()

    def close(self) -> None:
        self._closing = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()


class JoinFailed(Exception):
    """A node's rendezvous failed; the message says why (and ``failure`` is the master's)."""

    def __init__(self, message: str, failure: Optional[Failure] = None) -> None:
        super().__init__(message)
        self.failure = failure
