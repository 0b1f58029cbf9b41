"""An emulated cluster on one machine: one network namespace per host, shaped per-host egress.

Layout (nothing is created in, or routed through, the root namespace)::

    netns PREFIX-h0            netns PREFIX-sw                 netns PREFIX-h1
    eth0 10.77.0.1/24  <veth>  p0 --+-- br0 (bridge) --+-- p1  <veth>  eth0 10.77.0.2/24
    tc: tbf [+ netem] on eth0                                    tc: tbf [+ netem] on eth0

Every host knows the others' MAC addresses (static neighbours: no ARP). Each host's own ``eth0``
gets ``tbf rate R`` (and ``netem delay D`` if asked), so every host's NIC
sends at most R, as on a real cluster with one NIC per host (shaping ``lo`` instead would model
one shared link, which is a different thing). ``delay_ms`` is added on each host's egress, so the
round trip between two hosts grows by ``2 * delay_ms``.

Usage::

    with EmulatedCluster(2, bandwidth_bps=200e6) as cl:
        subprocess.run(cl.exec_argv(0, ["python3", "worker.py"]))   # runs inside host 0
        cl.host_address(1)                                         # "10.77.0.2"

Needs root plus ``ip`` and ``tc`` (iproute2); otherwise :class:`NetemUnavailableError` says to
run as root or use ``--loopback`` (:class:`LoopbackCluster`, same interface, no shaping).

Teardown (processes left inside the namespaces are killed, then the namespaces deleted) runs on
context exit, on exceptions, on SIGINT/SIGTERM and at interpreter exit. A run that was killed
with SIGKILL leaves namespaces behind: :func:`cleanup_stale` removes them, and entering a new
cluster with the same prefix does so automatically when the previous owner process is gone.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

from prophet_tf.errors import ProphetError

__all__ = ["EmulatedCluster", "LoopbackCluster", "NetemError", "NetemUnavailableError",
           "TBF_FRAME_EFFICIENCY", "cleanup_stale", "frame_efficiency", "list_namespaces"]


def frame_efficiency(mtu: int = 1500) -> float:
    """TCP's payload share of what tbf counts on a link of this MTU: a full segment carries
    mtu - 52 bytes (20 IP, 32 TCP with timestamps) in a frame of mtu + 14 (Ethernet)."""
    return (mtu - 52.0) / (mtu + 14.0)


SUBNET_PREFIX = "10.77.0"   # hosts are SUBNET_PREFIX.1 ... SUBNET_PREFIX.N, /24
HOST_IFACE = "eth0"
_BRIDGE = "br0"
_MAX_HOSTS = 250
_ACTIVE_PREFIXES: set[str] = set()   # prefixes of clusters alive in this process
#: Payload share of what tbf counts against a host's rate: a full TCP segment carries 1448 bytes
#: (MTU 1500 - 20 IP - 32 TCP with timestamps) in a 1514-byte frame (+ 14 Ethernet; tbf counts
#: the frame, GSO packets per segment). The acknowledgements of the other direction pass the same
#: tbf but are too few to count (GRO acknowledges many segments at once): a single TCP stream
#: through tbf at 1 Gbit/s measured 0.96 Gbit/s, and a ResNet50 all-reduce at 983 Mbit/s needs at
#: least 0.951 of the rate for its measured 876 ms steps (docs/benchmarks.md).
TBF_FRAME_EFFICIENCY = frame_efficiency(1500)
_FIX = ("Run as root (e.g. `sudo -E python ...`) so that network namespaces and tc can be used, "
        "or use --loopback to run the workers on 127.0.0.x without bandwidth shaping.")


class NetemError(ProphetError):
    """Setting up or tearing down the emulated network failed."""


class NetemUnavailableError(NetemError):
    """The emulated network cannot be built here (not root, or iproute2 missing)."""


def _lock_dir() -> str:
    d = "/run/prophet_tf_netem" if os.path.isdir("/run") and os.access("/run", os.W_OK) \
        else os.path.join(tempfile.gettempdir(), "prophet_tf_netem")
    os.makedirs(d, exist_ok=True)
    return d


def _owner_file(prefix: str) -> str:
    return os.path.join(_lock_dir(), f"{prefix}.owner")


def _check_prefix(prefix: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_.]{1,40}", prefix):
        raise ValueError(f"prefix {prefix!r} must be 1-40 characters of [A-Za-z0-9_.]")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise NetemError(f"`{' '.join(argv)}` failed (status {r.returncode}): "
                         f"{r.stderr.strip() or r.stdout.strip()}")
    return r


def list_namespaces(prefix: str) -> list[str]:
    """Names of existing network namespaces that belong to clusters with this prefix."""
    _check_prefix(prefix)
    if shutil.which("ip") is None:
        return []
    r = _run(["ip", "netns", "list"], check=False)
    pat = re.compile(rf"^{re.escape(prefix)}-(sw|h[0-9]+)$")
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if pat.match(n))


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILLs every process whose network namespace is ``ns`` (our own test hosts only)."""
    for _ in range(3):
        r = _run(["ip", "netns", "pids", ns], check=False)
        pids = [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def cleanup_stale(prefix: str = "ptf") -> list[str]:
    """Deletes the namespaces (and the veths/bridge inside them) of clusters with this prefix.

    Meant for leftovers of a crashed run; processes still running inside those namespaces are
    killed first. Returns the names of the namespaces that were deleted.
    """
    names = list_namespaces(prefix)
    # Hosts first, the switch last (deleting a host namespace destroys its veth pair).
    names.sort(key=lambda n: n.endswith("-sw"))
    for ns in names:
        _kill_namespace_processes(ns)
        _run(["ip", "netns", "delete", ns], check=False)
    try:
        os.unlink(_owner_file(prefix))
    except OSError:
        pass
    left = list_namespaces(prefix)
    if left:
        raise NetemError(f"could not delete network namespaces {left}; delete them with "
                         f"`ip netns delete NAME` as root")
    return names


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedCluster:
    """``n_hosts`` emulated hosts, each a network namespace whose NIC sends at ``bandwidth_bps``.

    Args:
      n_hosts: number of hosts (1..250).
      bandwidth_bps: egress rate of every host's interface, bits per second (e.g. ``1e9``).
        ``None`` or 0 = unshaped.
      delay_ms: extra one-way delay added on each host's egress (netem), milliseconds.
      prefix: names: namespaces ``PREFIX-h0``, ``PREFIX-h1``, ..., ``PREFIX-sw`` (the switch).
        Use distinct prefixes for clusters that live at the same time.
      burst_bytes: tbf bucket size; default max(64 KiB, rate/250 s), enough for GSO packets and
        the kernel's timer granularity without letting much more than the rate through.
      latency_ms: tbf queue limit expressed as time (``latency`` parameter).
      gso_max_segs: the hosts' interfaces hand the qdisc packets of at most this many TCP
        segments (``ip link set eth0 gso_max_segs``; None: the kernel's default, up to 64 KiB per
        packet). 1: one segment per packet, as a NIC's wire carries them; what each TCP socket
        keeps queued in the host (TCP small queues: two packets at low rates) is then a few KiB
        instead of up to 128 KiB, which matters at the few Mbit/s a slowed replay runs with many
        connections per host.
      sysctls: per-namespace kernel settings of every host (``{"net.ipv4.tcp_congestion_control":
        "reno"}``), set with ``sysctl -w`` inside it.
      mtu: the MTU of every host's link (None: 1500). Jumbo frames (9000) carry the same bytes in
        a sixth of the packets, each of which costs CPU on its way through two veths, the bridge
        and tbf; TCP's payload share is then (mtu - 52) / (mtu + 14) (:func:`frame_efficiency`).
    """

    def __init__(self, n_hosts: int, bandwidth_bps: Optional[float], delay_ms: float = 0,
                 prefix: str = "ptf", *, burst_bytes: Optional[int] = None,
                 latency_ms: float = 20.0, gso_max_segs: Optional[int] = None,
                 sysctls: Optional[dict[str, str]] = None, mtu: Optional[int] = None) -> None:
        _check_prefix(prefix)
        if not 1 <= n_hosts <= _MAX_HOSTS:
            raise ValueError(f"n_hosts must be in 1..{_MAX_HOSTS}, got {n_hosts}")
        if bandwidth_bps is not None and bandwidth_bps < 0:
            raise ValueError(f"bandwidth_bps must be >= 0, got {bandwidth_bps}")
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        self.n_hosts = n_hosts
        self.bandwidth_bps = int(bandwidth_bps) if bandwidth_bps else 0
        self.delay_ms = float(delay_ms)
        self.prefix = prefix
        rate_bytes = self.bandwidth_bps / 8
        self.burst_bytes = int(burst_bytes) if burst_bytes else max(64 * 1024, int(rate_bytes / 250))
        self.latency_ms = float(latency_ms)
        if gso_max_segs is not None and gso_max_segs < 1:
            raise ValueError(f"gso_max_segs must be at least 1, got {gso_max_segs}")
        self.gso_max_segs = gso_max_segs
        self.sysctls = dict(sysctls or {})
        if mtu is not None and not 576 <= mtu <= 65535:
            raise ValueError(f"mtu must be in 576..65535, got {mtu}")
        self.mtu = mtu
        self._lock = threading.RLock()
        self._active = False
        self._created: list[str] = []
        self._old_handlers: dict[int, Any] = {}
        self._procs: list[subprocess.Popen] = []

    # ----- names -----
    @property
    def switch_namespace(self) -> str:
        """Namespace that holds the bridge."""
        return f"{self.prefix}-sw"

    def namespace(self, i: int) -> str:
        """Network namespace of host ``i``."""
        self._check_index(i)
        return f"{self.prefix}-h{i}"

    @property
    def namespaces(self) -> list[str]:
        """All host namespaces, host order."""
        return [self.namespace(i) for i in range(self.n_hosts)]

    def host_address(self, i: int) -> str:
        """IPv4 address of host ``i`` (reachable only from the other hosts' namespaces)."""
        self._check_index(i)
        return f"{SUBNET_PREFIX}.{i + 1}"

    def exec_argv(self, host_index: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed with ``ip netns exec NS`` so that it runs on host ``host_index``."""
        return ["ip", "netns", "exec", self.namespace(host_index), *argv]

    def popen(self, host_index: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Starts ``argv`` on host ``host_index``; the process is killed at teardown."""
        p = subprocess.Popen(self.exec_argv(host_index, argv), **kwargs)
        self._procs.append(p)
        return p

    def run(self, host_index: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` on host ``host_index``."""
        return subprocess.run(self.exec_argv(host_index, argv), **kwargs)

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.n_hosts:
            raise IndexError(f"host index {i} out of range for {self.n_hosts} hosts")

    # ----- lifecycle -----
    def __enter__(self) -> "EmulatedCluster":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def check_available() -> None:
        """Raises :class:`NetemUnavailableError` unless running as root with ``ip`` and ``tc``."""
        if os.geteuid() != 0:
            raise NetemUnavailableError(
                f"the emulated cluster needs root (running as uid {os.geteuid()}). {_FIX}")
        missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
        if missing:
            raise NetemUnavailableError(
                f"the emulated cluster needs {' and '.join(missing)} from iproute2 (not found on "
                f"PATH; Debian: apt-get install iproute2). {_FIX}")

    def start(self) -> None:
        """Builds the namespaces, bridge, veths and qdiscs. Idempotent while active."""
        with self._lock:
            if self._active:
                return
            self.check_available()
            self._claim_prefix()
            self._active = True
            atexit.register(self.close)
            self._install_signal_handlers()
            try:
                self._build()
            except BaseException:
                self.close()
                raise

    def _claim_prefix(self) -> None:
        existing = list_namespaces(self.prefix)
        owner_path = _owner_file(self.prefix)
        if existing:
            owner = None
            try:
                with open(owner_path) as f:
                    owner = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
            if self.prefix in _ACTIVE_PREFIXES or (
                    owner is not None and owner != os.getpid() and _pid_alive(owner)):
                who = "this process" if self.prefix in _ACTIVE_PREFIXES else f"pid {owner}"
                raise NetemError(
                    f"network namespaces {existing} belong to a running process ({who}); "
                    "use another prefix, or stop that cluster first")
            cleanup_stale(self.prefix)
        elif self.prefix in _ACTIVE_PREFIXES:
            raise NetemError(f"prefix {self.prefix!r} is already used by an active cluster in "
                             "this process; use another prefix")
        with open(owner_path, "w") as f:
            f.write(f"{os.getpid()}\n")
        _ACTIVE_PREFIXES.add(self.prefix)

    def _ns_add(self, ns: str) -> None:
        r = _run(["ip", "netns", "add", ns], check=False)
        if r.returncode != 0:
            msg = r.stderr.strip()
            if "ermission" in msg or "not permitted" in msg:
                raise NetemUnavailableError(
                    f"`ip netns add {ns}` failed: {msg} (a container without CAP_SYS_ADMIN?). {_FIX}")
            raise NetemError(f"`ip netns add {ns}` failed: {msg}")
        self._created.append(ns)

    def _build(self) -> None:
        sw = self.switch_namespace
        self._ns_add(sw)
        _run(["ip", "-n", sw, "link", "add", _BRIDGE, "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", _BRIDGE, "up"])
        for i in range(self.n_hosts):
            ns, port = self.namespace(i), f"p{i}"
            self._ns_add(ns)
            # Both ends are created directly inside their namespaces: nothing in the root one.
            _run(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", HOST_IFACE,
                  "netns", ns])
            _run(["ip", "-n", sw, "link", "set", port, "master", _BRIDGE])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", HOST_IFACE, "address", self.host_mac(i)])
            if self.mtu is not None:
                _run(["ip", "-n", sw, "link", "set", port, "mtu", str(self.mtu)])
                _run(["ip", "-n", ns, "link", "set", HOST_IFACE, "mtu", str(self.mtu)])
            for key, value in self.sysctls.items():
                _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}"])
            if self.gso_max_segs is not None:
                _run(["ip", "-n", ns, "link", "set", HOST_IFACE, "gso_max_segs",
                      str(self.gso_max_segs)])
            _run(["ip", "-n", ns, "addr", "add", f"{self.host_address(i)}/24", "dev", HOST_IFACE])
            _run(["ip", "-n", ns, "link", "set", HOST_IFACE, "up"])
            self._shape(ns)
        self._add_neighbours()

    def host_mac(self, i: int) -> str:
        """The MAC address of host ``i``'s interface (locally administered, fixed)."""
        self._check_index(i)
        return f"02:77:00:00:{(i + 1) >> 8:02x}:{(i + 1) & 0xff:02x}"

    def _add_neighbours(self) -> None:
        """Every host knows every other host's MAC address (static neighbour entries): hosts never
        resolve addresses. At start-up every worker connects to every other host at once, and
        with tens of hosts on one bridge those N(N-1) ARP broadcasts, each delivered to every
        port, left requests unanswered for seconds on 2 busy cores ("No route to host"; 64 hosts
        did not connect within 120 s)."""
        if self.n_hosts < 2:
            return
        for i in range(self.n_hosts):
            lines = "".join(f"neigh replace {self.host_address(j)} lladdr {self.host_mac(j)} dev "
                            f"{HOST_IFACE} nud permanent\n" for j in range(self.n_hosts) if j != i)
            r = subprocess.run(["ip", "-n", self.namespace(i), "-batch", "-"], input=lines,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if r.returncode != 0:
                raise NetemError(f"adding the neighbours of {self.namespace(i)} failed: "
                                 f"{r.stderr.strip()}")

    def _shape(self, ns: str) -> None:
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", HOST_IFACE]
        tbf = ["tbf", "rate", f"{self.bandwidth_bps}bit", "burst", str(self.burst_bytes),
               "latency", f"{self.latency_ms:g}ms"]
        try:
            if self.delay_ms > 0:
                # netem (delay) at the root, tbf as its child: packets wait D, then leave at R.
                # netem's queue must hold rate * delay worth of packets.
                limit = 1000
                if self.bandwidth_bps:
                    limit = max(1000, int(self.bandwidth_bps / 8 * self.delay_ms / 1e3 / 1000) * 4)
                else:
                    limit = 100000
                _run([*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms:g}ms",
                      "limit", str(limit)])
                if self.bandwidth_bps:
                    _run([*tc, "parent", "1:1", "handle", "10:", *tbf])
            elif self.bandwidth_bps:
                _run([*tc, "root", "handle", "1:", *tbf])
        except NetemError as e:
            if "kind is unknown" in str(e):
                kind = "netem" if " netem " in str(e) else "tbf"
                hint = (" Delay emulation is not possible on this kernel; use delay_ms=0."
                        if kind == "netem" else "")
                raise NetemUnavailableError(
                    f"this kernel has no '{kind}' queueing discipline (sch_{kind}; try "
                    f"`modprobe sch_{kind}`): {str(e).rstrip('.')}.{hint}") from None
            raise

    def rate_change_argv(self, bandwidth_bps: float) -> list[str]:
        """``tc`` command that sets a host's egress rate to ``bandwidth_bps`` mid-run.

        It is run inside the host's namespace (by the host's own worker, so that the change lands
        at a known training step), on a cluster that was started with a rate. The bucket keeps
        the larger of the two rates' sizes, so a faster rate is not held back by a small burst.
        """
        if not self.bandwidth_bps:
            raise ValueError("only a shaped cluster (built with a bandwidth) can change its rate")
        if not bandwidth_bps or bandwidth_bps <= 0:
            raise ValueError(f"bandwidth_bps must be positive, got {bandwidth_bps}")
        rate = int(bandwidth_bps)
        burst = max(self.burst_bytes, int(rate / 8 / 250))
        where = ["parent", "1:1", "handle", "10:"] if self.delay_ms > 0 else ["root", "handle", "1:"]
        return ["tc", "qdisc", "change", "dev", HOST_IFACE, *where, "tbf", "rate", f"{rate}bit",
                "burst", str(burst), "latency", f"{self.latency_ms:g}ms"]

    def qdisc_stats(self, i: int) -> str:
        """``tc -s qdisc show`` of host ``i``'s interface (sent bytes, drops, overlimits)."""
        return _run(["tc", "-s", "-n", self.namespace(i), "qdisc", "show", "dev", HOST_IFACE]).stdout

    def close(self) -> None:
        """Kills processes left in the namespaces and deletes them. Safe to call repeatedly."""
        with self._lock:
            if not self._active:
                return
            self._active = False
            for p in self._procs:
                if p.poll() is None:
                    try:
                        p.kill()
                        p.wait(timeout=5)
                    except (OSError, subprocess.TimeoutExpired):
                        pass
            self._procs.clear()
            errors = []
            hosts_first = sorted(self._created, key=lambda n: n == self.switch_namespace)
            for ns in hosts_first:
                _kill_namespace_processes(ns)
                r = _run(["ip", "netns", "delete", ns], check=False)
                if r.returncode != 0 and "No such file" not in r.stderr:
                    errors.append(f"{ns}: {r.stderr.strip()}")
            self._created.clear()
            _ACTIVE_PREFIXES.discard(self.prefix)
            try:
                with open(_owner_file(self.prefix)) as f:
                    mine = int(f.read().split()[0]) == os.getpid()
                if mine:
                    os.unlink(_owner_file(self.prefix))
            except (OSError, ValueError, IndexError):
                pass
            self._restore_signal_handlers()
            try:
                atexit.unregister(self.close)
            except Exception:
                pass
            if errors:
                raise NetemError("teardown left namespaces behind: " + "; ".join(errors) +
                                 f". Run prophet_tf.bench.netem.cleanup_stale({self.prefix!r}).")

    # ----- signals -----
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works in the main thread; atexit still covers us
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        try:
            self.close()
        finally:
            # Then behave as if we had not been there: KeyboardInterrupt for SIGINT, death for a
            # default SIGTERM, or the previous Python handler.
            if callable(old):
                old(signum, frame)
            elif old in (signal.SIG_DFL, None):
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

    def __repr__(self) -> str:
        return (f"EmulatedCluster(n_hosts={self.n_hosts}, bandwidth_bps={self.bandwidth_bps}, "
                f"delay_ms={self.delay_ms:g}, prefix={self.prefix!r}, active={self._active})")


class LoopbackCluster:
    """Same interface as :class:`EmulatedCluster` without namespaces or shaping (``--loopback``).

    Host ``i`` is ``127.0.0.{i+1}`` (Linux routes all of 127/8 to ``lo``), so every host can use
    the same port, as with the emulated cluster. Needs no privileges.
    """

    def __init__(self, n_hosts: int, *_: Any, **__: Any) -> None:
        if not 1 <= n_hosts <= _MAX_HOSTS:
            raise ValueError(f"n_hosts must be in 1..{_MAX_HOSTS}, got {n_hosts}")
        self.n_hosts = n_hosts
        self.bandwidth_bps = 0
        self.delay_ms = 0.0

    def host_address(self, i: int) -> str:
        if not 0 <= i < self.n_hosts:
            raise IndexError(f"host index {i} out of range for {self.n_hosts} hosts")
        return f"127.0.0.{i + 1}"

    def exec_argv(self, host_index: int, argv: Sequence[str]) -> list[str]:
        self.host_address(host_index)
        return list(argv)

    def popen(self, host_index: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.exec_argv(host_index, argv), **kwargs)

    def run(self, host_index: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_argv(host_index, argv), **kwargs)

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "LoopbackCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass
