"""Custom training loops under ProphetStrategy.

Run: python -m prophet_tf.launch -n N tests/workers/strategy_custom_loop.py

strategy.run / reduce / gather, experimental_distribute_dataset,
distribute_datasets_from_function, experimental_distribute_values_from_function, replica-context
all_reduce / all_gather, sparse all_reduce, and a tf.function training loop that must match one
process training on the global batches.
"""

from __future__ import annotations

import strategy_common as common

import numpy as np
import tensorflow as tf
import keras

from prophet_tf.strategy import ProphetStrategy

GLOBAL_BATCH = 12
FEATURES = 5


def data():
    rng = np.random.RandomState(3)
    x = rng.randn(48, FEATURES).astype("float32")
    y = (x @ rng.randn(FEATURES, 1)).astype("float32") + 0.1
    return x, y


def build():
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def main():
    strategy = ProphetStrategy(schedule="fifo")
    n, rank = strategy.num_replicas_in_sync, strategy.rank
    x, y = data()

    # ---- values from function, reduce, gather, replica-context collectives (eager + graph) ----
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([float(ctx.replica_id_in_sync_group + 1)] *
                                (ctx.replica_id_in_sync_group + 1)))
    checks = {
        "values_local": strategy.experimental_local_results(values)[0].numpy().tolist(),
        "sum_axis0": float(strategy.reduce("SUM", values, axis=0)),
        "mean_axis0": float(strategy.reduce("MEAN", values, axis=0)),
        "gather": strategy.gather(values, axis=0).numpy().tolist(),
    }

    def replica_fn(v):
        ctx = tf.distribute.get_replica_context()
        rid = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        total = ctx.all_reduce("SUM", rid + 1.0)
        mean = ctx.all_reduce("MEAN", tf.stack([rid, 2.0 * rid]))
        gathered = ctx.all_gather(tf.reshape(rid, [1, 1]) * tf.ones([1, 2]), axis=1)
        sparse = ctx.all_reduce("SUM", tf.IndexedSlices(
            tf.fill([1, 3], rid + 1.0), tf.constant([rank % 2], tf.int64), tf.constant([4, 3],
                                                                                    tf.int64)))
        return total, mean, gathered, tf.convert_to_tensor(sparse), tf.reduce_sum(v)

    eager = strategy.run(replica_fn, args=(values,))
    @tf.function
    def run_in_graph(v):
        return strategy.run(replica_fn, args=(v,))

    graph = run_in_graph(values)
    for tag, out in (("eager", eager), ("graph", graph)):
        checks[f"{tag}_total"] = float(out[0])
        checks[f"{tag}_mean"] = out[1].numpy().tolist()
        checks[f"{tag}_all_gather"] = out[2].numpy().tolist()
        checks[f"{tag}_sparse"] = out[3].numpy().tolist()
        checks[f"{tag}_sum_local"] = float(out[4])
    def two():
        return tf.constant(2.0)

    @tf.function
    def reduce_in_graph():
        return strategy.reduce("SUM", strategy.run(two), axis=None)

    checks["reduce_graph"] = float(reduce_in_graph())
    common.result(section="collectives", **checks)

    # ---- distribute_datasets_from_function: disjoint shards, per-replica batches ---------------
    def dataset_fn(ctx):
        ids = tf.data.Dataset.range(40).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ids.batch(ctx.get_per_replica_batch_size(8))

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    seen = []
    for batch in dist:
        seen.append(strategy.gather(batch, axis=0).numpy().tolist())
    common.result(section="datasets_from_function", batches=seen)

    # ---- experimental_distribute_dataset: global batches split in rank order -------------------
    ids = tf.data.Dataset.range(36).batch(GLOBAL_BATCH)
    local_rows, gathered_rows = [], []
    for batch in strategy.experimental_distribute_dataset(ids):
        local_rows.append(batch.numpy().tolist())
        gathered_rows.append(strategy.gather(batch, axis=0).numpy().tolist())
    common.result(section="distribute_dataset", local=local_rows, gathered=gathered_rows)

    # ---- unseeded shuffles give every worker the same order: disjoint shards ---------------------
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter
    keras_shuffled = ArrayDataAdapter(np.arange(36), shuffle=True, batch_size=GLOBAL_BATCH)
    shuffled = {"keras_arrays": keras_shuffled.get_tf_dataset(),
                "dataset_shuffle": tf.data.Dataset.range(36).shuffle(36).batch(GLOBAL_BATCH)}
    epochs = {}
    for name, ds in shuffled.items():
        dist_ds = strategy.experimental_distribute_dataset(ds)
        epochs[name] = [[i for b in dist_ds for i in strategy.gather(
            tf.reshape(b[0] if isinstance(b, tuple) else b, [-1]), axis=0).numpy().tolist()]
            for _ in range(2)]
    common.result(section="shuffle", epochs=epochs)

    # ---- a tf.function training loop equals one process on the global batch ---------------------
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.SGD(0.05, momentum=0.5)
    initial = model.get_weights()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def step_fn(inputs):
        bx, by = inputs
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(bx, training=True) - by), axis=1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_epoch(iterator):
        total = tf.constant(0.0)
        for _ in tf.range(len(x) // GLOBAL_BATCH):
            per_replica = strategy.run(step_fn, args=(next(iterator),))
            total += strategy.reduce("SUM", per_replica, axis=None)
        return total

    losses = [float(train_epoch(iter(dist_dataset))) for _ in range(2)]

    reference = build()
    reference.set_weights(initial)
    ref_opt = keras.optimizers.SGD(0.05, momentum=0.5)
    ref_losses = []
    for _ in range(2):
        total = 0.0
        for bx, by in dataset:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(reference(bx, training=True) - by))
            grads = tape.gradient(loss, reference.trainable_variables)
            ref_opt.apply_gradients(zip(grads, reference.trainable_variables))
            total += float(loss)
        ref_losses.append(total)
    common.result(section="training_loop", losses=losses, ref_losses=ref_losses,
                  maxdiff=common.max_abs_diff(model.get_weights(), reference.get_weights()),
                  moved=common.max_abs_diff(model.get_weights(), initial),
                  digest=common.digest(model.get_weights()))
    print("WORKER DONE", rank, flush=True)


if __name__ == "__main__":
    main()
