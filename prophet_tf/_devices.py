"""Where a worker's replica runs and where prophet_tf's ops run.

One worker process has one replica: on its GPU when the process sees one (the launcher gives each
local worker its own through ``CUDA_VISIBLE_DEVICES``), on the CPU otherwise. The communication
ops have CPU kernels only and are placed on the worker's CPU explicitly (:data:`HOST_DEVICE`), so
that a gradient computed on the GPU is copied to host memory once, as the op's input, and the sum
once back where the optimizer runs; the deferred updates run where the variables live.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

#: Device of every prophet_tf op (merged with the job/task of the surrounding device scope).
HOST_DEVICE = "/device:CPU:0"
LOCAL_RANK_ENV = "PROPHET_LOCAL_RANK"


def replica_device(gpus: Sequence[str], local_rank: Optional[int] = None) -> str:
    """The replica's device given the GPUs this process sees (their names, in order).

    No GPU: ``"/cpu:0"``. One GPU (the launcher's one-GPU-per-worker): that one. Several (the user
    set ``CUDA_VISIBLE_DEVICES`` for every worker): the one at ``local_rank`` (default
    ``$PROPHET_LOCAL_RANK``, else 0) modulo their number.
    """
    if not gpus:
        return "/cpu:0"
    if local_rank is None:
        text = os.environ.get(LOCAL_RANK_ENV, "")
        local_rank = int(text) if text.isdigit() else 0
    return f"/gpu:{local_rank % len(gpus)}"


def default_device() -> str:
    """:func:`replica_device` for the GPUs TensorFlow sees in this process."""
    import tensorflow as tf

    return replica_device([d.name for d in tf.config.list_logical_devices("GPU")])
