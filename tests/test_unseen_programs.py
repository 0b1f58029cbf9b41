"""Programs the runtime was not written for (tests/workers/unseen_programs.py) on 2 workers,
crossing the barrier (the default), against ONE process training on the global batch (or, where
that cannot be guaranteed, fail closed with a clear error).

All programs run in one 2-worker launch and one reference process. Every program's final weights
(model weights and optimizer variables) must be bitwise identical on both workers and within
1e-5 of one process, and the logs it returns must be the same on both workers and match one
process (apart from the runtime's own ``prophet/...`` keys, which one process has not).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from conftest import WORKERS, run_programs_against_one_process
from prophet_tf._keras.step_report import is_report_key

WORKERS_N = 2
TOLERANCE = 1e-5
sys.path.insert(0, str(WORKERS))
from unseen_programs import PROGRAMS  # noqa: E402  (the worker script lists its programs)

# Programs the runtime cannot run with one-process results: they must fail on every worker before
# training, with an error that names the problem and what to do.
FAIL_CLOSED = {
    "custom_loss_returning_a_scalar": ("the loss 'mean_squared_error_scalar' returned one number",
                                       "one value per sample"),
}
# Saving on rank 0 only, Horovod style (the last program: rank 1 then ends its script).
RANK_0_SAVE = "horovod_style_save_on_rank_0_only"
MATCHING = [p for p in PROGRAMS if p not in FAIL_CLOSED and p != RANK_0_SAVE]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("unseen"))
    return run_programs_against_one_process("unseen_programs.py", workdir, list(PROGRAMS),
                                            WORKERS_N)


def _max_diff(a_list, b_list) -> float:
    assert len(a_list) == len(b_list), (len(a_list), len(b_list))
    return max((float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(a_list, b_list)
                if a.size), default=0.0)


def _close(got, want, where) -> None:
    """``got`` (a worker's logs) matches ``want`` (one process's), leaving out the step report's
    keys (prophet_tf/_keras/step_report.py: timings, not results)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), (where, got, want)
        got = {k: v for k, v in got.items() if not is_report_key(k)}
        assert set(got) == set(want), (where, got, want)
        for key in want:
            _close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{where}[{i}]")
    else:
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (where, got, want)


@pytest.mark.parametrize("program", list(FAIL_CLOSED))
def test_program_fails_closed(runs, program):
    for rank in range(WORKERS_N):
        error = runs.result(program, rank)["error"]
        assert error is not None and error.startswith("ValueError: ProphetStrategy"), error
        for words in FAIL_CLOSED[program]:
            assert words in error, (words, error)
    assert runs.result(program)["error"] is None  # one process trains it


@pytest.mark.parametrize("program", MATCHING)
def test_program_matches_one_process(runs, program):
    results, reference, ranks, one = runs.trained(program, WORKERS_N)
    cross = max(_max_diff(ranks[0], w) for w in ranks[1:])
    diff = max(_max_diff(w, one) for w in ranks)
    print(f"{program}: max |w_worker - w_one_process| = {diff:.3g}, across workers {cross:.3g}")
    assert cross == 0.0, f"{program}: weights differ across workers by {cross:.3g}"
    for r in results[1:]:
        assert r["logs"] == results[0]["logs"], f"{program}: logs differ across workers"
    assert diff <= TOLERANCE, f"{program}: max |w_worker - w_one_process| = {diff:.3g}"
    _close(results[0]["logs"], reference["logs"], program)


def test_a_file_every_worker_writes_has_the_one_process_content(runs):
    """A user callback writing its own file (no rank check) on both workers: the same logs on
    every worker, so the file ends with what one process writes."""
    program = "callback_writes_file_every_worker"
    assert runs.result(program, 0)["error"] is None
    with open(os.path.join(runs.workdir, f"{program}.distributed.json")) as f:
        written = json.load(f)
    with open(os.path.join(runs.workdir, f"{program}.reference.json")) as f:
        alone = json.load(f)
    _close(written, alone, program)


def test_a_save_on_rank_0_only_fails_at_once_and_says_saves_are_collectives(runs):
    logs = runs.result(RANK_0_SAVE, 0)["logs"]
    error = logs.get("save_error")
    assert error is not None and "rank 1 (" in error, logs
    assert "shut down its prophet_tf runtime before taking part in it" in error, error
    assert "EVERY worker must call it" in error and "if rank == 0" in error, error
    # Rank 1 left when its script ended: rank 0 learns it from rank 1's departure notice (the
    # message above), before timeout_s (60 s) could have fired.
    assert logs["save_seconds"] < 60, logs
    assert runs.result(RANK_0_SAVE)["error"] is None  # one process saves


def test_backup_fallback_is_written_once_and_atomically(runs):
    """BackupAndRestore's fall-back to the previous backup (a corrupt latest one): rank 0 alone
    puts the previous backup in place, by an atomic rename (Keras copies it in place, on every
    worker); every worker then trains from it as one process does (checked above)."""
    program = "backup_falls_back_to_previous"
    assert runs.result(program, 0)["error"] is None
    with open(os.path.join(runs.workdir, f"{program}.distributed", "restored.json")) as f:
        restored = json.load(f)
    assert restored == {"same_as_previous": True, "replaced_atomically": True}, restored
