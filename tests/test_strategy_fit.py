"""Keras fit/evaluate/predict, callbacks, saving and restoring under ProphetStrategy (2 workers)."""

from __future__ import annotations

import os

import pytest

N = 2


@pytest.fixture(scope="module")
def fit_run(run_workers, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("strategy_fit")
    run = run_workers("strategy_fit.py", N, str(workdir), timeout=300).check_ok()
    return run, workdir


def _same_on_all_ranks(run, section, *keys):
    first = run.one(0, section=section)
    for rank in range(1, N):
        other = run.one(rank, section=section)
        for key in keys:
            assert other[key] == first[key], f"{section}.{key} differs on rank {rank}"
    return first


def test_fit_with_validation_logs_the_same_numbers_on_every_worker(fit_run):
    run, _ = fit_run
    fit = _same_on_all_ranks(run, "fit", "history", "batch_digest", "batches", "digest")
    history = fit["history"]
    assert set(history) >= {"loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"}
    assert len(history["loss"]) == 3
    assert history["loss"][-1] < history["loss"][0], history["loss"]
    # 8 steps/epoch with steps_per_execution=2 -> 4 train callbacks, plus 1 test callback.
    assert fit["batches"] == 3 * (4 + 1)


def test_evaluate_and_predict_cover_the_whole_dataset(fit_run):
    run, _ = fit_run
    ev = _same_on_all_ranks(run, "evaluate", "logs", "pred_shape")
    # The sharded, reduced evaluation equals the full-dataset numbers computed in one process.
    assert abs(ev["logs"]["loss"] - ev["local_loss"]) <= 1e-5, ev
    assert abs(ev["logs"]["accuracy"] - ev["local_accuracy"]) <= 1e-6, ev
    assert ev["pred_shape"] == [48, 3]
    assert ev["on_batch_shape"] == [5, 3]
    for rank in range(N):
        assert run.one(rank, section="evaluate")["pred_maxdiff"] <= 1e-6
        assert run.one(rank, section="evaluate")["on_batch_maxdiff"] <= 1e-6


def test_only_rank_0_writes_and_other_ranks_redirect(fit_run):
    run, workdir = fit_run
    for name in ("best.keras", "model.keras", "model.weights.h5", os.path.join("ckpts",
                                                                              "checkpoint")):
        assert os.path.isfile(os.path.join(workdir, name)), name
    assert sorted(f for f in os.listdir(workdir / "ckpts") if f.endswith(".index")) == \
        ["ckpt-2.index", "ckpt-3.index"]
    rank0 = run.one(0, section="save")
    assert rank0["temp_root"] is None and rank0["redirected"] == []
    assert rank0["latest"] == os.path.join(str(workdir), "ckpts", "ckpt-3")
    for rank in range(1, N):
        save = run.one(rank, section="save")
        root = save["temp_root"]
        assert root and save["latest"].startswith(root), save
        rel = os.path.relpath(str(workdir), "/")
        for name in ("best.keras", "model.keras", "model.weights.h5", "ckpts/ckpt-3.index"):
            assert os.path.join(rel, name) in save["redirected"], (name, save["redirected"])
        assert not os.path.exists(root), "the redirected files must be removed at exit"
    # The checkpoint state file in the shared directory names only rank 0's checkpoints.
    state = (workdir / "ckpts" / "checkpoint").read_text()
    assert "prophet_tf_rank" not in state and 'model_checkpoint_path: "ckpt-3"' in state


def test_every_worker_loads_and_resumes_exactly(fit_run):
    run, _ = fit_run
    _same_on_all_ranks(run, "load", "digest")
    for rank in range(N):
        load = run.one(rank, section="load")
        assert load["load_model_diff"] == 0.0
        assert load["load_weights_diff"] == 0.0
        assert load["loaded_iterations"] == load["iterations"] == 24
        assert load["resumed_diff"] <= 1e-6, load


def test_batchnorm_trains_with_local_statistics(fit_run):
    run, _ = fit_run
    bn = _same_on_all_ranks(run, "batchnorm", "loss", "val_loss", "digest")
    assert bn["loss"][-1] < bn["loss"][0]


def test_mixed_precision_skips_a_step_on_every_worker_when_one_overflows(fit_run):
    run, _ = fit_run
    mp = _same_on_all_ranks(run, "mixed_precision", "digest", "scale", "iterations")
    assert mp["optimizer"] == "LossScaleOptimizer"
    assert mp["finite"]
    # One of the 8 steps overflowed on one worker only: all workers skipped it and halved the
    # loss scale (otherwise the others would have waited for its gradients until the timeout).
    assert mp["iterations"] == 7, mp
    assert mp["scale"] == mp["initial_scale"] / 2, mp
