"""XLA programs as users write them: ``model.compile(jit_compile=True)`` (the digits CNN of
examples/keras_fit_demo.py and a small Transformer), and custom loops that compile the gradient
computation (``tf.function(jit_compile=True)`` inside ``strategy.run``), or the whole step around
``strategy.run`` (refused on workers: XLA cannot compile the exchange).

Run:
  python -m prophet_tf.launch -n 2 tests/workers/xla_programs.py distributed WORKDIR [--programs a,b]
  python tests/workers/xla_programs.py reference WORKDIR [--programs a,b]      (one process)

The driver is tests/workers/strategy_common.run_programs_main, as for unseen_programs.py: each
process writes ``WORKDIR/<program>.<rank<r>|reference>.npz`` and prints one ``RESULT`` line per
program. Each program's logs also say how XLA ran its training function: the ``_XlaCompile`` /
``_XlaRun`` ops (XLA clusters) and the model's heavy ops (convolutions, matrix products) left
outside any cluster, counted in the graphs TensorFlow executed, and, with ``$XLA_FLAGS``
``--xla_dump_to``, the HLO modules the workers compiled.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import strategy_common as common

import numpy as np
import tensorflow as tf
import keras
from keras import layers
from tensorflow.python.eager import context

sys.path.insert(0, os.path.join(common.ROOT, "examples"))
from keras_fit_demo import build_model as build_digits_cnn, make_digits  # noqa: E402

# The model's own computation: outside an XLA cluster these op types mean it was not compiled.
HEAVY_OPS = frozenset(["MatMul", "_FusedMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D",
                       "_FusedConv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Einsum"])
GLOBAL_BATCH = 32


class Context:
    def __init__(self, name, role, rank, strategy, workdir):
        self.name, self.role, self.rank, self.strategy = name, role, rank, strategy
        self.workdir = workdir

    def scope(self):
        return self.strategy.scope()

    @property
    def distributed(self) -> bool:
        return self.role == "distributed"

    def init(self, model):
        """Rank 0 records the broadcast initial weights; the reference starts from them."""
        path = os.path.join(self.workdir, f"{self.name}.init.npz")
        if self.distributed and self.rank == 0:
            np.savez(path, *model.get_weights())
        elif not self.distributed:
            with np.load(path) as saved:
                model.set_weights([saved[f"arr_{i}"] for i in range(len(saved.files))])
        return model


class Warnings(logging.Handler):
    """The prophet_tf warnings a program triggers."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def executed_ops(run):
    """``run()``'s result and what TensorFlow executed meanwhile, from the function graphs after
    TensorFlow's and XLA's rewrites: XLA clusters appear as _XlaCompile/_XlaRun (the operations
    they hold as one function each), calls of functions compiled as a whole carry
    _XlaMustCompile, and the model's heavy operations appear only where XLA did not take them."""
    context.enable_graph_collection()
    try:
        result = run()
        metadata = context.export_run_metadata()
    finally:
        context.disable_graph_collection()
    nodes = [node for fg in metadata.function_graphs for g in fg.partition_graphs
             for node in g.node]
    return result, {
        "xla_clusters_run": sum(node.op == "_XlaRun" for node in nodes),
        "compiled_function_calls": sum(node.attr["_XlaMustCompile"].b for node in nodes
                                       if "_XlaMustCompile" in node.attr),
        "heavy_ops_outside_xla": sorted(node.op for node in nodes if node.op in HEAVY_OPS),
    }


def history_logs(history):
    return {k: common.floats(v) for k, v in history.history.items()}


PROGRAMS = {}


def program(fn):
    PROGRAMS[fn.__name__] = fn
    return fn


# ---- model.compile(jit_compile=True) -----------------------------------------------------------

@program
def digits_cnn_jit_compile(ctx):
    """examples/keras_fit_demo.py's model and data with jit_compile=True: fit, then predict."""
    x, y = make_digits(128, seed=1)
    xv, yv = make_digits(64, seed=2)
    with ctx.scope():
        model = build_digits_cnn()
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      jit_compile=True)
    ctx.init(model)
    history, ops = executed_ops(lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2,
                                                  shuffle=False, verbose=0))
    logs = history_logs(history)
    logs["predict_sum"] = float(np.sum(model.predict(xv, batch_size=GLOBAL_BATCH, verbose=0)))
    logs["jit_compile"] = bool(model.jit_compile)
    return [model], logs, ops


class TransformerBlock(layers.Layer):
    def __init__(self, dim, heads, hidden, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(heads, dim // heads)
        self.feed_forward = keras.Sequential([layers.Dense(hidden, activation="gelu"),
                                              layers.Dense(dim)])
        self.norm1 = layers.LayerNormalization()
        self.norm2 = layers.LayerNormalization()

    def call(self, inputs):
        h = self.norm1(inputs + self.attention(inputs, inputs))
        return self.norm2(h + self.feed_forward(h))


def transformer(vocab=50, length=16, dim=32, classes=4):
    tokens = keras.Input((length,), dtype="int32")
    positions = layers.Embedding(length, dim)(keras.ops.arange(length))
    h = layers.Embedding(vocab, dim)(tokens) + positions
    h = TransformerBlock(dim, heads=4, hidden=64)(h)
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, layers.Dense(classes, activation="softmax")(h))


@program
def transformer_jit_compile(ctx):
    """A small Transformer classifier (token and position embeddings, multi-head attention,
    layer norm, GELU) with jit_compile=True."""
    rng = np.random.RandomState(4)
    tokens = rng.randint(0, 50, size=(192, 16)).astype("int32")
    labels = (tokens[:, 0] % 4).astype("int32")
    with ctx.scope():
        model = transformer()
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      jit_compile=True)
    ctx.init(model)
    history, ops = executed_ops(lambda: model.fit(tokens, labels, batch_size=GLOBAL_BATCH,
                                                  epochs=2, shuffle=False, verbose=0))
    return [model], history_logs(history), ops


class HashedLabels(layers.Layer):
    """A layer with an operation XLA has no kernel for (string formatting), used as users use a
    tf.strings op in a model."""

    def call(self, inputs):
        text = tf.strings.as_string(tf.round(inputs * 0.0))
        return inputs + 0.0 * tf.strings.to_number(text)


@program
def jit_compile_with_an_op_xla_cannot_compile(ctx):
    """jit_compile=True and an op without XLA kernel: the workers train, that op runs outside
    XLA (one warning names it). One process cannot compile this model at all, so the reference
    trains it without XLA."""
    x, y = make_digits(128, seed=3)
    x = x.reshape(len(x), -1)[:, :32]
    with ctx.scope():
        model = keras.Sequential([keras.Input((32,)), layers.Dense(16, activation="relu"),
                                  HashedLabels(), layers.Dense(10, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      jit_compile=ctx.distributed)
    ctx.init(model)
    history, ops = executed_ops(lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2,
                                                  shuffle=False, verbose=0))
    return [model], history_logs(history), ops


# ---- custom loops --------------------------------------------------------------------------------

def _custom_loop(ctx, compiled_gradients=None, jit_around_run=False, epochs=2):
    """keras.io's custom training loop with strategy.run; the gradient computation is compiled
    by ``compiled_gradients`` (tf.function(jit_compile=True)), or the whole step around
    strategy.run is compiled."""
    x, y = make_digits(128, seed=5)
    x = x.reshape(len(x), -1)
    strategy = ctx.strategy
    with ctx.scope():
        model = keras.Sequential([keras.Input((x.shape[1],)), layers.Dense(32, activation="relu"),
                                  layers.Dense(10)])
        optimizer = keras.optimizers.Adam(1e-3)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    ctx.init(model)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))

    def loss_and_gradients(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.nn.compute_average_loss(loss_fn(yb, logits), global_batch_size=GLOBAL_BATCH)
        return loss, tape.gradient(loss, model.trainable_weights)

    if compiled_gradients:
        loss_and_gradients = tf.function(loss_and_gradients, jit_compile=True)

    def step_fn(xb, yb):
        loss, grads = loss_and_gradients(xb, yb)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    @tf.function(jit_compile=jit_around_run or None)
    def train_step(xb, yb):
        per_replica = strategy.run(step_fn, args=(xb, yb))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def train():
        losses = []
        for _ in range(epochs):
            for xb, yb in dataset:
                losses.append(float(train_step(xb, yb)))
        return losses

    losses, ops = executed_ops(train)
    # A read after the loop (a deferred update may still be pending): the compiled function
    # called eagerly waits for it outside the compiled code.
    probe = x[:4]
    logits = tf.function(lambda v: model(v, training=False), jit_compile=True)(probe)
    return [model], {"loss": losses, "logits_after": np.asarray(logits).ravel().tolist()}, ops


@program
def custom_loop_jit_compiled_gradients(ctx):
    """tf.function(jit_compile=True) on the loss and gradients, called in strategy.run from a
    tf.function; the optimizer applies the (summed) gradients outside XLA."""
    return _custom_loop(ctx, compiled_gradients=True)


@program
def custom_loop_jit_around_strategy_run(ctx):
    """tf.function(jit_compile=True) around strategy.run: one process compiles it; on workers
    the gradient sum would be inside the compiled function, which is refused while tracing."""
    return _custom_loop(ctx, jit_around_run=True, epochs=1)


# ---- driver ----------------------------------------------------------------------------------

def run(name, strategy, workdir, rank, role):
    keras.utils.set_random_seed(1234)
    warnings = Warnings()
    logging.getLogger("prophet_tf").addHandler(warnings)
    t0 = time.time()
    result = dict(program=name, role=role)
    try:
        ctx = Context(name, role, rank, strategy, workdir)
        models, logs, xla = PROGRAMS[name](ctx)
        final = []
        for model in models:
            final += [np.asarray(w) for w in model.get_weights()]
            optimizer = getattr(model, "optimizer", None)
            if optimizer is not None:
                final += [np.asarray(v) for v in optimizer.variables]
        who = "reference" if role == "reference" else f"rank{rank}"
        np.savez(os.path.join(workdir, f"{name}.{who}.npz"), *final)
        result.update(logs=logs, xla=xla, error=None)
    except Exception as e:  # noqa: BLE001 - a failing program is reported, the others still run
        text = str(e)
        text = text if len(text) <= 3000 else text[:1000] + " ... " + text[-2000:]
        result.update(error=f"{type(e).__name__}: {text}")
    finally:
        logging.getLogger("prophet_tf").removeHandler(warnings)
    result["warnings"] = [m for m in warnings.messages if "jit_compile" in m]
    result["seconds"] = round(time.time() - t0, 2)
    common.result(**result)


if __name__ == "__main__":
    common.run_programs_main(
        PROGRAMS, lambda name, strategy, *rest: run(
            name, strategy if strategy is not None else tf.distribute.get_strategy(), *rest),
        timeout_s=120.0)
