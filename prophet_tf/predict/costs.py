"""The CPU costs the predictor charges on each worker's I/O thread, measured on the machine at hand.

    python -m prophet_tf.predict calibrate [--out costs.json] [--effort 1]
    python -m prophet_tf.predict PROFILE.json ... --costs costs.json [--cost_scale 0.5]

The predictor charges, per worker, the CPU its runtime's one I/O thread spends (``NetworkModel``
in ops/sim/simulator.h): per frame sent and received (header, system calls, the engine's turn),
and per byte: the payload's copy into and out of the socket, adding a contribution into a sum,
casting float32 to or from 16 bits when compressing, and fusion's copies. :func:`calibrate` runs
``ops/predict/calibrate.cc`` in the predictor's library (no TensorFlow): the summation and codec
kernels and memcpy on their own, then two real engines in this process over loopback with large
and with tiny push_pulls (see that file for how each number is derived). It takes about
``effort`` x 5-10 s and measures CPU time, not wall time, so a loaded machine slows it rather than
biasing it much (caches and memory bandwidth are still shared).

The file holds ``options``: the :class:`~prophet_tf.predict.PredictOptions` fields to set
(``message_send_s``, ``message_receive_s``, ``send_byte_s``, ``receive_byte_s``, ``sum_byte_s``,
``cast_byte_s``, ``copy_byte_s``), with the machine they were measured on. A calibration of one
machine predicts another only as far as their cores compare: ``--cost_scale`` multiplies every
cost (0.5: a machine whose I/O thread is twice as fast).
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import json
import os
import platform
import sys
from typing import Any, Optional, Sequence

__all__ = ["COST_FIELDS", "calibrate", "load_costs", "apply_costs", "calibrate_main"]

COSTS_FORMAT = "prophet_tf.cpu_costs"
#: PredictOptions fields a calibration sets, and the library's key (ns) for each.
COST_FIELDS = {"message_send_s": "message_send_ns", "message_receive_s": "message_receive_ns",
               "send_byte_s": "send_byte_ns", "receive_byte_s": "receive_byte_ns",
               "sum_byte_s": "sum_byte_ns", "cast_byte_s": "cast_byte_ns",
               "copy_byte_s": "copy_byte_ns"}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def calibrate(effort: float = 1.0) -> dict[str, Any]:
    """Measures the costs on this machine; returns the costs file's content (module docstring).

    Raises:
      prophet_tf.predict.PredictError: the measurement failed (the message says why).
    """
    from prophet_tf._library import predict_api
    from prophet_tf.predict.model import PredictError
    api = predict_api()
    api.prophet_predict_calibrate.argtypes = [ctypes.c_double, ctypes.POINTER(ctypes.c_void_p)]
    api.prophet_predict_calibrate.restype = ctypes.c_int
    load = os.getloadavg()
    result = ctypes.c_void_p()
    code = api.prophet_predict_calibrate(float(effort), ctypes.byref(result))
    try:
        text = ctypes.string_at(result.value).decode() if result.value else ""
    finally:
        api.prophet_predict_free(result)
    if code != 0:
        raise PredictError(f"calibration failed: {text}")
    raw = json.loads(text)
    return {
        "format": COSTS_FORMAT,
        "version": 1,
        "options": {field: raw[key] * 1e-9 for field, key in COST_FIELDS.items()},
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "kernel": platform.release(),
                    "hostname": platform.node()},
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_before": list(load),
        "measurements": raw,
    }


def load_costs(path: str) -> dict[str, float]:
    """The PredictOptions fields of a costs file (``calibrate --out``).

    Raises:
      ValueError: not a costs file, or a cost that is not a number >= 0.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the costs file {path}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != COSTS_FORMAT:
        raise ValueError(f"{path} is not a costs file (written by `python -m prophet_tf.predict "
                         "calibrate --out FILE`)")
    options = data.get("options", {})
    out = {}
    for field in COST_FIELDS:
        value = options.get(field, 0.0)
        if not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{path}: {field} must be a number >= 0, got {value!r}")
        out[field] = float(value)
    return out


def apply_costs(options: Any, costs: Optional[dict[str, float]], scale: float = 1.0) -> Any:
    """``options`` (a PredictOptions) with ``costs`` x ``scale`` charged (None: unchanged)."""
    if not costs:
        return options
    if not scale >= 0:
        raise ValueError(f"the cost scale must be >= 0, got {scale!r}")
    return dataclasses.replace(options, **{k: v * scale for k, v in costs.items()})


def describe(costs: dict[str, float]) -> str:
    """``send 6.1 us + 0.42 ns/B, ...``: the costs in one line."""
    return (f"per frame {costs['message_send_s'] * 1e6:.1f} us sent, "
            f"{costs['message_receive_s'] * 1e6:.1f} us received; per byte "
            f"{costs['send_byte_s'] * 1e9:.3f} ns sent, {costs['receive_byte_s'] * 1e9:.3f} received, "
            f"{costs['sum_byte_s'] * 1e9:.3f} summed, {costs['cast_byte_s'] * 1e9:.3f} cast, "
            f"{costs['copy_byte_s'] * 1e9:.3f} copied")


def calibrate_main(argv: Sequence[str]) -> int:
    """``python -m prophet_tf.predict calibrate [--out FILE] [--effort E]``."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m prophet_tf.predict calibrate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="costs.json", help="Where to write the costs (JSON).")
    parser.add_argument("--effort", type=float, default=1.0,
                        help="Scales how long each measurement runs (1: about 5-10 s in all).")
    args = parser.parse_args(list(argv))
    from prophet_tf.predict.model import PredictError
    try:
        data = calibrate(args.effort)
    except PredictError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    m = data["measurements"]
    print(f"{data['machine']['cpu']} ({data['machine']['cores']} cores), load "
          f"{' '.join(f'{v:.1f}' for v in data['load_before'])}: {describe(data['options'])}")
    print(f"  engines on loopback: {m['engine_large_cpu_ns_per_byte']:.2f} ns of CPU per byte of a "
          f"{m['engine_large_bytes'] / 2**20:.0f} MiB push_pull (2 workers together), "
          f"{m['engine_small_cpu_ns_per_frame'] / 1e3:.1f} us per frame of tiny ones sent many at once "
          f"({m['engine_lone_cpu_ns_per_frame'] / 1e3:.1f} us one at a time); raw TCP: "
          f"{100 * m['tcp_send_share']:.0f}% of its CPU on the sending side")
    print(f"wrote {args.out} ({m['seconds']:.1f} s)")
    return 0
