"""Workers that create different variables under ProphetStrategy's scope (a model or optimizer
built differently on one worker) fail at once on every worker, naming the first variable that
differs and what each rank created there (prophet_tf/_variable_agreement.py), instead of waiting
for the initial-value broadcasts until the operation timeout; the runtime stays usable after it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import tensorflow as tf  # noqa: E402

from prophet_tf import _variable_agreement as agreement  # noqa: E402
from prophet_tf.errors import VariableMismatchError  # noqa: E402

# What rank 0 and rank 1 created first where they differ (tests/workers/variable_mismatch.py).
_EXPECTED = {
    "adam_frozen": ("middle_kernel_momentum' (shape [16, 16] float32)",
                    "last_kernel_momentum' (shape [16, 2] float32)"),
    "momentum_frozen": ("last_kernel_momentum' (shape [16, 2] float32)",
                        "no further variable"),
    "extra_layer": ("last/kernel' (shape [16, 2] float32)", "extra/kernel' (shape [16, 16] float32)"),
    "other_shape": ("middle/kernel' (shape [16, 16] float32)",
                    "middle/kernel' (shape [16, 32] float32)"),
}


def _core(message: str) -> str:
    start = message.index("ProphetStrategy: the workers created different variables")
    end = message.index("for the trainable variables only).", start)
    return message[start:end]


def test_models_that_differ_across_workers_fail_on_every_worker_soon_naming_the_variable(
        run_workers):
    op_timeout_s = 60
    cases = list(_EXPECTED) + ["same"]
    run = run_workers("variable_mismatch.py", 2, str(op_timeout_s), ",".join(cases), timeout=240)
    run.check_ok()
    for case, (on_rank0, on_rank1) in _EXPECTED.items():
        for rank in (0, 1):
            r = run.one(rank, case=case)
            assert r["outcome"] == "error", r
            message = r["message"]
            assert "the workers created different variables" in message, r
            assert "on rank 0: the variable '" in message and on_rank0 in message, r
            assert f"on rank 1: {'' if on_rank1.startswith('no') else 'the variable '}" in message, r
            assert on_rank1 in message, r
            assert "build the same model" in message and "freeze a layer on every worker" in message
            # Found by the agreement, not by the operation timeout: a bound only a hang reaches.
            assert r["seconds"] < op_timeout_s / 2, r
        # The same words on both (a worker whose error came while its step was traced may have
        # them wrapped in TensorFlow's context).
        core = [_core(run.one(rank, case=case)["message"]) for rank in (0, 1)]
        assert core[0] == core[1], core
    # After those errors the same model trains, with the same weights on both workers.
    same = [run.one(rank, case="same") for rank in (0, 1)]
    assert [r["outcome"] for r in same] == ["trained", "trained"], same
    assert same[0]["weights"] == same[1]["weights"], same


def test_records_name_every_side_and_group_ranks_that_agree():
    kernel = agreement.variable_record("kernel", "model/dense", tf.TensorShape([4, 8]), tf.float32)
    other = agreement.variable_record("kernel", "model/dense", tf.TensorShape([4, None]), tf.float32)
    end = agreement.end_record(7)
    assert kernel.dtype == np.uint8 and kernel.shape == (agreement.RECORD_BYTES,)
    agreement.check(3, np.concatenate([kernel, kernel, kernel]), 3)
    # Only the name, shape and dtype count (what the broadcasts already required), not the scope.
    elsewhere = agreement.variable_record("kernel", "model_1/dense_1", tf.TensorShape([4, 8]),
                                          tf.float32)
    agreement.check(3, np.concatenate([kernel, elsewhere]), 2)
    with pytest.raises(VariableMismatchError) as raised:
        agreement.check(3, np.concatenate([kernel, other, kernel, end]), 4)
    message = str(raised.value)
    assert "Variable #3 (in creation order) is, on ranks 0, 2: the variable 'model/dense/kernel' " \
           "(shape [4, 8] float32); on rank 1: the variable 'model/dense/kernel' (shape [4, ?] " \
           "float32); on rank 3: no further variable (7 created in all)." in message, message
    # A description longer than the record keeps its start and the digest still tells them apart.
    long_a = agreement.variable_record("v" * 300 + "a", "", tf.TensorShape([]), tf.float32)
    long_b = agreement.variable_record("v" * 300 + "b", "", tf.TensorShape([]), tf.float32)
    with pytest.raises(VariableMismatchError, match="the variable 'vvvv"):
        agreement.check(0, np.concatenate([long_a, long_b]), 2)
