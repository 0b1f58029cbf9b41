"""The link rate automatic fusion sizes buckets for, for tests/test_fusion.py.

    PROPHET_TIMELINE=trace.{rank}.json python -m prophet_tf.launch -n 2 -- tests/workers/fusion_link_probe.py

Run without ``$PROPHET_LINK_GBPS``. Two strategies, one after the other, each fitting a model of
many small gradients with ``fusion="auto"`` (the default):

* ``probe``: the first strategy measures the link when fit traces its first step; a second fit
  with another batch size traces the step again (a second fusion declaration: no second probe);
* ``env``: ``$PROPHET_LINK_GBPS`` = ENV_GBPS is set before the second strategy: it takes that
  rate and measures nothing.

Each prints ``RESULT {"case", "rate" (FusionLinkRate's fields, before and after fit), "fused"
(push_pulls that travelled in buckets), "digest" (final weights), "profiled" (tensor names in
Prophet's profile)}``. The test counts the probe's operations on the trace.
"""

from __future__ import annotations

import dataclasses
import os

import strategy_common as common

import keras
import numpy as np

from prophet_tf import runtime
from prophet_tf.strategy import ProphetStrategy

ENV_GBPS = "2.5"


def build() -> keras.Model:
    layers = [keras.Input((8,))]
    layers += [keras.layers.Dense(8, activation="tanh", name=f"small{i}") for i in range(6)]
    layers.append(keras.layers.Dense(2, activation="softmax", name="out"))
    return keras.Sequential(layers)


def fit_case(case: str, batch_sizes: list) -> None:
    strategy = ProphetStrategy()
    before = strategy.fusion_link_rate
    rng = np.random.RandomState(3)
    x = rng.randn(128, 8).astype("float32")
    y = rng.randint(0, 2, size=(128,)).astype("int32")
    with strategy.scope():
        model = build()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    fused_before = runtime.stats().get("fused_submitted", 0)
    for batch in batch_sizes:
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    rate = strategy.fusion_link_rate
    profile = runtime.scheduler_state().get("profile") or {}
    common.result(case=case, rate_before=before and dataclasses.asdict(before),
                  rate=rate and dataclasses.asdict(rate), bytes_per_s=rate and rate.bytes_per_s,
                  fused=runtime.stats().get("fused_submitted", 0) - fused_before,
                  digest=common.digest(model.get_weights()),
                  profiled=[t["name"] for t in profile.get("tensors", [])])


def main() -> None:
    assert not os.environ.get(runtime.LINK_GBPS_ENV), "run without $PROPHET_LINK_GBPS"
    fit_case("probe", [32, 16])
    os.environ[runtime.LINK_GBPS_ENV] = ENV_GBPS
    fit_case("env", [32])


if __name__ == "__main__":
    main()
