"""prophet_tf: Prophet-style gradient communication scheduling for TensorFlow / Keras 3."""

from typing import Any

from prophet_tf import _compat, errors
from prophet_tf.errors import ClusterConfigError, ProphetError

# Before anything uses TensorFlow or Keras: an unsupported pair fails here, naming both.
_compat.check_installed_versions()

__all__ = ["errors", "ProphetError", "ClusterConfigError", "ProphetStrategy"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: `python -m prophet_tf.launch` must not pay for importing TensorFlow.
    if name == "ProphetStrategy":
        from prophet_tf.strategy import ProphetStrategy

        return ProphetStrategy
    raise AttributeError(f"module 'prophet_tf' has no attribute {name!r}")
