"""The job's random seed: the same order on every worker, and one process's order where the
program gives its own seeds.

Without a TensorFlow global seed, a random operation without a seed of its own draws one per
process (``Dataset.shuffle()``, ``fit(shuffle=True)`` on arrays), so the workers' shards of a
global batch would come from different permutations. The strategy therefore sets a global seed,
the same on every worker (:func:`set_job_seed`). But a global seed also changes the operations
that have a seed of their own: one process without a global seed runs
``Dataset.shuffle(seed=5)`` with the seeds ``(DEFAULT_GRAPH_SEED, 5)``, and with a global seed
``g`` with ``(g, 5)``, another order. While the global seed is the one the strategy set (the
program set none), TensorFlow's ``get_seed`` gives an operation with its own seed the seeds of a
process without a global seed, as if the strategy had set nothing; operations without one take
the job's seed. A program that sets the global seed itself (before or after the strategy, with
``tf.random.set_seed`` or ``keras.utils.set_random_seed``) gets TensorFlow's usual seeds.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

_lock = threading.Lock()
_installed = False
# The random.Random TensorFlow's eager context made for the job seed (a new one replaces it at
# every set_seed, also with the same value), and the seed.
_job_rng: Any = None
_job_seed: Optional[int] = None


def set_job_seed(seed: int) -> None:
    """Sets TensorFlow's global seed to ``seed``, as the job's seed (see the module docstring)."""
    global _job_rng, _job_seed
    import tensorflow as tf
    from tensorflow.python.eager import context

    _install()
    tf.random.set_seed(seed)
    with _lock:
        _job_seed = int(seed)
        _job_rng = getattr(context.context(), "_rng", None)


def job_seed_in_effect() -> bool:
    """Whether the global seed in effect (eagerly, or of the graph being built) is the job's
    seed, not one the program set."""
    from tensorflow.python.eager import context
    from tensorflow.python.framework import ops

    with _lock:
        seed, rng = _job_seed, _job_rng
    if seed is None:
        return False
    ctx = context.context()
    if getattr(ctx, "_rng", None) is not rng or context.global_seed() != seed:
        return False  # the program set a seed since (a new generator, even for the same value)
    if context.executing_eagerly():
        return True
    return ops.get_default_graph().seed == seed


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    from tensorflow.python.framework import random_seed

    original = random_seed.get_seed

    def get_seed(op_seed):
        if op_seed is not None and job_seed_in_effect():
            # One process without a global seed (tensorflow/python/framework/random_seed.py).
            return random_seed.DEFAULT_GRAPH_SEED, random_seed._truncate_seed(op_seed)
        return original(op_seed)

    get_seed.__doc__ = original.__doc__
    random_seed.get_seed = get_seed


def host_random_states() -> "Any":
    """Python's and NumPy's global random states as one int64 array (see
    :func:`set_host_random_states`)."""
    import random

    import numpy as np

    version, internal, gauss = random.getstate()
    _name, keys, pos, has_gauss, cached = np.random.get_state()
    floats = np.array([np.nan if gauss is None else gauss, cached], np.float64).view(np.int64)
    return np.concatenate([np.array([version], np.int64), np.asarray(internal, np.int64),
                           np.asarray(keys, np.int64), np.array([pos, has_gauss], np.int64),
                           floats])


def set_host_random_states(states: "Any") -> None:
    """Sets Python's and NumPy's global random states to ``states`` (from
    :func:`host_random_states`, possibly of another process).

    Keras shuffles a ``PyDataset``'s batches (``fit(shuffle=True)``, the default) with Python's
    ``random``, and programs shuffle their own generators' data with it or with NumPy's global
    state: with every worker's states equal to rank 0's, they shuffle in one order. A program
    that seeds them (``keras.utils.set_random_seed``, ``random.seed``) does so on every worker
    alike, so it gets the order of one process that seeds them the same way.
    """
    import random

    import numpy as np

    states = np.asarray(states, np.int64)
    internal_len = len(random.getstate()[1])
    keys_len = len(np.random.get_state()[1])
    at = 1
    internal = tuple(int(v) for v in states[at:at + internal_len])
    at += internal_len
    keys = states[at:at + keys_len].astype(np.uint32)
    at += keys_len
    pos, has_gauss = (int(v) for v in states[at:at + 2])
    gauss, cached = states[at + 2:at + 4].view(np.float64)
    random.setstate((int(states[0]), internal, None if np.isnan(gauss) else float(gauss)))
    np.random.set_state(("MT19937", keys, pos, has_gauss, float(cached)))
