"""Tests of the predictor (prophet_tf.predict): profile parsing, the simulator through its C entry
point on a case computed by hand, the command line, and a profile recorded by a real one-worker
run (the only test here that runs TensorFlow)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest

from prophet_tf import timeline
from prophet_tf.predict import (SCHEDULES, PredictError, PredictOptions, Profile, ProfiledLayer,
                                ProfiledTensor, ProfileError, ideal_bound, load_profile, predict,
                                profile_from_trace)
from prophet_tf.predict.cli import parse_duration, parse_rate

REPO = Path(__file__).resolve().parents[1]
CONTROL = 1 << 40
TRACKS = ("step", "forward", "backward", "ready", "op", "apply")


def trace_writer(tracks: tuple[str, ...]) -> tuple[list[dict], dict[str, int], Callable[..., None]]:
    """A worker's trace events with one thread per track, the track ids, and a function adding a
    span (times in ms) to a track."""
    tid = {track: i for i, track in enumerate(tracks, start=1)}
    events: list[dict] = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t,
                           "args": {"name": track}} for track, t in tid.items()]

    def span(track: str, name: str, ts_ms: float, dur_ms: float, **args) -> None:
        events.append({"name": name, "ph": "X", "ts": ts_ms * 1e3, "dur": dur_ms * 1e3, "pid": 0,
                       "tid": tid[track], **({"args": args} if args else {})})

    return events, tid, span


def synthetic_trace(steps: int = 5, measured: bool = True, priorities: bool = True) -> list[dict]:
    """A one-worker trace as the runtime writes it (microseconds): every step begins at
    100 ms x step, two layers of 10 and 20 ms forward, then the backward pass: dense_1's gradient
    at +5 ms, dense's at +30 ms (it ends there), the metrics' at +1 ms; the step returns 2 ms
    after the backward pass; updates take 0.5 ms."""
    events, tid, span = trace_writer(TRACKS)
    sizes = {"grad/dense/kernel": (4096, 2), "grad/dense_1/kernel": (8192, 1),
             "metrics/step/float32/sum/2": (8, CONTROL)}
    offsets = {"grad/dense_1/kernel": 5.0, "grad/dense/kernel": 30.0, "metrics/step/float32/sum/2": 1.0}
    for step in range(steps):
        begin = 100.0 * step
        span("step", f"step {step}", begin, 62.0)
        if measured:
            span("forward", "dense", begin + 0.0, 10.0)
            span("forward", "dense_1", begin + 10.0, 20.0)
            span("backward", "dense_1", begin + 30.0, 5.0)
            span("backward", "dense", begin + 35.0, 25.0)
        for name, offset in offsets.items():
            ready = begin + 30.0 + offset
            events.append({"name": name, "ph": "i", "s": "t", "ts": ready * 1e3, "pid": 0,
                           "tid": tid["ready"]})
            size, priority = sizes[name]
            args = {"round": step, "bytes": size, "ok": True}
            if priorities:
                args["priority"] = priority
            span("op", name, ready, 0.01, **args)
            if priority < CONTROL:
                span("apply", name, ready + 0.01, 0.5)
    return events


def test_profile_from_a_trace_with_forward_spans():
    profile = profile_from_trace(synthetic_trace(), source="synthetic")
    assert profile.forward == "measured"
    assert [layer.name for layer in profile.layers] == ["dense", "dense_1"]
    assert [round(layer.forward_s, 6) for layer in profile.layers] == [0.010, 0.020]
    assert profile.backward_s == pytest.approx(0.030)
    assert profile.tail_s == pytest.approx(0.002)
    assert profile.gap_s == pytest.approx(0.038)
    assert profile.step_s == pytest.approx(0.100)
    assert profile.steps == 3  # steps 1-3: the first is skipped, the last has no gap
    by_name = {t.name: t for t in profile.tensors}
    assert by_name["grad/dense_1/kernel"].ready_s == pytest.approx(0.005)
    assert by_name["grad/dense_1/kernel"].layer == "dense_1"
    assert by_name["grad/dense/kernel"].layer == "dense"
    assert by_name["grad/dense/kernel"].priority == 2
    assert by_name["grad/dense/kernel"].apply_s == pytest.approx(0.0005)
    assert by_name["metrics/step/float32/sum/2"].layer is None
    assert by_name["metrics/step/float32/sum/2"].apply_s == 0.0
    assert profile.gradient_bytes == 4096 + 8192


def late_gradient_trace(steps: int = 5) -> list[dict]:
    """A one-worker trace (microseconds) like BERT's: steps begin every 100 ms and their spans end
    at +62 ms, but the first layer's gradient is handed over at +101 ms, after the next step has
    begun; that step's first layer waits at its gate (+0.5 to +4 ms) for the update (+101.5 to
    +103.5 ms). Layers: dense 10 ms and dense_1 20 ms forward from +4 ms; backward from +34 ms,
    dense_1's gradient at +39 ms; a control collective during the forward pass at +6 ms."""
    events, tid, span = trace_writer(TRACKS + ("gate",))

    def handed_over(name: str, ts_ms: float, step: int, size: int, priority: int) -> None:
        events.append({"name": name, "ph": "i", "s": "t", "ts": ts_ms * 1e3, "pid": 0,
                       "tid": tid["ready"]})
        span("op", name, ts_ms, 0.01, round=step, bytes=size, priority=priority, ok=True)

    for step in range(steps):
        begin = 100.0 * step
        span("step", f"step {step}", begin, 62.0)
        if step:
            span("gate", "dense", begin + 0.5, 3.5)
        span("forward", "dense", begin + 4.0, 10.0)
        span("forward", "dense_1", begin + 14.0, 20.0)
        span("backward", "dense_1", begin + 34.0, 5.0)
        span("backward", "dense", begin + 39.0, 21.0)
        handed_over("metrics/loss/float32/sum/2", begin + 6.0, step, 8, CONTROL)
        handed_over("grad/dense_1/kernel", begin + 39.0, step, 8192, 1)
        span("apply", "grad/dense_1/kernel", begin + 39.01, 0.5)
        handed_over("grad/dense/kernel", begin + 101.0, step, 4096, 2)
        span("apply", "grad/dense/kernel", begin + 101.5, 2.0)
    return events


def test_gradient_handed_over_after_the_step_returns_keeps_its_ready_time():
    # BERT-base's word embedding: its gradient is handed over after the step's span ends; taking
    # the previous step's hand-over instead (before the backward pass, clamped to its start) would
    # hide the all-reduce of its 94 MB.
    profile = profile_from_trace(late_gradient_trace(), source="late")
    by_name = {t.name: t for t in profile.tensors}
    assert by_name["grad/dense/kernel"].ready_s == pytest.approx(0.067)
    assert by_name["grad/dense_1/kernel"].ready_s == pytest.approx(0.005)
    assert by_name["metrics/loss/float32/sum/2"].ready_s == 0.0  # during the forward pass
    assert profile.backward_s == pytest.approx(0.067)
    # The launch excludes the gate's wait for the previous step's update (the simulator makes it).
    assert profile.launch_s == pytest.approx(0.0005)
    assert profile.tail_s == 0.0
    assert profile.gap_s == pytest.approx(0.038)


def test_profile_estimates_forward_times_without_forward_spans():
    profile = profile_from_trace(synthetic_trace(measured=False, priorities=False))
    assert profile.forward == "estimated"
    # The last gradient comes 60 ms after the step begins: 20 ms of forward, then the backward.
    assert profile.forward_s == pytest.approx(0.020)
    assert [layer.name for layer in profile.layers] == ["dense", "dense_1"]
    # dense_1's gradient 15 ms after the estimated backward start, dense's 25 ms later.
    by_name = {t.name: t for t in profile.tensors}
    assert by_name["grad/dense_1/kernel"].ready_s == pytest.approx(0.015)
    assert profile.layers[1].forward_s == pytest.approx(0.020 * 15 / 40)
    # Priorities inferred: the gradient ready last is the first layer's.
    assert by_name["grad/dense/kernel"].priority > by_name["grad/dense_1/kernel"].priority
    assert by_name["metrics/step/float32/sum/2"].priority >= CONTROL
    assert any("inferred" in note for note in profile.notes)


def test_trace_without_what_a_profile_needs_says_what_to_record():
    with pytest.raises(ProfileError, match="step marks"):
        profile_from_trace(synthetic_trace(steps=2))
    no_ready = [e for e in synthetic_trace() if e.get("ph") != "i"]
    with pytest.raises(ProfileError, match="PROPHET_PROFILE"):
        profile_from_trace(no_ready)


def test_profile_round_trip_and_validation(tmp_path):
    profile = profile_from_trace(synthetic_trace(), source="synthetic")
    path = tmp_path / "profile.json"
    profile.save(path)
    again = load_profile(path)
    assert again == profile
    data = json.loads(path.read_text())
    data["tensors"][0]["layer"] = "no_such_layer"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="no_such_layer"):
        load_profile(path)
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ProfileError, match="not a prophet_tf profile"):
        load_profile(path)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


def one_tensor_profile() -> Profile:
    """One 10 ms layer and one 100,000-byte gradient ready when the backward pass starts."""
    return Profile(layers=[ProfiledLayer("dense", 0.010)],
                   tensors=[ProfiledTensor("grad/dense/kernel", 100_000, 1, 0.0, "dense")])


# The kernel holds nothing; every tensor by its owners, unfused (the cases computed by hand are
# about that path: a tensor below 2 x 64 KiB on one owner; small tensors by exchange and fusion
# have their own tests).
EXACT = PredictOptions(payload_efficiency=1.0, frame_overhead_bytes=0, socket_buffer_bytes=0,
                       autotuned_socket_buffer_bytes=0, small_allreduce=False, fusion_bytes=0)


def test_predict_one_tensor_on_two_workers_exactly():
    # 1 MB/s: the push and the sum take 100 ms each after the 10 ms forward pass.
    p = predict(one_tensor_profile(), workers=2, bandwidth_bps=8e6, schedule="priority_nocross",
                options=EXACT)
    assert p.step_s == pytest.approx(0.210, abs=1e-6)
    assert p.single_step_s == pytest.approx(0.010)
    assert p.speedup == pytest.approx(2 * 0.010 / 0.210)
    assert p.comm_s == pytest.approx(0.100, abs=1e-6)
    assert p.tensor_times[0]["done_s"] == pytest.approx(0.210, abs=1e-6)
    # Fused (the default), the tensor alone is a bucket of one, cut between both owners: each
    # pushes 50,000 bytes to the other while it receives theirs, then the sums cross: 110 ms.
    fused = predict(one_tensor_profile(), workers=2, bandwidth_bps=8e6, schedule="priority_nocross",
                    options=dataclasses.replace(EXACT, fusion_bytes=-1))
    assert fused.step_s == pytest.approx(0.110, abs=1e-6)
    one = predict(one_tensor_profile(), workers=1, bandwidth_bps=8e6, options=EXACT)
    assert one.step_s == pytest.approx(0.010)
    with pytest.raises(PredictError, match="unknown schedule"):
        predict(one_tensor_profile(), workers=2, bandwidth_bps=8e6, schedule="lifo")
    with pytest.raises(PredictError, match="link rate"):
        predict(one_tensor_profile(), workers=2, bandwidth_bps=0)


def test_small_tensors_by_exchange_and_the_message_cost(tmp_path):
    # By exchange (the engine's path for a small tensor) the two workers send each other their
    # 100,000 bytes at once: 100 ms instead of a push and a sum. A message cost of 1 ms to send and
    # 2 ms to receive adds 3 ms per frame on the way: one by exchange, two by owners.
    exchange = dataclasses.replace(EXACT, small_allreduce=True)
    control = Profile(layers=[ProfiledLayer("dense", 0.010)],  # only control collectives go by exchange
                      tensors=[ProfiledTensor("metrics/loss", 100_000, CONTROL, 0.0)])
    p = predict(control, workers=2, bandwidth_bps=8e6, schedule="priority_nocross",
                options=exchange)
    assert p.step_s == pytest.approx(0.110, abs=1e-6)
    assert p.messages_per_step == pytest.approx(1)
    costly = dict(message_send_s=1e-3, message_receive_s=2e-3)
    assert predict(control, workers=2, bandwidth_bps=8e6, schedule="priority_nocross",
                   options=dataclasses.replace(exchange, **costly)).step_s == pytest.approx(0.113, abs=1e-6)
    assert predict(control, workers=2, bandwidth_bps=8e6, schedule="priority_nocross",
                   options=dataclasses.replace(EXACT, **costly)).step_s == pytest.approx(0.216, abs=1e-6)
    # 8 workers, a 64-byte metric: worker 0 sends log2(8) = 3 frames by exchange.
    tiny = Profile(layers=[ProfiledLayer("dense", 0.010)],
                   tensors=[ProfiledTensor("metrics/accuracy", 64, CONTROL, 0.0)])
    assert predict(tiny, workers=8, bandwidth_bps=1e9, options=exchange).messages_per_step == 3
    profile = tmp_path / "profile.json"
    tiny.save(profile)
    bad = run_cli(str(profile), "--message_cost", "1ms,2ms,3ms")
    assert bad.returncode == 2 and "--message_cost" in bad.stderr


def test_control_collectives_owners_or_exchange_by_the_engines_rule():
    # The engine's rule (ops/core/small_allreduce.h) keeps the owners at N = 3 (the fold's two
    # extra hops) and takes the exchange at 2 and 64; with 5 + 5 us per frame and 25 us of
    # latency the predictions of one control collective agree there: one hop against two at
    # N = 2, 6 stages against an owner's 63 frames each way at 64. (Between 8 and 16 the
    # predictor has the two paths within 5% of each other: docs/benchmarks.md.)
    from prophet_tf.bench import control_latency
    gradient = ProfiledTensor("grad/dense/kernel", 100_000, 1, 0.0, "dense")
    keras = Profile(layers=[ProfiledLayer("dense", 0.010)], tensors=[gradient])
    assert [t.bytes for t in control_latency.control_only(keras).tensors] == [8, 8, 16]
    profile = dataclasses.replace(keras, tensors=[gradient,
                                                  ProfiledTensor("metrics/loss", 8, CONTROL, 0.0)])
    assert [t.name for t in control_latency.control_only(profile).tensors] == ["metrics/loss"]
    options = PredictOptions(latency_s=25e-6, message_send_s=5e-6, message_receive_s=5e-6)
    points = {p.workers: p for p in control_latency.control_points(profile, [2, 3, 64], 1e10,
                                                                   options)}
    print(control_latency.format_table(list(points.values())))
    assert [points[n].engine for n in (2, 3, 64)] == ["exchange", "owners", "exchange"]
    assert points[2].owners_s > 1.8 * points[2].exchange_s
    assert points[3].owners_s <= points[3].exchange_s * 1.01
    assert points[64].owners_s > 1.5 * points[64].exchange_s
    with pytest.raises(PredictError, match="small_allreduce"):
        predict(profile, workers=2, bandwidth_bps=1e9,
                options=dataclasses.replace(options, small_allreduce="sometimes"))


def test_compressed_gradients_travel_in_half_the_bytes():
    # The one tensor as fp16 or bf16: the push and the sum carry 50,000 bytes (50 ms each); a
    # control collective and a gradient of 2-byte elements keep their bytes.
    for compression in ("fp16", "bf16"):
        options = dataclasses.replace(EXACT, compression=compression)
        p = predict(one_tensor_profile(), workers=2, bandwidth_bps=8e6,
                    schedule="priority_nocross", options=options)
        assert p.step_s == pytest.approx(0.110, abs=1e-6)
        assert p.wire_bytes_per_step == pytest.approx(50_000)
        # mwms sends what TensorFlow sends: the tensor's bytes
        mwms = predict(one_tensor_profile(), workers=2, bandwidth_bps=8e6, schedule="mwms",
                       options=options)
        assert mwms.wire_bytes_per_step == predict(
            one_tensor_profile(), workers=2, bandwidth_bps=8e6, schedule="mwms",
            options=EXACT).wire_bytes_per_step
        b = ideal_bound(one_tensor_profile(), workers=2, bandwidth_bps=8e6, options=options)
        assert b.step_s == pytest.approx(0.060, abs=1e-9) and b.gradient_bytes == 50_000
    profile = one_tensor_profile()
    profile.tensors += [ProfiledTensor("metrics/loss", 40_000, CONTROL, 0.0),
                        ProfiledTensor("grad/dense/bias", 20_000, 2, 0.0, "dense", element_size=2)]
    options = dataclasses.replace(EXACT, compression="bf16")
    assert ideal_bound(profile, workers=2, bandwidth_bps=8e6, options=options).gradient_bytes == \
        50_000 + 20_000
    plain = predict(profile, workers=2, bandwidth_bps=8e6, schedule="priority_nocross",
                    options=EXACT)
    half = predict(profile, workers=2, bandwidth_bps=8e6, schedule="priority_nocross",
                   options=options)
    assert plain.wire_bytes_per_step - half.wire_bytes_per_step == pytest.approx(50_000)
    with pytest.raises(PredictError, match="compression"):
        predict(profile, workers=2, bandwidth_bps=8e6,
                options=dataclasses.replace(EXACT, compression="int8"))


def twelve_varied_layers(ms: float) -> Profile:
    """Twelve layers of varied sizes and backward times (``ms`` x 1, 2 or 4), the case of
    simulator_test's ProphetDoesNotDeadlockWhenWorkersPlanApart."""
    kib = 1024
    sizes = [2048, 2048, 64, 1024, 4096, 2048, 2048, 1024, 2048, 1024, 4096, 256]
    units = [4, 1, 2, 1, 1, 4, 2, 4, 4, 4, 1, 2]
    ready, t = {}, 0.0
    for i in reversed(range(12)):
        t += units[i] * ms * 1e-3
        ready[i] = t
    layers = [ProfiledLayer(f"L{i}", units[i] * ms * 1e-3 / 2, units[i] * ms * 1e-3) for i in range(12)]
    tensors = [ProfiledTensor(f"grad/L{i}/k", sizes[i] * kib, 12 - i, ready[i], f"L{i}")
               for i in range(12)]
    return Profile(layers=layers, tensors=tensors, backward_s=t, tail_s=0.001, gap_s=0.001)


def test_prophet_never_stalls_when_workers_plan_apart():
    # With a 1 MiB credit these stalled for good at 4 and 8 workers: every worker plans with the
    # bytes it pushes itself, so plans differ, and credit held by pushes whose sums needed pushes
    # other workers' plans held back.
    options = PredictOptions(credit_bytes=1 << 20, partition_bytes=256 << 10, steps=6,
                             warmup_steps=4)
    for ms, workers in ((2.0, 4), (10.0, 8), (2.0, 8)):
        p = predict(twelve_varied_layers(ms), workers=workers, bandwidth_bps=1e9,
                    schedule="prophet", options=options)
        assert p.step_s >= p.single_step_s * 0.99


def test_ideal_bound_by_hand_and_below_every_schedule():
    # One tensor at 1 MB/s: any schedule needs its 100,000 bytes on the link (100 ms) between
    # the backward pass and the next forward pass (10 ms); the runtime's push and sum take 200.
    b = ideal_bound(one_tensor_profile(), workers=2, bandwidth_bps=8e6, options=EXACT)
    assert b.step_s == pytest.approx(0.110, abs=1e-9)
    assert (b.compute_s, b.comm_s, b.wait_s) == pytest.approx((0.010, 0.100, 0.100), abs=1e-9)
    assert b.binding_layer == "dense" and b.layer_done_s == pytest.approx([0.100], abs=1e-9)
    assert ideal_bound(one_tensor_profile(), workers=4, bandwidth_bps=8e6,
                       options=EXACT).step_s == pytest.approx(0.160, abs=1e-9)
    assert ideal_bound(one_tensor_profile(), workers=1, bandwidth_bps=None).step_s == \
        pytest.approx(0.010)
    with pytest.raises(PredictError, match="link rate"):
        ideal_bound(one_tensor_profile(), workers=2, bandwidth_bps=None)
    # Twelve layers, 4 workers, 1 Gbit/s: no schedule of the runtime beats the bound, which is
    # at least the naive max(compute, 2(N-1)/N x bytes at the payload rate).
    profile = twelve_varied_layers(2.0)
    options = PredictOptions(steps=6, warmup_steps=4)
    b = ideal_bound(profile, workers=4, bandwidth_bps=1e9, options=options)
    naive = max(profile.step_s,
                1.5 * profile.gradient_bytes * 8 / (1e9 * options.payload_efficiency))
    assert b.step_s >= naive * (1 - 1e-9)
    for schedule in SCHEDULES:
        assert predict(profile, workers=4, bandwidth_bps=1e9, schedule=schedule,
                       options=options).step_s >= b.step_s


@pytest.mark.parametrize("fusion_bytes", [0, -1])
def test_synthetic_timeline_is_a_runtime_trace(tmp_path, fusion_bytes):
    pattern = str(tmp_path / "predicted.json")
    profile = profile_from_trace(synthetic_trace())
    predict(profile, workers=2, bandwidth_bps=1e9, schedule="prophet",
            options=PredictOptions(steps=3, warmup_steps=2, fusion_bytes=fusion_bytes,
                                   small_allreduce=False),  # pushes: the owner path's track
            timeline_path=pattern)
    traces = [timeline.load_trace(tmp_path / f"predicted.{rank}.json") for rank in (0, 1)]
    tracks = timeline.events_by_track(traces[0])
    for track in ("step", "forward", "ready", "op", "push", "apply"):
        assert tracks.get(track), f"no {track!r} events on the synthetic timeline"
    assert timeline.worker_names(traces[1])[1] == "predicted worker 1"
    # The same profile parser reads it back (a predicted trace is a trace).
    again = profile_from_trace(traces[0])
    assert [layer.name for layer in again.layers] == ["dense", "dense_1"]
    # Fused, the buckets' spans are on the trace beside their members' own, and the parser
    # reads the gradients, not the buckets.
    fused = [e for e in tracks["op"] if str(e.get("name")).startswith("fused:")]
    assert bool(fused) == (fusion_bytes != 0)
    assert ({t.name: t.bytes for t in again.tensors} == {t.name: t.bytes for t in profile.tensors})
    # A tensor alone in its bucket (a bucket of one) keeps its own span too.
    one = str(tmp_path / "one.json")
    predict(one_tensor_profile(), workers=2, bandwidth_bps=1e9, options=dataclasses.replace(
        EXACT, fusion_bytes=fusion_bytes), timeline_path=one)
    alone = timeline.load_trace(tmp_path / "one.0.json")
    assert [t.name for t in profile_from_trace(alone).tensors] == ["grad/dense/kernel"]
    assert any(str(e.get("name")).startswith("fused:")
               for e in timeline.events_by_track(alone)["op"]) == (fusion_bytes != 0)


def test_rates_and_durations():
    assert parse_rate("10G") == 10e9
    assert parse_rate("2.5Gbit") == 2.5e9
    assert parse_rate("100M") == 100e6
    assert parse_rate("1e9") == 1e9
    assert parse_duration("50us") == pytest.approx(50e-6)
    assert parse_duration("0.2ms") == pytest.approx(0.2e-3)
    assert parse_duration("0") == 0
    for bad in ("fast", "-1G", "10X"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "prophet_tf.predict", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_command_line_table_chart_and_json(tmp_path):
    profile = profile_from_trace(synthetic_trace(), source="synthetic")
    profile.save(tmp_path / "profile.json")
    proc = run_cli(str(tmp_path / "profile.json"), "--workers", "1,2,4", "--bandwidth", "100M,1G",
                   "--schedule", "prophet,priority_nocross,mwms", "--output",
                   str(tmp_path / "chart.png"), "--json", str(tmp_path / "out.json"))
    assert proc.returncode == 0, proc.stderr
    assert "| link | N | prophet | priority_nocross | mwms | ideal |" in proc.stdout
    assert "| 100 Mbit/s | 4 |" in proc.stdout
    assert (tmp_path / "chart.png").stat().st_size > 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert len(out["predictions"]) + len(out["deadlocks"]) == 3 * 2 * 3
    for p in out["predictions"]:
        assert p["step_s"] > 0 and p["speedup"] > 0
    assert len(out["ideal_bounds"]) == 3 * 2
    for b in out["ideal_bounds"]:
        assert 0 < b["step_s"] <= min(p["step_s"] for p in out["predictions"]
                                      if (p["workers"], p["bandwidth_bps"]) ==
                                      (b["workers"], b["bandwidth_bps"]))

    # --compression: the gradients' pushes and sums carry half the bytes
    half = run_cli(str(tmp_path / "profile.json"), "--workers", "2", "--bandwidth", "100M",
                   "--schedule", "priority_nocross", "--compression", "bf16", "--output", "",
                   "--json", str(tmp_path / "half.json"))
    assert half.returncode == 0, half.stderr
    assert "gradients compressed as bf16" in half.stdout
    halved = json.loads((tmp_path / "half.json").read_text())
    assert halved["options"]["compression"] == "bf16"
    plain = [p for p in out["predictions"] if (p["workers"], p["bandwidth_bps"], p["schedule"]) ==
             (2, 1e8, "priority_nocross")][0]
    assert halved["predictions"][0]["wire_bytes_per_step"] < plain["wire_bytes_per_step"] * 0.6
    bad = run_cli(str(tmp_path / "profile.json"), "--compression", "int8")
    assert bad.returncode == 2 and "--compression must be one of none, fp16, bf16" in bad.stderr

    bad = run_cli(str(tmp_path / "profile.json"), "--schedule", "lifo")
    assert bad.returncode == 2 and "unknown schedule" in bad.stderr
    bad = run_cli(str(tmp_path / "profile.json"), "--timeline", str(tmp_path / "t.json"))
    assert bad.returncode == 2 and "one setting" in bad.stderr
    bad = run_cli(str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "cannot read" in bad.stderr


RECORDING_SCRIPT = textwrap.dedent("""
    import numpy as np, keras, prophet_tf
    strategy = prophet_tf.ProphetStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])
        model.compile(optimizer="adam", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.rand(256, 16).astype("float32")
    y = np.random.randint(0, 4, 256)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    print("RECORDED", strategy.world_size, len(model.trainable_weights))
""")


def test_profile_recorded_by_a_real_one_worker_run(tmp_path):
    trace = tmp_path / "profile.json"
    from conftest import _worker_env, worker_python

    env = _worker_env({"PROPHET_PROFILE": str(trace)})
    env.pop("PROPHET_TIMELINE", None)
    script = tmp_path / "train.py"
    script.write_text(RECORDING_SCRIPT)
    proc = subprocess.run([worker_python(), str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "RECORDED 1 6" in proc.stdout, proc.stdout + proc.stderr

    profile = load_profile(trace)
    grads = [t for t in profile.tensors if t.name.startswith("grad/")]
    assert len(grads) == 6  # every trainable weight, with its bytes, priority and layer
    assert sorted(t.priority for t in grads) == list(range(1, 7))
    assert {t.bytes for t in grads} >= {16 * 64 * 4, 64 * 64 * 4, 64 * 4 * 4}
    assert all(t.layer is not None for t in grads)
    assert len(profile.layers) == 3 and profile.steps >= 4
    assert any(t.priority >= CONTROL for t in profile.tensors)  # the metrics' collective
    assert all(t.apply_s > 0 for t in grads)  # updates recorded (crossing path)

    proc = run_cli(str(trace), "--workers", "2", "--bandwidth", "1G", "--schedule", "prophet",
                   "--output", "", "--timeline", str(tmp_path / "predicted.json"))
    assert proc.returncode == 0, proc.stderr
    assert "| 1 Gbit/s | 2 |" in proc.stdout
    # The real trace and the synthetic one drawn side by side.
    out = timeline.plot_timeline([timeline.load_trace(trace),
                                  timeline.load_trace(tmp_path / "predicted.0.json")],
                                 tmp_path / "side_by_side.png")
    assert out.stat().st_size > 0
