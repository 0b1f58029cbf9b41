"""Helpers shared by the ProphetStrategy worker scripts (run under python -m prophet_tf.launch)."""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def result(**fields) -> None:
    """One machine-readable line: ``RESULT {json}`` (the launcher prefixes ``[rank i]``)."""
    print("RESULT " + json.dumps(fields, sort_keys=True), flush=True)


def digest(arrays) -> str:
    """A hash of the exact bytes of a list of arrays (identical weights <=> identical digest)."""
    import numpy as np
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str(a.dtype).encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def max_abs_diff(a_list, b_list) -> float:
    import numpy as np
    assert len(a_list) == len(b_list), (len(a_list), len(b_list))
    return max((float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                for a, b in zip(a_list, b_list) if np.size(a)), default=0.0)


def floats(values):
    return [float(v) for v in values]


def digest_json(obj) -> str:
    """A hash of a JSON-serialisable object (exact float values included)."""
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()
