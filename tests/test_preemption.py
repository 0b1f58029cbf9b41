"""Coordinated preemption (SIGTERM on one worker: every worker stops at the same step, one
checkpoint, status 75) and step-exact resume (the resumed fit ends with the uninterrupted run's
weights, bitwise, without redoing a step)."""

from __future__ import annotations

import pytest

from conftest import parse_results
from prophet_tf import preemption

STEPS_PER_EPOCH, EPOCHS = 6, 2
TOTAL_STEPS = STEPS_PER_EPOCH * EPOCHS


def _fits(run, rank, label):
    found = [r for r in run.results(rank, section="fit") if r["label"] == label]
    assert found, f"rank {rank}: no fit {label}\n{run.tail()}"
    return found


def _applied(position):
    """Training steps applied before a stop at [epoch, step]."""
    return position[0] * STEPS_PER_EPOCH + position[1]


@pytest.fixture(scope="module")
def scenarios(run_workers, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("preemption")
    return run_workers("preemption.py", 2, "scenarios", str(workdir), timeout=400,
                       env={"PROPHET_JOB_SEED": "1234"}).check_ok()


def test_the_job_seed_is_every_workers_global_seed(scenarios):
    assert [scenarios.one(rank, section="seed")["seed"] for rank in range(2)] == [1234, 1234]


@pytest.mark.parametrize("name,expected_stop", [
    ("during_save", None),                # BackupAndRestore(save_freq=2), tf.data reshuffled per epoch
    ("before_first_step", [0, 1]),        # the strategy's own checkpoint (no BackupAndRestore)
    ("during_validation", [1, STEPS_PER_EPOCH]),  # BackupAndRestore per epoch
])
def test_every_worker_stops_at_one_step_and_the_resumed_fit_ends_bitwise_as_uninterrupted(
        scenarios, name, expected_stop):
    for rank in range(2):
        stopped, resumed = _fits(scenarios, rank, name)
        kind = stopped["kind"]
        (reference,) = _fits(scenarios, rank, f"reference-{kind}")
        other = _fits(scenarios, 1 - rank, name)[0]
        # Both workers stopped after the same step, knowing that one worker asked.
        assert stopped["stopped"] == other["stopped"] and stopped["signals"] == 1, (stopped, other)
        if expected_stop is not None:
            assert stopped["stopped"] == expected_stop, stopped
        else:
            assert stopped["stopped"][0] == 1 and 3 <= stopped["stopped"][1] <= STEPS_PER_EPOCH
        assert stopped["checkpoint"] and stopped["backup_left"], stopped
        # Resumed: the uninterrupted weights, bitwise, and no step trained twice.
        assert resumed["stopped"] is None and not resumed["backup_left"], resumed
        assert resumed["digest"] == reference["digest"], (name, rank, resumed, reference)
        assert _applied(stopped["stopped"]) + resumed["steps"] == TOTAL_STEPS, (stopped, resumed)


def test_a_program_handler_replaces_the_strategys_or_is_chained_to_it(scenarios):
    run = scenarios
    # Installed after the strategy: the program's handler alone runs, training goes on, and fit
    # said so when it began.
    assert run.output.count("the program installed its own handler for SIGTERM") == 2, run.tail()
    (replaced,) = _fits(run, 1, "replaced")
    assert replaced["stopped"] is None and replaced["steps"] == TOTAL_STEPS, replaced
    # Installed before: the request is recorded, then the program's handler runs; every worker
    # stops, without a checkpoint (no BackupAndRestore, no checkpoint_dir).
    assert run.output.count("[rank 1] PROGRAM HANDLER got SIGTERM") == 2, run.tail()
    for rank in range(2):
        (chained,) = _fits(run, rank, "chained")
        assert chained["signals"] == 1 and chained["checkpoint"] is None, chained
        assert chained["stopped"][0] == 1, chained
    assert "checkpoint: none" in run.output


def test_a_fit_that_fails_says_where(scenarios):
    for rank in range(2):
        assert scenarios.one(rank, section="failed")["error"] == "a bug at epoch 1 batch 3"
        lines = [f for line in scenarios.stderr.splitlines() if (f := preemption.parse_failure(line))
                 and f.rank == rank]
        # Steps 0..3 of epoch 1 were applied when the callback of step 3 raised.
        assert lines == [preemption.Failure(rank, 1, 4, "ValueError: a bug at epoch 1 batch 3")], lines


def test_the_launcher_restarts_a_job_after_a_sigterm_and_a_kill_and_it_ends_bitwise_as_uninterrupted(
        zygote_interpreter):
    """prophetrun --max-restarts with the restart trials' quick run: a SIGTERM to a worker (every
    worker stops at the same step, writes the backup and exits 75), then a kill -9 of one; the
    unchanged program, launched again, resumes each time and ends with the uninterrupted run's
    weights."""
    from prophet_tf.bench import restart_trials

    said: list[str] = []
    (trial,) = restart_trials.run(per_kind=1, seed=3, quick=True, deadline_s=300, log=said.append)
    report = "\n".join(said)
    assert trial.completed and trial.bitwise, report
    sigterm, kill = trial.interruptions
    assert (sigterm.fault, kill.fault) == ("sigterm", "kill"), report
    assert sigterm.redone == 0, report  # step-exact: nothing trained twice, nothing skipped
    assert sigterm.stopped_together, report  # every worker said: the same step, a checkpoint
    assert kill.redone is not None and 0 <= kill.redone, report
    assert sigterm.training_after_s is not None and kill.training_after_s is not None, report


# Ends with the Preempted exception (argv: OUT CATCH): its exit handlers run once each, in their
# order, an open file is flushed, and the status is 75; caught, the program exits as it chooses.
PREEMPTED_PROGRAM = """
import atexit, os, sys
from prophet_tf import preemption
out, catch = sys.argv[1], sys.argv[2] == "catch"
atexit.register(print, "handler registered first", flush=True)
left_open = open(os.path.join(out, "left-open.txt"), "w")
left_open.write("buffered, never closed")
preemption.leaving()
atexit.register(print, "handler registered after the preemption", flush=True)
try:
    raise preemption.Preempted(preemption.Report(rank=0, signals=1, epoch=0, step=3))
except preemption.Preempted:
    if not catch:
        raise
print("caught; going on", flush=True)
"""


@pytest.mark.parametrize("catch", [False, True])
def test_a_preempted_program_leaves_after_its_exit_handlers(tmp_path, catch):
    import subprocess

    from conftest import ROOT, _worker_env, worker_python

    script = tmp_path / "preempted.py"
    script.write_text(PREEMPTED_PROGRAM)
    done = subprocess.run([worker_python(), str(script), str(tmp_path), "catch" if catch else "raise"],
                          env=_worker_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    expected = ["handler registered after the preemption", "handler registered first"]
    assert done.returncode == (0 if catch else preemption.EXIT_PREEMPTED), done.stderr
    assert done.stdout.splitlines() == (["caught; going on"] if catch else []) + expected
    assert (tmp_path / "left-open.txt").read_text() == "buffered, never closed"


# ---- the pieces, without workers ---------------------------------------------------------------

def test_the_report_line_round_trips_and_reads_through_the_launchers_prefix():
    report = preemption.Report(rank=1, signals=2, epoch=3, step=17, checkpoint="/ck/backup")
    assert preemption.parse_report("[rank 1] " + report.line()) == report
    outside = preemption.Report(rank=0, signals=1)
    assert preemption.parse_report(outside.line()) == outside
    assert preemption.parse_report("prophet_tf: rank 1 received SIGTERM: ...") is None
    failure = preemption.Failure(rank=2, epoch=0, step=5, error="ValueError: bad input")
    assert preemption.parse_failure("[rank 2] " + failure.line()) == failure
    assert preemption.describe_error(ValueError("Graph execution error:\n\nDetected at node x\n"
                                                "  File \"a.py\"\nthe cause\nmore")) == "ValueError: the cause"


def test_preemption_signals_are_read_by_name_or_number_and_uncatchable_ones_refused():
    import signal

    assert preemption.signals_from("SIGTERM,usr1") == (signal.SIGTERM, signal.SIGUSR1)
    assert preemption.signals_from([15, "SIGTERM"]) == (signal.SIGTERM,)
    assert preemption.signals_from("none") == () and preemption.signals_from(None) == ()
    with pytest.raises(ValueError, match="SIGKILL cannot be handled"):
        preemption.signals_from("SIGKILL")
    with pytest.raises(ValueError, match="not a signal name"):
        preemption.signals_from("SIGNOPE")


def test_the_input_order_check_names_what_would_change_the_order():
    import numpy as np
    import tensorflow as tf
    from keras.src.trainers.data_adapters import array_data_adapter

    from prophet_tf import _input_order

    def arrays(shuffle):
        x = np.arange(20, dtype="float32")
        return array_data_adapter.ArrayDataAdapter(x, batch_size=5, shuffle=shuffle).get_tf_dataset()

    tf.random.set_seed(7)
    seeded = _input_order.describe(arrays(True))
    assert seeded.seeded and not seeded.unseeded and _input_order.problems(seeded, seeded) == []
    assert _input_order.describe(arrays(False)) == _input_order.InputOrder()
    tf.random.set_seed(8)
    other_seed = _input_order.describe(arrays(True))
    assert "random seeds of the input differ" in " ".join(_input_order.problems(seeded, other_seed))
    # Round trip through the backup's metadata.
    assert _input_order.InputOrder.from_json(seeded.to_json()) == seeded
    tf.random.set_seed(None)
    try:
        unseeded = _input_order.describe(arrays(True))
    finally:
        tf.random.set_seed(7)
    assert "without a seed" in " ".join(_input_order.problems(seeded, unseeded))

    ds = tf.data.Dataset.range(8).map(lambda v: v + 1, num_parallel_calls=2, deterministic=False)
    assert "deterministic=False" in " ".join(_input_order.problems(None, _input_order.describe(ds)))
    gen = tf.data.Dataset.from_generator(lambda: iter(range(3)), output_signature=tf.TensorSpec([], tf.int64))
    described = _input_order.describe(gen)
    assert described.unverifiable and _input_order.problems(None, described) == []
