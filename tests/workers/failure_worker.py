"""Worker for the failure tests: a peer that dies or stalls must not hang the others.

argv: scenario (`die` | `stall`), timeout_s. Prints "ERROR_AFTER <seconds> <type>: <message>" on
the surviving ranks.
"""

import os
import signal
import sys
import time

import tensorflow as tf

from prophet_tf import cluster, ops, runtime


def main() -> None:
    scenario, timeout_s = sys.argv[1], float(sys.argv[2])
    info = cluster.resolve_cluster()
    runtime.init(info.rank, info.world_size, info.addresses, info.token, timeout_s=timeout_s)
    ops.push_pull(tf.ones([1000]), name="warmup")
    print("WARMED UP", flush=True)
    if info.rank == 1:
        if scenario == "die":
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no shutdown, no goodbye
        time.sleep(3600)  # stall: alive but never reaches the next operation
    start = time.monotonic()
    try:
        for step in range(1000):
            ops.push_pull(tf.ones([1 << 18]), name="train/grad")
            time.sleep(0.01)
    except tf.errors.OpError as e:
        print(f"ERROR_AFTER {time.monotonic() - start:.2f} {type(e).__name__}: {e.message}", flush=True)
        sys.exit(3)
    print("NO ERROR", flush=True)


if __name__ == "__main__":
    main()
