"""Only rank 0 writes: redirect file writes of non-zero ranks to a private temporary directory.

In a multi-worker job every worker runs the same script, so every worker calls ``model.save``,
``save_weights``, ``tf.train.Checkpoint.save`` or the ``ModelCheckpoint``/``TensorBoard``
callbacks with the same paths. Concurrent writers would corrupt those files. On ranks other than
0 this module redirects each write to the same path below a per-process temporary directory
(removed at exit), so the code runs unchanged, nothing shared is touched, and what a worker wrote
stays readable by that worker (``tf.train.Checkpoint.save`` returns the redirected path; a
``CheckpointManager`` keeps its own redirected list). Reads are never redirected: every worker
reads the real paths (wait for rank 0 first, e.g. ``strategy.barrier()``).

Covered: Keras ``.keras`` / ``.weights.h5`` / legacy ``.h5`` saving (and thus ``ModelCheckpoint``),
``tf.train.Checkpoint`` write/save (and ``CheckpointManager`` state files and clean-up),
``tf.saved_model.save`` (and ``model.export``), ``tf.summary.create_file_writer`` (TensorBoard).
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import tempfile
import threading

_lock = threading.Lock()
_root: str | None = None
_rank: int | None = None


def temp_root() -> str | None:
    """The directory that receives this worker's redirected writes (None on rank 0 and before
    the first redirected write)."""
    return _root


def _ensure_root() -> str:
    """Creates the private directory at the first redirected write (removed at exit)."""
    global _root
    with _lock:
        if _root is None:
            _root = tempfile.mkdtemp(prefix=f"prophet_tf_rank{_rank}_")
            atexit.register(shutil.rmtree, _root, True)
        return _root


def redirect(path):
    """Returns where this worker writes ``path`` (the path itself on rank 0)."""
    if _rank is None or path is None:
        return path
    if not isinstance(path, (str, bytes, os.PathLike)):
        return path  # e.g. an open h5py.File: leave it alone
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = p.decode()
    root = _ensure_root()
    if p.startswith(root):
        return p
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", p)
    if m:  # remote file systems (gs://, hdfs://...): mirror locally
        rel = os.path.join(m.group(1), m.group(2))
    else:
        rel = os.path.abspath(p).lstrip(os.sep)
    target = os.path.join(root, rel)
    os.makedirs(os.path.dirname(target) or root, exist_ok=True)
    return target


def install(rank: int) -> None:
    """Installs the redirections (idempotent); no-op on rank 0."""
    global _rank
    with _lock:
        if rank == 0 or _rank is not None:
            return
        _rank = rank
        _patch_keras()
        _patch_tf_checkpoint()
        _patch_saved_model_and_summary()


def _wrap_path_arg(fn, index: int, keyword: str):
    """Wraps ``fn`` so that its path argument (position ``index`` or ``keyword``) is redirected."""
    if getattr(fn, "_prophet_redirect", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if keyword in kwargs:
            kwargs[keyword] = redirect(kwargs[keyword])
        elif len(args) > index:
            args = list(args)
            args[index] = redirect(args[index])
        return fn(*args, **kwargs)

    wrapper._prophet_redirect = True
    return wrapper


def _patch_keras():
    from keras.src.saving import saving_lib
    from keras.src.legacy.saving import legacy_h5_format

    saving_lib.save_model = _wrap_path_arg(saving_lib.save_model, 1, "filepath")
    saving_lib.save_weights_only = _wrap_path_arg(saving_lib.save_weights_only, 1, "filepath")
    legacy_h5_format.save_model_to_hdf5 = _wrap_path_arg(
        legacy_h5_format.save_model_to_hdf5, 1, "filepath")


def _patch_tf_checkpoint():
    from tensorflow.python.checkpoint import checkpoint as tf_checkpoint
    from tensorflow.python.checkpoint import checkpoint_management

    cls = tf_checkpoint.Checkpoint
    cls._write = _wrap_path_arg(cls._write, 1, "file_prefix")
    checkpoint_management.update_checkpoint_state_internal = _wrap_path_arg(
        checkpoint_management.update_checkpoint_state_internal, 0, "save_dir")

    original_delete = checkpoint_management._delete_file_if_exists
    if not getattr(original_delete, "_prophet_redirect", False):
        @functools.wraps(original_delete)
        def _delete_file_if_exists(filespec):
            # A CheckpointManager on a non-zero rank may only clean up its own redirected files.
            if _root is None or not os.path.abspath(os.fspath(filespec)).startswith(_root):
                return
            return original_delete(filespec)

        _delete_file_if_exists._prophet_redirect = True
        checkpoint_management._delete_file_if_exists = _delete_file_if_exists


def _patch_saved_model_and_summary():
    import tensorflow as tf

    tf.saved_model.save = _wrap_path_arg(tf.saved_model.save, 1, "export_dir")
    tf.summary.create_file_writer = _wrap_path_arg(tf.summary.create_file_writer, 0, "logdir")
