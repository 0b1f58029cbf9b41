"""Start N prophet_tf workers on this machine.

Usage::

    python -m prophet_tf.launch -n 2 [options] [--] script.py [script args]
    python -m prophet_tf.launch -np 2 script.py                      # horovodrun spelling
    python -m prophet_tf.launch -n 2 -- -m package.module [args]    # run a module
    python -m prophet_tf.launch -n 2 -- /path/to/executable [args]  # anything else

Each worker gets ``TF_CONFIG`` (``{"cluster": {"worker": [...]}, "task": {"type": "worker",
"index": i}}``), the same fresh random ``PROPHET_JOB_TOKEN``, ``PYTHONUNBUFFERED=1``, and
``PYTHONPATH`` led by the directory this ``prophet_tf`` was imported from (so a script anywhere on
disk imports the same package, installed or not). Every output line is prefixed with
``[rank i]`` (stdout stays stdout, stderr stays stderr). When a worker exits non-zero the others
are stopped (SIGTERM, then SIGKILL after ``--grace`` seconds), and the launcher reports the worker
that failed FIRST (the one whose Python traceback, or death, came earliest: the others usually
fail because it died) with the tail of its stderr, and exits non-zero. Ctrl-C / SIGTERM stop all
workers. The exit status is 0 only when every worker exits 0.

Exit status: 0 success; the failing worker's status (128+signal if it was killed) on a worker
failure; 124 on ``--timeout``; 128+signal when the launcher itself was interrupted; 2 on usage
errors.

Programmatic use (tests, benchmarks): :func:`launch`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Deque, Mapping, Optional, Sequence, TextIO

__all__ = ["launch", "main", "free_ports", "worker_envs", "package_root", "EXIT_TIMEOUT"]

EXIT_TIMEOUT = 124
_STDERR_TAIL_LINES = 20
# Lines that open the report of an uncaught failure on a worker's stderr.
_FAILURE_STARTS = ("Traceback (most recent call last):", "Fatal Python error:")
_POLL_S = 0.05

# Started through this stub, a worker gets SIGKILL when the launcher dies, even by SIGKILL
# (PR_SET_PDEATHSIG survives exec; it is set in the child, so no preexec_fn is needed, which
# would be unsafe with the launcher's reader threads). argv: stub LAUNCHER_PID CMD ARGS...
_PDEATHSIG_STUB = (
    "import ctypes,os,sys\n"
    "try: ctypes.CDLL(None,use_errno=True).prctl(1,9,0,0,0)\n"
    "except Exception: pass\n"
    "if os.getppid()!=int(sys.argv[1]): os._exit(137)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``n`` distinct ports that are free on ``host`` right now.

    All ``n`` sockets are bound to port 0 at the same time (so the kernel hands out distinct
    ports) and released together on return; the caller should start the workers immediately.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = host.strip("[]")
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind((bind_host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _fmt_addr(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def worker_envs(n: int, addresses: Sequence[str], token: str,
                extra_env: Optional[Mapping[str, str]] = None, threads: Optional[int] = None,
                base_env: Optional[Mapping[str, str]] = None) -> list[dict[str, str]]:
    """Builds the environment of each of the ``n`` workers.

    Order of precedence (later wins): ``base_env`` (default ``os.environ``), the ``threads``
    variables, ``TF_CONFIG``/``PROPHET_JOB_TOKEN``/``PYTHONUNBUFFERED``, ``extra_env``.
    """
    envs = []
    for i in range(n):
        env = dict(os.environ if base_env is None else base_env)
        if threads is not None:
            env["TF_NUM_INTRAOP_THREADS"] = str(threads)
            env["TF_NUM_INTEROP_THREADS"] = str(threads)
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(addresses)},
                                       "task": {"type": "worker", "index": i}})
        env["PROPHET_JOB_TOKEN"] = token
        env["PYTHONUNBUFFERED"] = "1"
        if extra_env:
            env.update(extra_env)
        root = package_root()
        entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root is not None and root not in entries:
            env["PYTHONPATH"] = os.pathsep.join([root, *entries])
        envs.append(env)
    return envs


def package_root() -> Optional[str]:
    """The directory this ``prophet_tf`` package was imported from, or None when it is a
    site-packages directory (Python finds those without help).

    Workers run the user's script, whose own directory (not the launcher's working directory)
    leads ``sys.path``: without this entry a package used from a source checkout is missing there.
    """
    import site
    import sysconfig

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sysconfig.get_paths()
    standard = [*site.getsitepackages(), site.getusersitepackages(), paths["purelib"],
                paths["platlib"]]
    if os.path.realpath(root) in {os.path.realpath(p) for p in standard}:
        return None
    return root


def _command(script_argv: Sequence[str]) -> list[str]:
    """``x.py args`` and ``-m mod args`` run with this interpreter; anything else is executed."""
    argv = list(script_argv)
    if not argv:
        raise ValueError("no script given: python -m prophet_tf.launch -n N [--] script.py [args]")
    if argv[0] == "-m" or argv[0].endswith(".py"):
        return [sys.executable, "-u", *argv]
    return argv


class _Worker:
    """One child process plus the threads that copy its output with a ``[rank i]`` prefix."""

    def __init__(self, rank: int, proc: subprocess.Popen, out: TextIO, err: TextIO,
                 lock: threading.Lock, peers: Sequence["_Worker"] = ()) -> None:
        self.rank = rank
        self.proc = proc
        self.peers = peers  # every worker of the job (filled in as they start)
        self._pidfd: Optional[int] = None
        self.tail: Deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
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
            select.select([pidfd], [], [])
            self.note_if_dead()

        self.threads.append(threading.Thread(target=watch, daemon=True))

    def note_if_dead(self) -> None:
        """Records the exit time now if the process is already dead and none was recorded."""
        if self.exited_at is None and self._pidfd is not None:
            if select.select([self._pidfd], [], [], 0)[0] and self.exited_at is None:
                self.exited_at = time.monotonic()

    def close(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

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
                with lock:
                    try:
                        dst.write(prefix + line + "\n")
                        dst.flush()
                    except (OSError, ValueError):
                        pass  # our own stdout went away (closed pipe): keep draining the child
        finally:
            src.close()

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


def _describe_status(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def launch(script_argv: Sequence[str], n: int, *, host: str = "127.0.0.1",
           hosts: Optional[Sequence[str]] = None, base_port: Optional[int] = None,
           timeout: Optional[float] = None, env: Optional[Mapping[str, str]] = None,
           threads: Optional[int] = None, grace: float = 5.0,
           wrap_argv: Optional[Callable[[int, list[str]], list[str]]] = None,
           stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
           token: Optional[str] = None, handle_signals: bool = True) -> int:
    """Runs ``script_argv`` as ``n`` workers and returns the launcher's exit status.

    Args:
      script_argv: ``["script.py", *args]``, ``["-m", "module", *args]`` or any command.
      n: number of workers (>= 1).
      host: address every worker listens on (all workers on this machine).
      hosts: one address per rank instead of ``host`` (e.g. ``EmulatedCluster.host_address(i)``).
      base_port: worker i listens on ``base_port + i``; default: free ports found by binding to
        port 0 (released just before the workers start).
      timeout: seconds after which every worker is killed and 124 is returned; None = no limit.
      env: extra environment for every worker (wins over everything else).
      threads: sets ``TF_NUM_INTRAOP_THREADS`` and ``TF_NUM_INTEROP_THREADS`` for every worker.
      grace: seconds between SIGTERM and SIGKILL when stopping workers.
      wrap_argv: ``f(rank, argv) -> argv`` applied to each worker's command line, e.g.
        ``EmulatedCluster.exec_argv`` to start worker i inside network namespace i.
      stdout, stderr: where prefixed output goes (default: ``sys.stdout``/``sys.stderr`` at call
        time).
      token: the job token (default: a fresh random one).
      handle_signals: install SIGINT/SIGTERM handlers that stop the workers (main thread only).

    Returns:
      0 when all workers exit 0; the first failing worker's status (128+signal if killed by a
      signal) otherwise; 124 on timeout; 128+signal if the launcher got SIGINT/SIGTERM.
    """
    if n < 1:
        raise ValueError(f"need at least one worker, got n={n}")
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    cmd = _command(script_argv)
    if hosts is not None:
        if len(hosts) != n:
            raise ValueError(f"hosts has {len(hosts)} entries for {n} workers")
        host_list = list(hosts)
    else:
        host_list = [host] * n
    if base_port is not None:
        if not (0 < base_port and base_port + n - 1 < 65536):
            raise ValueError(f"base port {base_port} + {n} workers is outside 1..65535")
        ports = [base_port + i for i in range(n)]
    elif hosts is not None and len(set(host_list)) == n:
        # Distinct hosts (e.g. one network namespace each): probe once, same port everywhere.
        ports = free_ports(1, "127.0.0.1") * n
    else:
        ports = free_ports(n, host_list[0])
    addresses = [_fmt_addr(h, p) for h, p in zip(host_list, ports)]
    token = secrets.token_hex(16) if token is None else token
    envs = worker_envs(n, addresses, token, env, threads)

    lock = threading.Lock()
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        stop_signal.append(signum)

    old_handlers: dict[int, object] = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old_handlers[s] = signal.signal(s, on_signal)

    def say(msg: str) -> None:
        with lock:
            try:
                err.write(f"[launch] {msg}\n")
                err.flush()
            except (OSError, ValueError):
                pass

    workers: list[_Worker] = []
    try:
        for i in range(n):
            argv = list(cmd)
            if wrap_argv is not None:
                argv = list(wrap_argv(i, argv))
            argv = [sys.executable, "-S", "-c", _PDEATHSIG_STUB, str(os.getpid()), *argv]
            try:
                proc = subprocess.Popen(argv, env=envs[i], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
            except OSError as e:
                say(f"could not start worker {i} ({' '.join(argv[5:])}): {e}")
                _stop(workers, grace)
                return 127
            workers.append(_Worker(i, proc, out, err, lock, workers))

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if stop_signal:
                sig = stop_signal[0]
                say(f"got {signal.Signals(sig).name}; stopping all workers")
                _stop(workers, grace)
                return 128 + sig
            codes = [w.poll_exit() for w in workers]
            if any(code not in (None, 0) for code in codes):
                stopping_at = time.monotonic()
                _stop(workers, grace)
                for w in workers:
                    w.poll_exit()
                    w.join_output(1.0)
                failed = [w for w in workers if w.proc.returncode not in (None, 0)]
                culprit = min(failed, key=lambda w: (w.failed_at(), w.rank))
                code = culprit.proc.returncode
                if culprit.exited_at is not None and culprit.exited_at >= stopping_at:
                    # It failed first but was still exiting when the launcher stopped it.
                    status = "failed first and was stopped by the launcher while exiting"
                    code = next(c for c in codes if c not in (None, 0))
                else:
                    status = _describe_status(code)
                later = [w.rank for w in failed if w is not culprit
                         and w.exited_at is not None and w.exited_at < stopping_at]
                also = f" (then rank(s) {later} failed too)" if later else ""
                tail = "\n".join(f"    {line}" for line in culprit.tail) or "    (no stderr output)"
                say(f"worker rank {culprit.rank} (pid {culprit.proc.pid}) {status}{also}; "
                    f"stopped the other workers. Last lines of its stderr:\n{tail}")
                return 128 - code if code < 0 else min(code, 255)
            if all(code == 0 for code in codes):
                for w in workers:
                    w.join_output(5.0)
                return 0
            if deadline is not None and time.monotonic() >= deadline:
                running = [w.rank for w in workers if w.proc.poll() is None]
                say(f"timeout after {timeout:g} s; killing workers {running}")
                _stop(workers, grace)
                return EXIT_TIMEOUT
            time.sleep(_POLL_S)
    except BaseException:
        _stop(workers, grace)
        raise
    finally:
        for w in workers:
            w.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)  # type: ignore[arg-type]


def _stop(workers: Sequence[_Worker], grace: float) -> None:
    """SIGTERM to every worker's process group, then SIGKILL to those alive after ``grace``."""
    for w in workers:
        if w.proc.poll() is None:
            w.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
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


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prophet_tf.launch",
        description="Start N prophet_tf workers on this machine (TF_CONFIG, job token, "
                    "[rank i] output prefixes, stop-all on failure).",
        usage="%(prog)s -n N [options] [--] script.py [args]")
    p.add_argument("-n", "-np", "--np", "--num-workers", dest="n", type=int, required=True,
                   help="number of worker processes (-np as in horovodrun)")
    p.add_argument("--host", default="127.0.0.1", help="address the workers listen on")
    p.add_argument("--base-port", type=int, default=None,
                   help="worker i listens on BASE_PORT+i (default: free ports)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="kill all workers and exit 124 after this many seconds")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable for every worker (repeatable)")
    p.add_argument("--threads", type=int, default=None, metavar="K",
                   help="TF_NUM_INTRAOP_THREADS and TF_NUM_INTEROP_THREADS for every worker")
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                   help="time between SIGTERM and SIGKILL when stopping workers (default 5)")
    p.add_argument("script", nargs=argparse.REMAINDER,
                   help="script.py [args], -m module [args], or a command")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if "--" in argv:
        cut = argv.index("--")
        opts, script = argv[:cut], argv[cut + 1:]
        args = parser.parse_args(opts)
        if args.script:
            parser.error(f"unexpected arguments before '--': {args.script}")
    else:
        args = parser.parse_args(argv)
        script = args.script
    if not script:
        parser.error("no script given")
    if args.n < 1:
        parser.error("-n must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    try:
        env = _parse_env(args.env)
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    return launch(script, args.n, host=args.host, base_port=args.base_port,
                  timeout=args.timeout, env=env, threads=args.threads, grace=args.grace)


if __name__ == "__main__":
    sys.exit(main())
