#!/usr/bin/env bash
# Builds everything, then runs the Keras training demo (examples/keras_fit_demo.py) on NUM_WORKERS (default 2) local workers.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh

PY="${PYTHON_BIN_PATH:-python3}"
NUM_WORKERS="${NUM_WORKERS:-2}"
printf '\033[1;34m[demo]\033[0m %s\n' "$PY -m prophet_tf.launch -n $NUM_WORKERS examples/keras_fit_demo.py $*"
exec "$PY" -m prophet_tf.launch -n "$NUM_WORKERS" examples/keras_fit_demo.py "$@"
