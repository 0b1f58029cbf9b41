"""The fault benchmark's own logic (prophet_tf/bench/faults.py): reading events, naming, outcome
classification, the trial plan and the summary line. No processes, no timing."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest

from prophet_tf.bench.faults import (EVENT, Checkpoint, Survivor, TrialRecord, _client_hello, classify_checkpoint,
                                     classify_hostile_job, classify_survivor, detection_s, essential_message,
                                     goal_lines, named_ranks, parse_event, plan_trials, summary_line)


def _line(kind: str, **fields) -> str:
    return f"{EVENT} " + json.dumps(dict(event=kind, t=12.5, **fields))


def test_events_are_read_with_and_without_the_launcher_prefix():
    ev = parse_event("[rank 2] " + _line("step", step=7))
    assert (ev.rank, ev.kind, ev.t, ev.fields) == (2, "step", 12.5, {"step": 7})
    ev = parse_event(_line("error", type="UnavailableError", message="x") + "\n", rank=1)
    assert (ev.rank, ev.kind, ev.fields["type"]) == (1, "error", "UnavailableError")
    assert parse_event("[rank 0] Epoch 1/4") is None
    assert parse_event(f"{EVENT} not json") is None
    assert parse_event(f"{EVENT} " + json.dumps({"t": 1.0})) is None  # no kind


def test_the_essential_message_drops_tensorflows_graph_traceback():
    raw = ("Graph execution error:\n\nDetected at node ProphetPushPull defined at (most recent call last):\n"
           "  File \"/x/trainer.py\", line 399, in fit\n\n  File \"/x/y.py\", line 2, in f\n\n"
           "push_pull 'dense/kernel' (round 3) failed: lost the connection to rank 1 (h:1): reset\n"
           "\t [[{{node ProphetPushPull}}]] [Op:__inference_one_step_on_data_1234]")
    assert essential_message(raw) == "push_pull 'dense/kernel' (round 3) failed: lost the connection to rank 1 (h:1): reset"
    assert essential_message("plain message") == "plain message"


def test_named_ranks_reads_the_runtimes_phrasings():
    assert named_ranks("lost the connection to rank 1 (127.0.0.1:4000): the peer closed") == {1}
    assert named_ranks("did not complete within 60 s; still waiting for rank(s) 0, 2. Those") == {0, 2}
    assert named_ranks("worker rank 3 (pid 77) was killed by SIGKILL") == {3}
    assert named_ranks("ranks 0 and 2 disagree") == {0, 2}
    assert named_ranks("push_pull 'dense/kernel' (round 12) failed") == set()
    assert named_ranks("") == set()


def test_a_survivor_that_names_the_victim_is_named():
    s = Survivor(0, exit_after_s=2.0, message="lost the connection to rank 1 (h:1)", reported_after_s=0.1)
    assert classify_survivor(s, victim=1) == "named"


def test_naming_a_survivor_that_left_first_is_a_cascade_not_unnamed():
    s = Survivor(0, exit_after_s=2.0, message="lost the connection to rank 2 (h:3)", reported_after_s=0.2)
    assert classify_survivor(s, victim=1, left_first=[2]) == "cascade"
    # ... but naming a rank that had not left is no explanation.
    assert classify_survivor(s, victim=1, left_first=[]) == "unnamed"


def test_errors_without_a_rank_and_silent_exits_are_unnamed():
    s = Survivor(0, exit_after_s=1.0, message="Graph execution error: something failed", reported_after_s=0.5)
    assert classify_survivor(s, victim=1) == "unnamed"
    assert classify_survivor(Survivor(0, exit_after_s=1.0, exit_code=1), victim=1) == "unnamed"


def test_still_running_at_the_deadline_is_a_hang_whatever_it_said():
    s = Survivor(0, exit_after_s=None, message="lost the connection to rank 1", reported_after_s=0.1)
    assert classify_survivor(s, victim=1) == "hang"


def test_survivors_stopped_by_the_launcher_count_as_named_when_the_launcher_names_the_fault():
    s = Survivor(1, exit_after_s=0.6, stopped_by_launcher=True)
    assert classify_survivor(s, victim=2, launcher_names=[2]) == "launcher"
    # The launcher blamed a survivor that failed first (e.g. after a SIGSTOP): still traced.
    assert classify_survivor(s, victim=2, left_first=[0], launcher_names=[0]) == "launcher"
    assert classify_survivor(s, victim=2, launcher_names=[]) == "unnamed"


def test_a_survivor_that_trained_to_the_end_completed():
    assert classify_survivor(Survivor(0, exit_after_s=3.0, exit_code=0, finished=True), victim=1) == "completed"


def test_detection_is_the_report_else_the_exit():
    assert detection_s(Survivor(0, exit_after_s=5.0, reported_after_s=0.3)) == 0.3
    assert detection_s(Survivor(0, exit_after_s=5.0)) == 5.0
    assert detection_s(Survivor(0)) is None


def test_checkpoint_states():
    assert classify_checkpoint(exists=False, ever_saved=False, load_error=None).state == "none"
    assert classify_checkpoint(exists=False, ever_saved=True, load_error=None).state == "missing"
    assert classify_checkpoint(exists=True, ever_saved=True, load_error=None).state == "loads"
    bad = classify_checkpoint(exists=True, ever_saved=True, load_error="BadZipFile: File is not a zip file")
    assert (bad.state, bad.detail) == ("corrupt", "BadZipFile: File is not a zip file")


def test_summary_counts_hangs_corrupt_checkpoints_unnamed_errors_and_the_slowest_detection():
    named = Survivor(0, exit_after_s=2.0, reported_after_s=0.4, message="rank 1")
    slow = Survivor(2, exit_after_s=40.0, reported_after_s=31.0, message="rank(s) 1")
    hung = Survivor(0, exit_after_s=None)
    unnamed = Survivor(1, exit_after_s=1.0, message="failed")
    records = [
        TrialRecord("a", survivors=[(named, "named"), (slow, "named")], checkpoint=Checkpoint("loads")),
        TrialRecord("b", survivors=[(hung, "hang"), (unnamed, "unnamed")], checkpoint=Checkpoint("corrupt", "x")),
        TrialRecord("c", survivors=[], checkpoint=Checkpoint("missing")),
        TrialRecord("d", survivors=[], checkpoint=Checkpoint("none")),
    ]
    assert summary_line(records) == \
        "faults: 4 trials, 1 hangs, 2 corrupt checkpoints, 1 unnamed errors, max detection 31.0 s"
    assert summary_line([]) == "faults: 0 trials, 0 hangs, 0 corrupt checkpoints, 0 unnamed errors, max detection 0.0 s"


def test_the_plan_covers_every_combination_and_is_seeded():
    plans = plan_trials(24, seed=3, epochs=4, steps=20)
    combos = {(p.n, p.launcher, p.fault, p.moment) for p in plans}
    assert len(combos) == 24
    assert all(0 <= p.victim < p.n and 2 <= p.step < 20 and 0 <= p.epoch < 3 for p in plans)
    assert plans == plan_trials(24, seed=3, epochs=4, steps=20)
    assert plans != plan_trials(24, seed=4, epochs=4, steps=20)
    assert len(plan_trials(4, seed=3, epochs=4, steps=20)) == 4


def test_goal_lines_count_survivors_out_late_and_hostile_outcomes():
    fast = Survivor(0, exit_after_s=12.0, reported_after_s=0.4, message="rank 1")
    late = Survivor(2, exit_after_s=71.0, reported_after_s=60.1, message="rank(s) 1")
    still = Survivor(1, exit_after_s=None)
    hostile = TrialRecord("h", survivors=[(Survivor(0, exit_after_s=99.0, finished=True), "completed")],
                          hostile={"outcome": "unaffected"})
    records = [TrialRecord("a", survivors=[(fast, "named"), (late, "named"), (still, "hang")]), hostile,
               TrialRecord("i", hostile={"outcome": "failed closed"})]
    assert goal_lines(records) == ["survivors out within 60 s of the fault: 1 of 2 (slowest 71.0 s)",
                                   "hostile jobs: 1 failed closed, 1 unaffected"]
    assert goal_lines([]) == ["survivors out within 60 s of the fault: 0 of 0"]


def test_hostile_job_outcomes():
    ok = "a" * 64
    assert classify_hostile_job([0, 0], {ok}, ok, []) == "unaffected"
    assert classify_hostile_job([0, 0], {"b" * 64}, ok, []) == "AFFECTED"  # other weights
    assert classify_hostile_job([3, 3], set(), ok, ["rank 0: token", "rank 1: token"]) == "failed closed"
    assert classify_hostile_job([3, 1], set(), ok, ["rank 0: token"]) == "AFFECTED"  # one said nothing
    assert classify_hostile_job([3, None], set(), ok, ["rank 0: x", "rank 1: y"]) == "AFFECTED"  # a hang


def test_the_impostors_hello_has_the_protocols_layout_and_version():
    hello = _client_hello(1, 2, 0, 10000, bytes(32))
    assert len(hello) == 56  # ops/core/handshake.h ClientHello
    # The version of the library built here: a wrong-token impostor must get as far as the token.
    from prophet_tf._library import runtime_constants
    assert struct.unpack_from("<H", hello, 4)[0] == runtime_constants()["protocol_version"] >= 3


# ---- restart trials (prophet_tf/bench/restart_trials.py) ----------------------------------------

def _restart_lines():
    from prophet_tf.bench.restart_trials import EVENT, Line

    def ev(t, rank, pid, kind, **fields):
        return Line(t, f"[rank {rank}] {EVENT} " + json.dumps(dict(event=kind, t=t, pid=pid, **fields)))

    return [
        ev(1.0, 0, 10, "start"), ev(1.1, 1, 11, "start"),
        ev(2.0, 0, 10, "step", epoch=0, batch=0), ev(2.0, 1, 11, "step", epoch=0, batch=0),
        ev(2.1, 0, 10, "step", epoch=0, batch=1),
        Line(2.2, "[rank 1] prophet_tf: preempted: rank 1, 1 worker(s) asked to stop; stopped at "
                  "epoch 0 step 2; checkpoint: /b"),
        Line(2.3, "[rank 0] prophet_tf: preempted: rank 0, 1 worker(s) asked to stop; stopped at "
                  "epoch 0 step 2; checkpoint: /b"),
        Line(2.5, "[launch] attempt 1 ended: the job was preempted. Restarting every worker"),
        ev(3.0, 1, 21, "start"), ev(3.0, 0, 20, "start"),
        ev(4.0, 0, 20, "step", epoch=0, batch=2), ev(4.5, 1, 21, "step", epoch=0, batch=2),
        ev(5.0, 0, 20, "step", epoch=0, batch=3),
        Line(5.2, "[launch] attempt 2 ended: worker rank 1 was killed by SIGKILL. Restarting"),
        ev(6.0, 0, 30, "start"), ev(6.0, 1, 31, "start"),
        ev(7.0, 0, 30, "step", epoch=0, batch=3), ev(7.2, 1, 31, "step", epoch=0, batch=3),
        ev(8.0, 0, 30, "done", weights="w"), ev(8.0, 1, 31, "done", weights="w"),
    ]


def test_restart_trials_group_attempts_and_measure_each_interruption():
    from prophet_tf.bench.restart_trials import Interruption, attempts_of, measure

    attempts = attempts_of(_restart_lines(), n=2)
    assert [sorted(a.pids.values()) for a in attempts] == [[10, 11], [20, 21], [30, 31]]
    assert attempts[0].preempted.step == 2 and attempts[1].preempted is None
    assert sorted(attempts[0].reports) == [0, 1] and not attempts[1].reports
    assert (attempts[0].ended_at, attempts[1].ended_at, attempts[2].ended_at) == (2.5, 5.2, None)
    assert attempts[2].done == {0: "w", 1: "w"}
    # A SIGTERM: the preemption says where the workers stopped (2 steps applied); the next attempt
    # starts with step index 2: nothing redone. Training again once BOTH workers did a step.
    sigterm = Interruption("sigterm", victim=1, at_step=1, fault_at=2.05)
    measure(sigterm, attempts[0], attempts[1], steps_per_epoch=10)
    assert (sigterm.applied, sigterm.resumed_from, sigterm.redone) == (2, 2, 0)
    assert sigterm.stopped_together  # both ranks: epoch 0 step 2, a checkpoint
    assert abs(sigterm.training_after_s - 2.45) < 1e-9 and abs(sigterm.ended_after_s - 0.45) < 1e-9
    # A kill: the last step a worker finished (4 applied); the backup was older: 1 redone.
    kill = Interruption("kill", victim=1, at_step=4, fault_at=5.1)
    measure(kill, attempts[1], attempts[2], steps_per_epoch=10)
    assert (kill.applied, kill.resumed_from, kill.redone) == (4, 3, 1)
    assert kill.stopped_together is None
    # One worker that did not report its stop is not "together".
    del attempts[0].reports[0]
    measure(sigterm, attempts[0], attempts[1], steps_per_epoch=10)
    assert sigterm.stopped_together is False


def test_restart_trials_plan_and_summary():
    from prophet_tf.bench.restart_trials import (Interruption, TrialResult, format_trial,
                                                 plan_trials, summary_lines)

    plans = plan_trials(10, seed=5, total_steps=80, quick=False)
    kinds = [p.faults[0][0] for p in plans]
    assert len(plans) == 20 and kinds.count("sigterm") == kinds.count("kill") == 10
    assert all(p.workers in (2, 3) and 0 <= p.faults[0][1] < p.workers and 2 <= p.faults[0][2] < 74
               for p in plans)
    assert plans == plan_trials(10, seed=5, total_steps=80, quick=False)
    assert {p.workers for p in plan_trials(10, seed=5, total_steps=80, quick=False, workers=[2])} == {2}
    (quick,) = plan_trials(1, seed=5, total_steps=30, quick=True)
    assert [f[0] for f in quick.faults] == ["sigterm", "kill"] and quick.faults[0][2] < quick.faults[1][2]

    good = TrialResult("a", 2, [Interruption("sigterm", 0, 5, 0.0, applied=6, resumed_from=6,
                                             training_after_s=12.0, stopped_together=True)],
                       0, True, True)
    slow = TrialResult("b", 3, [Interruption("kill", 1, 9, 0.0, applied=9, resumed_from=5,
                                             training_after_s=31.0)], 0, True, True)
    broken = TrialResult("c", 2, [Interruption("kill", 1, 9, 0.0, applied=9)], 1, False, False, "x")
    assert summary_lines([good, slow, broken]) == [
        "restarts: 3 interruptions (1 SIGTERM, 2 kill -9) in 3 runs: 2 of 3 completed, 2 of 3 "
        "bitwise equal to the uninterrupted run",
        "  steps redone after SIGTERM: max 0, mean 0.0; every worker stopped at one step with a "
        "checkpoint in 1 of 1",
        "  steps redone after kill -9: max 4, mean 4.0 (1 never resumed)",
        "  training again after the fault: median 21.5 s, max 31.0 s; 1 of 3 within 30 s"]
    # Trials whose uninterrupted runs differ from each other are not compared, and say so.
    apart = TrialResult("e", 3, [Interruption("kill", 1, 9, 0.0, applied=9, resumed_from=5)], 0, True,
                        False, comparable=False)
    assert summary_lines([good, apart])[0] == (
        "restarts: 2 interruptions (1 SIGTERM, 1 kill -9) in 2 runs: 2 of 2 completed, 1 of 1 bitwise "
        "equal to the uninterrupted run (1 runs of 3 workers not compared: two uninterrupted runs of "
        "as many workers differ from each other)")
    assert "weights not compared (two uninterrupted runs of 3 workers differ" in format_trial(apart)
    skipped = TrialResult("d", 2, [Interruption("kill", 0, 9, 0.0, applied=4, resumed_from=5)], 0, True, False)
    assert "[SKIPPED STEPS]" in format_trial(skipped) and "WEIGHTS DIFFER" in format_trial(skipped)


def _elastic_lines():
    from prophet_tf.bench.restart_trials import EVENT, Line

    def ev(t, rank, pid, kind, token, world, **fields):
        return Line(t, f"[rank {rank}] {EVENT} " + json.dumps(
            dict(event=kind, t=t, pid=pid, rank=rank, token=token, world=world, **fields)))

    return [  # 3 workers; node 2 leaves at 2.0 (SIGTERM): they stop after step 3; 2 go on
        ev(1.0, 0, 10, "start", "a", 3), ev(1.1, 1, 11, "start", "a", 3), ev(1.1, 2, 12, "start", "a", 3),
        ev(1.5, 0, 10, "step", "a", 3, epoch=0, batch=2), ev(1.9, 1, 11, "step", "a", 3, epoch=0, batch=2),
        Line(2.4, "[rank 2] prophet_tf: preempted: rank 2, 1 worker(s) asked to stop; stopped at epoch 0 "
                  "step 3; checkpoint: /b"),
        Line(3.0, "[launch node 0] master: node 2 left the job: the launcher of node 2 got SIGTERM"),
        Line(3.5, "[launch node 0] master: the job forms with 2 node(s), 2 worker(s): ..."),
        ev(6.0, 0, 20, "start", "b", 2), ev(6.5, 1, 21, "start", "b", 2),
        ev(7.0, 0, 20, "step", "b", 2, epoch=0, batch=3), ev(7.5, 1, 21, "step", "b", 2, epoch=0, batch=3),
        ev(9.0, 0, 20, "done", "b", 2, weights="w"), ev(9.0, 1, 21, "done", "b", 2, weights="w"),
    ]


def test_elastic_trials_group_attempts_by_token_and_measure_the_change():
    from prophet_tf.bench.elastic_trials import Result, attempts_of, measure
    from prophet_tf.bench.restart_trials import Line

    lines = _elastic_lines()
    before, after = attempts_of(lines)
    assert (before.token, before.world, sorted(before.pids)) == ("a", 3, [0, 1, 2])
    assert before.stopped.step == 3 and after.stopped is None and after.done == {0: "w", 1: "w"}
    master = [l for l in lines if "[launch node 0]" in l.text]
    result = Result("t", "sigterm", victim=2, at_step=3, fault_at=2.0, workers_before=3)
    assert measure(result, lines, master, steps_per_epoch=10)[1].token == after.token
    # Where they stopped (3 applied) and where the next attempt starts (its first step is index 3).
    assert (result.applied, result.resumed_from, result.redone, result.workers_after) == (3, 3, 0, 2)
    # A SIGTERM counts as detected when sent; training again once both new workers did a step.
    assert result.training_after_s == 5.5 and result.detected_after_s == 1.0
    assert (result.formed_after_s, result.started_after_s) == (1.5, 4.5)
    # A loss is detected when the master says so; a kill is measured from the last step seen.
    cut = Result("t", "netcut", victim=2, at_step=3, fault_at=2.0, workers_before=3)
    lost = [Line(2.8, "[launch node 0] master: node 2 (10.77.0.3:4) was lost: nothing heard")]
    measure(cut, [l for l in lines if "preempted" not in l.text], lost + master, steps_per_epoch=10)
    assert cut.applied == 3 and (cut.detected_after_s, cut.training_after_s) == pytest.approx((0.8, 4.7))


def test_elastic_trials_plan_summary_and_goals():
    from prophet_tf.bench.elastic_trials import Result, format_result, passed, plan_trials, summary_lines

    plans = plan_trials(10, seed=4, total_steps=100)
    assert len(plans) == 40 and plans == plan_trials(10, seed=4, total_steps=100)
    assert {p.kind for p in plans} == {"kill", "sigterm", "netcut", "grow"}
    assert all(1 <= p.victim <= 2 and 3 <= p.at_step < 70 for p in plans)
    assert {p.victim for p in plans if p.kind == "grow"} == {2}  # the node added
    good = Result("a", "kill", 1, 20, workers_before=3, workers_after=2, exit_code=0, kept_training=True,
                  training_after_s=12.0, applied=20, resumed_from=15, bitwise=True)
    slow = Result("b", "grow", 2, 20, workers_before=2, workers_after=3, exit_code=0, kept_training=True,
                  training_after_s=40.0, applied=21, resumed_from=21, bitwise=True)
    hung = Result("c", "netcut", 1, 20, workers_before=3, exit_code=None)
    assert passed([good], save_freq=5) and not passed([good, slow], save_freq=5)
    assert not passed([dataclasses.replace(good, resumed_from=14)], save_freq=5)  # 6 > save_freq
    table = summary_lines([good, slow, hung], save_freq=5)
    assert table[1] == "  kill -9 | 1 | 1 | 0 | - | 12.0 / 12.0 (1 of 1 within the goal) | 5 (5) | 1 of 1"
    assert table[2] == "  network cut | 1 | 0 | 1 | - | - | - | 0 of 1"
    assert table[3] == "  node added | 1 | 1 | 0 | - | 40.0 / 40.0 (0 of 1 within the goal) | 0 (0) | 1 of 1"
    assert "HANG" in format_result(hung) and "0 step(s) redone" in format_result(slow)
