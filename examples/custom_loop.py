"""A custom training loop with ProphetStrategy: strategy.run, strategy.reduce, a distributed
dataset and a Keras optimizer.

    python examples/custom_loop.py
    python -m prophet_tf.launch -n 2 examples/custom_loop.py

Fits a small MLP to a noisy 2-D function. Each worker computes the loss of its part of every
global batch divided by the *global* batch size (`tf.nn.compute_average_loss`), so the summed
gradients are the global-batch mean; `strategy.reduce(SUM, ...)` turns the per-worker losses
into the global loss, which every worker prints identically.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
try:
    import prophet_tf  # noqa: F401
except ImportError:  # a source checkout without `pip install .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

from prophet_tf.strategy import SCHEDULES, ProphetStrategy  # noqa: E402


def make_data(n: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    x = rng.uniform(-2.0, 2.0, size=(n, 2)).astype(np.float32)
    y = (np.sin(2.0 * x[:, :1]) * np.cos(x[:, 1:]) + 0.05 * rng.randn(n, 1)).astype(np.float32)
    return x, y


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=128, help="global batch size")
    p.add_argument("--schedule", default=None, choices=SCHEDULES, help="default: prophet")
    args = p.parse_args()

    strategy = ProphetStrategy(schedule=args.schedule)
    x, y = make_data(8192)
    steps = len(x) // args.batch
    dataset = (tf.data.Dataset.from_tensor_slices((x, y))
               .shuffle(len(x), seed=42, reshuffle_each_iteration=True)  # same order everywhere
               .batch(args.batch, drop_remainder=True))
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)),
                                  keras.layers.Dense(64, activation="tanh"),
                                  keras.layers.Dense(64, activation="tanh"),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.Adam(3e-3)

    def step_fn(inputs):
        bx, by = inputs
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(bx, training=True) - by), axis=1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=args.batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_epoch(iterator):
        total = tf.constant(0.0)
        for _ in tf.range(steps):
            per_worker_loss = strategy.run(step_fn, args=(next(iterator),))
            total += strategy.reduce(tf.distribute.ReduceOp.SUM, per_worker_loss, axis=None)
        return total / steps

    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        loss = float(train_epoch(iter(dist_dataset)))
        dt = time.perf_counter() - t0
        print(f"[worker {strategy.rank}/{strategy.num_replicas_in_sync}] epoch {epoch + 1}: "
              f"mse {loss:.5f}  {steps * args.batch / dt:,.0f} samples/s (global)", flush=True)


if __name__ == "__main__":
    main()
