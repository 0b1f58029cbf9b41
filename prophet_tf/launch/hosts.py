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
from typing import Callable, Optional, Sequence, TextIO

from prophet_tf.cluster import TOKEN_ENV
from prophet_tf.launch.rendezvous import Master, RendezvousError
from prophet_tf.launch.restarts import RestartPolicy
from prophet_tf.launch.workers import (CAUSE_INTERRUPTED, EXIT_JOB_FAILED, Controls, Failure,
                                       format_address, free_ports, package_root)

__all__ = ["parse_hosts", "assign_slots", "node_argv", "remote_command", "is_local_host",
           "run_hosts", "DEFAULT_SSH"]

DEFAULT_SSH = "ssh -o BatchMode=yes"
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


def node_argv(node_rank: int, nnodes: int, nproc: int, master: str, script: Sequence[str],
              forwarded: Sequence[str]) -> list[str]:
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
              policy: Optional[RestartPolicy] = None) -> int:
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
    """
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    remote = [h for h, _ in hosts if not is_local_host(h)]
    if master is None:
        address = _address_towards(remote[0]) if remote else "127.0.0.1"
        master = format_address(address, free_ports(1, address)[0])
    token = os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
    try:
        server = Master(master, len(hosts), token, rdzv_timeout=rdzv_timeout,
                        node_timeout=node_timeout, stop_wait=grace + 5.0, say=say, policy=policy)
    except RendezvousError as e:
        say(str(e))
        return 2
    server.start()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    tails: list[list[str]] = []
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
    try:
        for rank, (host, k) in enumerate(hosts):
            argv = node_argv(rank, len(hosts), k, master, script, forwarded)
            if not is_local_host(host):
                argv = [*shlex.split(ssh_command), host, remote_command(argv, cwd)]
            say(f"node {rank}: {host}, {k} worker(s): {shlex.join(argv)}")
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
            except OSError as e:
                server.inject_failure(Failure(EXIT_JOB_FAILED, f"node {rank} ({host}) could not be "
                                              f"started: {argv[0]}: {e}", node=rank, at=time.time()))
                break
            try:
                proc.stdin.write((token + "\n").encode())
                proc.stdin.close()
            except OSError:
                pass
            procs.append(proc)
            tails.append([])
            for src, dst, tail in ((proc.stdout, out, None), (proc.stderr, err, tails[-1])):
                t = threading.Thread(target=pump, args=(src, dst, tail), daemon=True)
                t.start()
                threads.append(t)
        reported: set[int] = set()
        interrupted = False
        while not server.done.is_set():
            if controls.signals and not interrupted:
                interrupted = True
                sig = controls.signals[0]
                server.inject_failure(Failure(128 + sig, f"the -H launcher got "
                                              f"{signal.Signals(sig).name}", at=time.time(),
                                              cause=CAUSE_INTERRUPTED))
            for rank, proc in enumerate(procs):
                code = proc.poll()
                if code is not None and rank not in reported:
                    reported.add(rank)
                    if code != 0:
                        tail = "; ".join(tails[rank][-3:]) or "no output"
                        server.inject_failure(Failure(
                            EXIT_JOB_FAILED, f"node {rank} ({hosts[rank][0]}): its launcher "
                            f"({'ssh' if not is_local_host(hosts[rank][0]) else 'local'}) exited "
                            f"with status {code} ({tail})", node=rank, at=time.time()))
            time.sleep(0.05)
        deadline = time.monotonic() + grace + node_timeout + 10.0
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        for t in threads:
            t.join(1.0)
        verdict = server.verdict or {"status": EXIT_JOB_FAILED}
        return int(verdict.get("status", EXIT_JOB_FAILED))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.close()
