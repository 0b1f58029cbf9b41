"""Tests of the training benchmark (prophet_tf/bench/train/): the pure parts (bounds, link rates,
the systems' names, the JSON, table and CSV of a setting, the flags), plus small end-to-end runs
on loopback (a tiny Transformer, 2 workers, a few steps)."""

from __future__ import annotations

import csv
import json
import os
import math
import subprocess
import time
from pathlib import Path

import pytest

from conftest import _worker_env, worker_python
from prophet_tf.bench import train
from prophet_tf.bench.train import (SYSTEMS, choose_bandwidth, choose_bandwidths, comm_bytes,
                                    comm_time_s, emulated_time_scale, format_bandwidth,
                                    format_markdown, lower_bound_s, make_setting, median,
                                    merge_results,
                                    parse_results, step_periods, validate_settings, write_csv,
                                    write_json)

REPO = Path(__file__).resolve().parents[1]
MB = 1_000_000


# ---------------------------------------------------------------- lower bound and bandwidths

def test_comm_bytes_is_all_reduce_optimum():
    assert comm_bytes(100 * MB, 1) == 0
    assert comm_bytes(100 * MB, 2) == pytest.approx(100 * MB)
    assert comm_bytes(100 * MB, 4) == pytest.approx(150 * MB)
    with pytest.raises(ValueError):
        comm_bytes(1, 0)


def test_comm_time_and_lower_bound():
    # 2 workers: 100 MB each way at 800 Mbit/s = 1 s
    assert comm_time_s(100 * MB, 2, 800e6) == pytest.approx(1.0)
    assert comm_time_s(100 * MB, 2, None) == 0.0
    assert lower_bound_s(0.4, 100 * MB, 2, 800e6) == pytest.approx(1.0)   # network bound
    assert lower_bound_s(1.5, 100 * MB, 2, 800e6) == pytest.approx(1.5)   # compute bound
    assert lower_bound_s(0.4, 100 * MB, 2, None) == pytest.approx(0.4)    # unshaped
    # 4 workers move 1.5x the gradient bytes
    assert lower_bound_s(0.1, 100 * MB, 4, 800e6) == pytest.approx(1.5)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("ratio", [0.3, 1.0, 3.0])
def test_choose_bandwidth_gives_the_requested_ratio(n, ratio):
    grad, compute = 134.6 * MB, 0.43
    bw = choose_bandwidth(grad, n, compute, ratio)
    assert comm_time_s(grad, n, bw) / compute == pytest.approx(ratio)
    assert lower_bound_s(compute, grad, n, bw) == pytest.approx(compute * max(1.0, ratio))


def test_choose_bandwidths_numbers_and_errors():
    # 2 workers, 100 MB, 1 s compute: ratio 1 -> 800 Mbit/s; ratio 2 -> 400; ratio 0.5 -> 1600
    assert choose_bandwidths(100 * MB, 2, 1.0, [0.5, 1, 2]) == [1.6e9, 8e8, 4e8]
    assert all(float(b).is_integer() for b in choose_bandwidths(13_236_264, 3, 0.37, [0.3, 3]))
    for bad in [dict(ratio=0), dict(ratio=-1), dict(compute_s=0)]:
        kw = {**dict(gradient_bytes=MB, workers=2, compute_s=1.0, ratio=1.0), **bad}
        with pytest.raises(ValueError):
            choose_bandwidth(**kw)
    with pytest.raises(ValueError):
        choose_bandwidth(MB, 1, 1.0, 1.0)


def test_emulated_time_scale_puts_the_links_at_the_budget():
    # ResNet50: 102.3 MB of gradients, 14.9 ms per step on the modelled accelerator
    grad, acc = 102.3 * MB, 0.0149
    for n in (2, 4, 8):
        scale = emulated_time_scale(grad, n, acc, 4e9)
        link_at_ratio1 = choose_bandwidth(grad, n, acc * scale, 1.0)
        assert link_at_ratio1 * n <= 4e9                          # within the budget ...
        assert link_at_ratio1 * n >= 4e9 / 1.1                    # ... after rounding up
        assert scale == float(f"{scale:.2g}")                     # two significant digits
    assert emulated_time_scale(grad, 2, acc, 4e9) == 28.0         # 54.9 Gbit/s -> 2 Gbit/s
    assert emulated_time_scale(MB, 2, 1.0, 4e9) == 1.0            # never below 1
    with pytest.raises(ValueError):
        emulated_time_scale(grad, 2, 0.0, 4e9)


def test_cpu_fraction():
    runs = {0: {"window_s": 10.0, "window_machine_busy_s": 19.0, "window_cpu_s": 4.0},
            1: {"window_s": 10.0, "window_machine_busy_s": 19.0, "window_cpu_s": 5.0}}
    assert train.cpu_fraction(runs, 2) == pytest.approx((0.95, 0.45))
    runs[1]["window_cpu_s"] = None
    assert train.cpu_fraction(runs, 2) == pytest.approx((0.95, None))
    assert train.cpu_fraction({}, 2) == (None, None)


def test_timeline_pattern():
    assert train.timeline_pattern("/t/dir", "m_n2_prophet") == "/t/dir/m_n2_prophet.{rank}.json"
    assert train.timeline_pattern("/t/trace.json", "x") == "/t/trace.x.{rank}.json"


def test_step_periods_and_median():
    begins = [0.0, 5.0, 5.5, 6.1, 6.6, 7.2]
    assert step_periods(begins, 0) == pytest.approx([5.0, 0.5, 0.6, 0.5, 0.6])
    assert step_periods(begins, 2) == pytest.approx([0.6, 0.5, 0.6])
    assert step_periods(begins, 10) == []
    assert median(step_periods(begins, 1)) == pytest.approx(0.55)
    assert math.isnan(median([]))
    with pytest.raises(ValueError):
        step_periods(begins, -1)


def test_format_bandwidth():
    assert format_bandwidth(None) == "unshaped"
    assert format_bandwidth(2.5e9) == "2.5 Gbit/s"
    assert format_bandwidth(204_123_456) == "204 Mbit/s"
    assert format_bandwidth(64_000) == "64 kbit/s"


# ---------------------------------------------------------------- systems and their variants

def test_system_names_options_and_modifiers():
    from prophet_tf.bench.train import systems
    plain = train.parse_system("prophet")
    assert (plain.name, plain.schedule, plain.cross_barrier, plain.is_variant) == (
        "prophet", "prophet", True, False)
    assert train.parse_system("prophet_nocross").cross_barrier is False
    assert train.parse_system("mwms").is_prophet is False
    small = train.parse_system(" priority[socket_buffer_bytes=1048576, timeline_path=/tmp/x] ")
    assert small.base == "priority" and small.is_variant
    assert small.options == (("socket_buffer_bytes", 1048576), ("timeline_path", "/tmp/x"))
    assert small.name == "priority[socket_buffer_bytes=1048576,timeline_path=/tmp/x]"
    assert train.parse_system(small.name) == small                   # the name parses back
    # a variant's own options win over --prophet_options
    assert small.strategy_options({"socket_buffer_bytes": 4, "credit_bytes": 8}) == {
        "socket_buffer_bytes": 1048576, "credit_bytes": 8, "timeline_path": "/tmp/x"}
    assert train.parse_system('fifo[a=true,b=null,c="7",d=[1,2]]').options == (
        ("a", True), ("b", None), ("c", "7"), ("d", [1, 2]))
    # modifiers name bundles of options: the gradient compressions the core offers
    assert set(systems.MODIFIERS) == set(systems.compressions()) == {"fp16", "bf16"}
    bf16 = train.parse_system("prophet+bf16")
    assert bf16.name == "prophet+bf16" and bf16.strategy_options() == {"compression": "bf16"}
    assert (bf16.compression, bf16.base, plain.compression) == ("bf16", "prophet", None)
    assert train.parse_system("fifo+fp16[credit_bytes=8]").strategy_options() == {
        "compression": "fp16", "credit_bytes": 8}
    for bad, why in (("lifo", "unknown base"), ("prophet+zip", "unknown modifier"),
                     ("mwms[a=1]", "only ProphetStrategy"), ("prophet[]", "empty"),
                     ("prophet[a]", "not KEY=VALUE"), ("prophet[a=1,a=2]", "twice"),
                     ("prophet[schedule=fifo]", "sets the schedule"), ("Prophet", "expected"),
                     ("prophet[compression=bf16]", "as a modifier"),
                     ("prophet+fp16+bf16", "more than one compression"),
                     ("mwms+bf16", "only ProphetStrategy")):
        with pytest.raises(ValueError, match=why):
            train.parse_system(bad)


def test_compression_flag_adds_compressed_systems_beside_the_others():
    opts = train.options_from_flags(_flags(compute="emulated", quick=True,
                                           systems=["prophet", "priority[credit_bytes=8]", "mwms"],
                                           compression=["fp16", "bf16"]))
    assert [s.name for s in opts.systems] == [
        "prophet", "prophet+fp16", "prophet+bf16", "priority[credit_bytes=8]",
        "priority+fp16[credit_bytes=8]", "priority+bf16[credit_bytes=8]", "mwms"]
    # a compressed system already named is not added twice
    assert [s.name for s in train.options_from_flags(_flags(
        compute="emulated", quick=True, systems=["prophet", "prophet+bf16"],
        compression=["bf16"])).systems] == ["prophet", "prophet+bf16"]
    with pytest.raises(ValueError, match="unknown compression"):
        train.options_from_flags(_flags(compute="emulated", quick=True, compression=["int8"]))
    with pytest.raises(ValueError, match="--compression"):
        train.options_from_flags(_flags(compute="emulated", quick=True,
                                        prophet_options='{"compression": "bf16"}'))


def test_compressed_systems_have_bounds_of_their_own():
    from prophet_tf.bench.netem import TBF_FRAME_EFFICIENCY
    from prophet_tf.bench.train import sweep
    specs = _two_layer_specs()
    described = dict(sweep.describe_specs(specs, 10, 100.0), specs=specs)
    opts = train.SweepOptions(models=["resnet50"], workers=[2], ratios=[1.0],
                              systems=["prophet", "prophet+bf16"], compute="emulated")
    profile = sweep._step_profile(described, 10, opts, compute_s=0.012)   # time scale 10
    compressed = sweep._compressed_bounds(profile, 2, 8e8, opts, 0.012, opts.systems)
    assert list(compressed) == ["bf16"]
    # the first layer's 1 MB gradient travels in 0.5 MB: 5 ms of link instead of 10
    assert compressed["bf16"]["gradient_bytes"] == 502_000
    assert compressed["bf16"]["ideal_bound_s"] == pytest.approx(
        0.008 + 0.005 / TBF_FRAME_EFFICIENCY + 0.004)
    ideal = sweep._ideal(profile, 2, 8e8, opts, 0.012)
    st = make_setting("m", 2, 8e8, 0.012, 1_004_000, 10, {"prophet": 0.03, "prophet+bf16": 0.02},
                      compute="emulated", ideal_bound_s=ideal["step_s"], ideal=ideal,
                      compressed=compressed)
    plain, half = st["results"]["prophet"], st["results"]["prophet+bf16"]
    assert "lower_bound_s" not in plain and plain["ratio_to_lower_bound"] == pytest.approx(
        0.03 / 0.012)
    # max(compute 12 ms, 2(N-1)/N x 502 kB at 800 Mbit/s = 5.02 ms)
    assert half["lower_bound_s"] == pytest.approx(0.012)
    assert half["ideal_bound_s"] == pytest.approx(compressed["bf16"]["ideal_bound_s"])
    assert half["ratio_to_ideal_bound"] == pytest.approx(0.02 / half["ideal_bound_s"])
    assert st["compressed_bounds"]["bf16"]["gradient_bytes"] == 502_000
    validate_settings([json.loads(json.dumps(st))])
    slow = make_setting("m", 2, 8e6, 0.012, 1_004_000, 10, {"prophet+bf16": 0.6},
                        compressed={"bf16": {"gradient_bytes": 502_000}})
    assert slow["results"]["prophet+bf16"]["lower_bound_s"] == pytest.approx(0.502)
    assert slow["lower_bound_s"] == pytest.approx(1.004)
    # the table puts a compressed system's own bounds on its row
    row = [line for line in format_markdown([st]).splitlines() if "| prophet+bf16 |" in line][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[6] == "12" and cells[7] == f"{half['ideal_bound_s'] * 1e3:.0f}"


def test_systems_flag_keeps_variants_whole():
    # absl's list flag cuts at every comma, also inside [...]: the pieces are put back together
    cut = ["prophet", "prophet[socket_buffer_bytes=1048576", "partition_bytes=262144]", "fifo"]
    assert [s.name for s in train.parse_systems(cut)] == [
        "prophet", "prophet[socket_buffer_bytes=1048576,partition_bytes=262144]", "fifo"]
    with pytest.raises(ValueError, match="given twice"):
        train.parse_systems("prophet,priority,prophet")
    opts = train.options_from_flags(_flags(compute="emulated", quick=True, systems=cut))
    assert [s.name for s in opts.systems][1].startswith("prophet[")
    with pytest.raises(ValueError, match="unknown base"):
        train.options_from_flags(_flags(compute="emulated", quick=True, systems=["lifo"]))
    st = make_setting("resnet50", 2, 1e9, 0.4, MB, 8,
                      {"prophet": 0.5, "prophet[socket_buffer_bytes=1048576]": 0.45},
                      compute="emulated")
    assert list(st["results"]) == ["prophet", "prophet[socket_buffer_bytes=1048576]"]
    validate_settings([json.loads(json.dumps(st))])
    st["results"]["prophet[ socket_buffer_bytes=1048576]"] = st["results"].pop("prophet")
    with pytest.raises(ValueError, match="canonical"):
        validate_settings([st])


# ---------------------------------------------------------------- the ideal bound

def _two_layer_specs():
    from prophet_tf.bench.emulated import LayerSpec, WeightSpec
    # 1 GFLOP and 3 GFLOP per example; 250,000 and 1,000 float32 weights
    return [LayerSpec("first", "Dense", (WeightSpec("kernel", (250_000,), "float32", True),), 1e9),
            LayerSpec("second", "Dense", (WeightSpec("kernel", (1_000,), "float32", True),
                                          WeightSpec("moving", (10,), "float32", False)), 3e9)]


def test_ideal_bound_of_the_emulated_step():
    from prophet_tf.bench.emulated import emulated_profile
    # batch 10 at 100 TFLOP/s: forward 0.1 and 0.3 ms, backward 0.2 and 0.6 ms; x 10 time scale
    profile = emulated_profile(_two_layer_specs(), batch=10, tflops=100.0, time_scale=10.0)
    assert [(layer.name, round(layer.forward_s, 9), round(layer.backward_s, 9))
            for layer in profile.layers] == [("first", 0.001, 0.002), ("second", 0.003, 0.006)]
    by_name = {t.name: t for t in profile.tensors}
    # backward runs last layer first: second's gradient at 6 ms, first's at 8 ms; the first
    # layer's gradient is the most urgent
    assert by_name["grad/second/kernel"].ready_s == pytest.approx(0.006)
    assert by_name["grad/first/kernel"].ready_s == pytest.approx(0.008)
    assert by_name["grad/first/kernel"].priority > by_name["grad/second/kernel"].priority
    assert by_name["grad/first/kernel"].bytes == 1_000_000 and len(profile.tensors) == 2
    assert profile.backward_s == pytest.approx(0.008)
    # 2 workers at 8e8 bit/s with full payload: first's 1 MB take 10 ms, ready at 8 ms -> done at
    # 18 ms; second's 4 kB are done at 6.04 ms. Next forward: first at 18, second at 19 (needs
    # 6.04), next backward at 22 ms: a 22 ms period, compute 12 ms, naive bound max(12, 10.04).
    b = train.ideal_bound(profile, 2, 8e8, payload_efficiency=1.0)
    assert b.step_s == pytest.approx(0.022, abs=1e-9) and b.binding_layer == "first"
    assert b.step_s >= lower_bound_s(0.012, 1_004_000, 2, 8e8)
    # 4 workers move 1.5 x the bytes; headers (efficiency 0.5) double the link time
    assert train.ideal_bound(profile, 4, 8e8, 1.0).step_s == pytest.approx(0.008 + 0.015 + 0.004,
                                                                           abs=1e-9)
    assert train.ideal_bound(profile, 2, 8e8, 0.5).step_s == pytest.approx(0.008 + 0.020 + 0.004,
                                                                           abs=1e-9)
    # unshaped: the compute
    assert train.ideal_bound(profile, 2, None, 1.0).step_s == pytest.approx(0.012)


def test_the_sweep_records_the_ideal_bound():
    from prophet_tf.bench.train import sweep
    specs = _two_layer_specs()
    described = dict(sweep.describe_specs(specs, 10, 100.0), specs=specs)
    opts = train.SweepOptions(models=["resnet50"], workers=[2], ratios=[1.0], systems=["prophet"],
                              compute="emulated")
    profile = sweep._step_profile(described, 10, opts, compute_s=0.012)   # time scale 10
    ideal = sweep._ideal(profile, 2, 8e8, opts, 0.012)
    from prophet_tf.bench.netem import TBF_FRAME_EFFICIENCY
    assert ideal["payload_efficiency"] == TBF_FRAME_EFFICIENCY
    assert ideal["step_s"] == pytest.approx(0.008 + 0.010 / TBF_FRAME_EFFICIENCY + 0.004)
    assert ideal["binding_layer"] == "first" and ideal["per_layer"] == "accelerator"
    st = make_setting("m", 2, 8e8, 0.012, 1_004_000, 10, {"prophet": 0.03}, compute="emulated",
                      ideal_bound_s=ideal["step_s"], ideal=ideal)
    assert st["results"]["prophet"]["ratio_to_ideal_bound"] == pytest.approx(0.03 / ideal["step_s"])
    assert st["ideal"]["binding_layer"] == "first"
    assert sweep._ideal(None, 2, 8e8, opts, 0.012) is None
    assert sweep._ideal(None, 2, None, opts, 0.012)["step_s"] == 0.012      # unshaped


# ---------------------------------------------------------------- settings, JSON, table, CSV

def _setting(mwms=1.0, prophet=0.6, bw=800e6, ideal=0.55):
    return make_setting("vgg16", 2, bw, compute_s=0.5, gradient_bytes=50 * MB,
                        batch_per_worker=16,
                        step_s={"prophet": prophet, "prophet_nocross": 0.7, "priority": 0.65,
                                "fifo": 0.8, "auto": 0.62, "bytescheduler": 0.7, "p3": 0.75,
                                "mwms": mwms},
                        ratio=1.0, extra={"prophet": {"schedule_effective": "prophet"}},
                        notes=["a note"], ideal_bound_s=ideal)


def test_make_setting_derived_numbers():
    st = _setting()
    assert st["compute"] == "real"
    assert make_setting("m", 2, 1e9, 0.5, MB, 8, {"prophet": 0.6},
                        compute="emulated")["compute"] == "emulated"
    with pytest.raises(ValueError):
        make_setting("m", 2, 1e9, 0.5, MB, 8, {"prophet": 0.6}, compute="gpu")
    assert st["lower_bound_s"] == pytest.approx(0.5)       # 50 MB at 800 Mbit/s = 0.5 s = compute
    assert st["global_batch"] == 32
    p = st["results"]["prophet"]
    assert p["step_s_median"] == pytest.approx(0.6)
    assert p["samples_per_s"] == pytest.approx(32 / 0.6)
    assert p["speedup_vs_mwms"] == pytest.approx(1.0 / 0.6)
    assert p["ratio_to_lower_bound"] == pytest.approx(1.2)
    assert st["ideal_bound_s"] == pytest.approx(0.55)
    assert p["ratio_to_ideal_bound"] == pytest.approx(0.6 / 0.55)
    assert p["schedule_effective"] == "prophet"
    assert st["results"]["mwms"]["speedup_vs_mwms"] == pytest.approx(1.0)
    assert list(st["results"]) == list(SYSTEMS)


def test_make_setting_failed_and_missing_systems():
    st = make_setting("transformer", 2, None, 0.2, MB, 8, {"prophet": None, "mwms": float("nan")})
    assert st["bandwidth_bps"] is None and st["comm_compute_ratio"] is None
    assert st["results"]["prophet"] == {"step_s_median": None, "samples_per_s": None,
                                        "speedup_vs_mwms": None, "ratio_to_lower_bound": None,
                                        "ratio_to_ideal_bound": None}
    assert st["ideal_bound_s"] is None
    assert set(st["results"]) == {"prophet", "mwms"}
    # failed mwms: no speed-ups anywhere
    st = make_setting("vgg16", 2, 1e9, 0.2, MB, 8, {"prophet": 0.3, "mwms": None})
    assert st["results"]["prophet"]["speedup_vs_mwms"] is None


def test_write_json_schema(tmp_path):
    settings = [_setting(), make_setting("transformer", 2, None, 0.2, MB, 8,
                                         {"prophet": None, "mwms": float("nan")})]
    path = tmp_path / "sub" / "out.json"
    write_json(str(path), settings)
    data = json.loads(path.read_text())
    assert isinstance(data, list) and len(data) == 2
    for st in data:
        assert {"model", "workers", "bandwidth_bps", "compute_s", "lower_bound_s",
                "results"} <= set(st)
        assert isinstance(st["model"], str) and isinstance(st["workers"], int)
        for system, res in st["results"].items():
            assert system in SYSTEMS
            assert {"step_s_median", "samples_per_s"} <= set(res)
    assert data[0]["bandwidth_bps"] == 800e6 and data[0]["compute"] == "real"
    assert data[1]["bandwidth_bps"] is None
    assert data[1]["results"]["mwms"]["step_s_median"] is None   # NaN -> null
    validate_settings(data)


def test_merge_joins_parts_of_one_sweep(tmp_path):
    vgg = _setting()
    vgg["run"] = {"steps": 10, "warmup": 3}
    resnet = dict(_setting(prophet=0.7), model="resnet50")
    resnet["run"] = dict(vgg["run"])
    for name, st in (("a", vgg), ("b", resnet)):
        write_json(str(tmp_path / name / "results.json"), [st])
    (tmp_path / "a" / "results.md").write_text("# x\n\nStarted 10:00, took 5 s; load 0.1\n")
    merged = merge_results([str(tmp_path / "a" / "results.json"),
                            str(tmp_path / "b" / "results.json")], str(tmp_path / "all"))
    assert [st["model"] for st in merged] == ["vgg16", "resnet50"]
    validate_settings(json.loads((tmp_path / "all" / "results.json").read_text()))
    md = (tmp_path / "all" / "results.md").read_text()
    assert "Started 10:00, took 5 s" in md and "(no results.md beside it)" in md
    assert "| resnet50 |" in md and "| vgg16 |" in md
    assert (tmp_path / "all" / "results.csv").exists()
    # the same setting twice, or parts measured with other options, are refused by name
    write_json(str(tmp_path / "c" / "results.json"), [vgg])
    with pytest.raises(ValueError, match="vgg16 N=2 comm/comp 1.0 is in both"):
        merge_results([str(tmp_path / "a" / "results.json"), str(tmp_path / "c" / "results.json")],
                      str(tmp_path / "bad"))
    other = dict(resnet, run={"steps": 4, "warmup": 3})
    write_json(str(tmp_path / "d" / "results.json"), [other])
    with pytest.raises(ValueError, match="other steps, threads, options"):
        merge_results([str(tmp_path / "a" / "results.json"), str(tmp_path / "d" / "results.json")],
                      str(tmp_path / "bad"))
    r = _run(["--merge", f"{tmp_path / 'a' / 'results.json'},{tmp_path / 'nope.json'}",
              "--out", str(tmp_path / "bad")], timeout=300)
    assert r.returncode == 2 and "nope.json" in r.stdout


@pytest.mark.parametrize("mutate", [
    lambda st: st.pop("model"),
    lambda st: st.update(workers="2"),
    lambda st: st.update(bandwidth_bps=-1),
    lambda st: st.pop("compute"),
    lambda st: st.update(compute="gpu"),
    lambda st: st["results"].update(single={"step_s_median": 1, "samples_per_s": 1}),
    lambda st: st["results"]["prophet"].pop("samples_per_s"),
    lambda st: st["results"]["prophet"].update(step_s_median="fast"),
])
def test_validate_settings_rejects(mutate):
    st = json.loads(json.dumps(_setting()))
    mutate(st)
    with pytest.raises(ValueError):
        validate_settings([st])


def test_format_markdown_table():
    text = format_markdown([_setting(), _setting(mwms=None, bw=400e6)])
    lines = text.strip().splitlines()
    assert lines[0].startswith("| model | N | batch | comm/comp | link |")
    assert "| bound ms | ideal ms |" in lines[0]
    assert lines[0].endswith("| step/bound | step/ideal |")
    assert set(lines[1].replace("|", "")) == {"-"}
    ncols = lines[0].count("|")
    assert all(line.count("|") == ncols for line in lines)
    assert len(lines) == 2 + 2 * len(SYSTEMS)
    first = [c.strip() for c in lines[2].strip("|").split("|")]
    assert first[:9] == ["vgg16", "2", "32", "1", "800 Mbit/s", "500", "500", "550", "prophet"]
    assert first[9:] == ["600", "53.3", "1.67x", "1.20", "1.09"]
    second = [c.strip() for c in lines[3].strip("|").split("|")]
    assert second[:8] == [""] * 8 and second[8] == "prophet_nocross"
    # missing mwms in the second setting: n/a speed-ups
    assert "n/a" in lines[2 + len(SYSTEMS)]


def test_format_markdown_emulated_setting():
    st = make_setting("resnet50", 2, 1.97e9, 0.416, 102 * MB, 64, {"prophet": 0.45, "mwms": 0.9},
                      ratio=1.0, compute="emulated",
                      extra={"prophet": {"machine_cpu": 0.93}})
    st["emulation"] = {"time_scale": 28.0, "accelerator_tflops": 100.0, "accelerator_s": 0.416,
                       "modelled_accelerator_s": 0.0149, "modelled_bandwidth_bps": 1.97e9 * 28}
    st["compute_single"] = {"step_s_median": 0.47}
    row = [c.strip() for c in format_markdown([st]).splitlines()[2].strip("|").split("|")]
    assert row[4] == "1.97 Gbit/s (55.2 Gbit/s)"
    assert row[5] == "416 (alone 470)"
    assert row[7] == "n/a"                                  # no ideal bound known
    assert row[8] == "prophet (CPU-limited: cores 93% busy)"


def test_write_csv(tmp_path):
    path = tmp_path / "r.csv"
    write_csv(str(path), [_setting()])
    rows = list(csv.DictReader(path.open()))
    assert [r["system"] for r in rows] == list(SYSTEMS)
    assert float(rows[0]["step_s_median"]) == pytest.approx(0.6)
    assert rows[0]["schedule_effective"] == "prophet"
    assert rows[1]["schedule_effective"] == ""


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "chart.png"
    train.plot([_setting(), _setting(bw=400e6)], str(path), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_foreign_cores():
    runs = {0: {"window_s": 10.0, "window_machine_busy_s": 25.0, "window_cpu_s": 10.0},
            1: {"window_s": 10.1, "window_machine_busy_s": 25.0, "window_cpu_s": 10.0}}
    assert train.foreign_cores(runs) == pytest.approx(0.5)
    runs[1]["window_cpu_s"] = 20.0                       # never negative
    assert train.foreign_cores(runs) == 0.0
    runs[1]["window_cpu_s"] = None
    assert train.foreign_cores(runs) is None
    assert train.foreign_cores({}) is None
    busy = train.machine_busy_s()
    assert busy is None or busy > 0


def test_noisy_measurement_is_flagged():
    st = _setting()
    st["results"]["fifo"]["foreign_cores"] = 0.8
    assert "fifo (noisy: other programs used 0.8 cores)" in format_markdown([st])


def test_parse_results():
    lines = ['[rank 1] RESULT {"a": 1}', "[rank 0] noise", '[rank 0] RESULT {"step_s_median": 0.5}',
             "RESULT {}"]
    assert parse_results(lines) == {1: {"a": 1}, 0: {"step_s_median": 0.5}}


# ---------------------------------------------------------------- the source a run reports

def test_a_benchmark_names_the_libraries_it_would_load_that_are_not_the_built_ones(tmp_path):
    """A `bazel build` alone leaves prophet_tf/'s copies (what the workers load) as they were, and
    a run would be labelled with a commit whose code it did not run."""
    from prophet_tf._library import stale_libraries
    (tmp_path / "prophet_tf").mkdir()
    (tmp_path / "bazel-bin" / "ops" / "tf").mkdir(parents=True)
    (tmp_path / "bazel-bin" / "ops" / "predict").mkdir(parents=True)
    (tmp_path / "prophet_tf" / "_prophet_ops.so").write_bytes(b"built yesterday")
    (tmp_path / "bazel-bin" / "ops" / "tf" / "_prophet_ops.so").write_bytes(b"built today")
    (tmp_path / "prophet_tf" / "_prophet_predict.so").write_bytes(b"the same")
    (tmp_path / "bazel-bin" / "ops" / "predict" / "_prophet_predict.so").write_bytes(b"the same")
    (tmp_path / "prophet_tf" / "_prophet_bench_ops.so").write_bytes(b"not built here")
    assert stale_libraries(tmp_path) == ["_prophet_ops.so"]
    (tmp_path / "prophet_tf" / "_prophet_ops.so").write_bytes(b"built today")
    assert stale_libraries(tmp_path) == []


# ---------------------------------------------------------------- command line

def _run(args, timeout):
    env = _worker_env({"TF_CPP_MIN_LOG_LEVEL": "2"})
    return subprocess.run([worker_python(), "-m", "prophet_tf.bench.train", *args], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def test_bad_flags_are_usage_errors():
    r = _run(["--models", "alexnet", "--loopback"], timeout=300)
    assert r.returncode == 2 and "unknown model" in r.stdout
    r = _run(["--workers", "9", "--loopback"], timeout=300)
    assert r.returncode == 2 and "between 2 and 8" in r.stdout
    r = _run(["--full", "--loopback"], timeout=300)
    assert r.returncode == 2 and "--compute emulated" in r.stdout
    r = _run(["--compute", "emulated", "--accelerator-tflops", "0", "--loopback"], timeout=300)
    assert r.returncode == 2 and "--accelerator_tflops must be positive" in r.stdout


def _flags(**overrides):
    """The command line's flag values (defaults of train._define_flags) with overrides."""
    from types import SimpleNamespace
    values = dict(compute="real", accelerator_tflops=100.0, time_scale=None, link_budget_gbps=4.0,
                  full=False, quick=False, models=None, workers=None, batch=None, steps=None,
                  warmup=None, ratios=None, systems=None, loopback=False, out="bench_out",
                  json=None, intra_threads=1, inter_threads=2, launch_timeout=600.0,
                  prophet_options="{}", model_options="{}", contended=None, retries=None,
                  noise_cores=0.3, netns_prefix="ptfbench", timeline=None, alone=False,
                  verbose=False, rate_change=None, plan=False, compression=None,
                  workers_per_host=1)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_options_for_emulated_compute():
    quick = train.options_from_flags(_flags(compute="emulated", quick=True))
    assert train.sweep_cells(quick) == [("resnet50", [(2, (1.0,))])]
    assert quick.compute == "emulated" and not quick.contended and quick.grid is None
    assert (quick.steps, quick.warmup) == (train.EMULATED_STEPS, train.EMULATED_WARMUP)
    # --quick: no auto and no retries unless asked for; the sweeps retry a disturbed launch once
    assert [s.name for s in quick.systems] == list(train.QUICK_SYSTEMS) and quick.retries == 0
    asked = train.options_from_flags(_flags(compute="emulated", quick=True, retries=2,
                                            systems=["prophet", "auto"]))
    assert [s.name for s in asked.systems] == ["prophet", "auto"] and asked.retries == 2
    default = train.options_from_flags(_flags(compute="emulated"))
    cells = train.sweep_cells(default)
    assert [m for m, _ in cells] == list(dict.fromkeys(m for m, _, _ in
                                                       train.EMULATED_DEFAULT_GRID))
    assert sum(len(runs) for _, runs in cells) == len(train.EMULATED_DEFAULT_GRID)
    assert default.retries == 1
    assert [s.name for s in default.systems] == list(train.EMULATED_DEFAULT_SYSTEMS)
    # the default sweep: every model x N = 2, 4, 8 x comm/comp 0.5, 1, 2
    assert sorted((m, n, r) for m, runs in cells for n, rs in runs for r in rs) == sorted(
        (m, n, r) for m in ("resnet50", "vgg16", "bert_base") for n in (2, 4, 8)
        for r in (0.5, 1.0, 2.0))
    full = train.options_from_flags(_flags(compute="emulated", full=True))
    assert [s.name for s in full.systems] == list(train.SYSTEMS)
    cells = train.sweep_cells(full)
    assert [m for m, _ in cells] == list(train.EMULATED_DEFAULT_MODELS)
    assert all(runs == [(n, train.EMULATED_FULL_RATIOS) for n in (2, 4, 8)] for _, runs in cells)
    # --models alone is the default grid's part for those models (measured per model, joined)
    part = train.options_from_flags(_flags(compute="emulated", models=["bert_base"]))
    assert train.sweep_cells(part) == [("bert_base", [(n, train.EMULATED_RATIOS)
                                                      for n in (2, 4, 8)])]
    assert part.mwms_ratios == (1.0,)
    # explicit choices replace the default grid
    mine = train.options_from_flags(_flags(compute="emulated", models=["vgg16"], workers=["4"]))
    assert train.sweep_cells(mine) == [("vgg16", [(4, train.EMULATED_RATIOS)])]
    real = train.options_from_flags(_flags())
    assert real.compute == "real" and real.contended and real.steps == 10
    assert [s.name for s in real.systems] == list(train.SYSTEMS)
    assert train.sweep_cells(real) == [(m, [(2, train.DEFAULT_RATIOS)])
                                       for m in train.DEFAULT_MODELS]


def test_default_emulated_sweep_runs_mwms_only_at_comm_comp_1(monkeypatch, tmp_path):
    opts = train.options_from_flags(_flags(compute="emulated", out=str(tmp_path)))
    assert opts.mwms_ratios == (1.0,)
    assert train.options_from_flags(_flags(compute="emulated", systems=["mwms"])).mwms_ratios is None
    assert train.options_from_flags(_flags(compute="emulated", ratios=["2"])).mwms_ratios is None
    from prophet_tf.bench import netem
    from prophet_tf.bench.train import sweep
    monkeypatch.setattr(netem.EmulatedCluster, "check_available", staticmethod(lambda: None))
    monkeypatch.setattr(sweep, "_describe", lambda *a, **k: {
        "gradient_bytes": 1e8, "accelerator_s": 0.015, "spec_path": "x"})
    monkeypatch.setattr(sweep, "_step_profile", lambda *a, **k: None)
    monkeypatch.setattr(sweep, "_emulation_facts", lambda *a, **k: {})
    monkeypatch.setattr(sweep, "write_outputs", lambda *a, **k: None)
    monkeypatch.setattr(sweep, "available_memory_bytes", lambda: None)
    ran = []

    def fake_setting(model, n, cfg, batch, ratio, bw, compute_s, gbytes, systems, *rest):
        ran.append((model, n, ratio, tuple(s.name for s in systems)))
        return {}
    monkeypatch.setattr(sweep, "_run_setting", fake_setting)
    train.run_sweep(opts)
    assert len(ran) == sum(len(r) for _, _, r in train.EMULATED_DEFAULT_GRID)
    for model, n, ratio, systems in ran:
        want = train.EMULATED_DEFAULT_SYSTEMS
        assert systems == (want if ratio == 1.0 else tuple(s for s in want if s != "mwms"))


def test_systems_that_do_not_fit_in_memory_are_skipped(monkeypatch, tmp_path):
    # VGG16-sized gradients at N=4: ProphetStrategy workers need about 4 x 4.5 GB, mwms workers
    # 4 x 6.7 GB; with 22 GB available (90% usable) mwms is skipped, the others run. At N=8
    # nothing fits and the whole setting is skipped.
    from prophet_tf.bench import netem
    from prophet_tf.bench.train import sweep
    assert train.worker_memory_bytes(553e6, "prophet") == pytest.approx(1.2e9 + 6 * 553e6)
    assert train.worker_memory_bytes(553e6, train.parse_system("mwms")) == pytest.approx(
        1.2e9 + 10 * 553e6)
    opts = train.options_from_flags(_flags(compute="emulated", models=["vgg16"],
                                           workers=["4", "8"], ratios=["1"], out=str(tmp_path)))
    monkeypatch.setattr(netem.EmulatedCluster, "check_available", staticmethod(lambda: None))
    monkeypatch.setattr(sweep, "_describe", lambda *a, **k: {
        "gradient_bytes": 553e6, "accelerator_s": 0.06, "spec_path": "x"})
    monkeypatch.setattr(sweep, "_step_profile", lambda *a, **k: None)
    monkeypatch.setattr(sweep, "_emulation_facts", lambda *a, **k: {})
    monkeypatch.setattr(sweep, "write_outputs", lambda *a, **k: None)
    monkeypatch.setattr(sweep, "available_memory_bytes", lambda: 22e9)
    ran = []

    def fake_setting(model, n, cfg, batch, ratio, bw, compute_s, gbytes, systems, *rest):
        ran.append((n, tuple(s.name for s in systems)))
        return {}
    monkeypatch.setattr(sweep, "_run_setting", fake_setting)
    train.run_sweep(opts)
    assert ran == [(4, ("prophet", "priority", "fifo", "bytescheduler", "p3"))]
    skipped = opts.meta["skipped"]
    assert any("4 workers: mwms skipped" in why for why in skipped)
    assert sum("8 workers" in why for why in skipped) == 6


def test_plan_says_what_would_run_and_how_long(monkeypatch, tmp_path):
    from prophet_tf.bench.train import sweep
    specs = _two_layer_specs()
    monkeypatch.setattr(sweep, "_describe", lambda *a, **k: dict(
        sweep.describe_specs(specs, 10, 100.0), spec_path="x", specs=specs))
    monkeypatch.setattr(sweep, "available_memory_bytes", lambda: None)
    monkeypatch.setattr(sweep, "_run_setting", lambda *a, **k: pytest.fail("--plan ran a setting"))
    opts = train.options_from_flags(_flags(compute="emulated", models=["resnet50"],
                                           workers=["2"], ratios=["1", "2"], plan=True,
                                           out=str(tmp_path), systems=["prophet", "mwms"]))
    assert opts.plan and train.run_sweep(opts) == []
    plan = opts.meta["plan"]
    assert [(p["workers"], p["ratio"], p["systems"]) for p in plan] == [
        (2, 1.0, ["prophet", "mwms"]), (2, 2.0, ["prophet", "mwms"])]
    for p in plan:
        assert p["ideal_bound_s"] >= p["lower_bound_s"] > 0
        launches = opts.warmup + opts.steps + 1
        assert p["estimated_s"] > launches * (p["ideal_bound_s"] * sweep.PLAN_PROPHET_OVER_IDEAL
                                              + p["lower_bound_s"] * sweep.PLAN_MWMS_OVER_BOUND)
    text = sweep.format_plan(plan, ["vgg16 with 8 workers: mwms skipped"])
    assert "| resnet50 | 2 | 1 |" in text and "2 settings, 4 launches: about" in text
    assert text.endswith("- vgg16 with 8 workers: mwms skipped")
    assert not list(tmp_path.iterdir())                      # nothing written
    with pytest.raises(ValueError, match="--compute emulated"):
        train.run_sweep(train.options_from_flags(_flags(plan=True, out=str(tmp_path))))


def test_workers_per_host_places_several_workers_on_one_emulated_host():
    opts = train.options_from_flags(_flags(compute="emulated", workers=["4"], ratios=["1"],
                                           workers_per_host=2))
    assert opts.workers_per_host == 2
    for workers in (["6"], ["2"]):  # not a multiple; a single host
        with pytest.raises(ValueError, match="multiple of --workers_per_host 4"):
            train.options_from_flags(_flags(compute="emulated", workers=workers, workers_per_host=4))
    with pytest.raises(ValueError, match="drop --loopback"):
        train.options_from_flags(_flags(workers=["4"], workers_per_host=2, loopback=True))
    from prophet_tf.bench.train.sweep import _placement

    class Cluster:
        def host_address(self, i):
            return f"10.9.0.{i + 1}"

        def exec_argv(self, i, argv):
            return [f"ns{i}", *argv]

    placement = _placement(Cluster(), 4, 2)
    assert placement["hosts"] == ["10.9.0.1", "10.9.0.1", "10.9.0.2", "10.9.0.2"]
    assert placement["wrap_argv"](3, ["python"]) == ["ns1", "python"]
    assert placement["base_port"] > 0
    assert "base_port" not in _placement(Cluster(), 4, 1)
    # The bounds are those of the hosts' links: 4 workers on 2 hosts are bound like 2 hosts.
    flat = train.make_setting("m", 2, 1e9, 1.0, int(1e9), 8, {"prophet": 2.0})
    shared = train.make_setting("m", 4, 1e9, 1.0, int(1e9), 8, {"prophet": 2.0}, workers_per_host=2)
    assert shared["lower_bound_s"] == flat["lower_bound_s"] and shared["workers_per_host"] == 2


def test_rate_change_flag_and_summary():
    opts = train.options_from_flags(_flags(compute="emulated", quick=True, rate_change="15:0.5"))
    assert opts.rate_change == (15, 0.5)
    for bad in ("15", "x:0.5", "0:0.5", "25:0.5", "15:0", "15:-1"):
        with pytest.raises(ValueError, match="--rate_change"):
            train.options_from_flags(_flags(compute="emulated", quick=True, rate_change=bad))
    with pytest.raises(ValueError, match="loopback"):
        train.options_from_flags(_flags(quick=True, loopback=True, rate_change="5:2"))
    # periods[i] is step warmup + i; the link halves at step 8: steps 5-7 before, 8-12 around,
    # 13- after. Compute 1 s, 1 GB of gradients, 2 workers at 8 Gbit/s: comm 1 s, then 2 s.
    periods = [1.0, 1.1, 1.2, 1.5, 2.5, 2.2, 2.1, 2.0, 2.05, 2.0, 2.1]
    s = train.rate_change_summary(periods, 5, (8, 0.5), 1.0, int(1e9), 2, 8e9)
    assert s["median_before_s"] == 1.1
    assert s["first_steps_after_s"] == [1.5, 2.5, 2.2, 2.1, 2.0]
    assert s["median_after_s"] == 2.05
    assert (s["lower_bound_before_s"], s["lower_bound_after_s"]) == (1.0, 2.0)
    assert "before 1100 ms (bound 1000)" in s["text"] and "after 2050 ms (bound 2000)" in s["text"]


def test_without_root_says_use_loopback(monkeypatch, tmp_path):
    from prophet_tf.bench.netem import NetemUnavailableError
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    opts = train.SweepOptions(models=["transformer"], workers=[2], ratios=[1.0],
                              systems=list(SYSTEMS), out=str(tmp_path))
    with pytest.raises(NetemUnavailableError, match="--loopback"):
        train.run_sweep(opts)
    assert not list(tmp_path.iterdir())   # failed before running anything


def test_end_to_end_loopback_smoke(tmp_path):
    """Tiny Transformer, 2 workers on loopback, mwms + a variant of prophet, 3 steps (about
    30-50 s)."""
    out, js = tmp_path / "out", tmp_path / "r.json"
    t0 = time.monotonic()
    r = _run(["--loopback", "--models", "transformer", "--systems",
              "prophet[partition_bytes=65536],mwms",
              "--model_options", '{"transformer": {"blocks": 1, "d_model": 32, "ff": 64, '
              '"seq_len": 8, "vocab": 64}}', "--batch", "4", "--steps", "3", "--warmup", "1",
              # a smoke test: no re-runs of launches disturbed by other programs
              "--retries", "0", "--nocontended", "--out", str(out), "--json", str(js)],
             timeout=900)
    assert r.returncode == 0, r.stdout[-4000:]
    data = json.loads(js.read_text())
    validate_settings(data)
    assert len(data) == 1
    st = data[0]
    assert st["model"] == "transformer" and st["workers"] == 2 and st["bandwidth_bps"] is None
    assert set(st["results"]) == {"prophet[partition_bytes=65536]", "mwms"}
    # the variant's option reached the runtime
    variant = st["results"]["prophet[partition_bytes=65536]"]
    assert variant["runtime_options"] == {"partition_bytes": 65536}
    assert variant["schedule_effective"] == "prophet"
    for res in st["results"].values():
        assert res["step_s_median"] > 0 and res["samples_per_s"] > 0
    for name in ("results.md", "results.csv", "results.json", "results.png"):
        assert (out / name).stat().st_size > 0
    assert "| transformer | 2 | 8 |" in (out / "results.md").read_text()
    print(f"smoke run: {time.monotonic() - t0:.0f} s")


def test_end_to_end_emulated_loopback_smoke(tmp_path):
    """Emulated compute: a small model's specs, 2 workers on loopback, prophet (with a
    timeline), prophet+bf16 (--compression) and mwms, one worker alone, 3 steps (about
    50-80 s)."""
    out, js = tmp_path / "out", tmp_path / "r.json"
    r = _run(["--loopback", "--compute", "emulated", "--models", "transformer", "--systems",
              "prophet,mwms", "--model_options", '{"transformer": {"blocks": 1, "d_model": 32, '
              '"ff": 64, "seq_len": 8, "vocab": 64}}', "--batch", "4", "--steps", "3",
              "--warmup", "1", "--alone", "--time_scale", "2", "--retries", "0", "--out",
              str(out), "--json", str(js), "--timeline", str(tmp_path / "tl"),
              "--compression", "bf16"], timeout=900)
    assert r.returncode == 0, r.stdout[-4000:]
    data = json.loads(js.read_text())
    validate_settings(data)
    st = data[0]
    assert st["compute"] == "emulated" and list(st["results"]) == ["prophet", "prophet+bf16",
                                                                     "mwms"]
    # the compressed system ran compressed, against bounds of its own (unshaped: the compute)
    half = st["results"]["prophet+bf16"]
    assert (half["compression"], st["results"]["prophet"]["compression"]) == ("bf16", None)
    # the engine's count of stall breaks (prophet never breaks its flow control); none for mwms
    assert st["results"]["prophet"]["stall_breaks"] == 0
    assert "stall_breaks" not in st["results"]["mwms"]
    assert half["lower_bound_s"] == half["ideal_bound_s"] == st["compute_s"]
    em = st["emulation"]
    assert em["time_scale"] == 2.0 and em["accelerator_tflops"] == 100.0
    assert st["compute_s"] == pytest.approx(em["accelerator_s"])
    assert em["accelerator_s"] == pytest.approx(2 * em["modelled_accelerator_s"])
    assert st["compute_single"]["step_s_median"] > 0
    # unshaped loopback: the ideal bound is the compute time
    assert st["ideal_bound_s"] == st["compute_s"]
    for res in st["results"].values():
        assert res["step_s_median"] > 0
        assert res["ratio_to_ideal_bound"] == pytest.approx(res["step_s_median"] / st["compute_s"])
    [spec_file] = (out / "specs").glob("transformer-*.json")
    specs = json.loads(spec_file.read_text())
    assert sum(len([w for w in s["weights"] if w["trainable"]]) for s in specs) == 20
    # one measured step of the prophet launch drawn from both workers' timelines
    assert Path(st["results"]["prophet"]["timeline_png"]).stat().st_size > 0
    trace = json.loads((tmp_path / "tl" / "transformer_n2_loopback_prophet.0.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"forward", "backward", "step"} <= tracks


# ---------------------------------------------------------------- models

def test_models_config_and_synthetic_data():
    from prophet_tf.bench import models
    cfg = models.config_for("transformer", blocks=1, d_model=16, heads=2, ff=32, seq_len=4,
                            vocab=11)
    x, y = models.synthetic_batch(cfg, 3, seed=5)
    assert x.shape == (3, 4) and x.dtype.name == "int32" and 0 <= x.min() and x.max() < 11
    assert y.shape == (3,) and y.max() < cfg.classes
    x2, _ = models.synthetic_batch(cfg, 3, seed=5)
    assert (x == x2).all()
    img = models.config_for("vgg16", image_size=32)
    xi, _ = models.synthetic_batch(img, 2)
    assert xi.shape == (2, 32, 32, 3) and xi.dtype.name == "float32"
    with pytest.raises(ValueError, match="unknown model"):
        models.config_for("alexnet")


def test_transformer_gradients_are_dense_and_counted():
    tf = pytest.importorskip("tensorflow")
    from prophet_tf.bench import models
    cfg = models.config_for("transformer", blocks=1, d_model=16, heads=2, ff=32, seq_len=4,
                            vocab=11)
    model = models.build_model(cfg)
    x, y = models.synthetic_batch(cfg, 3)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, model(x)))
    grads = tape.gradient(loss, model.trainable_weights)
    assert all(isinstance(g, tf.Tensor) for g in grads)     # no IndexedSlices
    assert models.gradient_bytes(model) == 4 * models.parameter_count(model)
    assert models.parameter_count(model) == sum(int(tf.size(g)) for g in grads)
