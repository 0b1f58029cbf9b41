"""Unchanged Keras `fit` under ProphetStrategy on a small, deterministic digits dataset.

    python examples/keras_fit_demo.py                               # one worker
    python -m prophet_tf.launch -n 2 examples/keras_fit_demo.py     # two workers on this machine

The dataset is generated, not downloaded: 10 digit glyphs (a 5x7 bitmap font) drawn into 16x16
images with random shifts, stroke thickening and noise. Every worker builds the same dataset;
`fit` gives each worker its share of every global batch. Prints the (global) loss and accuracy
going down and the training throughput in samples/s.
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
import keras  # noqa: E402

from prophet_tf.strategy import SCHEDULES, ProphetStrategy  # noqa: E402

# 5x7 bitmaps of the digits 0-9 (one string per row, '#' = ink).
FONT = {
    0: [".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."],
    1: ["..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."],
    2: [".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"],
    3: ["#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."],
    4: ["...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."],
    5: ["#####", "#....", "####.", "....#", "....#", "#...#", ".###."],
    6: ["..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."],
    7: ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."],
    8: [".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."],
    9: [".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."],
}
SIZE = 16


def make_digits(n: int, seed: int):
    """``n`` noisy 16x16 digit images (float32 in [0, 1]) and their labels."""
    rng = np.random.RandomState(seed)
    glyphs = {d: np.array([[c == "#" for c in row] for row in rows], dtype=np.float32)
              for d, rows in FONT.items()}
    x = np.zeros((n, SIZE, SIZE, 1), np.float32)
    y = rng.randint(0, 10, size=n).astype(np.int32)
    for i in range(n):
        g = glyphs[int(y[i])]
        scale = rng.choice([1, 2])  # small or large glyph
        g = np.kron(g, np.ones((scale, scale), np.float32))[:SIZE, :SIZE]
        if rng.rand() < 0.5:  # thicker stroke
            g = np.maximum(g, np.roll(g, 1, axis=1))
        h, w = g.shape
        top, left = rng.randint(0, SIZE - h + 1), rng.randint(0, SIZE - w + 1)
        x[i, top:top + h, left:left + w, 0] = g * rng.uniform(0.6, 1.0)
    x += rng.normal(0.0, 0.25, size=x.shape).astype(np.float32)
    return np.clip(x, 0.0, 1.0), y


def build_model():
    return keras.Sequential([
        keras.Input((SIZE, SIZE, 1)),
        keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])


class Throughput(keras.callbacks.Callback):
    """Prints global training samples/s per epoch (the first epoch includes tracing)."""

    def __init__(self, samples_per_epoch: int, rank: int):
        super().__init__()
        self.samples, self.rank = samples_per_epoch, rank

    def on_epoch_begin(self, epoch, logs=None):
        self.t0, self.t1 = time.perf_counter(), None

    def on_test_begin(self, logs=None):  # validation starts: training of this epoch is done
        if self.t1 is None:
            self.t1 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        dt = (self.t1 or time.perf_counter()) - self.t0
        if self.rank == 0:
            print(f"epoch {epoch + 1}: loss {logs['loss']:.4f}  accuracy {logs['accuracy']:.3f}  "
                  f"val_accuracy {logs['val_accuracy']:.3f}  {self.samples / dt:,.0f} samples/s "
                  f"(global)", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--schedule", default=None, choices=SCHEDULES, help="default: prophet")
    p.add_argument("--compression", default=None, choices=["fp16", "bf16"],
                   help="gradients travel in 16 bits (default: exact)")
    args = p.parse_args()

    strategy = ProphetStrategy(schedule=args.schedule, compression=args.compression)
    if strategy.rank == 0:
        print(f"{strategy.num_replicas_in_sync} worker(s), schedule {strategy.schedule}, "
              f"compression {strategy.compression}, global batch {args.batch}", flush=True)
    keras.utils.set_random_seed(0)  # the same shuffling order on every worker
    x, y = make_digits(args.samples, seed=1)
    x_val, y_val = make_digits(1024, seed=2)

    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(3e-3),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, validation_data=(x_val, y_val),
              callbacks=[Throughput(len(x), strategy.rank)], verbose=0)
    loss, acc = model.evaluate(x_val, y_val, batch_size=args.batch, verbose=0)
    if strategy.rank == 0:
        print(f"validation: loss {loss:.4f}  accuracy {acc:.3f}", flush=True)
        print(f"path: {path_taken(strategy)}", flush=True)


def path_taken(strategy: ProphetStrategy) -> str:
    """The path the push_pulls took, and who chose it."""
    hosts = strategy.two_level_hosts
    path = f"two-level over {hosts} hosts" if hosts else "flat"
    link = strategy.fusion_link_rate
    if link is None or link.two_level is None:
        return path
    return (f"{path} (chosen by the start-up probe: {link.two_level_round_s * 1e3:.1f} ms a round "
            f"on the two-level path, {link.flat_round_s * 1e3:.1f} ms on the flat one)")


if __name__ == "__main__":
    main()
