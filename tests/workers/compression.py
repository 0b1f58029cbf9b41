"""Gradient compression on N workers (tests/test_compression.py).

    python -m prophet_tf.launch -n N tests/workers/compression.py checks
    python -m prophet_tf.launch -n 2 tests/workers/compression.py train --epochs E --seed S

``checks``: push_pull of wide-range float32 gradients with fp16 and bf16 against the one-step
bound of docs/design.md ("Compression"), the fp16 range guard, non-finite values, float64 passing
through, compressed allgather, and under ``ProphetStrategy(compression="fp16")`` the gradients of
one optimizer step (deferred and synchronous updates) against the bound while strategy.reduce and
metric state stay exact. Prints one ``RESULT`` per check with what the test asserts.

``train``: the digits task of examples/keras_fit_demo.py (its data and model; by default its
settings) trained with no compression, fp16 and bf16, one model each from the same seed; prints
the validation accuracy of each. The comparison over seeds:

    for s in 0 1 2; do python -m prophet_tf.launch -n 2 tests/workers/compression.py train --seed $s; done
"""

from __future__ import annotations

import argparse
import os
import sys

import strategy_common as common

import numpy as np
import tensorflow as tf

from prophet_tf import ops
from prophet_tf.strategy import ProphetStrategy

UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24


def wide_gradient(rank: int, size: int, seed: int) -> np.ndarray:
    """Gradient-like float32 values of 2^-30 .. 2^20 in magnitude (beyond fp16's largest, 65504,
    and below its smallest subnormal), a different draw per rank; every worker can compute every
    rank's."""
    rng = np.random.RandomState(seed * 1000 + rank)
    mantissa = rng.uniform(0.5, 1.0, size) * rng.choice([-1.0, 1.0], size)
    return (mantissa * np.exp2(rng.randint(-30, 21, size))).astype(np.float32)


def error_bound(contributions: np.ndarray, compression: str, average: bool) -> np.ndarray:
    """The per-element bound on |result - exact| of docs/design.md ("Compression"), for
    contributions of shape (N, elements). The owner's own contribution is not rounded; the bound
    counts it as if it were (no worker knows which rank owns which element)."""
    n = contributions.shape[0]
    u = UNIT_ROUNDOFF[compression]
    g = contributions.astype(np.float64)
    a = np.abs(g).sum(axis=0)
    total = g.sum(axis=0)
    gamma = (n - 1) * FLOAT32_UNIT_ROUNDOFF / (1 - (n - 1) * FLOAT32_UNIT_ROUNDOFF)
    if compression == "fp16":
        # Half the spacing of fp16 subnormals at a block's scale: <= 2^-39 x the block's largest.
        h = sum(2.0 ** -39 * np.abs(g[r]).max() for r in range(n))
    else:
        h = n * 2.0 ** -134
    e1 = u * a + h + gamma * ((1 + u) * a + h)
    d, v = (n, 0.0 if n & (n - 1) == 0 else FLOAT32_UNIT_ROUNDOFF) if average else (1, 0.0)
    largest_sum = ((1 + gamma) * ((1 + u) * a + h)).max() * (1 + v) / d
    eta_result = 2.0 ** -39 * largest_sum if compression == "fp16" else 2.0 ** -134
    return (e1 + v * (np.abs(total) + e1)) / d + u * (1 + v) * (np.abs(total) + e1) / d + eta_result


def wider_than_16_bits(values: np.ndarray, compression: str) -> int:
    """How many float32 values have mantissa bits beyond fp16's 11 (bf16's 8) significant bits:
    0 for values that travelled in 16 bits (a power-of-two scale moves no bits)."""
    bits = np.asarray(values, np.float32).view(np.uint32)
    low = np.uint32(0x1FFF if compression == "fp16" else 0xFFFF)
    return int(np.count_nonzero((bits & low) != 0))


def compare(name: str, got: np.ndarray, contributions: np.ndarray, compression: str,
            average: bool, exact_runtime: np.ndarray, **extra) -> None:
    """One RESULT: the error against the bound, how many values differ from the uncompressed
    runtime's, and the digest every worker must share."""
    exact = contributions.astype(np.float64).sum(axis=0) / (contributions.shape[0] if average else 1)
    bound = error_bound(contributions, compression, average)
    err = np.abs(got.astype(np.float64) - exact)
    common.result(check=name, elements=int(got.size), beyond_bound=int(np.count_nonzero(err > bound)),
                  worst_fraction_of_bound=float((err / bound).max()),
                  differ_from_uncompressed=int(np.count_nonzero(got != exact_runtime)),
                  wider_than_16_bits=wider_than_16_bits(got, compression),
                  finite=bool(np.isfinite(got).all()), digest=common.digest([got]), **extra)


def plain_fp16_cast(value: float) -> float:
    """What casting to fp16 without a scale gives (inf for 1e6, 0 for 1e-8)."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float16(value))


def raw_op_checks(n: int, rank: int) -> None:
    size = (1 << 20) + 3  # 4 MiB + 12 bytes: several partitions on every worker
    contributions = np.stack([wide_gradient(r, size, seed=1) for r in range(n)])
    local = tf.constant(contributions[rank])
    for compression in ("fp16", "bf16"):
        for average in (False, True):
            name = f"wide/{compression}/{'mean' if average else 'sum'}"
            got = ops.push_pull(local, name=name, average=average, compression=compression).numpy()
            exact_runtime = ops.push_pull(local, name=name + "/exact", average=average).numpy()
            compare(name, got, contributions, compression, average, exact_runtime)

    # The range guard: whole gradients of 1e6 (above fp16's 65504) and of 1e-8 (below its
    # smallest subnormal, 6e-8) travel with 11 significant bits, neither inf nor 0.
    for magnitude in (1e6, 1e-8):
        contributions = np.stack([(magnitude * (1 + 0.37 * np.arange(1000) / 1000) * (r + 1))
                                  .astype(np.float32) for r in range(n)])
        got = ops.push_pull(tf.constant(contributions[rank]), name=f"range/{magnitude:g}",
                            compression="fp16").numpy()
        exact = contributions.astype(np.float64).sum(axis=0)
        common.result(check=f"range {magnitude:g}", finite=bool(np.isfinite(got).all()),
                      nonzero=bool((got != 0).all()),
                      max_relative_error=float((np.abs(got - exact) / exact).max()),
                      plain_cast_would_give=plain_fp16_cast(magnitude),
                      digest=common.digest([got]))

    # Non-finite values stay visible (loss scaling looks for them); finite ones stay finite.
    values = np.full(64, 3.0, np.float32)
    if rank == n - 1:
        values[5], values[9] = np.inf, np.nan
    got = ops.push_pull(tf.constant(values), name="nonfinite", compression="fp16").numpy()
    finite_rest = np.delete(got, [5, 9])
    common.result(check="nonfinite", inf_at_5=bool(np.isposinf(got[5])), nan_at_9=bool(np.isnan(got[9])),
                  rest=sorted(set(float(x) for x in finite_rest)), expected_rest=3.0 * n)

    # float64 travels as it is: exact.
    doubles = np.array([1.0 + 2.0 ** -50 * (rank + 1), 1e300 / n, -(rank + 0.1)], np.float64)
    got = ops.push_pull(tf.constant(doubles), name="float64", compression="bf16").numpy()
    exact = ops.push_pull(tf.constant(doubles), name="float64/exact").numpy()
    common.result(check="float64", identical=bool(np.array_equal(got, exact)))

    # allgather (sparse gradients' values): every worker gets every worker's rows as they
    # travelled, its own included.
    rows = wide_gradient(rank, 8 * (rank + 2), seed=2).reshape(rank + 2, 8)
    got = ops.allgather(tf.constant(rows), name="gather/values", compression="bf16").numpy()
    expected = np.concatenate([wide_gradient(r, 8 * (r + 2), seed=2).reshape(r + 2, 8) for r in range(n)])
    rel = np.abs(got.astype(np.float64) - expected) / np.abs(expected)
    common.result(check="allgather", shape=list(got.shape), expected_shape=list(expected.shape),
                  max_relative_error=float(rel.max()), rounded=int(np.count_nonzero(got != expected)),
                  wider_than_16_bits=wider_than_16_bits(got, "bf16"), digest=common.digest([got]))


def strategy_checks(strategy: ProphetStrategy) -> None:
    import keras

    n, rank = strategy.num_replicas_in_sync, strategy.rank
    # Control collectives: values whose float32 sums are exact but which fp16 or bf16 would round.
    fine = np.float32(1 + 2.0 ** -20)
    local = np.array([1.0, 2.0, 3.0], np.float32) * fine * np.float32(rank + 1)
    expected = np.array([1.0, 2.0, 3.0], np.float32) * fine * np.float32(n * (n + 1) // 2)
    per_replica = strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant(local))
    reduced = strategy.reduce("SUM", per_replica, axis=None).numpy()
    with strategy.scope():
        state = tf.Variable(local, synchronization=tf.VariableSynchronization.ON_READ,
                            aggregation=tf.VariableAggregation.SUM)
    reduced_state, _ = strategy.extended.collectives.reduce_metric_state([state])  # what Keras metrics use
    metric = reduced_state[0].numpy()
    common.result(check="control", reduce_exact=bool(np.array_equal(reduced, expected)),
                  metric_exact=bool(np.array_equal(metric, expected)),
                  fp16_would_round=bool(np.float32(np.float16(expected[0])) != expected[0]))

    # One optimizer step from zero weights with SGD(1.0): the weights become minus the reduced
    # gradient, so they show what travelled. The gradient of sum(c * (x @ W)) is x^T c.
    rows, units = 64, 256
    x = wide_gradient(rank, rows * 32, seed=3).reshape(rows, 32)
    c = np.random.RandomState(rank).uniform(0.5, 1.0, (rows, units)).astype(np.float32)
    local_gradient = tf.matmul(tf.constant(x), tf.constant(c), transpose_a=True).numpy()
    contributions = strategy.gather(
        strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant(local_gradient[None])),
        axis=0).numpy()  # every worker's exact local gradient (an uncompressed allgather)
    exact_runtime = strategy.reduce("SUM", strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(local_gradient)), axis=None).numpy()
    for mode in ("deferred", "synchronous"):
        with strategy.scope():
            model = keras.Sequential([keras.Input((32,)),
                                      keras.layers.Dense(units, use_bias=False, kernel_initializer="zeros")])
            optimizer = keras.optimizers.SGD(learning_rate=1.0)
            optimizer.build(model.trainable_variables)

        def step(xs, cs):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(cs * model(xs))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        args = (tf.constant(x), tf.constant(c))
        counts = dict(strategy.extended.gradient_counts)
        if mode == "deferred":  # inside a tf.function the update crosses the barrier
            tf.function(lambda *a: strategy.run(step, args=a))(*args)
        else:
            strategy.run(step, args=args)
        reduced_as = [k for k, v in strategy.extended.gradient_counts.items() if v > counts.get(k, 0)]
        got = -model.trainable_variables[0].numpy().reshape(-1)
        compare(f"strategy {mode}", got, contributions.reshape(n, -1), "fp16", False,
                exact_runtime.reshape(-1), reduced_as=reduced_as)


def checks() -> None:
    strategy = ProphetStrategy(compression="fp16")
    raw_op_checks(strategy.num_replicas_in_sync, strategy.rank)
    strategy_checks(strategy)


def train(epochs: int, seed: int, samples: int, batch: int, learning_rate: float, compressions: list) -> None:
    """The demo task per compression, each from the same initial weights and data order."""
    import keras

    sys.path.insert(0, os.path.join(common.ROOT, "examples"))
    import keras_fit_demo as demo

    x, y = demo.make_digits(samples, seed=1)
    x_val, y_val = demo.make_digits(1024, seed=2)
    for compression in compressions:
        strategy = ProphetStrategy(compression=None if compression == "none" else compression)
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            model = demo.build_model()
            model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
        model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)
        loss, accuracy = model.evaluate(x_val, y_val, batch_size=256, verbose=0)
        common.result(check="train", compression=compression, seed=seed, val_accuracy=float(accuracy),
                      val_loss=float(loss), weights=common.digest(model.get_weights()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["checks", "train"])
    # Defaults: examples/keras_fit_demo.py's.
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--compressions", default="none,fp16,bf16")
    args = p.parse_args()
    if args.mode == "checks":
        checks()
    else:
        train(args.epochs, args.seed, args.samples, args.batch, args.learning_rate, args.compressions.split(","))


if __name__ == "__main__":
    main()
