"""Checkpoints under faults (2 workers): atomic saves by the chief, one outcome for every worker,
and training resumed after a kill reaching the weights of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import ROOT, WORKERS, _worker_env, parse_results, worker_python


def _check_checkpoint(path) -> dict:
    proc = subprocess.run([worker_python(), str(WORKERS / "saving.py"), "check", str(path)],
                          cwd=ROOT, env=_worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{path} does not load:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return parse_results(proc.stdout, default_rank=0)[0][0]


def test_chief_killed_while_overwriting_a_checkpoint_leaves_the_previous_one(spawn_workers, tmp_path):
    spawned = spawn_workers("saving.py", 2, "kill_during_save", str(tmp_path),
                            env={"PROPHET_TIMEOUT_S": "60"})
    (code0, _, out0), (code1, _, out1) = spawned.wait(timeout=240)
    assert code0 == -9, f"rank 0 was not killed while saving:\n{out0[-3000:]}"
    results = parse_results(out0, default_rank=0)[0]
    assert [r["section"] for r in results] == ["saved", "armed"], results
    # Rank 1 does not go on alone: it fails, naming the dead peer from the lost connection (not
    # from the 60 s timeout). Its exit time would only measure TensorFlow's import and teardown.
    assert code1 not in (None, 0), out1[-3000:]
    assert "lost the connection to rank 0" in out1, out1[-3000:]
    checkpoint = tmp_path / "ckpts" / "ckpt.keras"
    assert _check_checkpoint(checkpoint)["digest"] == results[0]["digest"]
    # What the killed save left behind is a hidden temporary file beside it, never the target.
    assert sorted(p.name for p in checkpoint.parent.iterdir() if not p.name.startswith(".")) == \
        ["ckpt.keras"]


@pytest.fixture(scope="module")
def resumed(run_workers, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("resume")
    first = run_workers("saving.py", 2, "interrupted", str(workdir), timeout=200)
    assert first.returncode == 128 + 9, first.tail()
    assert "KILLING rank 0 mid-epoch" in first.stdout and not first.results(0, section="finished")
    return run_workers("saving.py", 2, "resume", str(workdir), timeout=300).check_ok()


def test_resume_after_a_kill_reaches_the_uninterrupted_weights(resumed):
    first = resumed.one(0, section="resume")
    for rank in range(2):
        r = resumed.one(rank, section="resume")
        assert r["last_checkpoint"] == "ckpt-02.keras"   # killed in the middle of epoch 3
        assert r["resumed_epochs"] == 2                  # BackupAndRestore re-ran epochs 3 and 4
        assert r["moved"] > 1e-3
        # Bitwise: the same additions in the same order, interrupted or not.
        assert r["backup_vs_full"] == 0.0 and r["checkpoint_vs_full"] == 0.0, r
        assert r["backup_digest"] == r["checkpoint_digest"] == r["full_digest"] == first["full_digest"]
        assert r["full_vs_one_process"] <= 1e-5, r


def test_a_failed_save_of_the_chief_fails_every_worker_with_its_error(resumed):
    for rank in range(2):
        r = resumed.one(rank, section="missing_dir")
        assert r["error"] == "FileNotFoundError", r
        if rank:
            assert "saving failed on rank 0 (the chief)" in r["message"], r
        assert "no/such/dir" in r["message"], r
        assert r["seconds"] < 30, r
        assert resumed.one(rank, section="after_error")["ok"]


# ---- the pieces, without workers ---------------------------------------------------------------

def test_replace_atomically_keeps_the_target_when_the_write_fails(tmp_path):
    from prophet_tf._keras import saving

    target = tmp_path / "model.keras"
    target.write_bytes(b"previous checkpoint")

    def broken_write(path):
        with open(path, "wb") as f:
            f.write(b"half a checkpo")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        saving.replace_atomically(broken_write, str(target))
    assert target.read_bytes() == b"previous checkpoint"
    assert os.listdir(tmp_path) == ["model.keras"]  # the temporary file is gone too
    saving.replace_atomically(lambda p: open(p, "wb").write(b"new"), str(target))
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["model.keras"]


def test_backup_metadata_follows_the_weights_in_place(tmp_path):
    """A kill between BackupAndRestore's two renames: '.next' describes the weights in place."""
    from types import SimpleNamespace

    from prophet_tf._keras import saving

    weights, metadata = tmp_path / "latest.weights.h5", tmp_path / "training_metadata.json"
    callback = SimpleNamespace(_weights_path=str(weights), _training_metadata_path=str(metadata))
    weights.write_bytes(b"weights of epoch 3")
    metadata.write_text('{"epoch": 2, "batch": 0}')
    assert saving._backup_metadata_path(callback) == str(metadata)
    next_metadata = tmp_path / "training_metadata.json.next"
    # Killed before the weights were renamed: '.next' names another file, the old pair stands.
    next_metadata.write_text(f'{{"epoch": 3, "weights_inode": {weights.stat().st_ino + 1}}}')
    assert saving._backup_metadata_path(callback) == str(metadata)
    # Killed after the weights were renamed: '.next' names the weights in place.
    next_metadata.write_text(f'{{"epoch": 3, "weights_inode": {weights.stat().st_ino}}}')
    assert saving._backup_metadata_path(callback) == str(next_metadata)
    next_metadata.write_text('{"epoch": 3, "weights_ino')  # truncated: ignored
    assert saving._backup_metadata_path(callback) == str(metadata)


def test_other_workers_raise_the_failing_workers_error_type():
    from prophet_tf._keras import saving
    from prophet_tf.errors import SaveError

    missing = FileNotFoundError(2, "No such file or directory")
    outcomes = [saving.encode_outcome(0, missing), b""]
    with pytest.raises(FileNotFoundError, match=r"rank 0 \(the chief\).*No such file"):
        saving.raise_first_failure(1, None, outcomes)
    saving.raise_first_failure(0, missing, outcomes)  # rank 0 re-raises its own error

    class CustomError(Exception):
        pass

    outcomes = [b"", saving.encode_outcome(1, CustomError("quota"))]
    with pytest.raises(SaveError, match="rank 1.*CustomError: quota"):
        saving.raise_first_failure(0, None, outcomes)
    saving.raise_first_failure(0, None, [b"", b""])
