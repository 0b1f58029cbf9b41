"""Workers whose fused gradients differ: rank 1 freezes a layer that rank 0 trains (a model built
differently on one worker), so its optimizer declares fewer gradients for fusion. fit must raise
on every worker, well before the operation timeout, naming the layer's kernel.

Run without the launcher (which would stop one worker when the other fails):
  TF_CONFIG=... python tests/workers/fusion_mismatch.py OP_TIMEOUT_S
"""

from __future__ import annotations

import sys
import time

import strategy_common as common

import numpy as np
import keras

from prophet_tf.strategy import ProphetStrategy


def main() -> None:
    # fusion="auto", the default. Plain SGD: no slot variables, which would differ first (rank 1
    # has fewer trainable variables) and fail the optimizer's build with VariableMismatchError
    # (tests/test_variable_agreement.py).
    strategy = ProphetStrategy(timeout_s=float(sys.argv[1]))
    rng = np.random.RandomState(0)
    x = rng.randn(256, 8).astype("float32")
    y = rng.randint(0, 2, size=(256,)).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="first"),
                                  keras.layers.Dense(16, activation="relu", name="middle"),
                                  keras.layers.Dense(2, activation="softmax", name="last")])
        if strategy.rank == 1:
            model.get_layer("middle").trainable = False
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    t0 = time.time()
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    except Exception as e:  # noqa: BLE001 - report what fit raised, then fail
        # The end of the message is the runtime's own words (a graph error starts with a trace).
        common.result(section="error", type=type(e).__name__, message=str(e)[-3000:],
                      seconds=round(time.time() - t0, 2))
        sys.exit(3)
    print("FINISHED WITHOUT ERROR", flush=True)


if __name__ == "__main__":
    main()
