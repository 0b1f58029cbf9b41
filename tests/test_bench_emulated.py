"""Tests of accelerator-emulated compute (prophet_tf/bench/emulated.py, the ProphetEmulatedCompute
op): the time model, the layer specs against real Keras models, and the emulated model's
gradients (shapes, dtypes, order, and the data dependencies that order them). No test depends on
how fast anything runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prophet_tf import timeline
from prophet_tf.bench import emulated
from prophet_tf.bench.emulated import (BACKWARD_FLOPS_FACTOR, LayerSpec, WeightSpec,
                                       accelerator_step_s, layer_specs, layer_times, step_flops)

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")


def _spec(name: str, flops: float, *shapes: tuple[int, ...]) -> LayerSpec:
    return LayerSpec(name, "Dense", tuple(WeightSpec(f"w{i}", s, "float32", True)
                                          for i, s in enumerate(shapes)), flops)


# ---------------------------------------------------------------- time model

def test_layer_times_follow_flops_rate_batch_and_scale():
    specs = [_spec("a", 1e9, (4, 4)), _spec("b", 3e9, (4,))]
    # 1 GFLOP x batch 10 at 100 TFLOP/s = 0.1 ms forward; backward twice that
    times = layer_times(specs, batch=10, tflops=100.0)
    assert times[0] == pytest.approx((1e-4, 2e-4))
    assert times[1] == pytest.approx((3e-4, 6e-4))
    assert BACKWARD_FLOPS_FACTOR == 2.0
    scaled = layer_times(specs, batch=10, tflops=100.0, time_scale=40.0)
    assert [f for f, _ in scaled] == pytest.approx([40 * f for f, _ in times])
    assert layer_times(specs, batch=20, tflops=200.0) == pytest.approx(times)
    assert step_flops(specs, 10) == pytest.approx(4e9 * 10 * 3)
    assert accelerator_step_s(specs, 10, 100.0, 2.0) == pytest.approx(2 * 3 * 4e-4)
    for bad in (dict(batch=0), dict(tflops=0.0), dict(tflops=float("inf")), dict(time_scale=0.0)):
        kw = {**dict(batch=1, tflops=1.0, time_scale=1.0), **bad}
        with pytest.raises(ValueError):
            layer_times(specs, **kw)


def test_layer_flops_of_conv_dense_attention_and_elementwise():
    x = keras.Input((8, 8, 3))
    conv = keras.layers.Conv2D(16, 3, padding="same", name="conv")
    relu = keras.layers.ReLU(name="relu")
    pool = keras.layers.MaxPooling2D(2, name="pool")
    flat = keras.layers.Flatten(name="flat")
    dense = keras.layers.Dense(10, name="dense")
    keras.Model(x, dense(flat(pool(relu(conv(x))))))
    assert emulated.layer_flops(conv) == 2 * (3 * 3 * 3 * 16) * (8 * 8)
    assert emulated.layer_flops(relu) == 8 * 8 * 16
    assert emulated.layer_flops(pool) == 4 * 4 * 16 * 4
    assert emulated.layer_flops(dense) == 2 * (4 * 4 * 16) * 10

    t = keras.Input((5, 12))
    mha = keras.layers.MultiHeadAttention(3, 4, name="mha")
    keras.Model(t, mha(t, t))
    projections = 4 * 12 * 12        # query, key, value: 12 -> 3x4; output: 3x4 -> 12
    assert emulated.layer_flops(mha) == 2 * projections * 5 + 4 * 5 * 5 * 12
    e = keras.Input((7,), dtype="int32")
    emb = keras.layers.Embedding(50, 6, name="emb")
    keras.Model(e, emb(e))
    assert emulated.layer_flops(emb) == 0


def _small_cnn():
    x = keras.Input((16, 16, 3))
    h = keras.layers.ZeroPadding2D(1, name="pad")(x)
    h = keras.layers.Conv2D(8, 3, name="conv1")(h)
    h = keras.layers.BatchNormalization(name="bn1")(h)
    h = keras.layers.ReLU(name="relu1")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", name="conv2")(h)
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    return keras.Model(x, keras.layers.Dense(5, name="head")(h))


def test_layer_specs_keep_every_variable_in_order_and_merge_variable_free_layers():
    model = _small_cnn()
    specs = layer_specs(model)
    assert [s.name for s in specs] == ["conv1", "bn1", "conv2", "head"]
    assert specs[0].merged == ("input_layer", "pad") or specs[0].merged[-1] == "pad"
    assert specs[1].merged == ("relu1",) and specs[2].merged == ("gap",)
    trainable = [(w.shape, w.dtype) for s in specs for w in s.weights if w.trainable]
    assert trainable == [(tuple(w.shape), "float32") for w in model.trainable_weights]
    assert [w.name for w in specs[1].weights] == ["gamma", "beta", "moving_mean",
                                                  "moving_variance"]
    assert [w.trainable for w in specs[1].weights] == [True, True, False, False]
    # merged layers' FLOPs are counted in the layer before them
    assert specs[1].flops == pytest.approx(emulated.layer_flops(model.get_layer("bn1"))
                                           + emulated.layer_flops(model.get_layer("relu1")))
    assert sum(s.gradient_bytes() for s in specs) == 4 * sum(
        int(tf.size(w)) for w in model.trainable_weights)
    assert emulated.specs_from_json(emulated.specs_to_json(specs)) == specs


def test_layer_specs_of_attention_have_unique_names_without_slashes():
    from prophet_tf.bench import models
    cfg = models.config_for("bert_base", "emulated", blocks=1, d_model=16, heads=2, ff=32,
                            seq_len=4, vocab=11, positions=8)
    model = models.build_model(cfg)
    specs = layer_specs(model)
    mha = next(s for s in specs if s.kind == "MultiHeadAttention")
    names = [w.name for w in mha.weights]
    assert names[:2] == ["query_kernel", "query_bias"] and len(set(names)) == len(names) == 8
    assert all("/" not in w.name for s in specs for w in s.weights)
    shapes = [w.shape for s in specs for w in s.weights if w.trainable]
    assert shapes == [tuple(w.shape) for w in model.trainable_weights]
    assert specs[0].name == "token_embedding" and specs[0].weights[0].shape == (11, 16)
    assert [s.name for s in specs][-2:] == ["pooler", "classifier"]


def test_resnet50_flops_match_the_published_count():
    # ResNet-50 at 224x224: 3.8-4.1 G multiply-adds per image (He et al. 2016; common counters)
    from prophet_tf.bench import models
    model = models.build_model(models.config_for("resnet50", "emulated"))
    specs = layer_specs(model)
    assert 7.6e9 <= sum(s.flops for s in specs) <= 8.2e9
    assert sum(s.gradient_bytes() for s in specs) == 4 * models.parameter_count(model)
    assert models.parameter_count(model) == 25_583_592      # trainable, keras.applications
    assert sum(len([w for w in s.weights if w.trainable]) for s in specs) == 214


def test_load_or_make_specs_builds_once(tmp_path):
    path = tmp_path / "specs" / "m.json"
    built = []

    def build():
        built.append(1)
        return _small_cnn()

    first = emulated.load_or_make_specs(str(path), build)
    second = emulated.load_or_make_specs(str(path), build)
    assert first == second and len(built) == 1 and path.exists()


# ---------------------------------------------------------------- the op and its gradient

def _emulated_small_cnn(time_scale: float = 1.0):
    specs = layer_specs(_small_cnn())
    return specs, emulated.build_emulated_model(specs, batch=4, tflops=100.0,
                                                time_scale=time_scale, classes=5)


def test_emulated_model_has_the_real_variables_and_output_shape():
    specs, model = _emulated_small_cnn()
    real = _small_cnn()
    assert [(tuple(w.shape), w.dtype) for w in model.trainable_weights] == [
        (tuple(w.shape), w.dtype) for w in real.trainable_weights]
    assert len(model.non_trainable_weights) == len(real.non_trainable_weights)
    y = model(tf.zeros([4, 1]))
    assert y.shape == (4, 5) and float(tf.reduce_sum(tf.abs(y))) == 0.0


@pytest.mark.parametrize("traced", [False, True])
def test_emulated_gradients_have_variable_shapes_dtypes_and_order(traced):
    _, model = _emulated_small_cnn()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def grads(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        return tape.gradient(loss, model.trainable_weights)

    fn = tf.function(grads) if traced else grads
    out = fn(tf.zeros([4, 1]), tf.constant([0, 1, 2, 3]))
    assert len(out) == len(model.trainable_weights)
    for g, w in zip(out, model.trainable_weights):
        assert g is not None and isinstance(g, tf.Tensor)
        assert tuple(g.shape) == tuple(w.shape) and g.dtype == w.dtype
        assert float(tf.reduce_sum(tf.abs(g))) == 0.0


def test_emulated_graph_orders_layers_as_real_training():
    """Forward k waits for forward k-1 and layer k's variable reads; backward k waits for
    backward k+1; each variable's gradient comes out of its own layer's backward op."""
    specs, model = _emulated_small_cnn()

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return tape.gradient(loss, model.trainable_weights)

    graph = step.get_concrete_function(tf.TensorSpec([4, 1], tf.float32)).graph
    forward = [op for op in graph.get_operations() if op.type == "ProphetEmulatedCompute"]
    backward = [op for op in graph.get_operations() if op.type == "ProphetEmulatedComputeGrad"]
    by_layer = {op.get_attr("layer").decode(): op for op in forward}
    grad_by_layer = {op.get_attr("layer").decode(): op for op in backward}
    names = [s.name for s in specs]
    assert sorted(by_layer) == sorted(names) == sorted(grad_by_layer)
    times = layer_times(specs, 4, 100.0)
    for k, name in enumerate(names):
        op = by_layer[name]
        assert op.get_attr("forward_ns") == round(times[k][0] * 1e9)
        assert op.get_attr("backward_ns") == round(times[k][1] * 1e9)
        trainable = [w for w in specs[k].weights if w.trainable]
        assert len(op.inputs) == 1 + len(trainable)
        for read in op.inputs[1:]:
            assert read.op.type == "ReadVariableOp"
        if k > 0:
            assert op.inputs[0].op is by_layer[names[k - 1]]
        grad = grad_by_layer[name]
        assert grad.get_attr("backward_ns") == op.get_attr("backward_ns")
        assert [tuple(d.size for d in proto.dim) for proto in grad.get_attr("grad_shapes")] == [
            w.shape for w in trainable]
        assert list(grad.get_attr("Tgrads")) == [tf.float32] * len(trainable)
        if k + 1 < len(names):
            # the incoming gradient is the dx of the next layer's backward (maybe via Identity)
            src = grad.inputs[0].op
            while src.type in ("Identity", "IdentityN"):
                src = src.inputs[0].op
            assert src is grad_by_layer[names[k + 1]]


def test_grad_op_rejects_mismatched_attributes():
    from prophet_tf._library import bench_op_module
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError, TypeError)):
        bench_op_module().prophet_emulated_compute_grad(
            tf.zeros([2, 1]), tf.zeros([2, 1]), Tgrads=[tf.float32, tf.float32],
            grad_shapes=[[3, 3]], backward_ns=0, layer="bad")


def test_emulated_compute_spans_reach_the_runtimes_timeline(tmp_path):
    # The emulated ops live in a library of their own, linked against the op library: their spans
    # must land on the timeline of the process's one engine, which the op library holds.
    path = tmp_path / "trace.json"
    code = textwrap.dedent(f"""
        import tensorflow as tf
        from prophet_tf import runtime
        from prophet_tf.bench import emulated
        runtime.init(0, 1, timeline_path={str(path)!r})
        emulated.emulated_compute(tf.zeros([2, 3]), [tf.zeros([3, 4])], forward_s=1e-3,
                                  backward_s=1e-3, units=4, layer="dense_x")
        runtime.shutdown()
    """)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          timeout=600, env={"PYTHONPATH": str(root), "TF_CPP_MIN_LOG_LEVEL": "3",
                                            "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    tracks = timeline.events_by_track(timeline.load_trace(path))
    assert [e["name"] for e in tracks.get("forward", [])] == ["dense_x"], tracks.keys()
