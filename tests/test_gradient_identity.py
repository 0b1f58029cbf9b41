"""A gradient's identity travels with it: keyed by the variable object from the all-reduce to the
update, summed across workers exactly once, and the run fails closed otherwise.

Covers the cases where that can go wrong silently: nested-layer variables under crossing (an
update must not apply the local gradient), sparse gradients with Adam (small tables must not be
densified), and optimizer steps outside ``strategy.run`` (which would update every worker with
its own gradient).
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from prophet_tf import _gradients
from prophet_tf.errors import GradientReductionError

TOLERANCE = 1e-5
TRAINING_CASES = {"nested_crossing": "deferred", "embedding_adam": "gathered"}
FAIL_CASES = ["fail_merge_call_train_step", "fail_custom_loop_graph", "fail_custom_loop_eager"]


@pytest.fixture(scope="module")
def two_workers(run_workers):
    return run_workers("gradient_identity.py", 2, timeout=300).check_ok()


@pytest.mark.parametrize("case", sorted(TRAINING_CASES))
def test_two_workers_match_one_process_bitwise_identical(two_workers, case):
    per_rank = [two_workers.one(rank, case=case) for rank in range(2)]
    for rank, r in enumerate(per_rank):
        assert r["moved"] > 1e-3, f"{case}: training did not change the weights"
        assert r["maxdiff"] <= TOLERANCE, \
            f"{case} rank {rank}: max |w - w_one_process| = {r['maxdiff']:.3g} > {TOLERANCE}"
        counts = r["counts"]
        assert counts.get(TRAINING_CASES[case], 0) >= 1, (case, counts)
        assert "summed" not in counts, f"{case}: expected no synchronous dense reduction, got {counts}"
        assert sum(counts.values()) >= r["trainable"], (case, counts, r["trainable"])
    assert per_rank[0]["digest"] == per_rank[1]["digest"], f"{case}: weights differ across workers"


@pytest.mark.parametrize("case", FAIL_CASES)
def test_gradients_applied_outside_strategy_run_fail_closed(two_workers, case):
    for rank in range(2):
        r = two_workers.one(rank, case=case)
        assert r["error"] == "GradientReductionError", f"{case} rank {rank}: no error (silent local update)"
        assert "head/kernel" in r["message"] and "strategy.run" in r["message"], r["message"]


# ---- GradientSite on its own (no workers) ------------------------------------------------------

def _site(variables):
    return _gradients.GradientSite.create(object(), variables, [f"grad/{i}" for i in range(len(variables))])


def test_gradients_are_keyed_by_variable_object_not_name():
    with tf.name_scope("block"):
        a = tf.Variable(1.0, name="kernel")
        b = tf.Variable(2.0, name="kernel")   # same TF name: keyed by name they would be confused
    site = _site([a, b])
    site.reduced = True
    site.gradients[0].reduced = _gradients.DEFERRED
    site.gradients[1].reduced = _gradients.SUMMED
    assert site.take_for_update(b).reduced == _gradients.SUMMED
    assert site.take_for_update(a).reduced == _gradients.DEFERRED
    assert site.verify() == {"deferred": 1, "summed": 1}


def test_update_of_an_unreduced_gradient_names_the_variable():
    v = tf.Variable(1.0, name="dense_kernel")
    site = _site([v])
    with pytest.raises(GradientReductionError, match="'dense_kernel'.*without having been summed"):
        site.take_for_update(v)


def test_update_of_a_trainable_variable_without_gradient_in_the_step_fails():
    v, other = tf.Variable(1.0, name="in_step"), tf.Variable(1.0, name="not_in_step")
    site = _site([v])
    site.reduced = True
    site.gradients[0].reduced = _gradients.SUMMED
    with pytest.raises(GradientReductionError, match="'not_in_step'"):
        site.take_for_update(other)
    assert site.take_for_update(tf.Variable(0, trainable=False, name="counter")) is None


def test_deferred_gradient_never_applied_is_an_error():
    v = tf.Variable(1.0, name="late")
    site = _site([v])
    site.reduced = True
    site.gradients[0].reduced = _gradients.DEFERRED
    with pytest.raises(GradientReductionError, match="'late'.*would be skipped"):
        site.verify()


def test_each_gradient_is_applied_exactly_once():
    v = tf.Variable(1.0, name="twice")
    site = _site([v])
    site.reduced = True
    site.gradients[0].reduced = _gradients.SUMMED
    site.take_for_update(v)
    with pytest.raises(GradientReductionError, match="more often than it reduced"):
        site.take_for_update(v)


def test_a_step_whose_all_reduce_never_reached_the_strategy_fails():
    v = tf.Variable(1.0, name="never_reduced")
    with pytest.raises(GradientReductionError, match="'never_reduced'.*without being summed"):
        _site([v]).verify()
