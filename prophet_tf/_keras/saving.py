"""Saving in a multi-worker job: one writer, atomic files, one outcome for every worker.

Every worker runs the same script, so every worker calls ``model.save``, ``save_weights``,
``tf.train.Checkpoint.save`` or the ``ModelCheckpoint`` / ``BackupAndRestore`` / ``CSVLogger`` /
``TensorBoard`` callbacks with the same paths. ``install(extended)`` (done by a multi-worker
``ProphetStrategy``) makes that safe:

* **Only rank 0 writes the real paths.** Other ranks write each file to the same path below a
  private temporary directory (removed at exit), so the code runs unchanged and nothing shared is
  touched; what a worker wrote stays readable by that worker (``tf.train.Checkpoint.save`` returns
  the redirected path; a ``CheckpointManager`` keeps its own redirected list). Reads are never
  redirected: every worker reads rank 0's files.
* **Rank 0's Keras files are replaced atomically**: written beside the target under a hidden
  temporary name, fsync'ed, renamed over the target, directory fsync'ed. A chief killed while
  saving leaves the previous file intact (plus a temporary file that the next save removes).
  ``BackupAndRestore`` keeps its weights and its metadata consistent the same way (see
  :func:`_backup_save`).
* **A save has one outcome on every worker.** After each save every worker tells the others
  whether it succeeded (a small collective). If any worker failed, every worker raises that
  worker's error (rank 0's when several failed): no worker goes on training while another one
  stopped, which would leave the next collective waiting until the timeout. As a side effect,
  once ``save`` returned on any worker, rank 0's file is complete and may be read.

Covered: Keras ``.keras`` / ``.weights.h5`` / legacy ``.h5`` saving (thus ``model.save``,
``save_weights``, ``ModelCheckpoint``), ``BackupAndRestore``, ``CSVLogger``, ``tf.train.Checkpoint``
write/save (and ``CheckpointManager`` state files and clean-up), ``tf.saved_model.save`` (and
``model.export``), ``tf.summary.create_file_writer`` (``TensorBoard``). TensorFlow checkpoints and
SavedModels are written by TensorFlow itself (new files per ``CheckpointManager`` save, the state
file replaced atomically); they are not made atomic here. Saves inside a ``tf.function`` are
redirected but not agreed on.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import threading
from typing import Any, Callable, Iterator, Optional

from prophet_tf import runtime
from prophet_tf._keras import fit_session
from prophet_tf._keras.patching import patch
from prophet_tf.errors import SaveError

_lock = threading.Lock()
_root: Optional[str] = None
_rank: Optional[int] = None
# agree(error or None) -> None: every worker reports its outcome; raises the first failure.
# (Process-global like the runtime: a job has one strategy's workers.)
_agree: Optional[Callable[[Optional[BaseException]], None]] = None
_local = threading.local()

_TEMP_MARK = ".prophet-tmp-"


def temp_root() -> Optional[str]:
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


def _redirecting() -> bool:
    return _rank is not None and _rank != 0


def redirect(path):
    """Returns where this worker writes ``path`` (the path itself on rank 0)."""
    if not _redirecting() or path is None:
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


def install(extended: Any) -> None:
    """Installs the hooks for the worker that ``extended`` (a multi-worker ``ProphetExtended``)
    belongs to (idempotent): rank 0 writes the real paths, the others are redirected, and every
    save ends with the outcome agreed through ``extended``'s all-gather."""
    global _rank, _agree
    with _lock:
        if _rank is not None:
            return
        _rank = extended._rank
        _agree = functools.partial(_agree_through, extended)
    _patch_keras_files()
    _patch_callbacks()
    _patch_tf_checkpoint()
    _patch_saved_model_and_summary()


# ---- one outcome per save -------------------------------------------------------------------

def _eager() -> bool:
    import tensorflow as tf
    return tf.executing_eagerly()


def agreed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a save so that every worker ends it with the same outcome (outermost call only)."""
    if getattr(fn, "_prophet_agreed", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_local, "depth", 0)
        if depth or _agree is None or not _eager():
            return fn(*args, **kwargs)
        _local.depth = depth + 1
        try:
            result = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - reported to the others, then re-raised
            _local.depth = depth
            _agree(error)
            raise
        _local.depth = depth
        _agree(None)
        return result

    wrapper._prophet_agreed = True
    return wrapper


_NOT_EVERY_WORKER_SAVED = (
    "prophet_tf: this happened while the workers agreed on the outcome of a save. Under "
    "ProphetStrategy a save (model.save, save_weights, ModelCheckpoint, tf.train.Checkpoint, "
    "tf.saved_model.save...) is a collective: EVERY worker must call it (rank 0 writes the real "
    "files, the others a private copy). A Horovod-style `if rank == 0: model.save(...)` leaves the "
    "other workers elsewhere, and this worker waits for them until timeout_s or until they exit: "
    "call the save on every worker.")


def _agree_through(extended: Any, error: Optional[BaseException]) -> None:
    """Every worker's outcome to every worker (one all-gather); raises the first failure."""
    import numpy as np
    import tensorflow as tf

    mine = encode_outcome(extended._rank, error)
    # Rank order, each entry [length, bytes...] (all-gather concatenates along dim 0).
    local = np.concatenate([[len(mine)], np.frombuffer(mine, np.uint8)]).astype(np.int32)
    try:
        gathered = extended.collectives.allgather(tf.constant(local), extended.collectives.site("save_outcome"),
                                       runtime.control_priority()).numpy()
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as failure:
        failure.add_note(_NOT_EVERY_WORKER_SAVED)
        raise
    outcomes, at = [], 0
    for _ in range(extended._world_size):
        length = int(gathered[at])
        outcomes.append(gathered[at + 1:at + 1 + length].astype(np.uint8).tobytes())
        at += 1 + length
    raise_first_failure(extended._rank, error, outcomes)


def encode_outcome(rank: int, error: Optional[BaseException]) -> bytes:
    """This worker's outcome as bytes (empty = success), for :func:`raise_first_failure`."""
    if error is None:
        return b""
    kind = type(error)
    text = json.dumps({"rank": rank, "module": kind.__module__, "type": kind.__qualname__,
                       "message": str(error)[:8000]})
    return text.encode()


def raise_first_failure(rank: int, own_error: Optional[BaseException],
                        outcomes: list[bytes]) -> None:
    """Raises the failure of the lowest rank among ``outcomes`` (one entry per rank).

    On the failing worker itself the caller re-raises its own exception (with its traceback);
    the others get an exception of the same built-in type (so the same ``except`` clauses run on
    every worker), or a ``prophet_tf.errors.SaveError``, whose message names the rank.
    """
    for failing_rank, raw in enumerate(outcomes):
        if not raw:
            continue
        if failing_rank == rank and own_error is not None:
            return  # the caller re-raises its own error
        info = json.loads(raw.decode())
        message = (f"saving failed on rank {failing_rank}{' (the chief)' if failing_rank == 0 else ''}"
                   f", so every worker stops: {info['type']}: {info['message']}")
        kind = getattr(builtins, info["type"], None) if info["module"] == "builtins" else None
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                error = kind(message)
            except TypeError:
                error = None  # a built-in type that does not take a message
            if error is not None:
                raise error
        raise SaveError(message)


# ---- Keras files: redirected on rank > 0, atomic on rank 0 ----------------------------------

def _is_local_file(path: str) -> bool:
    return not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path)


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temporaries(target: str) -> None:
    """Removes temporary files of earlier saves to ``target`` whose writer is gone."""
    directory, base = os.path.split(os.path.abspath(target))
    for stale in glob.glob(os.path.join(glob.escape(directory), f"{_TEMP_MARK}*-{glob.escape(base)}")):
        m = re.match(rf"^{re.escape(_TEMP_MARK)}(\d+)-", os.path.basename(stale))
        pid = int(m.group(1)) if m else 0
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # its writer is still alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            os.remove(stale)


def temporary_path(target: str) -> str:
    """Where an atomic save of ``target`` writes first: same directory, hidden, same suffix
    (Keras checks the suffix)."""
    directory, base = os.path.split(os.path.abspath(target))
    return os.path.join(directory, f"{_TEMP_MARK}{os.getpid()}-{base}")


def replace_atomically(write: Callable[[str], Any], target: str) -> Any:
    """Runs ``write(temporary)`` beside ``target``, fsyncs, and renames it over ``target``."""
    _remove_stale_temporaries(target)
    temporary = temporary_path(target)
    try:
        result = write(temporary)
        _fsync_path(temporary)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    _fsync_path(os.path.dirname(os.path.abspath(target)), directory=True)
    return result


def _file_save(fn: Callable[..., Any], index: int, keyword: str) -> Callable[..., Any]:
    """Wraps a Keras file save whose path is argument ``index`` / ``keyword``."""
    if getattr(fn, "_prophet_file_save", False):
        return fn

    def call_with_path(args, kwargs, path):
        if keyword in kwargs or len(args) <= index:
            kwargs = dict(kwargs, **{keyword: path})
        else:
            args = list(args)
            args[index] = path
        return fn(*args, **kwargs)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        path = kwargs.get(keyword, args[index] if len(args) > index else None)
        if _redirecting():
            return call_with_path(args, kwargs, redirect(path))
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if (isinstance(path, str) and _is_local_file(path)
                and not path.endswith(".weights.json")):  # sharded weights: several files
            return replace_atomically(lambda tmp: call_with_path(args, kwargs, tmp), path)
        return fn(*args, **kwargs)

    wrapper = agreed(wrapper)
    wrapper._prophet_file_save = True
    return wrapper


def _patch_keras_files() -> None:
    from keras.src.legacy.saving import legacy_h5_format
    from keras.src.saving import saving_lib

    saving_lib.save_model = _file_save(saving_lib.save_model, 1, "filepath")
    saving_lib.save_weights_only = _file_save(saving_lib.save_weights_only, 1, "filepath")
    legacy_h5_format.save_model_to_hdf5 = _file_save(
        legacy_h5_format.save_model_to_hdf5, 1, "filepath")


# ---- callbacks ------------------------------------------------------------------------------

_BACKUP_WRITE_PATHS = ("backup_dir", "_weights_path", "_training_metadata_path",
                       "_prev_weights_path", "_prev_training_metadata_path")


@contextlib.contextmanager
def _attributes_redirected(obj: Any, names: tuple) -> Iterator[None]:
    """On rank > 0, points ``obj``'s path attributes into the private directory meanwhile."""
    if not _redirecting():
        yield
        return
    saved = {name: getattr(obj, name) for name in names}
    for name, value in saved.items():
        setattr(obj, name, redirect(value))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def _next_metadata_path(callback: Any) -> str:
    return callback._training_metadata_path + ".next"


def backup_position(callback: Any) -> tuple[int, int]:
    """``(epoch, steps)``: the weights of ``callback``'s next save contain the updates of every
    epoch before ``epoch`` and of the first ``steps`` training steps of ``epoch``.

    Kept by the callback's own hooks (see ``_patch_callbacks``); Keras keeps only the epoch, and
    that one only from the end of the first epoch of a fit on (a mid-epoch save of a resumed fit's
    first epoch records epoch 0)."""
    position = getattr(callback, "_prophet_position", None)
    return position if position is not None else (callback._current_epoch, 0)


def _backup_save(callback: Any) -> None:
    """``BackupAndRestore._save_model`` with weights and metadata that always match.

    Keras writes the weights, then the metadata, each in place: a kill in between resumes the
    wrong epoch with the new weights (or finds truncated files). Here: (1) the weights go to a
    temporary file; (2) the metadata, naming that file's inode, is written atomically as
    ``training_metadata.json.next``; (3) the weights are renamed into place; (4) the ``.next``
    file is renamed over the metadata. After a kill between (3) and (4), ``.next`` names the inode
    of the weights in place and is the valid metadata (see :func:`_backup_metadata_path`).

    The metadata holds the position (:func:`backup_position`: ``epoch`` and ``steps_done``, with
    Keras' ``batch``) and what decides the order of the training input (``input_order``), from
    which a resumed fit continues step-exactly (``prophet_tf/_keras/fit_session.py``).
    """
    from keras.src.utils import file_utils

    os.makedirs(callback.backup_dir, exist_ok=True)
    weights, metadata = callback._weights_path, callback._training_metadata_path
    if callback.double_checkpoint:
        for source, copy in ((weights, callback._prev_weights_path),
                             (metadata, callback._prev_training_metadata_path)):
            if file_utils.exists(source):
                replace_atomically(lambda tmp, source=source: shutil.copyfile(source, tmp), copy)
    temporary = temporary_path(weights)
    _remove_stale_temporaries(weights)
    try:
        callback.model.save_weights(temporary, overwrite=True)
        _fsync_path(temporary)
        epoch, steps = backup_position(callback)
        state = {"epoch": epoch, "batch": max(steps - 1, 0), "steps_done": steps,
                 "weights_inode": os.stat(temporary).st_ino}
        session = fit_session.current()
        order = session.input_order() if session is not None else None
        if order is not None:
            state["input_order"] = order.to_json()
        next_metadata = _next_metadata_path(callback)
        replace_atomically(lambda tmp: _write_text(tmp, json.dumps(state)), next_metadata)
        os.replace(temporary, weights)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    os.replace(next_metadata, metadata)
    _fsync_path(callback.backup_dir, directory=True)
    callback._prophet_saved = (epoch, steps)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _backup_metadata_path(callback: Any) -> str:
    """The metadata that describes the weights in place (``.next`` after a kill between the
    weights' and the metadata's rename)."""
    next_metadata = _next_metadata_path(callback)
    try:
        with open(next_metadata) as f:
            inode = json.load(f).get("weights_inode")
        if inode is not None and os.stat(callback._weights_path).st_ino == inode:
            return next_metadata
    except (OSError, ValueError):
        pass
    return callback._training_metadata_path


def _register_resume(callback: Any, metadata_path: str) -> None:
    """Tells the running fit where the backup just loaded continues (step-exactly)."""
    session = fit_session.current()
    if session is None or not os.path.exists(callback._weights_path):
        return
    try:
        with open(metadata_path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return  # Keras' own loader decided what a missing or broken metadata file means
    session.resume_at(int(state.get("epoch", 0)), int(state.get("steps_done", 0)),
                      state.get("input_order"))


def _backup_restore(callback: Any) -> None:
    """``BackupAndRestore.on_train_begin`` in a multi-worker job.

    Keras loads the backup and, when that fails with an OSError (a corrupt file), copies the
    previous backup over the current one in place and loads again: on every worker at once, into
    the real (shared) paths, while the others may be reading them. Here every worker learns
    whether any worker failed to load; then rank 0 alone puts the previous backup in place,
    atomically, and every worker loads it once rank 0 is done."""
    from keras.src.utils import file_utils

    error = None
    try:
        callback._load_model()
    except OSError as e:
        error = e
    try:
        _agree(error)  # raises on the others when a worker failed (returns on that worker)
        failed = error is not None
    except Exception:  # noqa: BLE001 - another worker could not load the backup
        failed = True
    if not failed:
        return
    if not file_utils.exists(callback._prev_weights_path):
        raise error or OSError(
            f"BackupAndRestore: another worker could not load the backup in "
            f"{callback.backup_dir!r} and there is no previous backup to fall back to.")
    repair_error = None
    if not _redirecting():
        try:
            replace_atomically(lambda tmp: shutil.copyfile(callback._prev_weights_path, tmp),
                               callback._weights_path)
            if file_utils.exists(callback._prev_training_metadata_path):
                replace_atomically(lambda tmp: shutil.copyfile(
                    callback._prev_training_metadata_path, tmp), callback._training_metadata_path)
            elif file_utils.exists(callback._training_metadata_path):
                os.remove(callback._training_metadata_path)
        except OSError as e:
            repair_error = e
    _agree(repair_error)
    if repair_error is not None:
        raise repair_error
    callback._load_model()


def _patch_callbacks() -> None:
    from keras.src.callbacks import backup_and_restore, csv_logger

    @agreed
    def save_model(_original, self):
        with _attributes_redirected(self, _BACKUP_WRITE_PATHS):
            _backup_save(self)

    def load_model(original, self):
        # Every worker reads rank 0's files, through the metadata matching the weights.
        metadata = self._training_metadata_path
        self._training_metadata_path = valid = _backup_metadata_path(self)
        try:
            result = original(self)
        finally:
            self._training_metadata_path = metadata
        _register_resume(self, valid)
        return result

    @agreed
    def on_train_end(original, self, logs=None):
        # Agreed: a next fit's on_train_begin must not read a directory being deleted.
        with _attributes_redirected(self, _BACKUP_WRITE_PATHS):
            return original(self, logs)

    def on_train_begin(original, self, logs=None):
        if _agree is None:
            return original(self, logs)
        _backup_restore(self)

    # The position of the next save (backup_position), kept by the callback's own hooks.
    def on_epoch_begin(original, self, epoch, logs=None):
        self._prophet_position = (epoch, 0)
        return original(self, epoch, logs)

    def on_train_batch_end(original, self, batch, logs=None):
        self._prophet_position = (backup_position(self)[0], batch + 1)
        return original(self, batch, logs)

    def on_epoch_end(original, self, epoch, logs=None):
        self._prophet_position = (epoch + 1, 0)
        return original(self, epoch, logs)

    backup = backup_and_restore.BackupAndRestore
    patch(backup, "on_epoch_begin", on_epoch_begin)
    patch(backup, "on_train_batch_end", on_train_batch_end)
    patch(backup, "on_epoch_end", on_epoch_end)
    patch(backup, "_save_model", save_model)
    patch(backup, "_load_model", load_model)
    patch(backup, "on_train_end", on_train_end)
    patch(backup, "on_train_begin", on_train_begin)

    def csv_on_train_begin(original, self, logs=None):
        with _attributes_redirected(self, ("filename",)):
            return original(self, logs)

    patch(csv_logger.CSVLogger, "on_train_begin", csv_on_train_begin)


# ---- TensorFlow checkpoints, SavedModel, summaries ------------------------------------------

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


def _patch_tf_checkpoint() -> None:
    from tensorflow.python.checkpoint import checkpoint as tf_checkpoint
    from tensorflow.python.checkpoint import checkpoint_management

    cls = tf_checkpoint.Checkpoint
    cls._write = agreed(_wrap_path_arg(cls._write, 1, "file_prefix"))
    checkpoint_management.update_checkpoint_state_internal = agreed(_wrap_path_arg(
        checkpoint_management.update_checkpoint_state_internal, 0, "save_dir"))

    original_delete = checkpoint_management._delete_file_if_exists
    if _redirecting() and not getattr(original_delete, "_prophet_redirect", False):
        @functools.wraps(original_delete)
        def _delete_file_if_exists(filespec):
            # A CheckpointManager on a non-zero rank may only clean up its own redirected files.
            if _root is None or not os.path.abspath(os.fspath(filespec)).startswith(_root):
                return
            return original_delete(filespec)

        _delete_file_if_exists._prophet_redirect = True
        checkpoint_management._delete_file_if_exists = _delete_file_if_exists


def _replace_everywhere(original: Any, replacement: Any) -> None:
    """Replaces ``original`` in every loaded module that exports it under any name.

    ``tf.summary`` exists as several module objects (``tensorflow.summary`` imported by Keras'
    TensorBoard callback is not always the object ``tf.summary`` was when we patched it)."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is original:
                setattr(module, name, replacement)


def _patch_saved_model_and_summary() -> None:
    import tensorflow as tf
    import tensorflow.summary  # noqa: F401 - load every alias before replacing the function
    from tensorflow.python.ops import summary_ops_v2

    tf.saved_model.save = agreed(_wrap_path_arg(tf.saved_model.save, 1, "export_dir"))
    if _redirecting():
        original = summary_ops_v2.create_file_writer_v2
        _replace_everywhere(original, _wrap_path_arg(original, 0, "logdir"))
