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


def run_programs_main(programs, run, timeout_s=None, leave_without_barrier=(),
                      eager_reference=False, traced_reference=()) -> None:
    """The driver of a worker script of named programs, run either on every worker of a launch or
    as the one-process reference they are compared with::

        script.py distributed|reference WORKDIR [--programs a,b] [--timeout-s S] [--schedule NAME]

    Calls ``run(name, strategy, workdir, rank, role)`` per program, in order; ``strategy`` is the
    ProphetStrategy, or None in the reference process. A worker leaves as soon as its programs
    are done (the runtime delivers what the others still need from it). A program in
    ``leave_without_barrier`` makes a worker leave while another still waits for it (it is run
    last): the workers wait for each other before it, so that only that program sees it leave.

    ``eager_reference``: the reference runs its functions eagerly, the same computation without
    the trace, which costs more than these small programs' training; but for the programs named
    in ``traced_reference``. Over a dataset of unknown length (``filter``, ``interleave``) Keras
    counts other optimizer iterations eagerly than traced (10 against 12 in
    ``unseen_programs.py``'s ``uneven_last_batch_filtered_dataset``): such a program's eager
    reference is not the program users run, and its test fails until it is named there.
    """
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["distributed", "reference"])
    p.add_argument("workdir")
    p.add_argument("--programs", default=",".join(programs))
    p.add_argument("--timeout-s", type=float, default=timeout_s)
    p.add_argument("--schedule", default=None)
    args = p.parse_args()
    strategy, rank = None, 0
    if args.role == "distributed":
        from prophet_tf.strategy import ProphetStrategy

        options = {} if args.timeout_s is None else {"timeout_s": args.timeout_s}
        strategy = ProphetStrategy(args.schedule, **options)
        rank = strategy.rank
    waited = False
    for name in args.programs.split(","):
        if args.role == "reference" and eager_reference:
            import tensorflow as tf

            tf.config.run_functions_eagerly(name not in traced_reference)
        if strategy is not None and name in leave_without_barrier and not waited:
            strategy.barrier()
            waited = True
        run(name, strategy, args.workdir, rank, args.role)
    if strategy is not None:
        from prophet_tf import _crossing

        _crossing.wait_all()
    print("WORKER DONE", flush=True)
