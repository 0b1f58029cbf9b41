"""Worker for the failure tests: a peer that dies, stalls or is stopped must not hang the others.

argv: scenario (`die` | `stall` | `stop`), timeout_s, heartbeat_s. Rank 1 fails that way after a
warm-up; rank 0 then runs its steps eagerly and rank 2 inside a tf.function (errors must keep their
class through a graph). The survivors print "ERROR_AFTER <seconds> <type>: <message>".
"""

import os
import signal
import sys
import time

import tensorflow as tf

from prophet_tf import cluster, ops, runtime


@tf.function
def step_in_graph(x):
    return ops.push_pull(x, name="train/grad")


def main() -> None:
    scenario, timeout_s, heartbeat_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    info = cluster.resolve_cluster()
    liveness = {"heartbeat_s": heartbeat_s} if heartbeat_s > 0 else {}
    runtime.init(info.rank, info.world_size, info.addresses, info.token, timeout_s=timeout_s, **liveness)
    # The warm-up runs the very step (the tf.function traced and run once), so that after it every
    # survivor submits its next operation at once. On a loaded machine a worker may reach a warm-up
    # round after the others' timeout_s: then that round fails on every worker alike (the same
    # verdict), and all of them retry the next round together.
    step = step_in_graph if info.rank == 2 else (lambda x: ops.push_pull(x, name="train/grad"))
    while True:
        try:
            step(tf.ones([1 << 18])).numpy()
            break
        except tf.errors.DeadlineExceededError:
            continue
    print("WARMED UP", flush=True)
    if info.rank == 1:
        if scenario == "die":
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no shutdown, no goodbye
        if scenario == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: the runtime's thread stops too
        time.sleep(3600)  # stall: alive (the runtime answers) but never reaches the next operation
    start = time.monotonic()
    try:
        for _ in range(1000):
            step(tf.ones([1 << 18])).numpy()
            time.sleep(0.01)
    except tf.errors.OpError as e:
        print(f"ERROR_AFTER {time.monotonic() - start:.2f} {type(e).__name__}: {e.message}", flush=True)
        sys.exit(3)
    print("NO ERROR", flush=True)


if __name__ == "__main__":
    main()
