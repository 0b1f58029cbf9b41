"""Deletes iterators of a distributed dataset while the next element is being fetched.

Run: python -m prophet_tf.launch -n 2 tests/workers/abandoned_iterators.py [ROUNDS]

Every Keras epoch that ends before its data does (``fit`` with ``validation_split``, a
``steps_per_epoch``) abandons an iterator this way. Through TensorFlow's MultiDeviceIterator it
crashed the process (SIGSEGV: the iterator's destructor drops the dataset before stopping the
thread that reads from it; MirroredStrategy has the same defect). The pipeline is slow on purpose
(``py_function`` does not observe cancellation) and not rewritten by tf.data's optimizer, which is
the case in which the reading thread uses the dropped dataset. Prints one ``RESULT`` with the first
batch every iterator gave (this worker's share of the global batch).
"""

from __future__ import annotations

import gc
import sys
import time
import weakref

import strategy_common as common

import tensorflow as tf

from prophet_tf.strategy import ProphetStrategy

GLOBAL_BATCH = 4


def slow(x):
    time.sleep(0.01)
    return x


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    strategy = ProphetStrategy()
    dataset = (tf.data.Dataset.range(1_000_000).batch(GLOBAL_BATCH)
               .map(lambda x: tf.py_function(slow, [x], tf.int64)))
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.autotune.enabled = False
    distributed = strategy.experimental_distribute_dataset(dataset.with_options(options))
    first_batches = set()
    collected = 0
    for _ in range(rounds):
        iterator = iter(distributed)
        first_batches.add(tuple(int(v) for v in next(iterator).numpy()))
        time.sleep(0.005)  # the iterator is now fetching the next element, inside slow()
        alive = weakref.ref(iterator)
        del iterator
        # The last reference goes here and the iterator with it, while it fetches. A full
        # collection costs a third of a CPU-second in a TensorFlow process: only for a cycle.
        if alive() is not None:
            collected += 1
            gc.collect()
    common.result(rounds=rounds, first_batches=sorted(first_batches), collected=collected)


if __name__ == "__main__":
    main()
