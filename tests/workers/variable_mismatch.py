"""Workers that build different models, one case after the other in the same processes: every
case must raise VariableMismatchError on every worker, well before the operation timeout, naming
the first variable that differs; the last case builds the same model everywhere and trains (the
runtime stays usable after those errors, and a correct program is not refused).

  python -m prophet_tf.launch -n 2 -- tests/workers/variable_mismatch.py OP_TIMEOUT_S CASES

CASES, comma-separated, rank 1 differing from rank 0 in each:
  adam_frozen       rank 1 freezes the layer "middle": Adam makes fewer slot variables there
  momentum_frozen   rank 1 freezes the layer "last" with SGD(momentum): rank 0 makes two more
                    slot variables when rank 1 has finished creating variables
  extra_layer       rank 1 builds one more layer ("extra") before "last"
  other_shape       rank 1's "middle" has 32 units instead of 16
  same              every worker builds the same model (must train)
"""

from __future__ import annotations

import sys
import time

import strategy_common as common

import numpy as np
import keras

from prophet_tf.errors import VariableMismatchError
from prophet_tf.strategy import ProphetStrategy


def build_and_fit(case: str, rank: int, x, y) -> keras.Model:
    differs = rank == 1 and case != "same"
    layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="first"),
              keras.layers.Dense(32 if differs and case == "other_shape" else 16,
                                 activation="relu", name="middle")]
    if differs and case == "extra_layer":
        layers.append(keras.layers.Dense(16, activation="relu", name="extra"))
    layers.append(keras.layers.Dense(2, activation="softmax", name="last"))
    model = keras.Sequential(layers)
    if differs and case == "adam_frozen":
        model.get_layer("middle").trainable = False
    if differs and case == "momentum_frozen":
        model.get_layer("last").trainable = False
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9) if case == "momentum_frozen" \
        else keras.optimizers.Adam(1e-3)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model


def main() -> None:
    strategy = ProphetStrategy(timeout_s=float(sys.argv[1]))
    rng = np.random.RandomState(0)
    x = rng.randn(64, 8).astype("float32")
    y = rng.randint(0, 2, size=(64,)).astype("int32")
    for case in sys.argv[2].split(","):
        t0 = time.time()
        try:
            with strategy.scope():
                model = build_and_fit(case, strategy.rank, x, y)
        except VariableMismatchError as e:
            common.result(case=case, outcome="error", message=str(e),
                          seconds=round(time.time() - t0, 2))
            continue
        except Exception as e:  # noqa: BLE001 - another error (e.g. the timeout's) fails the test
            common.result(case=case, outcome=type(e).__name__, message=str(e)[-3000:],
                          seconds=round(time.time() - t0, 2))
            sys.exit(3)
        common.result(case=case, outcome="trained", weights=common.digest(model.get_weights()),
                      seconds=round(time.time() - t0, 2))


if __name__ == "__main__":
    main()
