"""The runtime's options are defined once, in the engine (ops/core/engine_options.def): runtime.init,
ProphetStrategy, the predictor and the README's table take them from its table, and only the
options set travel to the engine. In-process: nothing here starts a runtime."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from prophet_tf import _options, runtime
from prophet_tf.predict import PredictError, PredictOptions, Profile, ProfiledLayer, ProfiledTensor, predict
from prophet_tf.predict import model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_option_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for option in _options.runtime_options().values():
        if option.env:
            monkeypatch.delenv(option.env, raising=False)


def test_the_readme_table_is_the_generated_one() -> None:
    readme = (ROOT / "README.md").read_text()
    block = _options.readme_block(readme)
    assert block is not None, (f"README.md has no block between {_options.README_BEGIN!r} and "
                               f"{_options.README_END!r}")
    assert block == _options.markdown_table(), (
        "README.md's table of the runtime's options differs from the option table: paste the "
        "output of `python -m prophet_tf._options --markdown` between its markers")


def test_the_generator_prints_the_table() -> None:
    out = subprocess.run([sys.executable, "-m", "prophet_tf._options", "--markdown"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == _options.markdown_table()
    rows = {line.split(" | ")[0].strip("| `"): line for line in out.stdout.splitlines()[2:]}
    assert set(rows) == set(runtime.options())
    assert "| 0 (the schedule's: 4 MiB, bytescheduler 4 MB, p3 160 kB) |" in rows["partition_bytes"]
    assert "| -1 (sized for the workers) |" in rows["socket_buffer_bytes"]
    assert "| 60 s (`$PROPHET_TIMEOUT_S`) |" in rows["timeout_s"]


def test_init_takes_every_option_of_the_table_and_nothing_else() -> None:
    assert "socket_buffer_bytes" in runtime.options() and "rank" not in runtime.options()
    assert runtime.defaults()["socket_buffer_bytes"] == -1
    assert runtime.defaults()["schedule"] == "prophet"
    with pytest.raises(TypeError, match="unknown runtime option.*colour.*socket_buffer_bytes"):
        runtime.init(0, 1, colour="blue")


def test_only_the_options_set_travel_to_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    assert runtime._settings_text(0, 1, (), None, {}) == "rank=0\nworld_size=1\n"
    text = runtime._settings_text(1, 2, ["a:1", "b:2"], "t", {
        "socket_buffer_bytes": 1 << 20, "partition_bytes": None, "hierarchical": True,
        "replan_threshold": 0.5, "hosts": ["x", "y"], "timeline_path": "/tmp/trace.json"})
    assert text == ("rank=1\nworld_size=2\naddresses=a:1,b:2\ntoken=t\nreplan_threshold=0.5\n"
                    "socket_buffer_bytes=1048576\ntimeline_path=/tmp/trace.1.json\nhierarchical=1\n"
                    "hosts=x,y\n")
    # An option left out takes its environment variable, which then travels as set.
    monkeypatch.setenv("PROPHET_TIMEOUT_S", " 5 ")
    monkeypatch.setenv("PROPHET_JOB_TOKEN", "secret")
    assert runtime._settings_text(0, 1, (), None, {}) == "rank=0\nworld_size=1\ntoken=secret\ntimeout_s=5\n"
    assert "timeout_s=7" in runtime._settings_text(0, 1, (), None, {"timeout_s": 7})


def test_a_bad_value_fails_before_anything_starts_naming_the_option_what_it_takes_and_what_came(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(runtime.RuntimeOptionError,
                       match=r"runtime option socket_buffer_bytes must be -1 \(sized for the workers\), "
                             r"0 \(the kernel's autotuning\) or an integer of at least 131072, got '4096'"):
        runtime.init(0, 1, socket_buffer_bytes=4096)
    with pytest.raises(ValueError, match=r"partition_bytes must be 0 \(the schedule's: .*\) or a whole number of at least 64, got '4M'"):
        runtime.init(0, 1, partition_bytes="4M")
    with pytest.raises(ValueError, match=r"runtime option timeout_s must be a number above 0, got \[1\]"):
        runtime.init(0, 1, timeout_s=[1])
    monkeypatch.setenv("PROPHET_HIERARCHICAL", "maybe")
    with pytest.raises(ValueError, match=r"hierarchical must be one of off, on or auto, got 'maybe' "
                                         r"\(set by \$PROPHET_HIERARCHICAL='maybe'\)"):
        runtime.init(0, 1)
    assert not runtime.is_initialized()


def tiny_profile() -> Profile:
    return Profile(layers=[ProfiledLayer("dense", 0.010)],
                   tensors=[ProfiledTensor("grad/dense/kernel", 100_000, 1, 0.0, "dense")])


def test_the_predictor_models_the_options_the_table_marks_and_sends_only_those_set() -> None:
    fields = {f.name for f in dataclasses.fields(PredictOptions)}
    predicted = _options.predicted_options()
    assert {"partition_bytes", "socket_buffer_bytes", "hierarchical"} <= set(predicted) <= fields
    request = model.simulation_request(tiny_profile(), 4, 1e9, "prophet", PredictOptions(), None, 2)
    assert not [line for line in request.splitlines()
                if line.startswith("option ") and line[7:].split("=")[0] in predicted]
    request = model.simulation_request(tiny_profile(), 4, 1e9, "prophet",
                             PredictOptions(socket_buffer_bytes=1 << 20, hierarchical="auto"), None, 2)
    assert "option socket_buffer_bytes=1048576\n" in request and "option hierarchical=auto\n" in request
    # What the engine refuses the predictor refuses, in the same words.
    with pytest.raises(PredictError, match="socket_buffer_bytes must be -1 .* got '4096'"):
        predict(tiny_profile(), workers=2, bandwidth_bps=1e9,
                options=PredictOptions(socket_buffer_bytes=4096, steps=1, warmup_steps=0))
