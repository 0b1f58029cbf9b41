"""Custom training loops and the tf.distribute API of ProphetStrategy (2 workers)."""

from __future__ import annotations

import pytest

N = 2


@pytest.fixture(scope="module")
def loop_run(run_workers):
    return run_workers("strategy_custom_loop.py", N, timeout=240).check_ok()


def test_reduce_gather_and_replica_collectives(loop_run):
    for rank in range(N):
        r = loop_run.one(rank, section="collectives")
        # experimental_distribute_values_from_function: rank r holds r+1 copies of r+1.
        assert r["values_local"] == [float(rank + 1)] * (rank + 1)
        assert r["sum_axis0"] == 5.0
        assert abs(r["mean_axis0"] - 5.0 / 3.0) < 1e-6
        assert r["gather"] == [1.0, 2.0, 2.0]
        assert r["reduce_graph"] == 4.0
        for tag in ("eager", "graph"):
            assert r[f"{tag}_total"] == 3.0          # all_reduce SUM of (replica id + 1)
            assert r[f"{tag}_mean"] == [0.5, 1.0]    # all_reduce MEAN of [id, 2 id]
            assert r[f"{tag}_all_gather"] == [[0.0, 0.0, 1.0, 1.0]]
            assert r[f"{tag}_sparse"] == [[1.0] * 3, [2.0] * 3, [0.0] * 3, [0.0] * 3]
            assert r[f"{tag}_sum_local"] == float((rank + 1) ** 2)


def test_distribute_datasets_from_function_gives_disjoint_shards(loop_run):
    batches = loop_run.one(0, section="datasets_from_function")["batches"]
    assert loop_run.one(1, section="datasets_from_function")["batches"] == batches
    seen = [i for b in batches for i in b]
    assert sorted(seen) == list(range(40))           # every element once: disjoint, complete
    assert all(len(b) == 8 for b in batches)         # 4 per replica, global batch 8


def test_experimental_distribute_dataset_splits_global_batches_in_rank_order(loop_run):
    for rank in range(N):
        r = loop_run.one(rank, section="distribute_dataset")
        assert r["gathered"] == [list(range(s, s + 12)) for s in (0, 12, 24)]
        assert r["local"] == [list(range(s + 6 * rank, s + 6 * rank + 6)) for s in (0, 12, 24)]


def test_custom_training_loop_matches_one_process(loop_run):
    digests = set()
    for rank in range(N):
        r = loop_run.one(rank, section="training_loop")
        assert r["maxdiff"] <= 1e-5, r
        assert r["moved"] > 1e-3
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), r
        digests.add(r["digest"])
    assert len(digests) == 1


def test_unseeded_shuffles_are_identical_on_every_worker(loop_run):
    epochs = loop_run.one(0, section="shuffle")["epochs"]
    assert loop_run.one(1, section="shuffle")["epochs"] == epochs
    for name, per_epoch in epochs.items():
        for order in per_epoch:
            assert sorted(order) == list(range(36)), (name, order)   # disjoint and complete
        assert per_epoch[0] != list(range(36)), name                  # actually shuffled
