"""Finds and loads the compiled libraries once per process: the op library (`_prophet_ops.so`,
TensorFlow ops and the runtime), the predictor (`_prophet_predict.so`, no TensorFlow) and, for the
benchmarks only, their emulated compute ops (`_prophet_bench_ops.so`)."""

from __future__ import annotations

import ctypes
import filecmp
import functools
import json
import os
import pathlib
from types import ModuleType
from typing import Any

from prophet_tf import _compat
from prophet_tf.errors import ProphetError

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
# name -> (Bazel package, environment variable that may point at a build)
_LIBRARIES = {"_prophet_ops.so": ("ops/tf", "PROPHET_OPS_LIBRARY"),
              "_prophet_predict.so": ("ops/predict", "PROPHET_PREDICT_LIBRARY"),
              "_prophet_bench_ops.so": ("ops/tf_bench", "PROPHET_BENCH_OPS_LIBRARY")}


def library_path(name: str = "_prophet_ops.so") -> pathlib.Path:
    """Returns the path of library `name`, or raises ProphetError saying how to build it.

    Looked up in order: the environment variable (``$PROPHET_OPS_LIBRARY``,
    ``$PROPHET_PREDICT_LIBRARY``, ``$PROPHET_BENCH_OPS_LIBRARY``), the package directory (``pip install .`` and
    ``scripts/setup.sh`` put it there), then ``bazel-bin`` of a source checkout.
    """
    package, variable = _LIBRARIES[name]
    candidates = []
    if os.environ.get(variable):
        candidates.append(pathlib.Path(os.environ[variable]))
    candidates.append(_PACKAGE_DIR / name)
    candidates.append(_PACKAGE_DIR.parent / "bazel-bin" / package / name)
    for path in candidates:
        if path.is_file():
            return path
    raise ProphetError(
        f"the prophet_tf library {name} is not built (looked for "
        + ", ".join(str(c) for c in candidates)
        + "). Build it from the source checkout with `bash scripts/setup.sh` (or "
        f"`bazel build //{package}:{name}`), or install the package with `pip install .`."
    )


def stale_libraries(checkout: pathlib.Path = _PACKAGE_DIR.parent) -> list[str]:
    """The libraries of a source checkout whose copy in the package directory (what
    :func:`library_path` loads; ``scripts/setup.sh`` copies them there) differs from the one in
    ``bazel-bin`` (a ``bazel build`` alone leaves the copy as it was). Empty where either is
    missing."""
    stale = []
    for name, (package, _) in _LIBRARIES.items():
        loaded = checkout / "prophet_tf" / name
        built = checkout / "bazel-bin" / package / name
        if loaded.is_file() and built.is_file() and not filecmp.cmp(loaded, built, shallow=False):
            stale.append(name)
    return stale


@functools.lru_cache(maxsize=None)
def op_module() -> ModuleType:
    """The TensorFlow op module (generated wrappers such as ``prophet_push_pull``)."""
    import tensorflow as tf


    _compat.check_loaded_versions()
    path = library_path()
    _compat.check_library_matches_tensorflow(path)
    module = tf.load_op_library(str(path))
    _run_independently(_OP_TYPES)
    return module


@functools.lru_cache(maxsize=None)
def bench_op_module() -> ModuleType:
    """The benchmark-only op module (``prophet_emulated_compute`` and its gradient).

    Loaded after the op library: it links against ``_prophet_ops.so`` for the process's one
    engine (its ops write to that engine's timeline), and TensorFlow must have registered the
    op library's ops from that library's own load.
    """
    import tensorflow as tf

    op_module()
    return tf.load_op_library(str(library_path("_prophet_bench_ops.so")))


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
    lib.prophet_set_schedule.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    lib.prophet_set_schedule.restype = ctypes.c_int
    lib.prophet_set_io_threads.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.prophet_set_io_threads.restype = ctypes.c_int
    lib.prophet_set_two_level.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.prophet_set_two_level.restype = ctypes.c_int
    lib.prophet_declare_fusion.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_longlong, ctypes.c_double,
                                           ctypes.c_char_p, ctypes.c_int]
    lib.prophet_declare_fusion.restype = ctypes.c_int
    lib.prophet_scheduler_state.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.prophet_scheduler_state.restype = ctypes.c_int
    lib.prophet_pending_updates.restype = ctypes.c_longlong
    lib.prophet_timeline_flush.argtypes = []
    lib.prophet_timeline_flush.restype = None
    lib.prophet_step_meter_reset.argtypes = []
    lib.prophet_step_meter_reset.restype = None
    lib.prophet_step_begin.argtypes = []
    lib.prophet_step_begin.restype = None
    lib.prophet_step_end.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_int]
    lib.prophet_step_end.restype = ctypes.c_int
    lib.prophet_bytes_sent.argtypes = []
    lib.prophet_bytes_sent.restype = ctypes.c_longlong
    return lib


@functools.lru_cache(maxsize=None)
def runtime_constants() -> dict[str, Any]:
    """What the core defines once and Python must agree with, read from the core itself (through
    the TensorFlow-free library, which links the same core as the op library).

    ``{"schedules": [...], "compressions": [...], "control_priority": int, "protocol_version":
    int, "options": [...], "schedule_traits": {schedule: {"partition_bytes": ...,
    "exact_partitions": ..., "credit_bytes": ..., "automatic_fusion": ...}}}``: ``options`` is the
    engine's option table (ops/core/engine_options.def; prophet_tf/_options.py reads it).
    """
    lib = predict_api()
    buf = ctypes.create_string_buffer(1 << 14)
    needed = lib.prophet_runtime_constants(buf, len(buf))
    if needed >= len(buf):
        buf = ctypes.create_string_buffer(needed + 1)
        lib.prophet_runtime_constants(buf, len(buf))
    return json.loads(buf.value.decode())


def call_returning_text(entry: Any, request: str) -> tuple[int, str]:
    """Calls an entry point of the TensorFlow-free library that answers with text it allocates
    (``prophet_predict``'s conventions): its status code (0: done) and that text."""
    result = ctypes.c_void_p()
    code = entry(request.encode(), ctypes.byref(result))
    try:
        text = ctypes.string_at(result.value).decode() if result.value else ""
    finally:
        predict_api().prophet_predict_free(result)
    return int(code), text


@functools.lru_cache(maxsize=None)
def predict_api() -> ctypes.CDLL:
    """The TensorFlow-free library's C entry points (ops/predict/c_api.cc)."""
    lib = ctypes.CDLL(str(library_path("_prophet_predict.so")))
    lib.prophet_predict.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.prophet_predict.restype = ctypes.c_int
    lib.prophet_predict_ideal.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.prophet_predict_ideal.restype = ctypes.c_int
    lib.prophet_predict_free.argtypes = [ctypes.c_void_p]
    lib.prophet_predict_free.restype = None
    lib.prophet_runtime_constants.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.prophet_runtime_constants.restype = ctypes.c_int
    lib.prophet_runtime_lane_slice_from_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.prophet_runtime_lane_slice_from_bytes.restype = ctypes.c_ulonglong
    lib.prophet_runtime_resolve.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.prophet_runtime_resolve.restype = ctypes.c_int
    return lib
