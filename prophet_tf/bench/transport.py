"""push_pull throughput and latency next to raw TCP between the same two processes.

    python -m prophet_tf.bench.transport [--quick] [--sizes 4KiB,64MiB] [--iters N]
        [--compression fp16,bf16]
    python -m prophet_tf.bench.transport --check     # before an engine change lands

``--check`` measures push_pull uncompressed at 4, 16, 64 and 256 MiB (``--sizes`` overrides) and
exits with status 1 when any size runs below ``CHECK_MIN_RATIO`` of raw TCP's throughput or above
``CHECK_MAX_CPU_RATIO`` times its CPU per byte (the transport's goals), naming the sizes: the
pre-landing check of docs/development.md. It is a measurement, so it needs a quiet machine: on a
loaded one every ratio moves (the table prints the load average before and after).

Starts 2 workers on loopback. For each tensor size, each worker measures alternately
  * ``push_pull``: the eager op on a float32 tensor of that size (summation, partitioning,
    scheduling, TensorFlow dispatch included),
  * ``push_pull+fp16``, ``push_pull+bf16`` (``--compression``, default both): the same with the
    tensor compressed to 16 bits on the wire, the casts (encode before a partition leaves,
    decode-and-add at the owner, decode of the result) included, and
  * ``raw_tcp``: a second, plain TCP connection between the same two processes that moves the
    same bytes in the same pattern: each worker sends and receives as many bytes as push_pull
    sends and receives (2(N-1)/N of the tensor, i.e. the whole tensor for N = 2), both directions
    at once, no scheduling, no summation. It uses fixed socket options (TCP_NODELAY, 4 MiB
    buffers, no limit on unsent data) and sends straight from, and receives
    straight into, numpy buffers from two threads, so it is close to what the kernel can do.
    ``--runtime_options`` passes options to push_pull's runtime (e.g. those socket options).
The table gives median time per operation, throughput (tensor bytes / time), the ratio
raw_tcp time / push_pull time (1.0 = as fast as raw TCP), and the CPU both processes spent per
operation (process CPU time of every thread, median over iterations on each rank, summed over
the two ranks), per tensor byte, with the ratio push_pull / raw_tcp (1.0 = no more CPU than raw
TCP). Medians, like the times: the first calls of a new size also pay for TensorFlow's allocator
growing its pool for the output tensors, which is not what a step costs.
The last lines are the worst sizes of at least 4 MiB: the smallest throughput ratio and the
largest CPU-per-byte ratio of push_pull, and per compression the CPU the casts cost: compressed
minus uncompressed push_pull CPU per tensor byte (both ranks; net of the fewer bytes the kernel
copies).
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from absl import app, flags

FLAGS = flags.FLAGS
_UNITS = {"B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
DEFAULT_SIZES = ["4KiB", "64KiB", "1MiB", "4MiB", "16MiB", "64MiB", "256MiB"]
QUICK_SIZES = ["4KiB", "1MiB", "4MiB", "16MiB", "64MiB"]
SOCKET_BUFFER = 4 << 20
CHECK_SIZES = ["4MiB", "16MiB", "64MiB", "256MiB"]
#: The transport's goals, at every size of CHECK_SIZES: push_pull at least this fraction of raw
#: TCP's throughput ...
CHECK_MIN_RATIO = 0.9
#: ... and at most this many times raw TCP's CPU per byte (both processes, every thread).
CHECK_MAX_CPU_RATIO = 1.15


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"bad size {text!r}: expected e.g. 4KiB, 16MiB, 1GiB")
    return int(match.group(1)) * _UNITS[(match.group(2) or "B").upper()]


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    return str(nbytes)


def default_iters(nbytes: int, quick: bool) -> int:
    budget = (48 if quick else 256) << 20  # bytes moved per size and system
    # At least 10 (30) iterations: a median of 3 CPU times moved the CPU ratio by 30% between
    # runs on a busy machine.
    return max(10 if quick else 30, min(200 if not quick else 50, budget // max(nbytes, 1)))


# ------------------------------------------------------------------------------------------------
# Worker side


def system_name(compression: Optional[str]) -> str:
    return "push_pull" if compression is None else f"push_pull+{compression}"


def _raw_connection(rank: int, ops, tf) -> socket.socket:
    """A plain TCP connection between rank 0 and rank 1, next to the runtime's own."""
    if rank == 0:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        ops.broadcast(tf.constant([port], tf.int64), name="bench/raw_port", root_rank=0)
        conn, _ = listener.accept()
        listener.close()
    else:
        port = int(ops.broadcast(tf.constant([0], tf.int64), name="bench/raw_port", root_rank=0).numpy()[0])
        conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    return conn


def _raw_exchange(conn: socket.socket, send_buf, recv_buf) -> None:
    """Sends all of send_buf while receiving all of recv_buf (both directions at once)."""
    sender = threading.Thread(target=conn.sendall, args=(send_buf,))
    sender.start()
    view = memoryview(recv_buf).cast("B")
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("raw TCP peer closed the connection")
        got += n
    sender.join()


def _cpu_seconds() -> float:
    """CPU time of this process, all threads (the engine's included), in seconds."""
    return time.process_time()


def run_worker(config: dict) -> None:
    import numpy as np
    import tensorflow as tf

    from prophet_tf import cluster, ops, runtime

    info = cluster.resolve_cluster()
    runtime.init(info.rank, info.world_size, info.addresses, info.token, schedule=config["schedule"],
                 **config["runtime_options"])
    n = info.world_size
    conn = _raw_connection(info.rank, ops, tf)
    barrier = tf.zeros([1])
    results = []
    for size_index, nbytes in enumerate(config["sizes"]):
        elems = max(1, nbytes // 4)
        tensor = tf.fill([elems], float(info.rank + 1))
        wire = np.ones(elems * 4 * (n - 1) * 2 // n, dtype=np.uint8)
        inbox = np.empty_like(wire)
        iters = config["iters"] or default_iters(nbytes, config["quick"])
        compressions = [None] + config["compression"]
        systems = [system_name(c) for c in compressions] + ["raw_tcp"]
        times = {s: [] for s in systems}
        cpu = {s: [] for s in systems}
        expected = float(n * (n + 1) / 2)  # exact in fp16 and bf16 too
        for it in range(iters + 1):  # iteration 0 warms every system up
            for compression in compressions:
                system = system_name(compression)
                ops.push_pull(barrier, name="bench/barrier")
                start, cpu_start = time.perf_counter(), _cpu_seconds()
                out = ops.push_pull(tensor, name=f"bench/{size_index}/{system}", compression=compression)
                elapsed = time.perf_counter() - start
                if it == 0 and float(out[-1]) != expected:
                    raise AssertionError(f"{system} returned {float(out[-1])}, expected {expected}")
                if it:
                    cpu[system].append(_cpu_seconds() - cpu_start)
                    times[system].append(elapsed)
            ops.push_pull(barrier, name="bench/barrier")
            start, cpu_start = time.perf_counter(), _cpu_seconds()
            _raw_exchange(conn, wire, inbox)
            elapsed = time.perf_counter() - start
            if it:
                cpu["raw_tcp"].append(_cpu_seconds() - cpu_start)
            if it:
                times["raw_tcp"].append(elapsed)
        # Both ranks measured; report the slower rank's median (an operation ends for the job
        # when it ends everywhere), and the CPU of both ranks together.
        measured = tf.constant([statistics.median(times[s]) for s in systems] +
                               [statistics.median(cpu[s]) for s in systems], tf.float64)
        gathered = ops.allgather(tf.reshape(measured, [1, -1]), name=f"bench/medians/{size_index}").numpy()
        k = len(systems)
        seconds = {s: float(gathered[:, i].max()) for i, s in enumerate(systems)}
        cpu_seconds = {s: float(gathered[:, k + i].sum()) for i, s in enumerate(systems)}
        row = {"bytes": nbytes, "iters": iters, "push_pull_s": seconds["push_pull"], "raw_tcp_s": seconds["raw_tcp"],
               "ratio": seconds["raw_tcp"] / seconds["push_pull"],
               "push_pull_cpu_s": cpu_seconds["push_pull"], "raw_tcp_cpu_s": cpu_seconds["raw_tcp"],
               "cpu_ratio": cpu_seconds["push_pull"] / cpu_seconds["raw_tcp"],
               "compressed": {c: {"s": seconds[system_name(c)], "cpu_s": cpu_seconds[system_name(c)]}
                              for c in config["compression"]}}
        results.append(row)
        if info.rank == 0:
            print("RESULT " + json.dumps(row), flush=True)
    conn.close()
    runtime.shutdown()


# ------------------------------------------------------------------------------------------------
# Driver


def format_table(rows: Sequence[dict]) -> str:
    lines = ["| size | iters | push_pull median | push_pull GB/s | raw TCP median | raw TCP GB/s | push_pull/raw_tcp "
             "| CPU per op (both ranks): push_pull / raw TCP | CPU ns per byte: push_pull / raw TCP "
             "| CPU per byte push_pull/raw_tcp |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {human(r['bytes'])} | {r['iters']} | {r['push_pull_s'] * 1e3:.3f} ms | "
            f"{r['bytes'] / r['push_pull_s'] / 1e9:.2f} | {r['raw_tcp_s'] * 1e3:.3f} ms | "
            f"{r['bytes'] / r['raw_tcp_s'] / 1e9:.2f} | {r['ratio']:.2f} | "
            f"{r['push_pull_cpu_s'] * 1e3:.2f} ms / {r['raw_tcp_cpu_s'] * 1e3:.2f} ms | "
            f"{r['push_pull_cpu_s'] * 1e9 / r['bytes']:.3f} / {r['raw_tcp_cpu_s'] * 1e9 / r['bytes']:.3f} | "
            f"{r['cpu_ratio']:.2f} |")
    return "\n".join(lines)


def format_compressed_table(rows: Sequence[dict]) -> str:
    """Compressed push_pull beside uncompressed: time, GB/s of the tensor, and the CPU the casts
    add per tensor byte (compressed minus uncompressed, both ranks)."""
    lines = ["| size | system | median | tensor GB/s | uncompressed/compressed time | CPU ns per tensor byte "
             "| casts: CPU ns per tensor byte |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for compression, c in r["compressed"].items():
            lines.append(
                f"| {human(r['bytes'])} | push_pull+{compression} | {c['s'] * 1e3:.3f} ms | "
                f"{r['bytes'] / c['s'] / 1e9:.2f} | {r['push_pull_s'] / c['s']:.2f} | "
                f"{c['cpu_s'] * 1e9 / r['bytes']:.3f} | {(c['cpu_s'] - r['push_pull_cpu_s']) * 1e9 / r['bytes']:.3f} |")
    return "\n".join(lines)


def check_failures(rows: Sequence[dict], min_ratio: float = CHECK_MIN_RATIO,
                   max_cpu_ratio: float = CHECK_MAX_CPU_RATIO) -> list[str]:
    """The goals ``rows`` miss, one line per size and goal (empty: every size meets both)."""
    failures = []
    for r in rows:
        if r["ratio"] < min_ratio:
            failures.append(f"{human(r['bytes'])}: push_pull at {r['ratio']:.2f} of raw TCP's throughput "
                            f"(goal >= {min_ratio:.2f})")
        if r["cpu_ratio"] > max_cpu_ratio:
            failures.append(f"{human(r['bytes'])}: push_pull at {r['cpu_ratio']:.2f}x raw TCP's CPU per byte "
                            f"(goal <= {max_cpu_ratio:.2f}x)")
    return failures


def main(argv: Sequence[str]) -> int:
    del argv
    if FLAGS.worker:
        run_worker(json.loads(FLAGS.worker))
        return 0
    default_sizes = CHECK_SIZES if FLAGS.check else QUICK_SIZES if FLAGS.quick else DEFAULT_SIZES
    sizes = [parse_size(s) for s in (FLAGS.sizes or default_sizes)]
    compressions = [] if FLAGS.check else [c for c in FLAGS.compression if c]
    load_before = os.getloadavg()
    for c in compressions:
        if c not in ("fp16", "bf16"):
            raise app.UsageError(f"--compression: {c!r} is not fp16 or bf16")
    config = {"sizes": sizes, "iters": FLAGS.iters, "quick": FLAGS.quick, "schedule": "priority",
              "runtime_options": json.loads(FLAGS.runtime_options), "compression": compressions}
    cmd = [sys.executable, "-m", "prophet_tf.launch", "-n", "2", "--threads", "1", "--timeout", "900", "--",
           "-m", "prophet_tf.bench.transport", "--worker", json.dumps(config)]
    print(f"push_pull vs raw TCP, 2 workers on loopback, sizes {', '.join(human(s) for s in sizes)}", flush=True)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rows, tail = [], []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        match = re.search(r"RESULT (\{.*\})", line)
        if match:
            row = json.loads(match.group(1))
            rows.append(row)
            compressed = "".join(f", +{c} {v['s'] * 1e3:.3f} ms" for c, v in row["compressed"].items())
            print(f"  {human(row['bytes']):>9}: push_pull {row['push_pull_s'] * 1e3:9.3f} ms, raw TCP "
                  f"{row['raw_tcp_s'] * 1e3:9.3f} ms, ratio {row['ratio']:.2f}, CPU per byte ratio "
                  f"{row['cpu_ratio']:.2f}{compressed}", flush=True)
    if proc.wait() != 0 or len(rows) != len(sizes):
        sys.stderr.write("".join(tail))
        print(f"benchmark failed (exit code {proc.returncode})", file=sys.stderr)
        return 1
    print()
    print(format_table(rows))
    if compressions:
        print()
        print(format_compressed_table(rows))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=1)
    large = [r for r in rows if r["bytes"] >= 4 << 20]
    if large:
        print(f"push_pull/raw_tcp (>= 4 MiB): {min(r['ratio'] for r in large):.2f}")
        print(f"push_pull/raw_tcp CPU per byte (>= 4 MiB): {max(r['cpu_ratio'] for r in large):.2f}")
        for c in compressions:
            casts = [(r["compressed"][c]["cpu_s"] - r["push_pull_cpu_s"]) / r["bytes"] * 1e9 for r in large]
            print(f"push_pull+{c}: casts' CPU per tensor byte (>= 4 MiB, both ranks): "
                  f"{statistics.median(casts):.3f} ns (median over sizes), "
                  f"uncompressed/compressed time {min(r['push_pull_s'] / r['compressed'][c]['s'] for r in large):.2f} "
                  f"(smallest)")
    else:
        print("push_pull/raw_tcp (>= 4 MiB): n/a (no size of at least 4 MiB was measured)")
        print("push_pull/raw_tcp CPU per byte (>= 4 MiB): n/a")
    if not FLAGS.check:
        return 0
    load_after = os.getloadavg()
    print(f"load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores")
    failures = check_failures(rows)
    for failure in failures:
        print(f"CHECK FAILED {failure}")
    if failures:
        return 1
    print(f"CHECK PASSED: push_pull >= {CHECK_MIN_RATIO:.2f} of raw TCP's throughput and <= "
          f"{CHECK_MAX_CPU_RATIO:.2f}x its CPU per byte at every size")
    return 0


def _define_flags() -> None:
    """The command's flags, defined when it runs (not on import: other modules defining the same
    names, e.g. bench.faults' --quick, can then share a process with this one)."""
    flags.DEFINE_bool("quick", False, "Fewer sizes and iterations (finishes within a minute).")
    flags.DEFINE_list("sizes", None, "Tensor sizes, e.g. 4KiB,1MiB,256MiB (default: 4 KiB to 256 MiB).")
    flags.DEFINE_integer("iters", None, "Timed iterations per size and system (default depends on size).")
    flags.DEFINE_string("worker", None, "Internal: run as a worker with this JSON configuration.")
    flags.DEFINE_string("json", None, "Also write the results to this JSON file.")
    flags.DEFINE_string("runtime_options", "{}", "JSON object of prophet_tf.runtime.init keyword "
                        "arguments for push_pull, e.g. '{\"socket_buffer_bytes\": 4194304, "
                        "\"socket_unsent_bytes\": 0}' (raw_tcp's socket options).")
    flags.DEFINE_list("compression", ["fp16", "bf16"],
                      "Compressed push_pull systems measured beside the others ('' for none).")
    flags.DEFINE_bool("check", False, "Measure the transport's goals (uncompressed push_pull at 4-256 MiB) and "
                      "exit with status 1 if push_pull is below CHECK_MIN_RATIO of raw TCP's throughput or above "
                      "CHECK_MAX_CPU_RATIO of its CPU per byte at any size.")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
