"""``python -m prophet_tf.launch``: the same program as ``prophetrun``."""

import sys

from prophet_tf.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
