"""The command line of ``prophetrun`` / ``python -m prophet_tf.launch``, and :func:`launch`."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Mapping, Optional, Sequence, TextIO

from prophet_tf.cluster import JOB_SEED_ENV, TOKEN_ENV
from prophet_tf.launch import hosts as hosts_mod
from prophet_tf.launch import standby as standby_mod
from prophet_tf.launch.elastic import (DEFAULT_JOIN_WAIT_S, DEFAULT_REJOIN_WAIT_S,
                                       checkpoint_wait, parse_nnodes)
from prophet_tf.launch.node import run_node
from prophet_tf.launch.rendezvous import RendezvousError, parse_master, worker_token
from prophet_tf.launch.restarts import RestartPolicy
from prophet_tf.launch.workers import (EXIT_TIMEOUT, Controls, JobSpec, Placement, draw_job_seed,
                                       format_address, free_ports, run_workers, with_job_seed)
from prophet_tf.preemption import CHECKPOINT_DIR_ENV, EXIT_PREEMPTED

__all__ = ["launch", "main", "parser"]

_PROG = "prophetrun"


@contextlib.contextmanager
def _forwarding_signals(controls: Controls, enabled: bool = True) -> Iterator[None]:
    """Records SIGINT/SIGTERM in ``controls.signals`` (the attempt forwards them to the workers)
    instead of letting them end the launcher."""
    old: dict[int, object] = {}
    if enabled and threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, lambda signum, _frame: controls.signals.append(signum))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)  # type: ignore[arg-type]


def _sayer(err: TextIO, label: str = "launch") -> Callable[[str], None]:
    lock = threading.Lock()

    def say(msg: str) -> None:
        with lock:
            with contextlib.suppress(OSError, ValueError):
                err.write(f"[{label}] {msg}\n")
                err.flush()
    return say


def launch(script_argv: Sequence[str], n: int, *, host: str = "127.0.0.1",
           hosts: Optional[Sequence[str]] = None, base_port: Optional[int] = None,
           timeout: Optional[float] = None, env: Optional[Mapping[str, str]] = None,
           threads: Optional[int] = None, grace: float = 5.0,
           wrap_argv: Optional[Callable[[int, list[str]], list[str]]] = None,
           stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
           token: Optional[str] = None, handle_signals: bool = True,
           log_dir: Optional[str] = None, max_restarts: int = 0, restart_backoff: float = 0.0,
           checkpoint_dir: Optional[str] = None) -> int:
    """Runs ``script_argv`` as ``n`` workers on this machine; returns the launcher's exit status.

    Args:
      script_argv: ``["script.py", *args]``, ``["-m", "module", *args]`` or any command.
      n: number of workers (>= 1).
      host: address every worker listens on (all workers on this machine).
      hosts: one address per rank instead of ``host`` (e.g. ``EmulatedCluster.host_address(i)``).
      base_port: worker i listens on ``base_port + i``; default: free ports found by binding to
        port 0 (released just before the workers start), new ones for every attempt.
      timeout: seconds after which every worker is killed and 124 is returned (the whole job,
        restarts included); None = no limit.
      env: extra environment for every worker (wins over everything else).
      threads: sets ``TF_NUM_INTRAOP_THREADS`` and ``TF_NUM_INTEROP_THREADS`` for every worker.
      grace: seconds between SIGTERM (or the forwarded signal) and SIGKILL when stopping workers;
        a forwarded preemption signal (SIGTERM) gives them their preemption grace period on top.
      wrap_argv: ``f(rank, argv) -> argv`` applied to each worker's command line, e.g.
        ``EmulatedCluster.exec_argv`` to start worker i inside network namespace i.
      stdout, stderr: where prefixed output goes (default: ``sys.stdout``/``sys.stderr`` at call
        time).
      token: the job token (default: a fresh random one); restarted attempts get one derived
        from it.
      handle_signals: forward SIGINT/SIGTERM to the workers (main thread only).
      log_dir: also write rank i's output to ``LOG_DIR/rank.i.log``.
      max_restarts: restart every worker up to this many times after a worker ended the attempt
        (a preemption or a failure; see ``prophet_tf.launch.restarts``).
      restart_backoff: seconds between an ended attempt and the next one.
      checkpoint_dir: ``$PROPHET_CHECKPOINT_DIR`` of the workers: where a ``fit`` without
        ``BackupAndRestore`` keeps its preemption checkpoint.

    Returns:
      0 when all workers exit 0; the first failing worker's status (128+signal if killed by a
      signal) otherwise; 124 on timeout; 75 when the launcher got SIGTERM and every worker wrote
      its preemption checkpoint, else 128+signal if the launcher got SIGINT/SIGTERM.
    """
    if n < 1:
        raise ValueError(f"need at least one worker, got n={n}")
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    if not list(script_argv):
        raise ValueError("no script given: prophetrun -n N [--] script.py [args]")
    policy = RestartPolicy(max_restarts, restart_backoff)
    job_env = dict(env or {})
    if checkpoint_dir:
        job_env[CHECKPOINT_DIR_ENV] = os.path.abspath(checkpoint_dir)
    job_env, drawn_seed = with_job_seed(job_env, draw_job_seed())
    spec = JobSpec(list(script_argv), job_env, threads, grace, log_dir, wrap_argv)
    say = _sayer(err)
    controls = Controls(deadline=None if timeout is None else time.monotonic() + timeout)
    with _forwarding_signals(controls, handle_signals):
        while True:
            placement = Placement(_local_addresses(n, host, hosts, base_port), list(range(n)),
                                  _attempt_token(token, policy.restarts))
            header = None
            if policy.restarts:
                header = (f"[launch] attempt {policy.attempt} (restart {policy.restarts} of at "
                          f"most {policy.max_restarts})")
            outcome = run_workers(spec, placement, controls, stdout=out, stderr=err, say=say,
                                  log_header=header)
            if outcome.ok:
                return 0
            failure = outcome.failure
            decision = policy.decide([failure] if failure is not None else [])
            if failure is not None and failure.rank is not None and not (
                    decision.restart and failure.preempted):
                say(failure.report("; stopped the other workers"))
            if decision.message:
                say(decision.message)
            if not decision.restart:
                if outcome.status == EXIT_PREEMPTED and drawn_seed is not None:
                    say(f"the job was preempted: run it again to resume it from its checkpoint, "
                        f"with {JOB_SEED_ENV}={drawn_seed} (this job's seed: an input without a "
                        "seed of its own then repeats its order)")
                return outcome.status
            paused = _pause(policy.backoff_s, controls)
            if paused is not None:
                return paused


def _attempt_token(token: Optional[str], restarts: int) -> str:
    """The workers' token of an attempt: the given one first, then one derived from it (a
    worker of an earlier attempt cannot join a later one); random without one."""
    if token is None:
        return secrets.token_hex(16)
    return token if restarts == 0 else worker_token(token, f"attempt {restarts}")


def _pause(seconds: float, controls: Controls) -> Optional[int]:
    """Waits ``seconds`` between attempts; the exit status when the launcher got a signal or the
    job's deadline passed meanwhile, else None."""
    end = time.monotonic() + seconds
    while True:
        if controls.signals:
            return 128 + controls.signals[0]
        now = time.monotonic()
        if controls.deadline is not None and now >= controls.deadline:
            return EXIT_TIMEOUT
        if now >= end:
            return None
        time.sleep(min(0.05, end - now))


def _local_addresses(n: int, host: str, hosts: Optional[Sequence[str]],
                     base_port: Optional[int]) -> list[str]:
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
    return [format_address(h, p) for h, p in zip(host_list, ports)]


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def parser() -> argparse.ArgumentParser:
    """The flags of ``prophetrun`` (``python -m prophet_tf.launch`` is the same program)."""
    p = argparse.ArgumentParser(
        prog=_PROG,
        description="Start prophet_tf workers: N on this machine, or a job of several nodes "
                    "(--nnodes/--node-rank/--master on every node, or -H over ssh). TF_CONFIG, a "
                    "job token, [rank i] output prefixes, one GPU per worker, stop-all on failure.",
        usage="%(prog)s -n N [options] [--] script.py [args]")
    p.add_argument("-n", "-np", "--np", "--num-workers", "--nproc-per-node", dest="n", type=int,
                   default=None, help="number of worker processes on this node (-np as in "
                   "horovodrun; with -H: the total, filling the hosts' slots in order)")
    p.add_argument("--host", default=None,
                   help="address this node's workers listen on and are reached at (default: "
                        "127.0.0.1 on one machine; this machine's address towards the master "
                        "with --nnodes)")
    p.add_argument("--base-port", type=int, default=None,
                   help="worker i of this node listens on BASE_PORT+i (default: free ports)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="kill all workers and exit 124 after this many seconds")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable for every worker (repeatable)")
    p.add_argument("--threads", type=int, default=None, metavar="K",
                   help="TF_NUM_INTRAOP_THREADS and TF_NUM_INTEROP_THREADS for every worker")
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                   help="time between forwarding SIGTERM/SIGINT and SIGKILL when stopping workers "
                        "(default 5)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="also write each rank's output to DIR/rank.<rank>.log (appended)")
    r = p.add_argument_group("restarts")
    r.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="after a worker ends an attempt (a preemption, exit status 75, or a "
                        "failure), restart every worker, up to N times; the program resumes from "
                        "its checkpoint. Not after the same failure at the same place twice, a "
                        "--timeout, or a signal to the launcher (default 0; with several nodes "
                        "node 0's, or the -H launcher's, counts)")
    r.add_argument("--restart-backoff", type=float, default=0.0, metavar="SECONDS",
                   help="pause between an ended attempt and the next (default 0)")
    r.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="PROPHET_CHECKPOINT_DIR of the workers: where a model.fit without "
                        "BackupAndRestore keeps its preemption checkpoint (shared storage with "
                        "several nodes)")
    m = p.add_argument_group("several nodes")
    m.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="number of nodes (default 1); MIN:MAX: an elastic job, which starts with "
                        "MIN to MAX nodes and forms again from its last checkpoint when a node is "
                        "lost or arrives (see 'elastic jobs')")
    m.add_argument("--node-rank", type=int, default=None,
                   help="this node's rank, 0..nnodes-1 (node 0 runs the master); in an elastic "
                        "job any number >= 0, unique, or none: the master assigns one")
    m.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="where node 0's launcher listens for the other nodes (node 0 listens on "
                        "it; give every node the same)")
    m.add_argument("--rdzv-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long to wait for the master and every node (default 300)")
    m.add_argument("--node-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a node (or the master) not heard from for this long is lost (default 10)")
    m.add_argument("--token-stdin", action="store_true",
                   help="read the job's shared secret from the first line of standard input "
                        "instead of PROPHET_JOB_TOKEN (what -H does over ssh)")
    m.add_argument("--join-only", action="store_true",
                   help="do not run the master on node 0: it runs elsewhere (what -H does)")
    m.add_argument("-H", "--hosts", default=None, metavar="HOST:K,...",
                   help="start a node on each host (ssh, local hosts directly) with K workers, "
                        "this launcher being the master (like horovodrun -H)")
    m.add_argument("--ssh-command", default=hosts_mod.DEFAULT_SSH, metavar="CMD",
                   help=f"ssh client and options for -H (default: {hosts_mod.DEFAULT_SSH!r})")
    e = p.add_argument_group("elastic jobs (--nnodes MIN:MAX; the master's settings: node 0's "
                             "or the -H launcher's)")
    e.add_argument("--join-wait", type=float, default=DEFAULT_JOIN_WAIT_S, metavar="SECONDS",
                   help="once MIN nodes joined, wait this long for more before the job starts "
                        f"(at once with MAX; default {DEFAULT_JOIN_WAIT_S:g})")
    e.add_argument("--rejoin-wait", type=float, default=DEFAULT_REJOIN_WAIT_S, metavar="SECONDS",
                   help="after the job lost or was left by a node (killed, cut off, preempted), "
                        "wait this long for a node to take its place before it goes on with "
                        f"fewer (default {DEFAULT_REJOIN_WAIT_S:g}); below MIN it waits "
                        "--rdzv-timeout, then exits with 69")
    e.add_argument("--host-retry", type=float, default=hosts_mod.DEFAULT_HOST_RETRY_S,
                   metavar="SECONDS",
                   help="-H: start a node again on a host whose node ended this long ago (0: "
                        f"never; default {hosts_mod.DEFAULT_HOST_RETRY_S:g})")
    e.add_argument("--preload", default=",".join(standby_mod.DEFAULT_PRELOAD), metavar="MODULES",
                   help="each node keeps one interpreter per worker started ahead, with these "
                        "modules imported, and the next attempt's workers run in them: a job that "
                        "forms again skips starting Python and TensorFlow (comma-separated; 'none': "
                        f"no standbys; default {','.join(standby_mod.DEFAULT_PRELOAD)})")
    p.add_argument("script", nargs=argparse.REMAINDER,
                   help="script.py [args], -m module [args], or a command")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point of ``prophetrun``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    if "--" in argv:
        cut = argv.index("--")
        opts, script = argv[:cut], argv[cut + 1:]
        args = p.parse_args(opts)
        if args.script:
            p.error(f"unexpected arguments before '--': {args.script}")
    else:
        args = p.parse_args(argv)
        script = args.script
    if not script:
        p.error("no script given")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    try:
        env = _parse_env(args.env)
        policy = RestartPolicy(args.max_restarts, args.restart_backoff)
        nnodes = parse_nnodes(args.nnodes)
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(str(e))
    if args.checkpoint_dir:
        env[CHECKPOINT_DIR_ENV] = os.path.abspath(args.checkpoint_dir)
    try:
        preload = standby_mod.parse_preload(args.preload)
    except ValueError as e:
        p.error(str(e))
    spec = JobSpec(list(script), env, args.threads, args.grace, args.log_dir, preload=preload)
    controls = Controls(deadline=None if args.timeout is None else time.monotonic() + args.timeout)

    if args.hosts is not None:
        if (nnodes.max != 1 and not nnodes.elastic) or args.node_rank is not None:
            p.error("-H starts every node itself: leave out --node-rank, and --nnodes unless it "
                    "is MIN:MAX (an elastic job of those hosts)")
        if nnodes.elastic and args.n is not None:
            p.error("an elastic -H job (--nnodes MIN:MAX) runs every host's slots: give the "
                    "workers of each host in -H (HOST:K) and leave out -n")
        try:
            hosts = hosts_mod.assign_slots(hosts_mod.parse_hosts(args.hosts), args.n)
        except ValueError as e:
            p.error(str(e))
        forwarded = _forwarded_flags(args)
        say = _sayer(sys.stderr)
        with _forwarding_signals(controls):
            return hosts_mod.run_hosts(script, hosts, controls, forwarded=forwarded,
                                       ssh_command=args.ssh_command, master=args.master,
                                       rdzv_timeout=args.rdzv_timeout,
                                       node_timeout=args.node_timeout, grace=args.grace, say=say,
                                       policy=policy, nodes=nnodes if nnodes.elastic else None,
                                       join_wait=args.join_wait, rejoin_wait=args.rejoin_wait,
                                       checkpoint_wait=checkpoint_wait(spec, args.node_timeout),
                                       host_retry=args.host_retry)
    if args.n is None:
        p.error("-n N is required (the number of workers on this node)")
    if args.n < 1:
        p.error("-n must be at least 1")
    if nnodes.elastic or nnodes.max > 1 or args.master is not None or args.node_rank is not None:
        if nnodes.elastic:
            if args.master is None:
                p.error("an elastic job (--nnodes MIN:MAX) needs --master HOST:PORT on every node "
                        "(node 0 runs it: --node-rank 0 there), or -H")
            if args.node_rank is not None and args.node_rank < 0:
                p.error("--node-rank must be >= 0")
        else:
            if args.master is None or args.node_rank is None:
                p.error("a job of several nodes needs --master HOST:PORT and --node-rank R on every "
                        "node (the same --master and --nnodes everywhere)")
            if not 0 <= args.node_rank < nnodes.max:
                p.error(f"--node-rank {args.node_rank} is outside 0..{nnodes.max - 1}")
        try:
            parse_master(args.master)
        except RendezvousError as e:
            p.error(str(e))
        token = sys.stdin.readline().strip() if args.token_stdin else os.environ.get(TOKEN_ENV, "")
        if not token:
            p.error("a job of several nodes needs the same secret on every node: run `export "
                    "PROPHET_JOB_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(16))')` "
                    "once and set that value on every node (-H does this for you over ssh)")
        say = _sayer(sys.stderr, "launch node" + (f" {args.node_rank}" if args.node_rank is not None else ""))
        with _forwarding_signals(controls):
            try:
                return run_node(spec, controls, master=args.master, nnodes=nnodes,
                                node_rank=args.node_rank, nproc=args.n, token=token,
                                host=args.host, base_port=args.base_port,
                                rdzv_timeout=args.rdzv_timeout, node_timeout=args.node_timeout,
                                run_master=args.node_rank == 0 and not args.join_only, say=say,
                                policy=policy, join_wait=args.join_wait,
                                rejoin_wait=args.rejoin_wait)
            except RendezvousError as e:
                say(str(e))
                return 2
    return launch(script, args.n, host=args.host or "127.0.0.1", base_port=args.base_port,
                  timeout=args.timeout, env=env, threads=args.threads, grace=args.grace,
                  log_dir=args.log_dir, max_restarts=args.max_restarts,
                  restart_backoff=args.restart_backoff)


def _forwarded_flags(args: argparse.Namespace) -> list[str]:
    """The flags of this command line that every node of a -H job gets as well."""
    out: list[str] = []
    for flag, value in (("--threads", args.threads), ("--timeout", args.timeout),
                        ("--grace", args.grace), ("--log-dir", args.log_dir),
                        ("--checkpoint-dir", args.checkpoint_dir),
                        ("--base-port", args.base_port),
                        ("--rdzv-timeout", args.rdzv_timeout),
                        ("--node-timeout", args.node_timeout),
                        ("--preload", args.preload)):
        if value is not None:
            out += [flag, str(value)]
    for item in args.env:
        out += ["--env", item]
    return out
