"""Every schedule finishes every step. A byte credit that waited for a push's sum, which waits for
the other workers' pushes, would stall ``priority`` on 4 workers in its first step.

Here: ProphetStrategy on 4 workers trains an emulated model (one large first-layer gradient, many
small ones; fixed compute times, no CPU) with each schedule in turn, ``auto`` included, the credit,
partitions and socket buffers at their smallest (tests/workers/stall_matrix.py). A stall fails a
step on every worker within the runtime's ``timeout_s`` (60 s), whatever the machine's speed.
The same model runs on 4 and 8 real engines for every schedule with the credit, partitions and
socket buffers at both extremes in ``//ops/core:engine_stress_test``, and on 16-128 simulated
workers in ``//ops/sim:stall_matrix_test`` (C++, no TensorFlow: an 8-worker launch of TensorFlow
processes costs about a minute of CPU before the first step).
"""

from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

SCHEDULES = ["fifo", "priority", "prophet", "bytescheduler", "p3", "auto"]


def test_every_schedule_finishes_every_step_on_four_workers(run_workers):
    run = run_workers("stall_matrix.py", 4, ",".join(SCHEDULES), timeout=600)
    run.check_ok()
    for schedule in SCHEDULES:
        digests = set()
        for rank in range(4):
            got = run.one(rank, schedule=schedule)
            assert got["steps"] == got["expected_steps"] > 0, (schedule, rank, got)
            digests.add(got["digest"])
        assert len(digests) == 1, (schedule, digests)
    # "auto" decided at step 4 and every worker uses the same schedule.
    assert len({run.one(rank, schedule="auto")["in_use"] for rank in range(4)}) == 1
