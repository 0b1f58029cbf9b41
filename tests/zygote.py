"""Worker processes that start without importing TensorFlow again: a zygote for the test suite.

Most of this suite's multi-worker tests run a Python process per worker, and each paid for
``import tensorflow`` (with Keras, 8 CPU-seconds here): over a hundred such imports were most of the
suite's CPU on 2 cores. A zygote imports TensorFlow and Keras once and forks a process per request;
the forked process then runs the requested script exactly as ``python`` would, from ``import
prophet_tf`` on (the package itself is not preloaded, so every test runs the checkout's code).

The pieces:

* ``serve(socket_path)`` (``python tests/zygote.py SOCKET``): the zygote. It preloads, listens on
  a Unix socket and, per request, forks. It reaps its children and reports each exit status back.
* :func:`write_client`: the executable that stands in for ``python``. Started like ``python [-u]
  script.py args``, ``python [-u] -m module args`` or ``python [-u] -c code args``, it hands its
  standard streams, working directory, environment and arguments to a zygote and then mirrors the
  forked process: it forwards the signals it gets and exits with the forked process's status (by
  the same signal, if that was how it ended). Descriptors handed down beyond the standard streams
  (``pass_fds``: the launcher's standbys, ...) are handed on and keep their numbers. Anything else
  (other interpreter flags, more than a few such descriptors, an environment that changes what an
  import does, no zygote ready) it ``exec``s the real interpreter with the same arguments: a
  zygote only ever saves time.

What a forked worker shares with its siblings and what it does not:

* Python's string hashing is fixed when an interpreter starts. Two zygotes with different seeds
  serve alternating local ranks, so the two workers of a job hash strings differently, as separate
  processes would (code that relied on the iteration order of a ``set`` of names would show it).
* NumPy's global random state is re-seeded from the OS in every forked process (``random``
  re-seeds itself at fork).
* A forked process watches its client's connection and kills itself (SIGKILL) when the client
  is gone, so ``kill -9`` of the process a test or the launcher started ends the worker as well.
* A process in another network namespace (an emulated host: ``ip netns exec``) hands the zygote
  its namespace with its streams, and the forked process enters it (``setns``) before anything
  else, so its sockets are the emulated host's. Without the right to (no CAP_SYS_ADMIN) it starts
  fresh. Only the network namespace is entered: the mount namespace ``ip netns exec`` adds (its
  ``/sys`` and ``/etc/netns`` files) is not, and nothing here reads them.
* The CPU each forked process used (its ``wait4`` usage, once reaped) is added up per test process
  that asked for it (the request's ``PYTEST_XDIST_WORKER``) in ``SOCKET.cpu.json``: one set of
  zygotes serves every test process of a run, and each charges its tests only its own forks.
* ``os.getpid()`` is the forked process's, which the client does not share: a signal sent to that
  pid reaches the worker itself, and the client then ends the same way.
"""

from __future__ import annotations

import array
import gc
import io
import json
import os
import select
import signal
import socket
import sys

# Environment variables whose value matters when TensorFlow, Keras, NumPy or the interpreter load
# (read once, at import or start-up). A request whose value differs from the zygote's runs in a
# fresh interpreter instead.
IMPORT_TIME_ENV = ("PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONOPTIMIZE", "PYTHONMALLOC",
                   "PYTHONDONTWRITEBYTECODE", "LD_PRELOAD", "LD_LIBRARY_PATH", "TF_CPP_MIN_LOG_LEVEL",
                   "TF_CPP_MAX_VLOG_LEVEL", "TF_CPP_VMODULE", "TF_ENABLE_ONEDNN_OPTS",
                   "TF_XLA_FLAGS", "KERAS_BACKEND", "TF_USE_LEGACY_KERAS", "OMP_NUM_THREADS",
                   "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "KERAS_HOME")
SOCKET_ENV = "PROPHET_TEST_ZYGOTES"   # the zygotes' socket paths, os.pathsep-separated
OWNER_ENV = "PYTEST_XDIST_WORKER"     # which test process a request comes from (CPU accounting)
_MAX_HANDED_DOWN = 4    # descriptors beyond the standard streams that a fork takes on
# stdin, stdout, stderr, from an emulated host its network namespace, and those handed down
_MAX_FDS = 4 + _MAX_HANDED_DOWN
_NETNS = -1             # its "number" among the descriptors a request hands over
_OUT_OF_THE_WAY = 256   # the forked process's own descriptors go above the numbers it hands on
_CLONE_NEWNET = 0x40000000


def _send(conn: socket.socket, message: dict, fds: tuple = ()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        conn.sendall(data)


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    chunks, fds = [], []
    while not chunks or not chunks[-1].endswith(b"\n"):
        data, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(_MAX_FDS * 4))
        if not data:
            raise EOFError("client went away")
        chunks.append(data)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[:len(payload) - len(payload) % 4]))
    return json.loads(b"".join(chunks)), fds


# ------------------------------------------------------------------------------------------------
# The zygote

def _preload() -> None:
    import numpy  # noqa: F401
    import tensorflow  # noqa: F401
    import keras  # noqa: F401


def serve(socket_path: str, preload: bool = True) -> dict:
    """Preloads (unless ``preload`` is false: tests of the zygote itself), then serves forks until
    stdin closes (the test process that started it ended). Returns in a forked child only: the
    request it is to run."""
    if preload:
        _preload()
    # What the zygote holds now lives as long as it does: out of the collector's sight, so that
    # no forked process's collections (nor the one at its exit) walk, and so copy page by page,
    # the heap it shares with the zygote. Each fork that ran `pass` cost 1.4 CPU-s without this,
    # 0.34 with it (os._exit at once: 0.06).
    gc.freeze()
    base_path = [p for p in sys.path[1:]
                 if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp_path = socket_path + ".tmp"
    listener.bind(tmp_path)
    listener.listen(64)
    os.rename(tmp_path, socket_path)   # the socket appears once it accepts: clients never wait
    by_pid: dict[int, tuple[socket.socket, str]] = {}
    cpu_by_owner: dict[str, float] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            for pid in by_pid:
                _kill(pid)
            os.unlink(socket_path)
            # Without the interpreter's own shutdown: TensorFlow's, after a fork, sometimes
            # ended with a non-zero status, and nothing here needs it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if listener in readable:
            conn, _ = listener.accept()
            try:
                request, fds = _recv_request(conn)
            except (EOFError, OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other, _ in by_pid.values():
                    other.close()
                return _become(request, fds, conn, base_path)
            for fd in fds:
                os.close(fd)
            try:
                _send(conn, {"pid": pid})
            except OSError:
                pass
            by_pid[pid] = (conn, request["env"].get(OWNER_ENV, ""))
        reaped = False
        while by_pid:   # reap: report each exit to its client
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn, owner = by_pid.pop(pid, (None, ""))
            cpu_by_owner[owner] = cpu_by_owner.get(owner, 0.0) + usage.ru_utime + usage.ru_stime
            reaped = True
            if conn is not None:
                try:
                    _send(conn, {"status": status})
                except OSError:
                    pass
                conn.close()
        if reaped:
            _write_cpu(socket_path, cpu_by_owner)


def cpu_path(socket_path: str) -> str:
    """The file in which the zygote at ``socket_path`` keeps its forks' CPU-seconds by owner."""
    return socket_path + ".cpu.json"


def _write_cpu(socket_path: str, cpu_by_owner: dict) -> None:
    tmp = cpu_path(socket_path) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cpu_by_owner, f)
    os.rename(tmp, cpu_path(socket_path))   # a reader sees the old totals or the new, whole


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _become(request: dict, fds: list, conn: socket.socket, base_path: list) -> dict:
    """In the forked child: take the client's streams, descriptors, network, directory and
    environment."""
    import fcntl

    received = dict(zip(request["fd_numbers"], fds))
    if _NETNS in received:   # first, while this is the only thread: later threads inherit it
        _enter_network_namespace(received.pop(_NETNS))
    os.setsid()
    # The numbers the worker expects may be those the descriptors arrived with, or this
    # connection's: every one moves out of the way first.
    kept = fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD_CLOEXEC, _OUT_OF_THE_WAY)
    conn.close()
    conn = socket.socket(fileno=kept)
    moved = {}
    for number, fd in received.items():
        moved[number] = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _OUT_OF_THE_WAY)
        os.close(fd)
    for number, fd in moved.items():
        if number > 2 and _is_open(number):   # the zygote's own: this fork cannot hand it on
            _send(conn, {"fresh": True})
            os._exit(0)
        os.dup2(fd, number)   # inheritable, as a descriptor handed down is
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    import threading

    def watch_client() -> None:   # the client gone (even by SIGKILL): so is this process
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    # The threads started here (this watch; numpy's BLAS pool where numpy is first imported here,
    # without preloading) block every signal: a ``python`` process has only its main thread at
    # this point, so the kernel gives it every signal sent to the process. Python runs handlers in the main thread only, and a signal given to another
    # thread does not interrupt the main thread's blocking call.
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        threading.Thread(target=watch_client, name="zygote-client-watch", daemon=True).start()
        import numpy
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)

    numpy.random.seed()
    python_path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    request["sys_path"] = python_path + base_path
    return request


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _enter_network_namespace(fd: int) -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
        # The client checked that it may (the same call on its own namespace): this is a bug.
        errno = ctypes.get_errno()
        os.write(2, f"zygote: setns into the client's network namespace failed: "
                    f"{os.strerror(errno)}\n".encode())
        os._exit(70)
    os.close(fd)


def run(request: dict) -> None:
    """Runs the request as ``python`` would have (in the forked child, at top level)."""
    import runpy

    unbuffered = request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                                  write_through=unbuffered, line_buffering=name == "stderr",
                                  errors="backslashreplace" if name == "stderr" else "strict")
        setattr(sys, name, stream)
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
    sys.executable = request["client"]
    sys.argv = list(request["argv"])
    if request["code"] is not None:
        import types

        sys.path[:] = [""] + request["sys_path"]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    elif request["module"]:
        sys.path[:] = [os.getcwd()] + request["sys_path"]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(sys.argv[0])
        sys.path[:] = [os.path.dirname(script)] + request["sys_path"]
        runpy.run_path(script, run_name="__main__")


# ------------------------------------------------------------------------------------------------
# The client: the executable that stands in for ``python``

_CLIENT = r'''
import array, json, os, signal, socket, sys
REAL, IMPORT_TIME_ENV, ZYGOTE_ENV = {real!r}, {import_time_env!r}, {zygote_env!r}
ZYGOTE_VALUES, NETWORK_NAMESPACE = {zygote_values!r}, {netns!r}

def fresh():
    os.execv(REAL, [REAL] + sys.argv[1:])

args, unbuffered, module = sys.argv[1:], False, None
while args and args[0] == "-u":
    unbuffered, args = True, args[1:]
code = None
if args[:1] == ["-m"] and len(args) > 1:
    module, argv = args[1], [args[1]] + args[2:]
elif args[:1] == ["-c"] and len(args) > 1:
    code, argv = args[1], ["-c"] + args[2:]
elif args and not args[0].startswith("-"):
    argv = args
else:
    fresh()
env = dict(os.environ)
if any(env.get(k) != ZYGOTE_VALUES.get(k) for k in IMPORT_TIME_ENV):
    fresh()
handed, numbers = [0, 1, 2], [0, 1, 2]
if os.readlink("/proc/self/ns/net") != NETWORK_NAMESPACE:
    # An emulated host (ip netns exec): the forked process enters this namespace, if it may (the
    # same setns on this process's own namespace changes nothing and needs the same right).
    import ctypes
    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(netns, {clone_newnet}) != 0:
        fresh()
    handed.append(netns)
    numbers.append({netns_number})
own_fd_dir = f"/proc/{{os.getpid()}}/fd"
for name in os.listdir("/proc/self/fd"):   # descriptors handed down (pass_fds): handed on
    try:
        if int(name) not in handed and os.readlink(f"/proc/self/fd/{{name}}") != own_fd_dir:
            handed.append(int(name))
            numbers.append(int(name))
    except OSError:
        pass
if len([n for n in numbers if n > 2]) > {max_handed_down}:
    fresh()
paths = [p for p in env.get(ZYGOTE_ENV, "").split(os.pathsep) if p]
if not paths:
    fresh()
path = paths[int(env.get("PROPHET_LOCAL_RANK", "0") or 0) % len(paths)]
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    conn.connect(path)
except OSError:
    fresh()   # not ready yet (still importing) or gone
request = dict(argv=argv, module=module, code=code, unbuffered=unbuffered, cwd=os.getcwd(), env=env,
               client=sys.argv[0], fd_numbers=numbers)
worker, early = [], []   # a signal that comes before the worker's pid waits for it

def forward(sig, frame):
    if not worker:
        early.append(sig)
        return
    try:
        os.kill(worker[0], sig)
    except ProcessLookupError:
        pass

for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2, signal.SIGCONT):
    signal.signal(sig, forward)
conn.sendmsg([json.dumps(request).encode() + b"\n"],
             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", handed))])
reader = conn.makefile("rb")
status = None
while status is None:   # the zygote says the pid, then the status; the fork may say "fresh"
    line = reader.readline()
    if not line:
        if not worker:
            os._exit(1)   # the zygote went away before it forked
        status = (128 + signal.SIGKILL) << 8
        break
    said = json.loads(line)
    if said.get("fresh"):
        fresh()   # nothing of this process's was used yet
    if "pid" in said:
        worker.append(said["pid"])
        for sig in early:
            forward(sig, None)
    if "status" in said:
        status = said["status"]
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
'''


def write_client(path: str, zygote_env: dict) -> str:
    """Writes the ``python`` stand-in to ``path`` (executable) for zygotes started with
    ``zygote_env``; returns ``path``."""
    source = _CLIENT.format(real=sys.executable, import_time_env=IMPORT_TIME_ENV,
                            zygote_env=SOCKET_ENV,
                            zygote_values={k: zygote_env.get(k) for k in IMPORT_TIME_ENV},
                            netns=os.readlink("/proc/self/ns/net"), clone_newnet=_CLONE_NEWNET,
                            netns_number=_NETNS, max_handed_down=_MAX_HANDED_DOWN)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"#!{sys.executable} -S\n{source}")
    os.chmod(path, 0o755)
    return path


if __name__ == "__main__":
    request = serve(sys.argv[1], preload="--no-preload" not in sys.argv[2:])
    del serve
    run(request)
