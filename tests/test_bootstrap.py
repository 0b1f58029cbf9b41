"""Job start-up with real worker processes on loopback: authentication, hostile and idle
connections, misconfigured or dying peers. Two long-lived workers (tests/workers/
bootstrap_worker.py) start the runtime again for each case, so TensorFlow is imported only once."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import threading
import time
from typing import Optional

import pytest

from conftest import ROOT, WORKERS, _worker_env, worker_python
from prophet_tf.launch import free_ports

TOKEN = "bootstrap-test-token"


class WorkerPool:
    """Long-lived worker processes that run one start-up per command."""

    def __init__(self, n: int) -> None:
        self.procs: list[Optional[subprocess.Popen]] = [None] * n
        self.pending = [0] * n  # commands sent whose result was not read yet
        for i in range(n):
            self._spawn(i)
        for i in range(n):
            self._await_ready(i)

    def _spawn(self, i: int) -> None:
        env = _worker_env({"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"})
        for key in ("PROPHET_JOB_TOKEN", "PROPHET_ALLOW_NO_TOKEN", "PROPHET_BIND_HOST"):
            env.pop(key, None)
        self.pending[i] = 0
        self.procs[i] = subprocess.Popen([worker_python(), "-u", str(WORKERS / "bootstrap_worker.py")], cwd=ROOT,
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)

    def _await_ready(self, i: int) -> None:
        line = self.procs[i].stdout.readline()
        assert line.strip() == "WORKER READY", line

    def ensure_alive(self, i: int) -> None:
        if self.procs[i].poll() is not None:
            self._spawn(i)
            self._await_ready(i)

    def init(self, i: int, rank: int, addresses: list[str], token: str = TOKEN, world_size: Optional[int] = None,
             sum: bool = True, **kwargs) -> None:
        self.ensure_alive(i)
        cmd = {"op": "init", "rank": rank, "world_size": world_size or len(addresses), "addresses": addresses,
               "token": token, "kwargs": kwargs, "sum": sum}
        self.procs[i].stdin.write(json.dumps(cmd) + "\n")
        self.procs[i].stdin.flush()
        self.pending[i] += 1

    def result(self, i: int, timeout: float = 60.0) -> dict:
        """The next RESULT of worker i; a worker still busy after `timeout` is killed (it hung)."""
        proc = self.procs[i]
        self.pending[i] -= 1
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box:
            proc.kill()
            proc.wait()
            return {"ok": False, "error": f"HUNG: no result within {timeout} s"}
        line = box[0]
        assert line.startswith("RESULT "), line
        return json.loads(line[len("RESULT "):])

    def drain(self) -> None:
        """Reads the results a failed test left unread, so the next test starts clean."""
        for i, p in enumerate(self.procs):
            while p is not None and p.poll() is None and self.pending[i] > 0:
                self.result(i, timeout=60)

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def close(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def workers():
    started = WorkerPool(2)
    yield started
    started.close()


@pytest.fixture
def pool(workers: WorkerPool):
    yield workers
    workers.drain()


def addresses(n: int) -> list[str]:
    return [f"127.0.0.1:{p}" for p in free_ports(n)]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _sockets(port: int, state: str) -> int:
    """Sockets with local port `port` in TCP state `state` (from /proc: no connection is made)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            count += sum(1 for line in f.readlines()[1:]
                         if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == state)
    return count


def listening(port: int) -> bool:
    return _sockets(port, "0A") > 0


# What an acceptor sends a connector it accepts: a challenge Verdict, the Challenge and the final
# Verdict (264 + 64 + 264 bytes, ops/core/handshake.h).
HANDSHAKE_REPLY_BYTES = 2 * 264 + 64


def handshake_replied(port: int) -> bool:
    """Whether the worker listening on `port` has delivered a whole handshake to a connector,
    i.e. accepted it (the kernel's count of acknowledged bytes, TCP_INFO, read with ss)."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return any(int(n) >= HANDSHAKE_REPLY_BYTES for n in re.findall(r"bytes_acked:(\d+)", out))


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the workers"
        time.sleep(0.02)


def assert_formed(*results: dict) -> None:
    for r in results:
        assert r["ok"], r
        assert r["sum"] == [float(len(results))] * 4, r


def test_idle_connection_flood_during_startup_does_not_stop_the_job(pool: WorkerPool) -> None:
    a = addresses(2)
    pool.init(0, 0, a, connect_timeout_s=20)
    wait_for(lambda: listening(port_of(a[0])))
    idle = []
    for _ in range(200):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port_of(a[0])))
        idle.append(s)
    try:
        pool.init(1, 1, a, connect_timeout_s=20)
        assert_formed(pool.result(0), pool.result(1))
    finally:
        for s in idle:
            s.close()


class RecordingProxy:
    """Forwards connections to `target`, recording what each client sent (a client may retry)."""

    def __init__(self, target: str) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.target = ("127.0.0.1", port_of(target))
        self.streams: list[bytearray] = []
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.listener.settimeout(0.2)
        while not self.done.is_set():
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.streams.append(bytearray())
            threading.Thread(target=self._forward, args=(client, self.streams[-1]), daemon=True).start()
        self.listener.close()

    def _forward(self, client: socket.socket, record: bytearray) -> None:
        try:
            server = socket.create_connection(self.target)
        except OSError:
            client.close()
            return

        def pump(src: socket.socket, dst: socket.socket, into: Optional[bytearray]) -> None:
            while True:
                try:
                    data = src.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                if into is not None:
                    into.extend(data)
                try:
                    dst.sendall(data)
                except OSError:
                    return

        back = threading.Thread(target=pump, args=(server, client, None), daemon=True)
        back.start()
        pump(client, server, record)
        back.join(10)
        client.close()
        server.close()


def test_a_recorded_handshake_replayed_is_rejected_and_the_job_still_forms(pool: WorkerPool) -> None:
    # A job of two whose rank 1 reaches rank 0 through a proxy that records what rank 1 sends.
    a = addresses(2)
    proxy = RecordingProxy(a[0])
    pool.init(0, 0, a)
    pool.init(1, 1, [proxy.address, a[1]])
    assert_formed(pool.result(0), pool.result(1))
    proxy.done.set()
    recorded = bytes(proxy.streams[-1])  # the connection that joined the job
    assert recorded, "nothing recorded"
    # The same job starts again; an eavesdropper replays rank 1's bytes to rank 0.
    b = addresses(2)
    pool.init(0, 0, b, connect_timeout_s=30, timeout_s=3)
    wait_for(lambda: listening(port_of(b[0])))
    answer = b""
    with socket.create_connection(("127.0.0.1", port_of(b[0]))) as s:
        s.sendall(recorded)
        s.settimeout(5)
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except OSError:
            pass
    assert b"job token mismatch" in answer, answer  # rejected, and told why
    # Rank 0 did not give up: the real rank 1 joins.
    pool.init(1, 1, b, connect_timeout_s=30, timeout_s=3)
    assert_formed(pool.result(0), pool.result(1))


@pytest.mark.parametrize("case", ["token", "world_size"])
def test_a_peer_that_cannot_join_fails_at_once_and_is_named_by_the_other(pool: WorkerPool, case: str) -> None:
    # The connecting worker is rejected and fails at once with the reason; the worker it knocked
    # at waits for the real peer, and names the rejection when its own connect timeout ends.
    a = addresses(3)
    if case == "token":
        pool.init(0, 0, a[:2], connect_timeout_s=4)
        pool.init(1, 1, a[:2], token="another-job", connect_timeout_s=30)
        expect = "job token mismatch"
    else:
        pool.init(0, 0, a, connect_timeout_s=4)
        pool.init(1, 1, a[:2], connect_timeout_s=30)
        expect = "world size"
    r0, r1 = pool.result(0), pool.result(1)
    assert not r1["ok"] and expect in r1["error"] and a[0] in r1["error"], r1
    assert r1["seconds"] < 15, r1  # its connect timeout is 30 s
    assert not r0["ok"] and "rejected meanwhile" in r0["error"] and expect in r0["error"], r0
    assert "did not connect to this worker" in r0["error"], r0


def test_listens_on_the_configured_host_only(pool: WorkerPool) -> None:
    a = addresses(2)
    pool.init(0, 0, a, connect_timeout_s=20)
    wait_for(lambda: listening(port_of(a[0])))
    # 127.0.0.2 is another address of the loopback network: free on that port unless the worker
    # listens on every interface.
    with socket.socket() as other:
        other.bind(("127.0.0.2", port_of(a[0])))
    pool.init(1, 1, a, connect_timeout_s=20)
    assert_formed(pool.result(0), pool.result(1))


def test_a_multi_worker_job_needs_a_token_unless_the_user_opts_out(pool: WorkerPool) -> None:
    a = addresses(2)
    pool.init(0, 0, a, token="")
    r = pool.result(0)
    assert not r["ok"] and "needs a job token" in r["error"], r
    assert "PROPHET_JOB_TOKEN" in r["error"] and "allow_no_token=True" in r["error"], r
    pool.init(0, 0, a, token="", allow_no_token=True)
    pool.init(1, 1, a, token="", allow_no_token=True)
    assert_formed(pool.result(0), pool.result(1))


def test_two_ranks_on_one_endpoint_are_rejected_after_resolution(pool: WorkerPool) -> None:
    port = free_ports(1)[0]
    pool.init(0, 0, [f"localhost:{port}", f"127.0.0.1:{port}"])
    r = pool.result(0)
    assert not r["ok"] and "ClusterConfigError" in r["error"] and "same endpoint" in r["error"], r


def test_connect_timeout_is_honoured_against_a_listener_that_never_answers(pool: WorkerPool) -> None:
    a = addresses(2)
    with socket.socket() as never:
        never.bind(("127.0.0.1", port_of(a[0])))
        never.listen(0)
        fill = [socket.socket() for _ in range(3)]  # fill the backlog: further SYNs are dropped
        for s in fill:
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port_of(a[0])))
        pool.init(1, 1, a, connect_timeout_s=3)
        r = pool.result(1, timeout=30)
        for s in fill:
            s.close()
    assert not r["ok"] and "could not connect to rank 0" in r["error"] and "within 3 s" in r["error"], r
    # Soon after the deadline (slack for a loaded or much slower machine; the default is 60 s).
    assert r["seconds"] < 3 + 20, r


def test_a_worker_dying_during_startup_is_named_at_once(pool: WorkerPool) -> None:
    # Three workers, rank 2 not started yet; rank 1 connected to rank 0, then it is killed.
    # (Last in this file: it uses up worker 1.)
    a = addresses(3)
    pool.init(0, 0, a, connect_timeout_s=30)
    pool.init(1, 1, a, connect_timeout_s=30)
    # Rank 0 has accepted rank 1 (an established TCP connection alone may still be mid-handshake:
    # killed then, rank 1 would never have been known to rank 0).
    wait_for(lambda: handshake_replied(port_of(a[0])))
    killed = time.monotonic()
    pool.kill(1)
    r = pool.result(0, timeout=40)
    waited = time.monotonic() - killed
    assert not r["ok"] and "rank 1" in r["error"] and "exited" in r["error"], r
    assert waited < 15, (waited, r)  # the connect timeout is 30 s
