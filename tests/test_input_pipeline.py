"""Distributed datasets: iterators deleted mid-fetch, and what every worker reads.

Input pipelines as users write them (tests/workers/input_programs.py) are trained with ``fit`` on
2 workers and in ONE process: a deterministic pipeline must give the workers the global batches
of one process, so the final weights (and optimizer variables) must be bitwise equal across the
workers and within 1e-5 of one process, and the logged metrics must match.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import WORKERS, run_programs_against_one_process
from prophet_tf._keras.step_report import is_report_key

WORKERS_N = 2
TOLERANCE = 1e-5
sys.path.insert(0, str(WORKERS))
from input_programs import PROGRAMS  # noqa: E402  (the worker script lists its programs)


def test_iterators_deleted_while_fetching_do_not_crash_the_worker(run_workers) -> None:
    """TensorFlow's MultiDeviceIterator crashed here (SIGSEGV within a few rounds, MirroredStrategy
    too): ProphetStrategy's workers read through plain tf.data iterators."""
    run = run_workers("abandoned_iterators.py", 2, "60", timeout=300).check_ok()
    for rank in range(2):
        r = run.one(rank)
        assert r["rounds"] == 60, r
        # Every new iterator starts at the first global batch [0, 1, 2, 3]; rank r reads its half.
        assert r["first_batches"] == [[2 * rank, 2 * rank + 1]], (rank, r)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """Every program in one 2-worker launch and one reference process."""
    workdir = str(tmp_path_factory.mktemp("pipelines"))
    return run_programs_against_one_process("input_programs.py", workdir, list(PROGRAMS),
                                            WORKERS_N, timeout=900)


def _max_diff(a_list, b_list) -> float:
    assert len(a_list) == len(b_list), (len(a_list), len(b_list))
    return max((float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(a_list, b_list)
                if a.size), default=0.0)


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_pipeline_gives_the_batches_of_one_process(pipelines, program):
    results, reference, ranks, one = pipelines.trained(program, WORKERS_N)
    cross = max(_max_diff(ranks[0], w) for w in ranks[1:])
    diff = max(_max_diff(w, one) for w in ranks)
    print(f"{program}: max |w_worker - w_one_process| = {diff:.3g}, across workers {cross:.3g}")
    assert cross == 0.0, f"{program}: weights differ across workers by {cross:.3g}"
    assert diff <= TOLERANCE, f"{program}: max |w_worker - w_one_process| = {diff:.3g}"
    logs = [{k: v for k, v in r["logs"].items() if not is_report_key(k)} for r in results]
    assert all(log == logs[0] for log in logs), f"{program}: logs differ across workers"
    for key, want in reference["logs"].items():
        if key in logs[0]:  # the resumed run logs its own epochs only
            assert np.allclose(logs[0][key], want, rtol=1e-4, atol=1e-6), (program, key,
                                                                          logs[0][key], want)
