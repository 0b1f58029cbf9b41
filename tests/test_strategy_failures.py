"""ProphetStrategy failure modes: bad cluster configuration, a worker dying mid-fit; and the
single-worker path (no TF_CONFIG, no network)."""

from __future__ import annotations

import subprocess

import pytest

from conftest import ROOT, WORKERS, _worker_env, parse_results, worker_python


@pytest.fixture(scope="module")
def config_run():
    proc = subprocess.run([worker_python(), str(WORKERS / "strategy_config.py")], cwd=ROOT,
                          env=_worker_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return parse_results(proc.stdout, default_rank=0)[0]


def test_bad_tf_config_raises_a_clear_cluster_config_error(config_run):
    errors = {r["case"]: r for r in config_run if r["section"] == "bad_config"}
    assert set(errors) == {"not_json", "index_out_of_range", "no_port", "parameter_server"}
    for case, r in errors.items():
        assert r["error"] == "ClusterConfigError", (case, r)
    assert "TF_CONFIG is not valid JSON" in errors["not_json"]["message"]
    assert "task index 5" in errors["index_out_of_range"]["message"]
    assert "valid indices are 0..1" in errors["index_out_of_range"]["message"]
    assert "has no port" in errors["no_port"]["message"]
    assert "'ps'" in errors["parameter_server"]["message"]
    bad_schedule = [r for r in config_run if r["section"] == "bad_schedule"]
    assert bad_schedule and "round-robin" in bad_schedule[0]["message"]


def test_single_worker_trains_without_network(config_run):
    (single,) = [r for r in config_run if r["section"] == "single_worker"]
    assert single["replicas"] == 1 and single["rank"] == 0
    assert single["schedule"] in ("prophet", "priority")
    assert single["loss"][-1] < single["loss"][0]
    assert single["reduced"] == 2.0
    assert single["predict_rows"] == 64


def test_worker_crash_mid_fit_makes_every_worker_exit_nonzero(spawn_workers):
    op_timeout_s = 30
    spawned = spawn_workers("strategy_crash.py", 2, "1", "10", str(op_timeout_s))
    results = spawned.wait(timeout=240)
    (code0, t0, out0), (code1, t1, out1) = results
    assert code1 == 17, out1[-3000:]                 # the worker that crashed on purpose
    assert "CRASHING rank 1" in out1
    assert code0 is not None, "the surviving worker hung:\n" + out0[-3000:]
    assert code0 == 3, out0[-3000:]                  # fit raised, the script exited non-zero
    (err,) = parse_results(out0, default_rank=0)[0]
    assert err["section"] == "error"
    # The class survives model.fit's tf.function (not "InternalError: Graph execution error").
    assert err["type"] == "UnavailableError" and "rank 1" in err["message"], err
    # It reported the dead peer (connection loss) before the operation timeout could have fired
    # (its report, not its exit: the exit adds the interpreter's teardown).
    detection = err["wall"] - (spawned.started_wall + t1)
    assert detection < op_timeout_s, f"reported {detection:.1f} s after rank 1 died"
    assert "FINISHED WITHOUT ERROR" not in out0
    # Then it exits by itself within the 60 s: a bound that only a hang fails. The runtime's
    # own shutdown takes milliseconds (at most 3 s with a stopped peer); the rest is CPython's and
    # TensorFlow's exit: about 1.2 s of CPU, 6-25 s of wall time measured on a loaded machine.
    teardown = spawned.started_wall + t0 - err["wall"]
    assert teardown < 60, f"the survivor took {teardown:.1f} s to exit after reporting the failure"
