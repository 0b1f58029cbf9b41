"""Trains an emulated model through ProphetStrategy with each given schedule in turn, the byte
credit, partitions and socket buffers at their smallest, and reports each run's steps.

Run: python -m prophet_tf.launch -n 4 tests/workers/stall_matrix.py fifo,priority,prophet,bytescheduler,p3,auto

The model (prophet_tf/bench/emulated.py) has the shape that stalls ``priority`` on 4 workers when
the credit waits for sums: one large first-layer gradient, the most urgent and the last one the
backward pass makes, and many small ones; its layers take fixed times on the emulated
accelerator and no CPU, so 8 workers fit on 2 cores. Each schedule gets a runtime of its own
(started, used, shut down). A stall fails the step within ``timeout_s`` on every worker, naming
what did not arrive.

Prints one ``RESULT`` per schedule: the steps trained (and how many were asked for), the schedule
in use at the end and a digest of the weights (equal on every worker when every step completed).
"""

from __future__ import annotations

import sys

import strategy_common as common

import keras
import numpy as np

from prophet_tf import runtime
from prophet_tf.bench.emulated import LayerSpec, WeightSpec, build_emulated_model
from prophet_tf.strategy import ProphetStrategy

LAYERS = 12
STEPS = 8
BATCH = 4
# Smallest settings: a credit of one partition, partitions of 4 KiB (the large gradient is cut
# into 256), the smallest socket buffers the runtime accepts and 1 KiB of unsent data per socket.
OPTIONS = dict(partition_bytes=4096, credit_bytes=4096, socket_buffer_bytes=128 << 10,
               socket_unsent_bytes=1024, timeout_s=60.0)


def specs() -> list:
    """Layer 0: a 1 MiB kernel; layers 1-11: 1-60 KiB kernels and biases. Forward passes of
    0.2-0.4 ms; backward passes of 0.4-0.8 ms except every third, 3 ms (stages for prophet)."""
    out = []
    for i in range(LAYERS):
        rows = 4096 if i == 0 else 4 * (1 + (i * 7) % 60)
        weights = (WeightSpec("kernel", (rows, 64), "float32", True),
                   WeightSpec("bias", (64,), "float32", True))
        forward_s = (2 + i % 3) * 1e-4
        out.append(LayerSpec(f"L{i}", "Dense", weights, forward_s * 1e12 / BATCH))
    return out


def backward_scale(layer: int) -> float:
    return 7.5 if layer % 3 == 2 else 1.0


def build(strategy: ProphetStrategy):
    with strategy.scope():
        model = build_emulated_model(specs(), BATCH, tflops=1.0, time_scale=1.0, classes=2)
        for i, layer in enumerate(model.layers[1:]):
            layer.backward_s *= backward_scale(i)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(schedules: list) -> None:
    x = np.zeros((STEPS * BATCH, 1), np.float32)
    y = np.zeros((STEPS * BATCH,), np.int32)
    for schedule in schedules:
        strategy = ProphetStrategy(schedule, **OPTIONS)
        n = strategy.num_replicas_in_sync
        model = build(strategy)
        steps = []
        count = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: steps.append(batch))
        model.fit(np.tile(x, (n, 1)), np.tile(y, n), batch_size=BATCH * n, epochs=1, verbose=0,
                  shuffle=False, callbacks=[count])
        common.result(schedule=schedule, steps=len(steps), expected_steps=STEPS,
                      in_use=strategy.schedule_in_use,
                      digest=common.digest(model.get_weights()))
        runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1].split(","))
