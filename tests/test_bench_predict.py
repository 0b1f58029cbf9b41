"""The prediction benchmark's pure parts (no TensorFlow, no emulated cluster): errors, the last
line, the table, the model of the emulated cluster, auto against the best fixed schedule."""

from __future__ import annotations

import pytest

from prophet_tf.bench import predict as bench_predict
from prophet_tf.bench import train


def row(system: str, predicted, measured, **extra) -> dict:
    return dict(compute="emulated", model="resnet50", workers=2, ratio=1.0, bandwidth_bps=2e9,
                system=system, predicted_s=predicted, measured_s=measured, **extra)


def test_errors_and_the_last_line():
    rows = [row("prophet", 1.05, 1.0), row("priority", 0.9, 1.0), row("fifo", 1.0, 1.0),
            row("mwms", None, 2.0, deadlock=True), row("auto", 1.0, None)]
    assert bench_predict.errors(rows) == pytest.approx([0.05, 0.1, 0.0])
    assert bench_predict.summary_line(rows) == "prediction error: median 5.0%, max 10.0%"
    assert "no setting" in bench_predict.summary_line([row("fifo", None, 1.0)])


def test_table_marks_errors_and_deadlocks_and_shows_stall_breaks():
    table = bench_predict.format_table([
        row("prophet", 1.05, 1.0, predicted_stall_breaks=0, measured_stall_breaks=0),
        row("bytescheduler", 1.2, 1.0, predicted_stall_breaks=7, measured_stall_breaks=2),
        row("mwms", None, 2.0, deadlock=True)])
    assert "| emulated | resnet50 | 2 | 1 | 2 Gbit/s | prophet | 1050 | 1000 | +5.0% | 0 / 0 |" in table
    assert "| bytescheduler | 1200 | 1000 | +20.0% | 7 / 2 |" in table
    assert "| mwms | deadlock | 2000 | n/a | n/a / n/a |" in table


def test_the_emulated_cluster_is_modelled_as_shaped():
    opts = train.SweepOptions(models=["resnet50"], workers=[2], ratios=[1.0], systems=["prophet"],
                              inter_threads=3, prophet_options={"credit_bytes": 1 << 20})
    options = bench_predict.predict_options(opts)
    assert not options.ingress_limited  # tbf shapes each host's egress only
    assert options.payload_efficiency == pytest.approx(1448 / 1514)
    assert options.apply_threads == 3 and options.credit_bytes == 1 << 20
    assert (options.steps, options.warmup_steps) == (opts.steps, opts.warmup)
    # a variant's own options over --prophet_options
    variant = train.parse_system("priority[credit_bytes=4096,socket_buffer_bytes=65536]")
    options = bench_predict.predict_options(opts, variant)
    assert options.credit_bytes == 4096 and options.socket_buffer_bytes == 65536
    # a compressed system is predicted compressed
    assert options.compression is None
    assert bench_predict.predict_options(opts, train.parse_system("prophet+bf16")).compression == \
        "bf16"


def test_auto_against_the_best_fixed_schedule():
    setting = {"model": "resnet50", "workers": 2, "comm_compute_ratio": 1.0, "results": {
        "prophet": {"step_s_median": 1.0}, "priority": {"step_s_median": 0.8},
        "fifo": {"step_s_median": 0.9}, "auto": {"step_s_median": 0.82, "schedule_in_use": "priority"}}}
    (line,) = bench_predict.auto_lines([setting])
    assert line.startswith("auto vs best fixed (priority): 1.025") and "auto ran priority" in line
    assert bench_predict.auto_lines([{"results": {"prophet": {"step_s_median": 1.0}}}]) == []


def test_measured_settings_bring_their_run_options():
    opts = train.SweepOptions(models=["resnet50"], workers=[2], ratios=[1.0], systems=["prophet"])
    run = {"steps": 12, "warmup": 3, "intra_threads": 1, "inter_threads": 4,
           "prophet_options": {"socket_buffer_bytes": 1 << 20}}
    bench_predict._use_run_facts(opts, [{"run": run}, {"run": dict(run)}])
    assert (opts.steps, opts.warmup, opts.inter_threads) == (12, 3, 4)
    assert bench_predict.predict_options(opts).socket_buffer_bytes == 1 << 20
    with pytest.raises(ValueError, match="different options"):
        bench_predict._use_run_facts(opts, [{"run": run}, {"run": dict(run, steps=5)}])
    before = (opts.steps, opts.inter_threads)
    bench_predict._use_run_facts(opts, [{"model": "resnet50"}])    # an older results.json
    assert (opts.steps, opts.inter_threads) == before


def test_measured_takes_the_parts_of_one_sweep_and_names_a_bad_one(tmp_path):
    import json, os, subprocess, sys
    from pathlib import Path
    good = tmp_path / "a.json"
    good.write_text(json.dumps([]))
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"not": "a list"}))
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "prophet_tf.bench.predict", "--measured",
                        f"{good},{bad}", "--out", str(tmp_path / "out")], cwd=repo,
                       env=dict(os.environ, PYTHONPATH=str(repo), TF_CPP_MIN_LOG_LEVEL="2"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == 2 and f"--measured {bad}: the output must be a list" in r.stdout
