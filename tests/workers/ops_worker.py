"""Worker for tests/test_ops.py: exercises the ops against exact numpy references.

Run under the launcher; prints "CHECK <name> ok" per passed check and exits non-zero on the
first failure. Argument: the scenario (`exact`, `mismatch`).
"""

import sys

import numpy as np
import tensorflow as tf

from prophet_tf import cluster, ops, runtime

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]


def contribution(rank: int, n_elems: int, salt: int) -> np.ndarray:
    # Small integers: every partial sum is exact in every dtype, float16 included.
    values = (np.arange(n_elems, dtype=np.int64) * (rank + 3) + salt) % 13 - 6
    return values


CHECKS_RUN = []


def check(name: str, ok: bool, detail: str = "") -> None:
    CHECKS_RUN.append(name)
    if not ok:
        print(f"CHECK {name} FAILED {detail}", flush=True)
        sys.exit(1)
    print(f"CHECK {name} ok", flush=True)


def exact(info: cluster.ClusterInfo, small: bool = False) -> None:
    r, n = info.rank, info.world_size
    # Sizes from one element to 64 MiB (float32), crossing the 4 MiB partition size.
    sizes = [1, 3, 1000, (1 << 16) + 5, 1 << 20] + ([] if small else [(3 << 20) + 7])
    # The same small integers in every dtype: each size's values and sum are made once.
    values = [(contribution(r, size, i), sum(contribution(k, size, i) for k in range(n)))
              for i, size in enumerate(sizes)]
    for dtype in DTYPES:
        for size, (local, expected) in zip(sizes, values):
            got = ops.push_pull(tf.cast(tf.constant(local), dtype), name=f"exact/{dtype.name}/{size}")
            ok = np.array_equal(tf.cast(got, tf.int64).numpy(), expected)
            check(f"sum {dtype.name} {size}", ok,
                  "" if ok else f"max err {np.abs(tf.cast(got, tf.float64).numpy() - expected).max()}")
    if not small:
        big = 16 << 20  # 64 MiB of float32
        got = ops.push_pull(tf.fill([big], float(r + 1)), name="exact/64MiB")
        check("sum float32 64MiB", bool(tf.reduce_all(got == n * (n + 1) / 2)))
    # A large output comes from the recycled pool (ops/core/output_pool.h): the next push_pull of
    # its size gets the same memory back, holding the last sum, and must overwrite all of it.
    recycled = runtime.stats()["outputs_recycled"]
    for step in range(3):
        got = ops.push_pull(tf.fill([1 << 19], float(r + 2 * step)), name="exact/recycled")
        check(f"recycled output {step}", bool(tf.reduce_all(got == n * 2 * step + n * (n - 1) / 2)))
        del got
    check("outputs recycled", runtime.stats()["outputs_recycled"] >= recycled + 2)
    got = ops.push_pull(tf.constant([2.0 * (r + 1), 4.0]), name="exact/mean", average=True)
    check("mean", np.allclose(got.numpy(), [float(n + 1), 4.0]))

    # The owner sums in a fixed order (its own values, then the next ranks in turn), not in the
    # order contributions arrive: terms whose float32 sum depends on the order (1e8 absorbs 1 and
    # 3) give, in every element, the sum in one of those orders, and the same bits every round.
    terms = np.array([1e8, 1.0, -1e8, 3.0], np.float32)
    idx = np.arange(1 << 20)
    values = [terms[(idx // 3 + idx + k) % 4] for k in range(n)]
    rotations = []
    for owner in range(n):
        total = values[owner].copy()
        for k in range(1, n):
            total += values[(owner + k) % n]
        rotations.append(total)
    rounds = [ops.push_pull(tf.constant(values[r]), name="exact/order").numpy() for _ in range(5)]
    check("sum order: the same bits every round", all(np.array_equal(x, rounds[0]) for x in rounds))
    in_order = np.zeros(idx.shape, bool)
    for total in rotations:
        in_order |= rounds[0] == total
    check("sum order: own values, then the next ranks", bool(in_order.all()),
          f"{int((~in_order).sum())} elements summed in another order")

    # The same name used again is matched by round.
    for step in range(3):
        got = ops.push_pull(tf.constant([float(step + r)]), name="exact/repeated")
        check(f"repeated round {step}", got.numpy()[0] == n * step + n * (n - 1) / 2)

    # 200 operations in flight inside one tf.function. Odd ranks list them in reverse order, so a
    # runtime that handled them one at a time in program order would deadlock (and time out).
    order = list(range(200))
    if r % 2:
        order.reverse()

    @tf.function
    def many(tensors):
        return {i: ops.push_pull(tensors[i], name=f"many/{i}", priority=200 - i) for i in order}

    tensors = [tf.fill([1 + 97 * i], float(r + i)) for i in range(200)]
    out = many(tensors)
    check("200 in flight", all(np.all(out[i].numpy() == n * i + n * (n - 1) / 2) for i in range(200)))
    out = many(tensors)  # the traced function again: the next round of every name
    check("200 in flight again", all(np.all(out[i].numpy() == n * i + n * (n - 1) / 2) for i in range(200)))

    root = n - 1
    for dtype in DTYPES + [tf.bool, tf.uint8]:
        value = tf.cast(tf.constant(np.arange(1000) % 2 + r), dtype)
        got = ops.broadcast(value, name=f"bcast/{dtype.name}", root_rank=root)
        want = tf.cast(tf.constant(np.arange(1000) % 2 + root), dtype)
        check(f"broadcast {dtype.name}", bool(tf.reduce_all(got == want)))
    got = ops.broadcast(tf.fill([3 << 20], float(r)), name="bcast/large", root_rank=root)
    check("broadcast 12MiB", bool(tf.reduce_all(got == float(root))))

    rows = r  # rank 0 contributes no rows
    got = ops.allgather(tf.fill([rows, 3], r), name="gather/rows")
    want = np.concatenate([np.full([k, 3], k) for k in range(n)])
    check("allgather", got.shape == want.shape and np.array_equal(got.numpy(), want))

    @tf.function
    def gathered(x):
        return ops.allgather(x, name="gather/fn")

    got = gathered(tf.constant([[float(r)] * 2] * (r + 1)))
    check("allgather in tf.function", got.shape[0] == n * (n + 1) // 2)
    stats = runtime.stats()
    check("stats", stats["ops_failed"] == 0 and stats["bytes_sent"] > 0, str(stats))


def mismatch(info: cluster.ClusterInfo) -> None:
    shape = [2, 3] if info.rank == 0 else [3, 3]
    try:
        ops.push_pull(tf.zeros(shape), name="weights/kernel")
    except tf.errors.InvalidArgumentError as e:
        message = str(e)
        check("mismatch message", "weights/kernel" in message and "[2, 3]" in message and "[3, 3]" in message,
              message)
    else:
        check("mismatch raised", False, "no error")
    # The runtime stays usable for the next, well-formed operation.
    got = ops.push_pull(tf.ones([4]), name="after/mismatch")
    check("usable after mismatch", bool(tf.reduce_all(got == info.world_size)))


def main() -> None:
    info = cluster.resolve_cluster()
    runtime.init(info.rank, info.world_size, info.addresses, info.token, timeout_s=60,
                 partition_bytes=4 << 20)
    scenarios = {"exact": exact, "exact-small": lambda i: exact(i, small=True), "mismatch": mismatch}
    scenarios[sys.argv[1]](info)
    print(f"CHECKS TOTAL {len(CHECKS_RUN)}", flush=True)
    runtime.shutdown()
    print("WORKER DONE", flush=True)


if __name__ == "__main__":
    main()
