"""``python -m prophet_tf.bench.train``: see :mod:`prophet_tf.bench.train`."""

from absl import app

from prophet_tf.bench.train.cli import define_flags, main

if __name__ == "__main__":
    define_flags()
    app.run(main)
