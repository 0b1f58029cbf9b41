"""The test suite's zygotes (tests/zygote.py): a forked worker behaves as the ``python`` process it
stands in for (arguments, streams, directory, environment, exit status, signals, kill -9 of the
client), and whatever a fork cannot reproduce starts a fresh interpreter instead.

These zygotes preload nothing (``--no-preload``): what is tested is the forking and the client,
which are the same with TensorFlow preloaded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zygote

ROOT = Path(__file__).resolve().parents[1]

SHOW = """
import json, os, signal, sys, threading, time
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode == "wait":   # before it says it is up: a test signals it as soon as it is
    signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM handled", flush=True), sys.exit(7)))
def blocked_elsewhere():   # each other thread's blocked signals (/proc: SigBlk, a hex mask)
    tasks = [t for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id()]
    return [int(next(line.split()[1] for line in open(f"/proc/self/task/{t}/status")
                     if line.startswith("SigBlk:")), 16) for t in tasks]
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(),
                  "kept": os.environ.get("KEPT"), "hash": hash("prophet"),
                  "executable": sys.executable, "path0": sys.path[0],
                  "netns": os.readlink("/proc/self/ns/net"), "blocked": blocked_elsewhere()}),
      flush=True)
print("on stderr", file=sys.stderr, flush=True)
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise RuntimeError("raised in the worker")
if mode == "wait":
    # Short sleeps: Python runs a handler between bytecodes, so a signal that comes after the
    # last check and before a long sleep starts would be handled only when that sleep ends.
    for _ in range(600):
        time.sleep(0.1)
"""


@pytest.fixture
def zygotes(tmp_path):
    """Two zygotes without preloading, the client, and the environment that reaches them."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONHASHSEED", None)
    procs, paths = [], []
    for i in range(2):
        path = str(tmp_path / f"z{i}.sock")
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py"), path,
                                       "--no-preload"], stdin=subprocess.PIPE, env=env))
        paths.append(path)
    deadline = time.monotonic() + 60
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, "the zygotes did not start"
        time.sleep(0.05)
    client = zygote.write_client(str(tmp_path / "python"), env)
    (tmp_path / "show.py").write_text(SHOW)
    yield client, dict(env, **{zygote.SOCKET_ENV: os.pathsep.join(paths)}), tmp_path, procs
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=30)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (it may be reaped at any moment)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _shown(out: str) -> dict:
    return json.loads(out.splitlines()[0])


def test_a_forked_script_gets_its_arguments_streams_directory_environment_and_exit_status(zygotes):
    client, env, tmp_path, procs = zygotes
    done = subprocess.run([client, "-u", str(tmp_path / "show.py"), "exit", "3"], cwd=tmp_path,
                          env=dict(env, KEPT="yes"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    shown = _shown(done.stdout)
    assert shown["ppid"] in {p.pid for p in procs}, "not forked from a zygote"
    assert shown["argv"] == [str(tmp_path / "show.py"), "exit", "3"]
    assert shown["cwd"] == str(tmp_path) and shown["kept"] == "yes"
    assert shown["path0"] == str(tmp_path) and shown["executable"] == client
    assert done.stderr == "on stderr\n"


def test_an_exception_prints_its_traceback_and_exits_1(zygotes):
    client, env, tmp_path, _ = zygotes
    done = subprocess.run([client, str(tmp_path / "show.py"), "raise"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "RuntimeError: raised in the worker" in done.stderr


def test_module_and_code_run_as_python_would(zygotes):
    client, env, tmp_path, procs = zygotes
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "show.py").write_text(SHOW)
    by_module = subprocess.run([client, "-m", "pkg.show", "exit", "0"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60)
    assert by_module.returncode == 0, by_module.stderr
    assert _shown(by_module.stdout)["argv"] == [str(tmp_path / "pkg" / "show.py"), "exit", "0"]
    assert _shown(by_module.stdout)["ppid"] in {p.pid for p in procs}
    by_code = subprocess.run([client, "-c", "import os, sys; print(os.getppid(), sys.argv)", "a"],
                             env=env, capture_output=True, text=True, timeout=60)
    ppid, argv = by_code.stdout.split(" ", 1)
    assert int(ppid) in {p.pid for p in procs} and argv.strip() == "['-c', 'a']"


def test_a_signal_to_the_client_reaches_the_worker(zygotes):
    client, env, tmp_path, _ = zygotes
    proc = subprocess.Popen([client, "-u", str(tmp_path / "show.py"), "wait"], env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    shown = _shown(proc.stdout.readline())
    # The zygote's own threads block SIGTERM, so the kernel gives it to the main thread.
    assert shown["blocked"] and all(mask & (1 << (signal.SIGTERM - 1)) for mask in shown["blocked"])
    os.killpg(proc.pid, signal.SIGTERM)   # as the launcher stops a worker's process group
    assert proc.wait(timeout=30) == 7
    assert "SIGTERM handled" in proc.stdout.read()


def test_kill_9_of_the_client_ends_the_worker_and_a_killed_worker_ends_its_client(zygotes):
    client, env, tmp_path, _ = zygotes
    proc = subprocess.Popen([client, "-u", str(tmp_path / "show.py"), "wait"], env=env,
                            stdout=subprocess.PIPE, text=True)
    worker = _shown(proc.stdout.readline())["pid"]
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _running(worker):
        assert time.monotonic() < deadline, "the forked worker outlived its client's kill -9"
        time.sleep(0.05)
    proc = subprocess.Popen([client, "-u", str(tmp_path / "show.py"), "wait"], env=env,
                            stdout=subprocess.PIPE, text=True)
    os.kill(_shown(proc.stdout.readline())["pid"], signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_the_workers_of_two_ranks_hash_strings_differently(zygotes):
    client, env, tmp_path, _ = zygotes
    hashes = [_shown(subprocess.run([client, str(tmp_path / "show.py")],
                                    env=dict(env, PROPHET_LOCAL_RANK=str(rank)),
                                    capture_output=True, text=True, timeout=60).stdout)["hash"]
              for rank in (0, 1)]
    assert hashes[0] != hashes[1]


def test_descriptors_handed_down_keep_their_numbers_in_the_forked_worker(zygotes):
    """``pass_fds`` (the launcher's standbys say they are ready on one): the worker writes to the
    number it was told, and reads from another."""
    client, env, tmp_path, procs = zygotes
    to_worker_read, to_worker_write = os.pipe()
    from_worker_read, from_worker_write = os.pipe()
    os.write(to_worker_write, b"sent in")
    os.close(to_worker_write)
    code = ("import os, sys; print(os.getppid(), flush=True); "
            "os.write(int(sys.argv[2]), b'ready:' + os.read(int(sys.argv[1]), 100))")
    proc = subprocess.Popen([client, "-c", code, str(to_worker_read), str(from_worker_write)],
                            env=env, stdout=subprocess.PIPE, text=True,
                            pass_fds=(to_worker_read, from_worker_write))
    os.close(to_worker_read)
    os.close(from_worker_write)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert int(out.split()[0]) in {p.pid for p in procs}, "started fresh instead of forked"
    assert os.read(from_worker_read, 100) == b"ready:sent in"
    os.close(from_worker_read)


@pytest.mark.parametrize("case", ["interpreter_flag", "import_time_environment", "many_fds",
                                  "no_zygote"])
def test_what_a_fork_cannot_reproduce_starts_a_fresh_interpreter(zygotes, case):
    client, env, tmp_path, procs = zygotes
    argv, pass_fds = [client, str(tmp_path / "show.py")], ()
    if case == "interpreter_flag":
        argv = [client, "-B", str(tmp_path / "show.py")]
    elif case == "import_time_environment":
        env = dict(env, TF_CPP_MIN_LOG_LEVEL="0")
    elif case == "many_fds":
        pass_fds = tuple(os.pipe()[0] for _ in range(zygote._MAX_HANDED_DOWN + 1))
    else:
        env = dict(env, **{zygote.SOCKET_ENV: str(tmp_path / "nobody.sock")})
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, pass_fds=pass_fds)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    shown = _shown(out)
    assert shown["pid"] == proc.pid and shown["ppid"] == os.getpid(), shown   # exec'd in place
    assert shown["ppid"] not in {p.pid for p in procs}


def test_a_process_on_an_emulated_host_is_forked_into_that_hosts_network(zygotes):
    """``ip netns exec NS python ...``: the forked worker's sockets are the namespace's (it binds
    the emulated host's address, which the zygote's namespace has not)."""
    from prophet_tf.bench import netem

    try:
        netem.EmulatedCluster.check_available()
    except netem.NetemError as e:
        pytest.fail(f"network emulation unavailable ({e}); this test needs root, ip and tc")
    client, env, tmp_path, procs = zygotes
    with netem.EmulatedCluster(2, bandwidth_bps=1e9, prefix=f"ptfz{os.getpid()}") as cluster:
        address = cluster.host_address(1)
        code = (SHOW.replace('mode = sys.argv[1] if len(sys.argv) > 1 else ""', 'mode = ""')
                + f"import socket; socket.socket().bind(({address!r}, 0)); print('bound')")
        done = cluster.run(1, [client, "-c", code], env=env, capture_output=True, text=True,
                           timeout=60)
        in_namespace = cluster.run(1, ["readlink", "/proc/self/ns/net"], capture_output=True,
                                   text=True, timeout=60).stdout.strip()
    assert done.returncode == 0, done.stderr
    shown = _shown(done.stdout)
    assert shown["ppid"] in {p.pid for p in procs}, "started fresh instead of forked"
    assert shown["netns"] == in_namespace != os.readlink("/proc/self/ns/net"), shown
    assert done.stdout.splitlines()[-1] == "bound"
