"""Training throughput of a keras.applications model on synthetic images.

    python examples/synthetic_throughput.py --model resnet50 --batch 32 --steps 20
    python -m prophet_tf.launch -n 2 examples/synthetic_throughput.py --model vgg16 --batch 32

``--batch`` is the global batch (each of N workers computes batch/N images per step). The model
is built with ``weights=None`` (no download) for small images (default 64x64, 10 classes); the
data is random and generated once. Prints images/s (global) measured over ``--steps`` steps
after ``--warmup`` steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
try:
    import prophet_tf  # noqa: F401
except ImportError:  # a source checkout without `pip install .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

from prophet_tf.strategy import SCHEDULES, ProphetStrategy  # noqa: E402

MODELS = {
    "resnet50": keras.applications.ResNet50,
    "vgg16": keras.applications.VGG16,
    "mobilenetv2": keras.applications.MobileNetV2,
}


class StepTimer(keras.callbacks.Callback):
    def __init__(self, warmup: int):
        super().__init__()
        self.warmup, self.times = warmup, []

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument("--steps", type=int, default=20, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps (tracing)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--schedule", default=None, choices=SCHEDULES, help="default: prophet")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    args = p.parse_args()

    strategy = ProphetStrategy(schedule=args.schedule)
    n = strategy.num_replicas_in_sync
    if args.batch % n:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {n} workers")

    with strategy.scope():
        model = MODELS[args.model](weights=None, input_shape=(args.image_size,) * 2 + (3,),
                                   classes=args.classes)
        opt = (keras.optimizers.SGD(0.01, momentum=0.9) if args.optimizer == "sgd"
               else keras.optimizers.Adam(1e-3))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")

    rng = np.random.RandomState(0)
    images = rng.rand(args.batch, args.image_size, args.image_size, 3).astype(np.float32)
    labels = rng.randint(0, args.classes, size=(args.batch,)).astype(np.int32)
    total_steps = args.warmup + args.steps
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat(total_steps)

    timer = StepTimer(args.warmup)
    model.fit(dataset, epochs=1, steps_per_epoch=total_steps, callbacks=[timer], verbose=0,
              shuffle=False)
    measured = timer.times[args.warmup - 1:] if args.warmup > 0 else timer.times
    seconds = measured[-1] - measured[0] if len(measured) > 1 else float("nan")
    steps = len(measured) - 1
    params = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    if strategy.rank == 0:
        print(f"{args.model}: {params / 1e6:.1f}M parameters, {n} worker(s), global batch "
              f"{args.batch} ({args.batch // n}/worker), {args.image_size}x{args.image_size}, "
              f"schedule {strategy.schedule}", flush=True)
        print(f"{steps} steps in {seconds:.2f} s: {steps * args.batch / seconds:,.1f} images/s "
              f"(global), {seconds / steps * 1e3:.0f} ms/step", flush=True)


if __name__ == "__main__":
    main()
