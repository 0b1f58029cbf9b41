"""Where the indices of a sparse gradient come from (prophet_tf/_sparse.py), in one process: it
decides whether the workers' slices are gathered (ids from the batch) or summed (positions)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import keras

from prophet_tf import _sparse

LENGTH, VOCAB, DIM = 6, 20, 3


class TokenAndPosition(keras.layers.Layer):
    def __init__(self, tied=False):
        super().__init__()
        self.tokens = keras.layers.Embedding(VOCAB, DIM)
        self.positions = self.tokens if tied else keras.layers.Embedding(LENGTH, DIM)

    def call(self, x):
        return self.tokens(x) + self.positions(keras.ops.arange(keras.ops.shape(x)[-1]))


def _origins(tied=False) -> dict:
    """Traces a train-step-like function; returns {variable path: (from input, mixed)}."""
    layer = TokenAndPosition(tied)
    found = {}

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x))
        for v, g in zip(layer.trainable_variables, tape.gradient(loss, layer.trainable_variables)):
            assert isinstance(g, tf.IndexedSlices), (v.path, type(g))
            found[v.path] = (_sparse.may_come_from_input(g.indices),
                             _sparse.mixes_origins(g.indices))
        return loss

    step(np.zeros((4, LENGTH), "int32"))
    return found


def test_token_ids_come_from_input_positions_do_not():
    origins = _origins()
    token_path, position_path = sorted(origins)   # embedding/..., embedding_1/...
    assert origins[token_path] == (True, False)
    assert origins[position_path] == (False, False)


def test_one_table_looked_up_both_ways_is_mixed():
    (origin,) = _origins(tied=True).values()
    assert origin == (True, True)


def test_random_and_eager_indices_count_as_from_input():
    """Random indices may differ per worker, eager ones have no graph: never summed blindly."""
    found = {}

    @tf.function
    def traced():
        found["random"] = _sparse.may_come_from_input(
            tf.random.uniform([3], maxval=5, dtype=tf.int32))
        found["constant"] = _sparse.may_come_from_input(tf.range(3) * 2)
        return tf.constant(0)

    traced()
    assert found == {"random": True, "constant": False}
    assert _sparse.may_come_from_input(tf.range(3))
