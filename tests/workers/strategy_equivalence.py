"""Multi-worker training must give the weights of one process training on the global batch.

Run: python -m prophet_tf.launch -n N tests/workers/strategy_equivalence.py [--cases a,b,...]

For every case: build the model under ProphetStrategy (initial weights broadcast from rank 0),
fit on N workers (each gets B/N rows of every global batch), then build the same model in this
process *outside* the strategy, give it the same initial weights, fit it on the global batches,
and compare. Prints one ``RESULT`` line per case.
"""

from __future__ import annotations

import argparse
import time

import strategy_common as common

import numpy as np
import tensorflow as tf
import keras

from prophet_tf.strategy import ProphetStrategy

GLOBAL_BATCH = 24          # divisible by 2 and 3 workers
NUM_SAMPLES = 96           # 4 steps per epoch
EPOCHS = 2
FEATURES, CLASSES, VOCAB, SEQ = 6, 3, 1000, 5


def data(kind: str):
    rng = np.random.RandomState(1234)
    if kind == "tokens":
        x = rng.randint(0, VOCAB, size=(NUM_SAMPLES, SEQ)).astype("int32")
        y = (x[:, 0] % CLASSES).astype("int32")
    else:
        x = rng.randn(NUM_SAMPLES, FEATURES).astype("float32")
        teacher = rng.randn(FEATURES, CLASSES).astype("float32")
        y = np.argmax(x @ teacher + 0.1 * rng.randn(NUM_SAMPLES, CLASSES), axis=1).astype("int32")
    return x, y


def sequential():
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])


def functional():
    inp = keras.Input((FEATURES,))
    h = keras.layers.Dense(16, activation="tanh")(inp)
    h2 = keras.layers.Dense(8, activation="relu")(h)
    out = keras.layers.Dense(CLASSES, activation="softmax")(keras.layers.Concatenate()([h, h2]))
    return keras.Model(inp, out)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(16, activation="relu")
        self.d2 = keras.layers.Dense(CLASSES, activation="softmax")

    def call(self, x):
        return self.d2(self.d1(x))


def subclassed():
    m = Subclassed()
    m(np.zeros((1, FEATURES), "float32"))
    return m


def embedding(vocab=VOCAB):
    def build():
        return keras.Sequential([
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(vocab, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ])
    return build


def regularized():
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(1e-2),
                           bias_regularizer=keras.regularizers.L1(1e-3),
                           activity_regularizer=keras.regularizers.L1(1e-3)),
        keras.layers.Dense(CLASSES, activation="softmax",
                           kernel_regularizer=keras.regularizers.L1L2(1e-3, 1e-3)),
    ])


def many_small():
    """Twelve small dense layers: 24 gradients of 3 to 64 floats (what fusion is for)."""
    layers = [keras.Input((FEATURES,))]
    layers += [keras.layers.Dense(8, activation="tanh") for _ in range(11)]
    layers.append(keras.layers.Dense(CLASSES, activation="softmax"))
    return keras.Sequential(layers)


def wide():
    """A 1024 x 2048 kernel (8 MiB): large enough to travel in slices on up to 8 lanes
    (io_threads)."""
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])


# name: (model builder, optimizer factory, data kind, input kind, steps_per_execution,
#        sparse_as_dense_bytes or None for the default)
CASES = {
    "sgd": (sequential, lambda: keras.optimizers.SGD(0.1), "dense", "numpy", 1, None),
    "momentum": (functional, lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
                 "dense", "dataset", 1, None),
    "adam": (subclassed, lambda: keras.optimizers.Adam(0.01), "dense", "numpy", 2, None),
    "embedding": (embedding(), lambda: keras.optimizers.SGD(0.5), "tokens", "numpy", 1, None),
    "embedding_adam": (embedding(), lambda: keras.optimizers.Adam(0.01), "tokens", "dataset",
                       1, None),
    "embedding_small_dense": (embedding(50), lambda: keras.optimizers.SGD(0.5), "tokens",
                              "numpy", 1, 1 << 20),
    "many_small": (many_small, lambda: keras.optimizers.SGD(0.05, momentum=0.9), "dense", "numpy", 1,
                   None),
    # SGD: Adam turns the last-bit differences of the sums' order (which the lanes' partitions
    # set) into steps of the learning rate's size where a gradient is near 0.
    "wide": (wide, lambda: keras.optimizers.SGD(0.05, momentum=0.9), "dense", "numpy", 1, None),
    "regularizers": (regularized, lambda: keras.optimizers.RMSprop(0.01), "dense", "numpy", 1,
                     None),
}


def fit(model, x, y, input_kind, batch_size):
    if input_kind == "dataset":
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
        return model.fit(ds, epochs=EPOCHS, verbose=0)
    return model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)


def run_case(strategy, name):
    t0 = time.time()
    build, make_opt, data_kind, input_kind, spe, sparse_bytes = CASES[name]
    x, y = data(data_kind)
    if name == "embedding_small_dense":
        x = x % 50
    default_sparse = strategy.extended.collectives.sparse_as_dense_bytes
    if sparse_bytes is not None:
        strategy.extended.collectives.sparse_as_dense_bytes = sparse_bytes
    try:
        with strategy.scope():
            model = build()
            model.compile(optimizer=make_opt(), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"], steps_per_execution=spe)
        initial = model.get_weights()
        ops_before, fused_before = _runtime_ops()
        hist = fit(model, x, y, input_kind, GLOBAL_BATCH)
        ops_after, fused_after = _runtime_ops()
    finally:
        strategy.extended.collectives.sparse_as_dense_bytes = default_sparse
    final = model.get_weights()

    t_ref = time.time()
    against_reference = {}
    # Every rank makes the reference's layers and optimizer, so that Keras's automatic names (in
    # the variables the next case creates under the strategy, which the workers check agree) stay
    # the same on every rank; rank 0 alone trains it: the others' weights and logs are checked
    # bitwise equal to rank 0's, so its comparison is theirs.
    reference = build()          # outside the strategy: one process, global batches
    reference_optimizer = make_opt()
    if strategy.rank == 0:
        reference.set_weights(initial)
        # Eagerly: no second tf.function trace (the slow part of these tiny runs).
        reference.compile(optimizer=reference_optimizer, loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"], steps_per_execution=spe, run_eagerly=True)
        ref_hist = fit(reference, x, y, input_kind, GLOBAL_BATCH)
        against_reference = dict(maxdiff=common.max_abs_diff(final, reference.get_weights()),
                                 ref_loss=common.floats(ref_hist.history["loss"]),
                                 ref_accuracy=common.floats(ref_hist.history["accuracy"]))
    common.result(
        case=name,
        workers=strategy.num_replicas_in_sync,
        moved=common.max_abs_diff(final, initial),
        initial_digest=common.digest(initial),
        digest=common.digest(final),
        loss=common.floats(hist.history["loss"]),
        accuracy=common.floats(hist.history["accuracy"]),
        **against_reference,
        ops=ops_after - ops_before,
        fused=fused_after - fused_before,
        gradients=len(model.trainable_weights),
        two_level_hosts=int(runtime_stats().get("two_level_hosts", 0)),
        lane_bytes_sent=runtime_stats().get("lane_bytes_sent", []),
        lanes=int(runtime_stats().get("lanes", 1)),
        io_threads=int(runtime_stats().get("io_threads", 1)),
        link=_link(strategy),
        steps=EPOCHS * NUM_SAMPLES // GLOBAL_BATCH,
        seconds=round(time.time() - t0, 2),
        fit_seconds=round(t_ref - t0, 2),
    )


def _link(strategy) -> dict:
    """What the start-up probe agreed (fusion's rate, the lanes), or {}."""
    rate = strategy.fusion_link_rate
    if rate is None:
        return {}
    return {"agreed_gbps": rate.agreed_gbps, "io_threads": rate.io_threads,
            "cpu_ns_per_byte": rate.cpu_ns_per_byte, "two_level": rate.two_level,
            "two_level_round_s": rate.two_level_round_s, "flat_round_s": rate.flat_round_s}


def runtime_stats() -> dict:
    from prophet_tf import runtime
    return runtime.stats()


def _runtime_ops() -> tuple[int, int]:
    """Operations this worker's runtime finished so far (a fused bucket is one), and push_pulls
    that travelled in a fused bucket."""
    from prophet_tf import runtime
    stats = runtime.stats()
    return int(stats.get("ops_done", 0)), int(stats.get("fused_submitted", 0))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--schedule", default="priority")
    p.add_argument("--fusion", default=None,
                   help="ProphetStrategy(fusion=...): auto, off or bytes (default: the strategy's)")
    p.add_argument("--hosts", default=None,
                   help="comma-separated host label per rank: the two-level push_pull over them "
                        "(ProphetStrategy(hierarchical='on', hosts=...))")
    p.add_argument("--io_threads", type=int, default=None, help="ProphetStrategy(io_threads=...)")
    p.add_argument("--host_labels", default=None,
                   help="comma-separated host label per rank (ProphetStrategy(hosts=...)), the path "
                        "left to hierarchical's default")
    args = p.parse_args()
    options = ({} if args.fusion is None else
               {"fusion": args.fusion if args.fusion in ("auto", "off") else int(args.fusion)})
    if args.host_labels:
        options.update(hosts=args.host_labels.split(","))
    if args.io_threads is not None:
        options.update(io_threads=args.io_threads)
    if args.hosts:
        options.update(hierarchical="on", hosts=args.hosts.split(","))
    strategy = ProphetStrategy(schedule=args.schedule, **options)
    for name in args.cases.split(","):
        run_case(strategy, name)
    print("WORKER DONE", flush=True)


if __name__ == "__main__":
    main()
