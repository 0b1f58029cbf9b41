"""Gradient compression (``compression="fp16"|"bf16"``) on real workers: the one-step difference
from exact summation within the bound of docs/design.md ("Compression"), the same bits on every
worker, the fp16 range guard, control collectives untouched, and the demo task's accuracy.

The worker script is tests/workers/compression.py; each check prints one RESULT per rank."""

from __future__ import annotations

import pytest

# The largest difference of validation accuracy (compressed minus uncompressed, either sign) the
# short training run may show. Measured: under 1.5 points (2048 samples, 5 epochs, seed 0).
ACCURACY_MARGIN = 0.03


@pytest.mark.parametrize("n", [2, 3])
def test_one_step_difference_is_within_the_bound_and_the_same_everywhere(run_workers, n: int) -> None:
    run = run_workers("compression.py", n, "checks", timeout=300).check_ok()
    bounded = ["wide/fp16/sum", "wide/fp16/mean", "wide/bf16/sum", "wide/bf16/mean",
               "strategy deferred", "strategy synchronous"]
    for check in bounded:
        results = [run.one(rank, check=check) for rank in range(n)]
        for r in results:
            assert r["beyond_bound"] == 0 and r["finite"], (check, r)
            # The bound is not vacuous: the worst element uses a good part of it...
            assert r["worst_fraction_of_bound"] > 0.25, (check, r)
            # ...and the values did travel in 16 bits: they differ from the exact sum's.
            assert r["wider_than_16_bits"] == 0, (check, r)
            assert r["differ_from_uncompressed"] > r["elements"] // 2, (check, r)
        assert len({r["digest"] for r in results}) == 1, (check, results)  # the same bits everywhere
    # The optimizer step went through both update paths.
    assert run.one(0, check="strategy deferred")["reduced_as"] == ["deferred"]
    assert run.one(0, check="strategy synchronous")["reduced_as"] == ["summed"]

    for rank in range(n):
        # fp16's range guard: a plain cast would give inf and 0; scaled, 11 significant bits stay.
        for magnitude, plain in (("1e+06", float("inf")), ("1e-08", 0.0)):
            r = run.one(rank, check=f"range {magnitude}")
            assert r["plain_cast_would_give"] == plain, r
            assert r["finite"] and r["nonzero"] and r["max_relative_error"] < 2.0 ** -10, r
        nonfinite = run.one(rank, check="nonfinite")
        assert nonfinite["inf_at_5"] and nonfinite["nan_at_9"], nonfinite
        assert nonfinite["rest"] == [nonfinite["expected_rest"]], nonfinite
        assert run.one(rank, check="float64")["identical"]
        gathered = run.one(rank, check="allgather")
        assert gathered["shape"] == gathered["expected_shape"], gathered
        assert gathered["wider_than_16_bits"] == 0 and gathered["rounded"] > 0, gathered
        assert 0 < gathered["max_relative_error"] <= 2.0 ** -8, gathered
        # strategy.reduce and metric state under ProphetStrategy(compression="fp16"): exact,
        # although fp16 would have rounded these values.
        control = run.one(rank, check="control")
        assert control["reduce_exact"] and control["metric_exact"] and control["fp16_would_round"], control
    for check in ("range 1e+06", "range 1e-08", "allgather"):
        assert len({run.one(rank, check=check)["digest"] for rank in range(n)}) == 1, check


def test_demo_task_reaches_the_same_accuracy_compressed(run_workers) -> None:
    """The digits task of examples/keras_fit_demo.py, shortened (2048 samples, 5 epochs), with no
    compression, fp16 and bf16 from the same seed. The 3-seed comparison at the demo's own
    settings is the worker's `train` mode (see tests/workers/compression.py)."""
    run = run_workers("compression.py", 2, "train", "--samples", "2048", "--epochs", "5",
                      "--batch", "32", "--learning-rate", "5e-3", timeout=600).check_ok()
    accuracy = {}
    for compression in ("none", "fp16", "bf16"):
        results = [run.one(rank, check="train", compression=compression) for rank in range(2)]
        assert results[0]["weights"] == results[1]["weights"], results  # one model, everywhere
        accuracy[compression] = results[0]["val_accuracy"]
    assert accuracy["none"] > 0.7, accuracy  # it learned (chance is 0.1)
    for compression in ("fp16", "bf16"):
        assert abs(accuracy[compression] - accuracy["none"]) <= ACCURACY_MARGIN, accuracy
