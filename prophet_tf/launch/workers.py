"""The workers of one node for one attempt of a job: their environment, starting them, copying
their output, supervising them and stopping them.

:func:`run_workers` is the unit a launcher calls once per attempt: it starts the node's workers
of a :class:`Placement`, waits until they all succeed, one fails, the launcher is interrupted, the
attempt's deadline passes or someone else (another node, through the rendezvous) asks it to stop,
and returns an :class:`Outcome` that names the first failure. It never exits the process and
leaves nothing running, so a restart loop can call it again with a fresh placement.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Deque, Mapping, Optional, Sequence, TextIO

from prophet_tf import preemption
from prophet_tf.cluster import JOB_SEED_ENV

if TYPE_CHECKING:
    from prophet_tf.launch.standby import StandbyPool

__all__ = ["EXIT_TIMEOUT", "EXIT_JOB_FAILED", "EXIT_NO_START", "Failure", "Outcome", "JobSpec",
           "Placement", "Controls", "run_workers", "free_ports", "reserve_ports", "format_address",
           "worker_envs", "package_root", "command", "describe_status", "status_of", "draw_job_seed",
           "with_job_seed", "preemption_wait", "preemption_signal", "with_death_stub"]

EXIT_TIMEOUT = 124
#: The job failed outside any worker: a rendezvous that did not complete, a node or the master
#: that was lost.
EXIT_JOB_FAILED = 1
#: A worker could not be started (its command does not exist...).
EXIT_NO_START = 127
_STDERR_TAIL_LINES = 20
# Lines that open the report of an uncaught failure on a worker's stderr.
_FAILURE_STARTS = ("Traceback (most recent call last):", "Fatal Python error:")
_POLL_S = 0.05
# How the runtime names a peer whose connection broke (ops/core: the error of every operation that
# needed it). A worker killed with SIGKILL can take a moment to be seen dead (its memory is torn
# down) while its peers already print their tracebacks about it.
_LOST_PEER = "lost the connection to rank "
_LOST_PEER_RE = re.compile(re.escape(_LOST_PEER) + r"(\d+)\b")
#: Set by the launcher for each worker: its index on this node and the number of workers on this
#: node (ProphetStrategy picks the worker's GPU with them).
LOCAL_RANK_ENV = "PROPHET_LOCAL_RANK"
LOCAL_SIZE_ENV = "PROPHET_LOCAL_SIZE"
_CUDA_ENV = "CUDA_VISIBLE_DEVICES"

# Started through this stub, a worker gets SIGKILL when the launcher dies, even by SIGKILL
# (PR_SET_PDEATHSIG survives exec; it is set in the child, so no preexec_fn is needed, which
# would be unsafe with the launcher's reader threads). argv: stub LAUNCHER_PID CMD ARGS...
_PDEATHSIG_STUB = (
    "import ctypes,os,sys\n"
    "try: ctypes.CDLL(None,use_errno=True).prctl(1,9,0,0,0)\n"
    "except Exception: pass\n"
    "if os.getppid()!=int(sys.argv[1]): os._exit(137)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n")


def with_death_stub(argv: Sequence[str]) -> list[str]:
    """``argv`` started through the stub that kills it when this launcher dies (the stub must be
    started by a thread that lives as long as the launcher: the signal follows the thread)."""
    return [sys.executable, "-S", "-c", _PDEATHSIG_STUB, str(os.getpid()), *argv]


# ------------------------------------------------------------------------------------------------
# What an attempt is given and what it returns


#: What ended an attempt (``Failure.cause``): a worker exited non-zero (a restart may follow); a
#: launcher got a signal; the job's --timeout passed; a worker could not be started; the job
#: failed outside any worker (rendezvous, the master lost); a node was lost (its launcher's
#: connection closed or went silent: an elastic job goes on without it).
CAUSE_WORKER, CAUSE_INTERRUPTED, CAUSE_TIMEOUT, CAUSE_NO_START, CAUSE_JOB, CAUSE_LOST = (
    "worker", "interrupted", "timeout", "no start", "job", "node lost")


@dataclasses.dataclass
class Failure:
    """Why an attempt failed, as every launcher of the job reports it.

    Attributes:
      status: the exit status the launchers exit with (the failing worker's; 128+signal if it was
        killed; see the module's EXIT_* constants for failures outside a worker).
      description: one line, e.g. ``worker rank 1 (pid 4242) exited with status 3``.
      tail: the last lines of the failing worker's stderr (empty when not a worker).
      rank: the failing worker's global rank, or None.
      node: the node whose launcher saw it (multi-node jobs), or None.
      at: when it failed (``time.time()``; the earliest failure of a job is the one named).
      cause: what ended the attempt (one of the ``CAUSE_*`` constants).
      preempted: the failing worker's ``prophet_tf: preempted: ...`` line (it stopped for a
        preemption and says where its checkpoint is), or None.
      fit_failure: its ``prophet_tf: failed: ...`` line (where its ``fit`` failed), or None.
      received: ``rank R received SIGNAL`` when a worker of this node said it received the
        preemption signal, or None.
    """

    status: int
    description: str
    tail: list[str] = dataclasses.field(default_factory=list)
    rank: Optional[int] = None
    node: Optional[int] = None
    at: float = 0.0
    cause: str = CAUSE_JOB
    preempted: Optional[str] = None
    fit_failure: Optional[str] = None
    received: Optional[str] = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> "Failure":
        return cls(status=int(data["status"]), description=str(data["description"]),
                   tail=[str(x) for x in data.get("tail", [])][-_STDERR_TAIL_LINES:],
                   rank=None if data.get("rank") is None else int(data["rank"]),
                   node=None if data.get("node") is None else int(data["node"]),
                   at=float(data.get("at", 0.0)), cause=str(data.get("cause", CAUSE_JOB)),
                   preempted=_optional_str(data.get("preempted")),
                   fit_failure=_optional_str(data.get("fit_failure")),
                   received=_optional_str(data.get("received")))

    def report(self, where: str = "") -> str:
        """The launcher's message: what failed, then the tail of its stderr if it is a worker."""
        text = self.description + where
        if self.rank is not None:
            tail = "\n".join(f"    {line}" for line in self.tail) or "    (no stderr output)"
            text += f". Last lines of its stderr:\n{tail}"
        return text


def _optional_str(value: object) -> Optional[str]:
    return None if value is None else str(value)[:1000]


@dataclasses.dataclass
class Outcome:
    """How one attempt ended on this node: status 0 and no failure when every worker exited 0."""

    status: int
    failure: Optional[Failure] = None
    #: Stopped on request (another node failed): this node's own workers did not fail first.
    stopped: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 0


@dataclasses.dataclass
class JobSpec:
    """What every attempt runs: the same on every node of the job.

    Attributes:
      argv: ``["script.py", *args]``, ``["-m", "module", *args]`` or any command.
      env: extra environment for every worker (wins over everything else).
      threads: ``TF_NUM_INTRAOP_THREADS`` / ``TF_NUM_INTEROP_THREADS`` for every worker.
      grace: seconds between forwarding a stop signal and SIGKILL.
      log_dir: if set, worker rank i's output also goes to ``LOG_DIR/rank.i.log`` (appended).
      wrap_argv: ``f(local_index, argv) -> argv`` applied to each worker's command line (e.g. to
        start it in a network namespace).
      preload: an elastic job's standby workers import these modules ahead of the next attempt
        (``prophet_tf.launch.standby``); empty: no standbys.
    """

    argv: Sequence[str]
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    threads: Optional[int] = None
    grace: float = 5.0
    log_dir: Optional[str] = None
    wrap_argv: Optional[Callable[[int, list[str]], list[str]]] = None
    preload: Sequence[str] = ()


@dataclasses.dataclass
class Placement:
    """Where one attempt's workers run, as the launcher (or the rendezvous) decided it.

    Attributes:
      addresses: ``host:port`` of every worker of the job, in rank order.
      ranks: the global ranks of the workers started on this node (their local index is their
        position here).
      token: the job token of this attempt (every worker of the job gets the same).
    """

    addresses: list[str]
    ranks: list[int]
    token: str


@dataclasses.dataclass
class Controls:
    """What can end an attempt from outside its workers.

    Attributes:
      signals: signals the launcher received (its handler appends them); the first is forwarded
        to every worker.
      deadline: ``time.monotonic()`` after which every worker is killed (status 124), or None.
      stop: set by another party (the rendezvous: another node failed); ``stop_reason`` says why.
      checkpoint: a signal to forward to every worker once, at another party's request (an
        elastic job's master): the workers' preemption signal (:func:`preemption_signal`), so
        that they stop at one step and checkpoint (they then exit by themselves); ``stop_reason``
        says why.
      launcher: how messages name the launcher that got the signals.
    """

    signals: list[int] = dataclasses.field(default_factory=list)
    deadline: Optional[float] = None
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    stop_reason: str = ""
    checkpoint: Optional[int] = None
    #: Who gets the signals, in messages ("the launcher of node 1").
    launcher: str = "the launcher"


# ------------------------------------------------------------------------------------------------
# Ports, addresses, environment


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``n`` distinct ports that are free on ``host`` right now.

    All ``n`` sockets are bound to port 0 at the same time (so the kernel hands out distinct
    ports) and released together on return; the caller should start the workers immediately.
    """
    with reserve_ports(n, host) as ports:
        return ports


@contextlib.contextmanager
def reserve_ports(n: int, host: str = "127.0.0.1"):
    """Yields ``n`` distinct free ports of ``host``, held (bound, not listening) until the block
    ends, so that no other launcher on this host is handed them meanwhile."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = host.strip("[]")
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind((bind_host, 0))
            socks.append(s)
        yield [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def package_root() -> Optional[str]:
    """The directory this ``prophet_tf`` package was imported from, or None when it is a
    site-packages directory (Python finds those without help).

    Workers run the user's script, whose own directory (not the launcher's working directory)
    leads ``sys.path``: without this entry a package used from a source checkout is missing there.
    """
    import site
    import sysconfig

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = sysconfig.get_paths()
    standard = [*site.getsitepackages(), site.getusersitepackages(), paths["purelib"],
                paths["platlib"]]
    if os.path.realpath(root) in {os.path.realpath(p) for p in standard}:
        return None
    return root


def worker_envs(n: int, addresses: Sequence[str], token: str,
                extra_env: Optional[Mapping[str, str]] = None, threads: Optional[int] = None,
                base_env: Optional[Mapping[str, str]] = None,
                ranks: Optional[Sequence[int]] = None) -> list[dict[str, str]]:
    """Builds the environment of each of the ``n`` workers of this node.

    Worker i (local index i) gets ``TF_CONFIG`` with task index ``ranks[i]`` (default ``i``), the
    job token, ``PYTHONUNBUFFERED=1``, ``PROPHET_LOCAL_RANK=i`` and ``PROPHET_LOCAL_SIZE=n``, and
    ``CUDA_VISIBLE_DEVICES`` = its own GPU (see :func:`visible_gpu`) unless the user set that
    variable. Order of precedence (later wins): ``base_env`` (default ``os.environ``), the
    ``threads`` variables, the launcher's variables, ``extra_env``.
    """
    ranks = list(range(n)) if ranks is None else list(ranks)
    if len(ranks) != n:
        raise ValueError(f"{len(ranks)} ranks for {n} workers")
    base = dict(os.environ if base_env is None else base_env)
    user_set_gpus = _CUDA_ENV in base or (extra_env is not None and _CUDA_ENV in extra_env)
    gpus = None if user_set_gpus else gpu_count()
    envs = []
    for i, rank in enumerate(ranks):
        env = dict(base)
        if threads is not None:
            env["TF_NUM_INTRAOP_THREADS"] = str(threads)
            env["TF_NUM_INTEROP_THREADS"] = str(threads)
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(addresses)},
                                       "task": {"type": "worker", "index": rank}})
        env["PROPHET_JOB_TOKEN"] = token
        env["PYTHONUNBUFFERED"] = "1"
        env[LOCAL_RANK_ENV] = str(i)
        env[LOCAL_SIZE_ENV] = str(n)
        if not user_set_gpus:
            env[_CUDA_ENV] = visible_gpu(i, gpus)
        if extra_env:
            env.update(extra_env)
        root = package_root()
        entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root is not None and root not in entries:
            env["PYTHONPATH"] = os.pathsep.join([root, *entries])
        envs.append(env)
    return envs


def draw_job_seed() -> int:
    """A fresh job seed (``$PROPHET_JOB_SEED``), drawn once per job."""
    import random
    return random.SystemRandom().randrange(1, 2**31 - 1)


def with_job_seed(env: Mapping[str, str], seed: int) -> tuple[dict[str, str], Optional[int]]:
    """``env`` with ``$PROPHET_JOB_SEED`` = ``seed`` unless the user set one (in ``env`` or in
    this launcher's environment); returns it and the seed the launcher set (None: the user's)."""
    out = dict(env)
    if JOB_SEED_ENV in out or JOB_SEED_ENV in os.environ:
        return out, None
    out[JOB_SEED_ENV] = str(seed)
    return out, seed


def gpu_count() -> Optional[int]:
    """The number of NVIDIA GPUs the driver shows (``/proc/driver/nvidia/gpus``), None when that
    cannot be told (no NVIDIA driver loaded)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return None


def visible_gpu(local_rank: int, gpus: Optional[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` of the worker with this local rank: its own GPU, ``local_rank``
    (shared round-robin when the node has fewer GPUs than workers and their number is known)."""
    if gpus:
        return str(local_rank % gpus)
    return str(local_rank)


def command(script_argv: Sequence[str]) -> list[str]:
    """``x.py args`` and ``-m mod args`` run with this interpreter; anything else is executed."""
    argv = list(script_argv)
    if not argv:
        raise ValueError("no script given: prophetrun -n N [--] script.py [args]")
    if argv[0] == "-m" or argv[0].endswith(".py"):
        return [sys.executable, "-u", *argv]
    return argv


def describe_status(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def status_of(code: int) -> int:
    """A process's return code as a shell exit status (128+signal when killed)."""
    return 128 - code if code < 0 else min(code, 255)


# ------------------------------------------------------------------------------------------------
# One worker process


class _Worker:
    """One child process plus the threads that copy its output with a ``[rank i]`` prefix (and
    into its log file)."""

    def __init__(self, rank: int, proc: subprocess.Popen, out: TextIO, err: TextIO,
                 lock: threading.Lock, peers: Sequence["_Worker"] = (),
                 log: Optional[TextIO] = None) -> None:
        self.rank = rank
        self.proc = proc
        self.peers = peers  # every worker of this node (filled in as they start)
        self.log = log
        self._log_lock = threading.Lock()
        self._pidfd: Optional[int] = None
        self.tail: Deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        # What the worker said about a preemption or a failed fit (prophet_tf.preemption's lines).
        self.preempted_line: Optional[str] = None
        self.fit_failure_line: Optional[str] = None
        self.received: Optional[tuple[float, str]] = None  # (when, "rank R received SIGTERM")
        # The peer whose loss this worker reported first (the runtime's "lost the connection to
        # rank R"): that peer failed before it, whatever the launcher saw first.
        self.lost_peer: Optional[int] = None
        # When it failed: its first uncaught Python traceback (printed before any clean-up, which
        # can take seconds), else when it was seen to exit. Peers of a failed worker fail after it.
        self.traceback_at: Optional[float] = None
        self.exited_at: Optional[float] = None
        self.threads = [
            threading.Thread(target=self._pump, args=(proc.stdout, out, lock, False), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, err, lock, True), daemon=True),
        ]
        self._watch_exit()
        for t in self.threads:
            t.start()

    def _watch_exit(self) -> None:
        """Records the moment the process dies (a pidfd turns readable; nothing is reaped, so
        ``Popen`` still owns the exit status). Without pidfds: when ``poll_exit`` first sees it."""
        try:
            self._pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            return
        pidfd = self._pidfd

        def watch() -> None:
            with contextlib.suppress(OSError, ValueError):
                select.select([pidfd], [], [])
            self.note_if_dead()

        self.threads.append(threading.Thread(target=watch, daemon=True))

    def note_if_dead(self) -> None:
        """Records the exit time now if the process is already dead and none was recorded."""
        pidfd = self._pidfd
        if self.exited_at is None and pidfd is not None:
            with contextlib.suppress(OSError, ValueError):
                if select.select([pidfd], [], [], 0)[0] and self.exited_at is None:
                    self.exited_at = time.monotonic()

    def close(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
        if self.log is not None:
            with self._log_lock, contextlib.suppress(OSError, ValueError):
                self.log.close()

    def _pump(self, src, dst: TextIO, lock: threading.Lock, keep_tail: bool) -> None:
        prefix = f"[rank {self.rank}] "
        previous = ""
        try:
            for raw in iter(src.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if keep_tail:
                    self.tail.append(line)
                    if (self.traceback_at is None and line.startswith(_FAILURE_STARTS)
                            and not previous.startswith("Exception ignored")):
                        # A peer already dead died before this traceback was written (often its
                        # cause): stamp it first, even if its own watcher has not woken yet.
                        for peer in self.peers:
                            peer.note_if_dead()
                        self.traceback_at = time.monotonic()
                    previous = line
                    if "prophet_tf: " in line:
                        self._note_preemption_line(line)
                    if self.lost_peer is None and _LOST_PEER in line:
                        self._note_lost_peer(line)
                if self.log is not None:
                    with self._log_lock, contextlib.suppress(OSError, ValueError):
                        self.log.write(line + "\n")
                        self.log.flush()
                with lock:
                    try:
                        dst.write(prefix + line + "\n")
                        dst.flush()
                    except (OSError, ValueError):
                        pass  # our own stdout went away (closed pipe): keep draining the child
        finally:
            src.close()

    def _note_preemption_line(self, line: str) -> None:
        if self.preempted_line is None and preemption.parse_report(line) is not None:
            self.preempted_line = line
        elif self.fit_failure_line is None and preemption.parse_failure(line) is not None:
            self.fit_failure_line = line
        elif self.received is None:
            received = preemption.parse_received(line)
            if received is not None:
                self.received = (time.monotonic(), f"rank {received[0]} received {received[1]}")

    def _note_lost_peer(self, line: str) -> None:
        m = _LOST_PEER_RE.search(line)
        if m is not None:
            self.lost_peer = int(m.group(1))

    def join_output(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def poll_exit(self) -> Optional[int]:
        """The exit status once the worker has exited (recording when that was seen), else None."""
        code = self.proc.poll()
        if code is not None and self.exited_at is None:
            self.exited_at = time.monotonic()
        return code

    def failed_at(self) -> float:
        candidates = [t for t in (self.traceback_at, self.exited_at) if t is not None]
        return min(candidates) if candidates else float("inf")

    def signal_group(self, sig: int) -> None:
        """Sends ``sig`` to the worker's process group (the worker and anything it started)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wall(monotonic_at: float) -> float:
    """``time.time()`` of a ``time.monotonic()`` instant (failure times travel between nodes)."""
    return time.time() - (time.monotonic() - monotonic_at)


def _stop(workers: Sequence[_Worker], grace: float, sig: int = signal.SIGTERM,
          controls: Optional[Controls] = None) -> None:
    """``sig`` to every worker's process group, then SIGKILL to those alive after ``grace`` (or
    at once when the launcher gets another signal meanwhile)."""
    seen_signals = len(controls.signals) if controls is not None else 0
    for w in workers:
        if w.proc.poll() is None:
            w.signal_group(sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
        if controls is not None and len(controls.signals) > seen_signals:
            break  # asked twice: do not wait
        time.sleep(_POLL_S)
    for w in workers:
        # Also the groups of workers that already exited: they may have left children behind.
        w.signal_group(signal.SIGKILL)
    for w in workers:
        try:
            w.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        w.join_output(1.0)


# ------------------------------------------------------------------------------------------------
# One attempt on this node


def run_workers(spec: JobSpec, placement: Placement, controls: Controls, *,
                stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
                say: Optional[Callable[[str], None]] = None,
                on_start: Optional[Callable[[], None]] = None,
                log_header: Optional[str] = None,
                standby: Optional["StandbyPool"] = None) -> Outcome:
    """Runs this node's workers of one attempt until it ends; returns how it ended.

    Every worker is started in its own session (its process group gets the signals) through a
    stub that kills it if the launcher dies. The attempt ends when:

    - every worker exited 0: ``Outcome(0)``;
    - a worker exited non-zero: the others get SIGTERM (SIGKILL after ``spec.grace``); the
      failure named is the one that came first (its Python traceback, or its death: the others
      usually fail because it died), with the tail of its stderr; status = its exit status;
    - the launcher got SIGINT/SIGTERM (``controls.signals``): that signal is forwarded to every
      worker (SIGKILL after the grace, or at once on a second signal); status 128+signal;
    - ``controls.deadline`` passed: every worker is stopped; status 124;
    - ``controls.stop`` was set: every worker is stopped; ``Outcome(stopped=True)`` with this
      node's own first failure if one of its workers had failed before.

    Args:
      spec: what to run (the same for every attempt).
      placement: this attempt's addresses, the ranks run here and the token.
      controls: signals, deadline and the stop request.
      stdout, stderr: where the prefixed output goes (default: ``sys.stdout``/``sys.stderr``).
      say: writes one ``[launch]`` line (default: to ``stderr``).
      on_start: called once every worker is started.
      log_header: a line written to each ``--log-dir`` file before the worker's output (the
        restart loop names the attempt there: the files are appended to).
      standby: the node's standby workers (``prophet_tf.launch.standby``): a worker runs in its
        slot's standby when there is one that fits, and the standbys for the next attempt are
        started once these workers are.
    """
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    lock = threading.Lock()
    if say is None:
        def say(msg: str) -> None:
            with lock:
                with contextlib.suppress(OSError, ValueError):
                    err.write(f"[launch] {msg}\n")
                    err.flush()
    cmd = command(spec.argv)
    n = len(placement.ranks)
    envs = worker_envs(n, placement.addresses, placement.token, spec.env, spec.threads,
                       ranks=placement.ranks)
    if spec.log_dir:
        os.makedirs(spec.log_dir, exist_ok=True)
    if standby is not None and (spec.wrap_argv is not None or not standby.command_fits(cmd)):
        standby = None
    workers: list[_Worker] = []
    try:
        for i, rank in enumerate(placement.ranks):
            argv = list(cmd)
            if spec.wrap_argv is not None:
                argv = list(spec.wrap_argv(i, argv))
            argv = with_death_stub(argv)
            log = (open(os.path.join(spec.log_dir, f"rank.{rank}.log"), "a", encoding="utf-8")
                   if spec.log_dir else None)
            if log is not None and log_header:
                log.write(log_header + "\n")
                log.flush()
            try:
                proc = standby.take(i, envs[i], cmd) if standby is not None else None
                if proc is None:
                    proc = subprocess.Popen(argv, env=envs[i], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            start_new_session=True)
            except OSError as e:
                if log is not None:
                    log.close()
                _stop(workers, spec.grace)
                failure = Failure(EXIT_NO_START, f"could not start worker rank {rank} "
                                  f"({' '.join(argv[5:])}): {e}", rank=None, at=time.time(),
                                  cause=CAUSE_NO_START)
                say(failure.description)
                return Outcome(EXIT_NO_START, failure)
            workers.append(_Worker(rank, proc, out, err, lock, workers, log))
        if standby is not None:
            standby.fill(envs)
        if on_start is not None:
            on_start()
        return _supervise(workers, spec, controls, say)
    except BaseException:
        _stop(workers, spec.grace)
        raise
    finally:
        for w in workers:
            w.close()


def _supervise(workers: Sequence[_Worker], spec: JobSpec, controls: Controls,
               say: Callable[[str], None]) -> Outcome:
    checkpoint_until: Optional[float] = None
    while True:
        if controls.signals:
            return _interrupted(workers, spec, controls, say)
        if controls.checkpoint is not None and checkpoint_until is None:
            sig = controls.checkpoint
            wait = preemption_wait(spec, sig) or spec.grace
            say(f"{controls.stop_reason or 'asked for a checkpoint'}: forwarding "
                f"{signal.Signals(sig).name} to the workers (SIGKILL after {wait:g} s)")
            for w in workers:
                if w.proc.poll() is None:
                    w.signal_group(sig)
            checkpoint_until = time.monotonic() + wait
        if checkpoint_until is not None and time.monotonic() >= checkpoint_until:
            running = [w.rank for w in workers if w.proc.poll() is None]
            if running:
                say(f"workers {running} did not stop for the checkpoint in time; killing them")
                controls.stop.set()
        codes = [w.poll_exit() for w in workers]
        if any(code not in (None, 0) for code in codes):
            return _worker_failed(workers, codes, spec, say)
        if all(code == 0 for code in codes):
            for w in workers:
                w.join_output(5.0)
            return Outcome(0)
        if controls.stop.is_set():
            stopping_at = time.monotonic()
            _stop(workers, spec.grace, signal.SIGTERM, controls)
            failed = [w for w in workers if w.exited_at is not None and w.exited_at < stopping_at
                      and w.proc.returncode not in (None, 0)]
            own = _first_failure(failed, stopping_at) if failed else None
            return Outcome(own.status if own else EXIT_JOB_FAILED, own, stopped=True)
        if controls.deadline is not None and time.monotonic() >= controls.deadline:
            running = [w.rank for w in workers if w.proc.poll() is None]
            say(f"timeout; killing workers {running}")
            at = time.time()
            _stop(workers, spec.grace, signal.SIGTERM, controls)
            return Outcome(EXIT_TIMEOUT, Failure(EXIT_TIMEOUT, "the job's --timeout passed", at=at,
                                                 cause=CAUSE_TIMEOUT))
        time.sleep(_POLL_S)


def _preemption_setting(spec: JobSpec, name: str, default: str) -> str:
    return str(spec.env.get(name, os.environ.get(name, default)))


def preemption_signal(spec: JobSpec) -> Optional[int]:
    """The signal that asks the workers for the coordinated preemption checkpoint: the first of
    their preemption signals (``$PROPHET_PREEMPTION_SIGNALS``, SIGTERM by default); None when
    they have none."""
    try:
        signals = preemption.signals_from(_preemption_setting(spec, preemption.SIGNALS_ENV, "SIGTERM"))
    except ValueError:
        return None  # the workers will say what is wrong with this setting
    return signals[0] if signals else None


def preemption_wait(spec: JobSpec, sig: int) -> Optional[float]:
    """How long the workers may take to stop after ``sig`` when it asks them for the coordinated
    preemption checkpoint (one of their preemption signals, ``$PROPHET_PREEMPTION_SIGNALS``,
    SIGTERM by default): their grace period (``$PROPHET_PREEMPTION_GRACE_S``, 30 s by default;
    a worker leaves by itself then) plus ``spec.grace``. None when ``sig`` is not one of them."""
    try:
        signals = preemption.signals_from(_preemption_setting(spec, preemption.SIGNALS_ENV, "SIGTERM"))
        grace = float(_preemption_setting(spec, preemption.GRACE_ENV, str(preemption.DEFAULT_GRACE_S)))
    except ValueError:
        return None  # the workers will say what is wrong with these settings
    if sig not in signals:
        return None
    return max(grace, 0.0) + spec.grace


def _interrupted(workers: Sequence[_Worker], spec: JobSpec, controls: Controls,
                 say: Callable[[str], None]) -> Outcome:
    """The launcher got a signal: forwards it to every worker. A preemption signal gives them
    their grace period to stop at one step and checkpoint; when every worker then exited with
    EXIT_PREEMPTED, so does the attempt (the job can be resumed), else 128 + the signal."""
    sig = controls.signals[0]
    name = signal.Signals(sig).name
    wait = preemption_wait(spec, sig)
    if wait is None:
        say(f"got {name}; forwarding it to the workers (SIGKILL after {spec.grace:g} s)")
    else:
        say(f"got {name}; forwarding it to the workers: every worker stops at the same step of "
            f"model.fit and writes its checkpoint (SIGKILL after {wait:g} s, or at once on "
            "another signal)")
    at = time.time()
    _stop(workers, spec.grace if wait is None else wait, sig, controls)
    preempted = [w for w in workers if w.proc.returncode == preemption.EXIT_PREEMPTED]
    if wait is not None and workers and len(preempted) == len(workers):
        for w in workers:
            w.join_output(1.0)
        line = next((w.preempted_line for w in workers if w.preempted_line), None)
        report = preemption.parse_report(line) if line else None
        where = (f"; every worker stopped at epoch {report.epoch} step {report.step} "
                 f"(checkpoint: {report.checkpoint or 'none'})"
                 if report is not None and report.epoch is not None else
                 "; every worker stopped for the preemption")
        return Outcome(preemption.EXIT_PREEMPTED, Failure(
            preemption.EXIT_PREEMPTED, f"{controls.launcher} got {name}{where}", at=at,
            cause=CAUSE_INTERRUPTED, preempted=line))
    return Outcome(128 + sig, Failure(128 + sig, f"{controls.launcher} got {name}", at=at,
                                      cause=CAUSE_INTERRUPTED))


def _worker_failed(workers: Sequence[_Worker], codes: Sequence[Optional[int]], spec: JobSpec,
                   say: Callable[[str], None]) -> Outcome:
    stopping_at = time.monotonic()
    _stop(workers, spec.grace)
    for w in workers:
        w.poll_exit()
        w.join_output(1.0)
    failed = [w for w in workers if w.proc.returncode not in (None, 0)]
    failure = _first_failure(failed, stopping_at, next(c for c in codes if c not in (None, 0)))
    later = [w.rank for w in failed if w.rank != failure.rank
             and w.exited_at is not None and w.exited_at < stopping_at]
    also = f" (then rank(s) {later} failed too)" if later else ""
    failure.description += also
    return Outcome(failure.status, failure)


def _first_failure(failed: Sequence[_Worker], stopping_at: float,
                   first_code: Optional[int] = None) -> Failure:
    """The failure of the worker that failed first (its traceback or death came earliest; but a
    worker that reported the loss of a peer that failed too failed after that peer)."""
    culprit = min(failed, key=lambda w: (w.failed_at(), w.rank))
    by_rank = {w.rank: w for w in failed}
    seen = {culprit.rank}
    while culprit.lost_peer in by_rank and culprit.lost_peer not in seen:
        culprit = by_rank[culprit.lost_peer]
        seen.add(culprit.rank)
    code = culprit.proc.returncode
    if culprit.exited_at is not None and culprit.exited_at >= stopping_at and first_code is not None:
        # It failed first but was still exiting when the launcher stopped it.
        status = "failed first and was stopped by the launcher while exiting"
        code = first_code
    else:
        status = describe_status(code)
    received = min((w.received for w in failed if w.received is not None), default=None)
    return Failure(status_of(code), f"worker rank {culprit.rank} (pid {culprit.proc.pid}) {status}",
                   tail=list(culprit.tail), rank=culprit.rank, at=_wall(culprit.failed_at()),
                   cause=CAUSE_WORKER, preempted=culprit.preempted_line,
                   fit_failure=culprit.fit_failure_line,
                   received=received[1] if received is not None else None)
