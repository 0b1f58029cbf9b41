"""Tests of the emulated cluster (network namespaces + tbf), run as root only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prophet_tf.bench import netem
from prophet_tf.bench.netem import (EmulatedCluster, LoopbackCluster, NetemUnavailableError,
                                    cleanup_stale, list_namespaces)

REPO = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
HAVE_IP = shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(
    not (IS_ROOT and HAVE_IP),
    reason="network namespaces need root and iproute2 (ip, tc); run the tests as root")

RATE = 200e6          # bits/s
NBYTES = 6_000_000    # ~0.24 s at 200 Mbit/s

RECEIVER = textwrap.dedent("""\
    import json, socket, sys, time
    host, port = sys.argv[1], int(sys.argv[2])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(1); s.settimeout(10)
    print("ready", flush=True)
    c, peer = s.accept(); c.settimeout(10)
    got, t0 = 0, None
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        if t0 is None:
            t0 = time.monotonic()
        got += len(b)
    print(json.dumps({"bytes": got, "secs": time.monotonic() - t0, "peer": peer[0]}), flush=True)
    """)

SENDER = textwrap.dedent("""\
    import socket, sys
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    c = socket.create_connection((host, port), timeout=10)
    buf, sent = b"x" * 65536, 0
    while sent < n:
        c.sendall(buf[: min(len(buf), n - sent)]); sent += min(len(buf), n - sent)
    c.close()
    """)


@pytest.fixture
def prefix() -> str:
    p = f"ptft{os.getpid()}"
    yield p
    if IS_ROOT and HAVE_IP:
        cleanup_stale(p)


def _root_view() -> tuple[str, str]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    return links, addrs


@needs_root
def test_shaped_transfer_and_teardown(prefix: str, tmp_path: Path) -> None:
    (tmp_path / "recv.py").write_text(RECEIVER)
    (tmp_path / "send.py").write_text(SENDER)
    links_before, _ = _root_view()
    with EmulatedCluster(2, RATE, prefix=prefix) as cl:
        assert set(list_namespaces(prefix)) == {f"{prefix}-sw", f"{prefix}-h0", f"{prefix}-h1"}
        assert cl.exec_argv(1, ["x", "y"]) == ["ip", "netns", "exec", f"{prefix}-h1", "x", "y"]
        assert (cl.host_address(0), cl.host_address(1)) == ("10.77.0.1", "10.77.0.2")
        # Nothing of ours in the root namespace: no new links, no 10.77 address.
        links, addrs = _root_view()
        assert links == links_before and "10.77.0." not in addrs
        recv = cl.popen(1, [sys.executable, str(tmp_path / "recv.py"), cl.host_address(1), "5001"],
                        stdout=subprocess.PIPE, text=True)
        assert recv.stdout.readline().strip() == "ready"
        cl.run(0, [sys.executable, str(tmp_path / "send.py"), cl.host_address(1), "5001",
                   str(NBYTES)], check=True, timeout=10)
        result = json.loads(recv.stdout.readline())
        recv.wait(timeout=5)
        assert result["bytes"] == NBYTES and result["peer"] == cl.host_address(0)
        rate = result["bytes"] * 8 / result["secs"]
        print(f"\nshaped TCP rate: {rate / 1e6:.1f} Mbit/s (limit {RATE / 1e6:.0f} Mbit/s)")
        assert 0.5 * RATE <= rate <= 1.1 * RATE, rate
        assert "tbf" in cl.qdisc_stats(0) and "rate 200Mbit" in cl.qdisc_stats(0)
        # A host's worker can change its own link mid-run (the training benchmark's --rate_change).
        cl.run(0, cl.rate_change_argv(RATE / 2), check=True, timeout=10)
        assert "rate 100Mbit" in cl.qdisc_stats(0) and "rate 200Mbit" in cl.qdisc_stats(1)
        # Isolation, checked structurally (without sending anything): a host has only lo and
        # eth0 and a route to 10.77.0.0/24 only (no default route), the root namespace has no
        # route to that subnet.
        for i in range(2):
            host_links = cl.run(i, ["ip", "-o", "link"], capture_output=True, text=True).stdout
            assert sorted(line.split(":")[1].strip().split("@")[0]
                          for line in host_links.splitlines()) == ["eth0", "lo"]
            host_routes = cl.run(i, ["ip", "route"], capture_output=True, text=True).stdout
            assert host_routes.split()[:3] == ["10.77.0.0/24", "dev", "eth0"]
            assert "default" not in host_routes and len(host_routes.splitlines()) == 1
        root_routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
        assert "10.77.0." not in root_routes
    assert list_namespaces(prefix) == []
    assert _root_view()[0] == links_before


@needs_root
def test_sigterm_tears_down(prefix: str) -> None:
    code = textwrap.dedent(f"""\
        import time
        from prophet_tf.bench.netem import EmulatedCluster
        with EmulatedCluster(2, 100e6, prefix={prefix!r}):
            print("up", flush=True)
            time.sleep(30)
        """)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "up"
        assert len(list_namespaces(prefix)) == 3
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
    assert list_namespaces(prefix) == []


@needs_root
def test_stale_leftovers_after_sigkill(prefix: str) -> None:
    code = textwrap.dedent(f"""\
        import os, signal
        from prophet_tf.bench.netem import EmulatedCluster
        EmulatedCluster(2, 100e6, prefix={prefix!r}).start()
        os.kill(os.getpid(), signal.SIGKILL)   # no teardown possible
        """)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=20).returncode == -9
    assert len(list_namespaces(prefix)) == 3
    # A new cluster with the same prefix sees a dead owner and cleans up by itself...
    with EmulatedCluster(3, 100e6, prefix=prefix):
        assert len(list_namespaces(prefix)) == 4
        leftover = EmulatedCluster(1, 0, prefix=prefix)
        with pytest.raises(netem.NetemError, match="running process"):
            leftover.start()  # ...but not while the owner is alive
    assert list_namespaces(prefix) == []
    # ...and cleanup_stale removes leftovers explicitly.
    subprocess.run([sys.executable, "-c", code], env=env, timeout=20)
    assert sorted(cleanup_stale(prefix)) == sorted(
        [f"{prefix}-sw", f"{prefix}-h0", f"{prefix}-h1"])
    assert list_namespaces(prefix) == []


@needs_root
def test_setup_failure_leaves_nothing(prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self, ns):
        raise netem.NetemError("injected failure")
    monkeypatch.setattr(EmulatedCluster, "_shape", boom)
    with pytest.raises(netem.NetemError, match="injected"):
        with EmulatedCluster(2, RATE, prefix=prefix):
            pass
    assert list_namespaces(prefix) == []


@needs_root
def test_delay_needs_netem(prefix: str) -> None:
    # Some kernels (e.g. minimal VM kernels) have no sch_netem: then a clear error, no leftovers.
    try:
        with EmulatedCluster(2, RATE, delay_ms=5, prefix=prefix) as cl:
            assert "netem" in cl.qdisc_stats(0)
    except NetemUnavailableError as e:
        assert "netem" in str(e) and "delay_ms=0" in str(e)
    assert list_namespaces(prefix) == []


def test_requires_root_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetemUnavailableError, match=r"needs root.*--loopback"):
        EmulatedCluster(2, RATE, prefix="ptfnoroot").start()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(NetemUnavailableError, match=r"needs ip and tc.*--loopback"):
        EmulatedCluster.check_available()


def test_loopback_cluster_interface() -> None:
    with LoopbackCluster(3) as cl:
        assert [cl.host_address(i) for i in range(3)] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        assert cl.exec_argv(2, ["a"]) == ["a"]
        with pytest.raises(IndexError):
            cl.host_address(3)


def test_argument_checks() -> None:
    with pytest.raises(ValueError):
        EmulatedCluster(0, RATE)
    with pytest.raises(ValueError):
        EmulatedCluster(2, RATE, prefix="bad/prefix")
    with pytest.raises(ValueError):
        EmulatedCluster(2, -1)
    with pytest.raises(IndexError):
        EmulatedCluster(2, RATE).host_address(2)
    with pytest.raises(ValueError, match="shaped cluster"):
        EmulatedCluster(2, None).rate_change_argv(RATE)
    with pytest.raises(ValueError, match="mtu"):
        EmulatedCluster(2, RATE, mtu=100)


def test_frame_efficiency_is_tcp_payload_per_ethernet_frame() -> None:
    from prophet_tf.bench.netem import TBF_FRAME_EFFICIENCY, frame_efficiency
    assert TBF_FRAME_EFFICIENCY == frame_efficiency(1500) == 1448 / 1514
    assert frame_efficiency(9000) == 8948 / 9014
    assert EmulatedCluster(2, RATE).rate_change_argv(RATE / 2)[:8] == [
        "tc", "qdisc", "change", "dev", "eth0", "root", "handle", "1:"]
