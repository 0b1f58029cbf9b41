"""Runtime start-up errors: each names the problem and the fix (in-process, no peers needed)."""

from __future__ import annotations

import socket
import subprocess
import textwrap
from pathlib import Path

from conftest import _worker_env, worker_python

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    # A process per case (forked from a zygote: tests/zygote.py): the runtime is process-wide.
    return subprocess.run([worker_python(), "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=_worker_env())


def test_port_in_use_is_reported_with_the_port_and_a_fix() -> None:
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        proc = run_python(f"""
            from prophet_tf import runtime
            try:
                runtime.init(0, 2, ["127.0.0.1:{port}", "127.0.0.1:1"], "t", connect_timeout_s=2)
            except runtime.RuntimeInitError as e:
                print("ERROR:", e)
        """)
    finally:
        holder.close()
    assert f"port {port}" in proc.stdout and "already in use" in proc.stdout, proc.stdout + proc.stderr
    assert "choose another port" in proc.stdout


def test_unreachable_peer_fails_within_the_connect_timeout() -> None:
    proc = run_python("""
        import time
        from prophet_tf import runtime
        from prophet_tf._library import c_api
        from prophet_tf.launch import free_ports
        c_api()  # load TensorFlow and the op library first: the bound is on the start-up alone
        a, b = free_ports(2)
        runtime.c_api()  # load the library (and TensorFlow) first: on a loaded machine that alone takes seconds
        start = time.monotonic()
        try:
            runtime.init(1, 2, [f"127.0.0.1:{a}", f"127.0.0.1:{b}"], "t", connect_timeout_s=1.5)
        except runtime.RuntimeInitError as e:
            print(f"ERROR after {time.monotonic() - start:.1f}s:", e)
    """)
    assert "ERROR after" in proc.stdout, proc.stdout + proc.stderr
    elapsed = float(proc.stdout.split("ERROR after ")[1].split("s:")[0])
    assert elapsed < 30, proc.stdout  # 1.5 s asked for; the default connect timeout is 60 s
    assert "could not connect to rank 0" in proc.stdout and "is that worker started" in proc.stdout


def test_ops_before_init_say_how_to_initialise() -> None:
    proc = run_python("""
        import tensorflow as tf
        from prophet_tf import ops
        try:
            ops.push_pull(tf.ones([2]), name="x")
        except tf.errors.FailedPreconditionError as e:
            print("ERROR:", e.message)
    """)
    assert "not initialised" in proc.stdout and "ProphetStrategy" in proc.stdout, proc.stdout + proc.stderr


def test_invalid_arguments_are_rejected_before_anything_starts() -> None:
    proc = run_python("""
        from prophet_tf import runtime
        for kwargs in (dict(schedule="lifo"), dict(rank=3), dict(addresses=["127.0.0.1:1"])):
            args = dict(rank=0, world_size=2, addresses=["127.0.0.1:1", "127.0.0.1:2"])
            args.update(kwargs)
            try:
                runtime.init(**args)
            except ValueError as e:
                print("ERROR:", e)
        runtime.init(0, 1, schedule="priority")
        runtime.init(0, 1, schedule="priority")  # the same settings again: nothing happens
        try:
            runtime.init(0, 1, schedule="fifo")
        except runtime.RuntimeInitError as e:
            print("ERROR:", e)
    """)
    out = proc.stdout
    assert "schedule must be one of" in out and "rank 3 is outside" in out and "1 addresses given for 2" in out, out
    assert "already running with different settings" in out and "schedule: 'priority' -> 'fifo'" in out, \
        out + proc.stderr


def test_single_worker_needs_no_network() -> None:
    proc = run_python("""
        import tensorflow as tf
        from prophet_tf import ops, runtime
        runtime.init(0, 1)
        print("SUM", ops.push_pull(tf.constant([1.0, 2.0]), name="x").numpy().tolist())
        print("GATHER", ops.allgather(tf.constant([[1]]), name="g").numpy().tolist())
    """)
    assert "SUM [1.0, 2.0]" in proc.stdout and "GATHER [[1]]" in proc.stdout, proc.stdout + proc.stderr


def test_published_schedulers_are_accepted_by_name() -> None:
    """bytescheduler and p3 reach the engine from ProphetStrategy and from runtime.init; the
    training itself is covered on 4 workers by tests/test_stall_matrix.py."""
    proc = run_python("""
        import tensorflow as tf
        from prophet_tf import ops, runtime
        from prophet_tf.strategy import ProphetStrategy
        traits = runtime.schedule_traits()
        for name in ("bytescheduler", "p3"):
            strategy = ProphetStrategy(schedule=name)
            print("STATE", name, strategy.schedule, runtime.scheduler_state()["schedule"],
                  traits[name]["partition_bytes"], traits[name]["automatic_fusion"])
            print("SUM", name, ops.push_pull(tf.constant([1.0, 2.0]), name="x" + name).numpy().tolist())
            runtime.shutdown()
    """)
    out = proc.stdout
    assert "STATE bytescheduler bytescheduler bytescheduler 4000000 False" in out, out + proc.stderr
    assert "STATE p3 p3 p3 160000 False" in out, out + proc.stderr
    assert "SUM bytescheduler [1.0, 2.0]" in out and "SUM p3 [1.0, 2.0]" in out, out + proc.stderr
