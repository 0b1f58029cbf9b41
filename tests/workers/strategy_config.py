"""Cluster configuration errors and the single-worker (no network) path.

Run: python tests/workers/strategy_config.py   (no launcher; TF_CONFIG is set per check)
"""

from __future__ import annotations

import json
import os

import strategy_common as common

import numpy as np
import keras

from prophet_tf.errors import ClusterConfigError
from prophet_tf.strategy import ProphetStrategy

BAD = {
    "not_json": "{cluster: worker}",
    "index_out_of_range": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                      "task": {"type": "worker", "index": 5}}),
    "no_port": json.dumps({"cluster": {"worker": ["localhost", "127.0.0.1:2"]},
                           "task": {"type": "worker", "index": 0}}),
    "parameter_server": json.dumps({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]},
                                    "task": {"type": "worker", "index": 0}}),
}


def main():
    for name, value in BAD.items():
        os.environ["TF_CONFIG"] = value
        try:
            ProphetStrategy()
        except ClusterConfigError as e:
            common.result(section="bad_config", case=name, error=type(e).__name__,
                          message=str(e))
        else:
            common.result(section="bad_config", case=name, error=None, message="")
    try:
        ProphetStrategy(schedule="round-robin")
    except ValueError as e:
        common.result(section="bad_schedule", message=str(e))

    # One worker, no TF_CONFIG: no network, plain training.
    del os.environ["TF_CONFIG"]
    strategy = ProphetStrategy()
    rng = np.random.RandomState(0)
    x = rng.randn(64, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    hist = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    reduced = float(strategy.reduce("SUM", strategy.run(lambda: np.float32(2.0)), axis=None))
    common.result(section="single_worker", replicas=strategy.num_replicas_in_sync,
                  rank=strategy.rank, schedule=strategy.schedule,
                  loss=common.floats(hist.history["loss"]), reduced=reduced,
                  predict_rows=int(model.predict(x, verbose=0).shape[0]))
    print("WORKER DONE", flush=True)


if __name__ == "__main__":
    main()
