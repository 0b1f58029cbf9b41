"""A deferred (crossing) update of a variable that lives on another device than the ops' host
CPU: two logical CPU devices stand in for a CPU and a GPU. Prints ``RESULT {json}``."""

import json
import sys

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

from prophet_tf import _crossing, runtime  # noqa: E402

runtime.init(0, 1, [])


class Optimizer:
    """What deferred_update reads of a Keras optimizer."""


optimizer = Optimizer()
optimizer._iterations = tf.Variable(0, dtype=tf.int64)
with tf.device("/cpu:1"):
    variable = _crossing.GatedVariable(tf.ones([4]))


@tf.function
def step(gradient):
    with tf.device("/cpu:1"):
        _crossing.deferred_update(variable, lambda v, summed, lr: v.assign_sub(lr * summed), gradient, 0.5,
                                  optimizer, "grad/v", 1)


step(tf.fill([4], 1.5))
_crossing.wait_all()
print("RESULT " + json.dumps({"device": variable.device, "value": variable.numpy().tolist()}))
sys.stdout.flush()
