"""``python -m prophet_tf.predict``: see :mod:`prophet_tf.predict.cli`."""

from absl import app

from prophet_tf.predict.cli import define_flags, main

if __name__ == "__main__":
    define_flags()
    app.run(main)
