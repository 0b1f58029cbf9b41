"""Communication ops: usable eagerly and inside `tf.function`.

Every worker must call the same ops with the same ``name`` for the same logical tensor; a name
used repeatedly is matched by how many times each worker used it before.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from prophet_tf import _xla
from prophet_tf._devices import HOST_DEVICE
from prophet_tf._library import op_module, runtime_constants

#: Values of ``compression`` besides ``None``: float32 values travel as IEEE half precision
#: ("fp16", scaled per partition so that no finite value overflows) or as bfloat16 ("bf16").
COMPRESSIONS: tuple[str, ...] = tuple(runtime_constants()["compressions"])


def _check_name(name: str, what: str) -> str:
    """``name``, checked, for a collective that is not inside a function XLA compiles."""
    if not isinstance(name, str) or not name:
        raise ValueError("prophet_tf ops need a non-empty `name` that is the same on every worker")
    _xla.refuse_collective(f"the {what} '{name}'")
    return name


def compression_attr(compression: Optional[str]) -> str:
    """The ops' ``compression`` attribute for ``None`` or one of :data:`COMPRESSIONS`; raises
    ValueError naming the accepted values for anything else."""
    if compression is None:
        return "none"
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be None or one of {COMPRESSIONS}, got {compression!r}")
    return compression


def push_pull(tensor: tf.Tensor, name: str, priority: int = 0, average: bool = False,
              compression: Optional[str] = None) -> tf.Tensor:
    """Sums ``tensor`` over all workers (or averages it with ``average=True``).

    Args:
      tensor: a float16, bfloat16, float32, float64, int32 or int64 tensor.
      name: the tensor's name, identical on every worker.
      priority: larger is sent earlier when several tensors wait for the network.
      average: divide the sum by the number of workers.
      compression: ``None`` (exact), ``"fp16"`` or ``"bf16"``: a float32 tensor's values travel in
        16 bits each way. The partitions' owners add in float32 and send the sum back compressed,
        so every worker gets the same result, within the bound of docs/design.md
        ("Compression"). Other dtypes travel as they are. Every worker must pass the same value.
    """
    tensor = tf.convert_to_tensor(tensor)
    with tf.device(HOST_DEVICE):  # CPU kernels: one copy from the GPU, as the op's input
        return op_module().prophet_push_pull(
            tensor, tensor_name=_check_name(name, "sum over workers"), priority=int(priority),
            reduce_op="mean" if average else "sum", compression=compression_attr(compression),
        )


def broadcast(tensor: tf.Tensor, name: str, root_rank: int = 0) -> tf.Tensor:
    """Returns ``root_rank``'s value of ``tensor`` on every worker."""
    tensor = tf.convert_to_tensor(tensor)
    with tf.device(HOST_DEVICE):
        return op_module().prophet_broadcast(tensor, tensor_name=_check_name(name, "broadcast"),
                                             root_rank=int(root_rank))


def allgather(tensor: tf.Tensor, name: str, priority: int = 0,
              compression: Optional[str] = None) -> tf.Tensor:
    """Concatenates every worker's ``tensor`` along dimension 0, in rank order.

    The first dimension may differ across workers; the others must match. ``priority`` orders it
    against other traffic, as for :func:`push_pull` (sparse gradients use it). ``compression``
    as for :func:`push_pull`: every worker, the sender included, gets each float32 tensor as it
    travelled.
    """
    tensor = tf.convert_to_tensor(tensor)
    with tf.device(HOST_DEVICE):
        return op_module().prophet_allgather(tensor,
                                             tensor_name=_check_name(name, "gather across workers"),
                                             priority=int(priority),
                                             compression=compression_attr(compression))
