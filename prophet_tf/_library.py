"""Finds and loads the compiled op library (`_prophet_ops.so`) once per process."""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
from types import ModuleType

from prophet_tf.errors import ProphetError

_LIBRARY_NAME = "_prophet_ops.so"
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def library_path() -> pathlib.Path:
    """Returns the path of the op library, or raises ProphetError saying how to build it.

    Looked up in order: ``$PROPHET_OPS_LIBRARY``, the package directory (``pip install .`` and
    ``scripts/setup.sh`` put it there), then ``bazel-bin`` of a source checkout.
    """
    candidates = []
    if os.environ.get("PROPHET_OPS_LIBRARY"):
        candidates.append(pathlib.Path(os.environ["PROPHET_OPS_LIBRARY"]))
    candidates.append(_PACKAGE_DIR / _LIBRARY_NAME)
    candidates.append(_PACKAGE_DIR.parent / "bazel-bin" / "ops" / "tf" / _LIBRARY_NAME)
    for path in candidates:
        if path.is_file():
            return path
    raise ProphetError(
        "the prophet_tf op library is not built (looked for "
        + ", ".join(str(c) for c in candidates)
        + "). Build it from the source checkout with `bash scripts/setup.sh` (or "
        "`bazel build //ops/tf:_prophet_ops.so`), or install the package with `pip install .`."
    )


@functools.lru_cache(maxsize=None)
def op_module() -> ModuleType:
    """The TensorFlow op module (generated wrappers such as ``prophet_push_pull``)."""
    import tensorflow as tf

    module = tf.load_op_library(str(library_path()))
    _run_independently(_OP_TYPES)
    return module


# The ops are stateful (never constant-folded, merged or pruned), and tf.function's automatic
# control dependencies chain every stateful op that takes no resource in program order. For ops
# matched across workers by name that chain is a deadlock waiting to happen (workers may reach
# them in different orders) and it caps what is in flight at one tensor. TensorFlow's own list of
# "must run, order-insensitive" stateful ops is the documented escape; we join it.
_OP_TYPES = ("ProphetPushPull", "ProphetBroadcast", "ProphetAllgather")


def _run_independently(op_types: tuple[str, ...]) -> None:
    from tensorflow.python.framework import auto_control_deps

    auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = frozenset(
        auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS | set(op_types)
    )


@functools.lru_cache(maxsize=None)
def c_api() -> ctypes.CDLL:
    """The C entry points of the same library (one engine per process is shared with the ops)."""
    op_module()  # load through TensorFlow first so that its framework library is resolved
    lib = ctypes.CDLL(str(library_path()))
    lib.prophet_init.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    lib.prophet_init.restype = ctypes.c_int
    lib.prophet_shutdown.argtypes = []
    lib.prophet_shutdown.restype = None
    lib.prophet_is_initialized.restype = ctypes.c_int
    lib.prophet_rank.restype = ctypes.c_int
    lib.prophet_world_size.restype = ctypes.c_int
    lib.prophet_stats.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.prophet_stats.restype = ctypes.c_int
    lib.prophet_timeline_event.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_longlong, ctypes.c_longlong]
    lib.prophet_timeline_event.restype = None
    lib.prophet_timeline_enabled.restype = ctypes.c_int
    return lib
