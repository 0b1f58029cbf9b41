"""ProphetStrategy(schedule="auto") on N workers: rank 0 predicts every candidate at a check step
once it has profiled a step and measured the link; the test then makes it choose "fifo" so that
switching every worker's runtime is exercised too. Training goes on (bounded) until that happens:
how many steps the runtime needs for its first link sample depends on the machine's speed.
Prints RESULT with each rank's decisions, the schedule in use, the runtime's policy and a digest
of the final weights."""

from __future__ import annotations

import strategy_common as common  # noqa: F401  (sets the path and the log level)

import numpy as np

import keras
import prophet_tf
from prophet_tf import _auto_schedule, runtime

original_decide = _auto_schedule.AutoSchedule._decide
seen = {}
MAX_EPOCHS = 20  # 320 steps: a bound, not an expectation (the first check usually decides)


def decide_fifo(self, step):
    """Records rank 0's first real decision, then asks for fifo (nothing before it)."""
    real = original_decide(self, step)
    if not self.decisions:  # nothing measured yet: every worker keeps its schedule
        return None
    seen.setdefault("real", real)
    seen.setdefault("predicted", dict(self.decisions[0].predicted_s))
    return "fifo"


_auto_schedule.AutoSchedule._decide = decide_fifo

strategy = prophet_tf.ProphetStrategy(schedule="auto")
with strategy.scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.random((16 * 32, 16), dtype=np.float32)
y = rng.integers(0, 4, 16 * 32)
# 16 steps per epoch, checks at steps 4, 14, 24, ...; every worker learns rank 0's choice at each
# check, so all of them see the switch after the same epoch.
for epoch in range(MAX_EPOCHS):
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    if strategy.schedule_in_use == "fifo":
        break
strategy.barrier()  # a collective after the last step: the runtime switches when nothing is queued
common.result(section="auto", schedule=strategy.schedule, in_use=strategy.schedule_in_use,
              runtime=runtime.stats()["schedule"], real_decision=seen.get("real"),
              predicted=seen.get("predicted", {}),
              decisions=[d.step for d in strategy.schedule_decisions],
              digest=common.digest(model.get_weights()))
