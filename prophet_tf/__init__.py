"""prophet_tf: Prophet-style gradient communication scheduling for TensorFlow / Keras 3."""

from prophet_tf import errors
from prophet_tf.errors import ClusterConfigError, ProphetError

__all__ = ["errors", "ProphetError", "ClusterConfigError"]
__version__ = "0.1.0"
