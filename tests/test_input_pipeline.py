"""Distributed datasets: iterators deleted mid-fetch, and what every worker reads."""

from __future__ import annotations


def test_iterators_deleted_while_fetching_do_not_crash_the_worker(run_workers) -> None:
    """TensorFlow's MultiDeviceIterator crashed here (SIGSEGV within a few rounds, MirroredStrategy
    too): ProphetStrategy's workers read through plain tf.data iterators."""
    run = run_workers("abandoned_iterators.py", 2, "60", timeout=300).check_ok()
    for rank in range(2):
        r = run.one(rank)
        assert r["rounds"] == 60, r
        # Every new iterator starts at the first global batch [0, 1, 2, 3]; rank r reads its half.
        assert r["first_batches"] == [[2 * rank, 2 * rank + 1]], (rank, r)
