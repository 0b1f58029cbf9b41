"""``prophetrun -H host1:K,host2:K train.py``: start one node launcher per host over ssh (local
hosts directly), with this launcher as the master, like ``horovodrun -H``.

Every host must have the same Python environment at the same path (this interpreter,
``sys.executable``) and the script at the same path under the same working directory; the job
token is created here (unless ``PROPHET_JOB_TOKEN`` is set) and handed to each node's launcher on
its standard input (never on a command line). ssh must log in without a password prompt
(``BatchMode``): keys or an agent.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence, TextIO, Union

from prophet_tf.cluster import TOKEN_ENV
from prophet_tf.launch.elastic import (DEFAULT_JOIN_WAIT_S, DEFAULT_REJOIN_WAIT_S, ElasticMaster,
                                       NodeRange)
from prophet_tf.launch.rendezvous import Master, RendezvousError
from prophet_tf.launch.restarts import RestartPolicy
from prophet_tf.launch.workers import (CAUSE_INTERRUPTED, EXIT_JOB_FAILED, Controls, Failure,
                                       format_address, free_ports, package_root)

__all__ = ["parse_hosts", "assign_slots", "node_argv", "remote_command", "is_local_host",
           "run_hosts", "DEFAULT_SSH"]

DEFAULT_SSH = "ssh -o BatchMode=yes"
#: Seconds after which an elastic -H job starts a node again on a host whose node ended.
DEFAULT_HOST_RETRY_S = 30.0
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``"a:4,b:4"`` -> ``[("a", 4), ("b", 4)]``; a host without ``:K`` has one slot. IPv6
    hosts go in brackets (``[fe80::1]:2``). Raises ValueError naming the bad entry."""
    out: list[tuple[str, int]] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if entry.startswith("["):
            host, _, rest = entry[1:].partition("]")
            slots = rest[1:] if rest.startswith(":") else ("1" if not rest else None)
        elif entry.count(":") == 1:
            host, slots = entry.split(":")
        elif ":" not in entry:
            host, slots = entry, "1"
        else:
            host, slots = entry, None
        if not host or slots is None or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H entry {entry!r} is not HOST or HOST:SLOTS with SLOTS >= 1 "
                             "(e.g. -H node1:4,node2:4)")
        out.append((host, int(slots)))
    if not out:
        raise ValueError("-H names no host (e.g. -H node1:4,node2:4)")
    return out


def assign_slots(hosts: Sequence[tuple[str, int]], n: Optional[int]) -> list[tuple[str, int]]:
    """The (host, workers) of each node: every slot, or the first ``n`` slots in host order (as
    ``horovodrun -np N -H ...``); hosts left without a worker are not used."""
    total = sum(k for _, k in hosts)
    if n is None:
        return [(h, k) for h, k in hosts]
    if n > total:
        raise ValueError(f"-n {n} workers but -H offers {total} slots")
    out, left = [], n
    for h, k in hosts:
        if left <= 0:
            break
        out.append((h, min(k, left)))
        left -= min(k, left)
    return out


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (started without ssh)."""
    return host in _LOCAL_NAMES or host in {socket.gethostname(), socket.getfqdn()}


def node_argv(node_rank: int, nnodes: Union[int, str], nproc: int, master: str,
              script: Sequence[str], forwarded: Sequence[str]) -> list[str]:
    """The launcher command a node runs (the token comes on its standard input)."""
    return [sys.executable, "-u", "-m", "prophet_tf.launch", "--nnodes", str(nnodes),
            "--node-rank", str(node_rank), "--master", master, "-n", str(nproc), "--token-stdin",
            "--join-only",
            *forwarded, "--", *script]


def remote_command(argv: Sequence[str], cwd: str) -> str:
    """The shell command ssh runs on a host: same working directory, same package."""
    root = package_root()
    env = f"env PYTHONPATH={shlex.quote(root)}${{PYTHONPATH:+:$PYTHONPATH}} " if root else ""
    return f"cd {shlex.quote(cwd)} && exec {env}{shlex.join(argv)}"


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host``."""
    try:
        family = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def run_hosts(script: Sequence[str], hosts: Sequence[tuple[str, int]], controls: Controls, *,
              forwarded: Sequence[str], ssh_command: str = DEFAULT_SSH,
              master: Optional[str] = None, rdzv_timeout: float = 300.0,
              node_timeout: float = 10.0, grace: float = 5.0, say: Callable[[str], None],
              stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
              policy: Optional[RestartPolicy] = None, nodes: Optional[NodeRange] = None,
              join_wait: float = DEFAULT_JOIN_WAIT_S, rejoin_wait: float = DEFAULT_REJOIN_WAIT_S,
              checkpoint_wait: float = 60.0, host_retry: float = DEFAULT_HOST_RETRY_S) -> int:
    """Starts a node launcher per host and referees the job; returns its exit status.

    Args:
      script: the workers' command (``script.py args``).
      hosts: (host, workers) per node, node rank = position.
      controls: this launcher's signals (a signal stops every node's workers).
      forwarded: launcher flags every node gets (``--threads``, ``--env``, ``--log-dir``...).
      ssh_command: the ssh client and its options; the host and the command are appended.
      master: ``HOST:PORT`` the nodes reach this launcher at; default: this machine's address
        towards the first remote host, a free port.
      policy: the restarts of the job (this launcher's master decides them for every node).
      nodes: an elastic job's ``--nnodes MIN:MAX`` (None: every host is a node of a job of fixed
        size). A node that ends while the job runs is then no failure of the job: the master
        forms it again without that node, and this launcher starts a node on that host again
        ``host_retry`` seconds later (0: never), which enters the job at its next checkpoint.
      join_wait, rejoin_wait, checkpoint_wait: the elastic master's (``launch.elastic``).
    """
    elastic = nodes is not None and nodes.elastic
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    remote = [h for h, _ in hosts if not is_local_host(h)]
    if master is None:
        address = _address_towards(remote[0]) if remote else "127.0.0.1"
        master = format_address(address, free_ports(1, address)[0])
    token = os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
    try:
        if elastic:
            server: Master = ElasticMaster(
                master, nodes, token, rdzv_timeout=rdzv_timeout, node_timeout=node_timeout,
                stop_wait=grace + 5.0, say=say, policy=policy, join_wait=join_wait,
                rejoin_wait=rejoin_wait, checkpoint_wait=checkpoint_wait)
        else:
            server = Master(master, len(hosts), token, rdzv_timeout=rdzv_timeout,
                            node_timeout=node_timeout, stop_wait=grace + 5.0, say=say,
                            policy=policy)
    except RendezvousError as e:
        say(str(e))
        return 2
    server.start()
    lock = threading.Lock()
    procs: dict[int, subprocess.Popen] = {}
    tails: dict[int, list[str]] = {}
    threads: list[threading.Thread] = []

    def pump(src, dst: TextIO, tail: Optional[list[str]]) -> None:
        for raw in iter(src.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if tail is not None:
                tail.append(line)
                del tail[:-20]
            with lock:
                try:
                    dst.write(line + "\n")
                    dst.flush()
                except (OSError, ValueError):
                    pass
        src.close()

    cwd = os.getcwd()
    nnodes: Union[int, str] = nodes.spec if elastic else len(hosts)

    def start(rank: int) -> bool:
        host, k = hosts[rank]
        argv = node_argv(rank, nnodes, k, master, script, forwarded)
        if not is_local_host(host):
            argv = [*shlex.split(ssh_command), host, remote_command(argv, cwd)]
        say(f"node {rank}: {host}, {k} worker(s): {shlex.join(argv)}")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            if not elastic:
                server.inject_failure(Failure(EXIT_JOB_FAILED, f"node {rank} ({host}) could not "
                                              f"be started: {argv[0]}: {e}", node=rank,
                                              at=time.time()))
            else:
                say(f"node {rank} ({host}) could not be started: {argv[0]}: {e}")
            return False
        try:
            proc.stdin.write((token + "\n").encode())
            proc.stdin.close()
        except OSError:
            pass
        procs[rank] = proc
        tails[rank] = []
        for src, dst, tail in ((proc.stdout, out, None), (proc.stderr, err, tails[rank])):
            t = threading.Thread(target=pump, args=(src, dst, tail), daemon=True)
            t.start()
            threads.append(t)
        return True

    try:
        retry_at: dict[int, float] = {}
        for rank in range(len(hosts)):
            if not start(rank):
                if not elastic:
                    break
                if host_retry > 0:
                    retry_at[rank] = time.monotonic() + host_retry
        reported: set[subprocess.Popen] = set()
        interrupted = False
        while not server.done.is_set():
            if controls.signals and not interrupted:
                interrupted = True
                sig = controls.signals[0]
                server.inject_failure(Failure(128 + sig, f"the -H launcher got "
                                              f"{signal.Signals(sig).name}", at=time.time(),
                                              cause=CAUSE_INTERRUPTED))
            for rank, proc in list(procs.items()):
                code = proc.poll()
                if code is None or proc in reported:
                    continue
                reported.add(proc)
                tail = "; ".join(tails[rank][-3:]) or "no output"
                kind = 'ssh' if not is_local_host(hosts[rank][0]) else 'local'
                if elastic:
                    # The master forms the job again without it (or never had it); the host
                    # may come back.
                    again = (f"; starting a node there again in {host_retry:g} s"
                             if host_retry > 0 and not interrupted else "")
                    say(f"node {rank} ({hosts[rank][0]}): its launcher ({kind}) exited with "
                        f"status {code}{again}")
                    if again:
                        retry_at[rank] = time.monotonic() + host_retry
                elif code != 0:
                    server.inject_failure(Failure(
                        EXIT_JOB_FAILED, f"node {rank} ({hosts[rank][0]}): its launcher "
                        f"({kind}) exited with status {code} ({tail})", node=rank, at=time.time()))
            now = time.monotonic()
            for rank, at in list(retry_at.items()):
                if now >= at and not interrupted:
                    del retry_at[rank]
                    if not start(rank) and host_retry > 0:
                        retry_at[rank] = now + host_retry
            time.sleep(0.05)
        deadline = time.monotonic() + grace + node_timeout + 10.0
        for proc in procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        for t in threads:
            t.join(1.0)
        verdict = server.verdict or {"status": EXIT_JOB_FAILED}
        return int(verdict.get("status", EXIT_JOB_FAILED))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.close()
