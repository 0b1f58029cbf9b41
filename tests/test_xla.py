"""``jit_compile=True`` and ``tf.function(jit_compile=True)`` on 2 workers against ONE process
compiling the same program with XLA (tests/workers/xla_programs.py).

All programs run in one 2-worker launch and one reference process. A program that trains must
end with weights (and optimizer variables) bitwise equal across the workers and within 1e-5 of
one process, and XLA must really have compiled its computation: XLA clusters ran and none of the
model's heavy operations (matrix products, convolutions) ran outside them. A custom loop that
compiles the exchange between workers is refused with an error naming the fix.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import WORKERS, run_programs_against_one_process

WORKERS_N = 2
TOLERANCE = 1e-5
sys.path.insert(0, str(WORKERS))
from xla_programs import PROGRAMS  # noqa: E402  (the worker script lists its programs)

REFUSED = "custom_loop_jit_around_strategy_run"
# One process cannot compile this model with XLA at all; the workers compile all but that op.
UNCOMPILABLE_OP = "jit_compile_with_an_op_xla_cannot_compile"
TRAINING = [p for p in PROGRAMS if p != REFUSED]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("xla"))
    return run_programs_against_one_process("xla_programs.py", workdir, list(PROGRAMS),
                                            WORKERS_N, timeout=1200)


def _max_diff(a_list, b_list) -> float:
    assert len(a_list) == len(b_list), (len(a_list), len(b_list))
    return max((float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(a_list, b_list)
                if a.size), default=0.0)


@pytest.mark.parametrize("program", TRAINING)
def test_compiled_program_matches_one_process(runs, program):
    results, reference, ranks, one = runs.trained(program, WORKERS_N)
    cross = max(_max_diff(ranks[0], w) for w in ranks[1:])
    diff = max(_max_diff(w, one) for w in ranks)
    print(f"{program}: max |w_worker - w_one_process| = {diff:.3g}, across workers {cross:.3g}")
    assert cross == 0.0, f"{program}: weights differ across workers by {cross:.3g}"
    assert diff <= TOLERANCE, f"{program}: max |w_worker - w_one_process| = {diff:.3g}"
    for r in results:
        xla = r["xla"]
        assert xla["xla_clusters_run"] > 0 or xla["compiled_function_calls"] > 0, (program, xla)
        if program != UNCOMPILABLE_OP:
            assert xla["heavy_ops_outside_xla"] == [], (program, xla)


def test_keras_jit_compile_warns_once_that_the_exchange_runs_between_clusters(runs):
    """The first compiled model of a process warns; the next one (same warning) does not."""
    for rank in range(WORKERS_N):
        first = runs.result("digits_cnn_jit_compile", rank)["warnings"]
        assert len(first) == 1 and "the exchange between workers" in first[0], first
        assert "XLA cannot compile operations that wait for other processes" in first[0], first
        assert runs.result("transformer_jit_compile", rank)["warnings"] == []


def test_an_op_without_xla_kernel_runs_uncompiled_and_is_named(runs):
    warnings = runs.result(UNCOMPILABLE_OP, 0)["warnings"]
    assert len(warnings) == 1 and "AsString" in warnings[0], warnings


def test_compiling_strategy_run_as_a_whole_is_refused_with_the_fix(runs):
    for rank in range(WORKERS_N):
        error = runs.result(REFUSED, rank)["error"]
        assert error is not None and error.startswith("JitCompileError"), error
        assert "XLA cannot compile an exchange between workers" in error, error
        assert "put jit_compile=True on a tf.function that computes the loss and gradients" \
            in error, error
    assert runs.result(REFUSED)["error"] is None  # one process compiles it
