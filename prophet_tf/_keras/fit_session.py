"""One ``model.fit`` of a multi-worker ``ProphetStrategy``: where it is, where it resumes, how it
stops for a preemption.

* **Position**: the epoch and the number of its training steps whose updates are applied. The
  step functions (wrapped in ``_keras_patches``) count the steps; an internal callback, last in
  the fit's list, starts each epoch's count.
* **Step-exact resume**: ``BackupAndRestore`` records the position with its weights
  (``saving._backup_save``). Keras records only the epoch and, on restore, runs that epoch
  again from its first batch on top of weights that already contain some of its updates. Here,
  loading a backup registers a :class:`ResumePlan`; when the resumed epoch starts, the training
  epoch iterator reads the batches already applied without training on them, so the first step
  trains on the first batch the interrupted run had not applied, in the same data order. Epochs
  before it are replayed the way Keras iterated them (one new iterator per epoch, whose shuffle
  seeds advance; with ``steps_per_epoch``, by reading their batches), so a pipeline that
  reshuffles every epoch gives the same order too. Whether the input can give the same order in
  a new process is checked first (``_input_order``): a mid-epoch resume fails closed
  (:class:`~prophet_tf.errors.ResumeError`) when it cannot.
* **Preemption stop** (``prophet_tf/preemption.py``): the step in which the workers agree to stop
  ends the fit on every worker: the checkpoint is written at the position after that step, and
  :class:`~prophet_tf.preemption.Preempted` leaves the program. The batch-end callbacks of that
  step do not run (the resumed fit skips it too).
* The strategy's own checkpoint: a fit without ``BackupAndRestore`` gets an internal one in
  ``checkpoint_dir/fit-<k>`` (the k-th fit of the program) when a checkpoint directory is set;
  it writes only when the workers stop for a preemption and restores like the Keras callback.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import threading
from typing import Any, Optional

from prophet_tf import _compat, _input_order, preemption, runtime
from prophet_tf.errors import ResumeError

logger = logging.getLogger("prophet_tf")

#: Key under which a step function's outputs carry the number of workers asking to stop (taken
#: out before Keras sees the logs).
STOP_KEY = "_prophet_preemption_stop"
#: Set to 1 to resume mid-epoch by counting batches even where the input's order cannot be
#: checked to be the same (a warning instead of ResumeError).
INEXACT_RESUME_ENV = "PROPHET_ALLOW_INEXACT_RESUME"

_local = threading.local()


@dataclasses.dataclass
class ResumePlan:
    """Where a restored backup continues: ``steps`` training steps of ``epoch`` are applied."""

    epoch: int
    steps: int
    input_order: Optional[_input_order.InputOrder]  # recorded with the backup


class FitSession:
    """State of one multi-worker ``fit`` call (see the module docstring)."""

    def __init__(self, model: Any, extended: Any, first_epoch: int) -> None:
        self.model = model
        self.extended = extended
        self.first_epoch = int(first_epoch or 0)
        self.epoch = self.first_epoch
        self.steps_done = 0
        self.backup: Any = None          # the BackupAndRestore holding this fit's checkpoint
        self.training_iterator: Any = None
        self.began = False               # on_train_begin done (the restore happened)
        self.plan: Optional[ResumePlan] = None
        self._input_order: Optional[_input_order.InputOrder] = None

    # ---- position ---------------------------------------------------------------------------
    def input_order(self) -> Optional[_input_order.InputOrder]:
        """What decides the order of the training input (None: not a dataset we can inspect)."""
        if self._input_order is None:
            distributed = getattr(self.training_iterator, "_distributed_dataset", None)
            source = getattr(distributed, "_prophet_source", None)
            if source is not None:
                self._input_order = _input_order.describe(source)
        return self._input_order

    # ---- resume -----------------------------------------------------------------------------
    def resume_at(self, epoch: int, steps: int, recorded: Optional[dict]) -> None:
        """A backup was loaded: the next epoch to run is ``epoch``, ``steps`` of it applied."""
        self.plan = ResumePlan(int(epoch), int(steps), _input_order.InputOrder.from_json(recorded))

    def take_plan(self, iterator: Any) -> Optional[ResumePlan]:
        """The resume plan, once, for the training iterator's first epoch after the restore."""
        if iterator is not self.training_iterator or not self.began or self.plan is None:
            return None
        plan, self.plan = self.plan, None
        if plan.epoch <= self.first_epoch and plan.steps == 0:
            return None  # the fit starts where it would have anyway
        self._check_input(plan)
        return plan

    def _check_input(self, plan: ResumePlan) -> None:
        current = self.input_order()
        where = f"epoch {plan.epoch} step {plan.steps}"
        if current is None:
            issues = ["the training input is not a dataset the strategy can inspect (a dataset "
                      "made by a function, or a Python generator)"]
        else:
            issues = _input_order.problems(plan.input_order, current)
            if current.unverifiable and not issues:
                logger.warning("prophet_tf: resuming at %s by counting batches; the order of the "
                               "input cannot be checked (%s): it continues the interrupted run "
                               "only if that code gives the same batches in the same order",
                               where, "; ".join(current.unverifiable))
        if not issues:
            return
        fix = ("Fix: give the input a fixed order: set a seed (keras.utils.set_random_seed(S) or "
               "tf.random.set_seed(S) before building the input, or $PROPHET_JOB_SEED=S, the same "
               "for every attempt of the job), and use deterministic=True.")
        if plan.steps == 0:
            logger.warning("prophet_tf: resuming at the start of epoch %d; the epochs from here "
                           "on will not see the batches of the uninterrupted run: %s. %s",
                           plan.epoch, "; ".join(issues), fix)
            return
        message = (f"cannot resume step-exactly at {where}: the backup's weights contain the "
                   f"updates of the first {plan.steps} batches of that epoch, and the resumed "
                   f"input would not give the same batches in the same order: "
                   f"{'; '.join(issues)}. {fix} Set {INEXACT_RESUME_ENV}=1 to skip "
                   f"{plan.steps} batches of the new order anyway (some samples of that epoch "
                   "then twice, others never).")
        if os.environ.get(INEXACT_RESUME_ENV, "").strip().lower() in ("1", "true", "yes"):
            logger.warning("prophet_tf: %s", message)
            return
        raise ResumeError(message)

    # ---- preemption ---------------------------------------------------------------------------
    def stop_for_preemption(self, signals: int) -> None:
        """Every worker agreed to stop after the step that just ran: checkpoint, report, leave."""
        checkpoint = None
        backup = self.backup
        if backup is not None:
            position = (self.epoch, self.steps_done)
            if getattr(backup, "_prophet_saved", None) != position:
                backup._prophet_position = position
                backup._save_model()  # agreed: every worker is here, in the same step
            checkpoint = backup.backup_dir
        leave(preemption.Report(self.extended._rank, signals, self.epoch, self.steps_done,
                                checkpoint))


def leave(report: preemption.Report) -> None:
    """Says where this worker stopped and leaves with EXIT_PREEMPTED."""
    preemption.mark_checkpoint_written()
    preemption.write_stderr(report.line())
    runtime.timeline_flush()
    preemption.leaving()
    raise preemption.Preempted(report)


def current() -> Optional[FitSession]:
    stack = _local.__dict__.get("sessions")  # (no AttributeError raised per step)
    return stack[-1] if stack else None


# ---- step functions ------------------------------------------------------------------------

def after_step(outputs: Any, training: bool, steps: int) -> None:
    """Takes the stop flag out of a step function's outputs and acts on it."""
    if not isinstance(outputs, dict):
        return
    stop = outputs.pop(STOP_KEY, None)
    session = current()
    if training and session is not None:
        session.steps_done += steps
    if stop is None:
        return
    signals = int(round(float(stop)))
    if signals <= 0:
        return
    if session is None:  # train_on_batch, evaluate outside fit: nothing to resume
        leave(preemption.Report(runtime.rank(), signals))
    session.stop_for_preemption(signals)


def carry_stop_flag(extended: Any, values: Any) -> Any:
    """Adds the stop flag to a step's outputs when its metrics did not carry it (a custom
    ``train_step`` that does not return ``get_metrics_result()``): one float of its own."""
    flag = preemption.flag_to_carry()
    if flag is None or (isinstance(values, dict) and STOP_KEY in values):
        return values
    if not isinstance(values, dict):
        logger.warning("prophet_tf: a train/test step returns %s, not a dict: the workers cannot "
                       "agree on a preemption stop in it (a signal then ends the worker after "
                       "the grace period)", type(values).__name__)
        return values

    agreed = extended.collectives.push_pull(flag, extended.collectives.site("preemption"),
                                 runtime.control_priority(), False)
    return dict(values, **{STOP_KEY: agreed[0]})


# ---- fit --------------------------------------------------------------------------------------

def run_fit(original: Any, model: Any, extended: Any, args: tuple, kwargs: dict) -> Any:
    """``fit`` with a session: its callbacks get the tracker (last) and, without a
    ``BackupAndRestore``, the strategy's own backup (first) when a checkpoint directory is set."""
    from keras.src.callbacks import backup_and_restore, callback_list

    bound = inspect.signature(original).bind(model, *args, **kwargs)
    session = FitSession(model, extended, bound.arguments.get("initial_epoch", 0))
    callbacks = bound.arguments.get("callbacks")
    if isinstance(callbacks, callback_list.CallbackList):
        listed = callbacks.callbacks
    else:
        listed = callbacks = list(callbacks or [])
    backups = [c for c in listed if isinstance(c, backup_and_restore.BackupAndRestore)]
    extended._fit_count += 1
    if backups:
        session.backup = backups[0]
    elif extended._checkpoint_dir:
        session.backup = strategy_backup(os.path.join(extended._checkpoint_dir,
                                                      f"fit-{extended._fit_count}"))
        listed.insert(0, session.backup)
    tracker = _tracker(session)
    listed.append(tracker)
    if isinstance(callbacks, callback_list.CallbackList):
        for added in (tracker, session.backup):
            if added is not None:
                added.set_model(model)
                added.set_params(callbacks.params)
    bound.arguments["callbacks"] = callbacks
    stack = getattr(_local, "sessions", None)
    if stack is None:
        stack = _local.sessions = []
    stack.append(session)
    try:
        return original(*bound.args, **bound.kwargs)
    except preemption.Preempted:
        raise
    except Exception as error:
        if session.began:  # where, for the launcher (a failure repeating there is not a fault)
            preemption.write_stderr(preemption.Failure(
                extended._rank, session.epoch, session.steps_done,
                preemption.describe_error(error)).line())
        raise
    finally:
        stack.pop()
        listed.remove(tracker)
        if session.backup is not None and session.backup not in backups:
            listed.remove(session.backup)


def _tracker(session: FitSession) -> Any:
    import keras

    class _FitTracker(keras.callbacks.Callback):
        """Marks the restore done and starts each epoch's step count (epoch hooks only: batch
        hooks would turn off Keras' asynchronous batch callbacks)."""

        def on_train_begin(self, logs=None):
            session.began = True
            replaced = preemption.replaced_handlers()
            if replaced:
                logger.warning(
                    "prophet_tf: the program installed its own handler for %s: a signal now runs "
                    "that handler only, and the workers do not stop together with a checkpoint "
                    "unless it calls prophet_tf.preemption.request()", ", ".join(replaced))

        def on_epoch_begin(self, epoch, logs=None):
            session.epoch, session.steps_done = epoch, 0

    return _FitTracker()


def strategy_backup(directory: str) -> Any:
    """The strategy's own checkpoint of one fit: a ``BackupAndRestore`` that writes only when
    the workers stop for a preemption, and restores (step-exactly) when its directory holds a
    backup."""
    from keras.src.callbacks import backup_and_restore
    from keras.src.utils import file_utils

    class StrategyBackup(backup_and_restore.BackupAndRestore):
        def on_epoch_end(self, epoch, logs=None):
            pass  # no backup per epoch: only the preemption stop writes one

        def _should_save_on_batch(self, batch):
            return False

        def _load_model(self):
            if file_utils.exists(self._weights_path):  # else nothing to restore: no build needed
                super()._load_model()

    return StrategyBackup(directory)


# ---- the training epoch iterator -----------------------------------------------------------

def claim_iterator(iterator: Any) -> None:
    """The first epoch iterator a fit creates is its training input."""
    session = current()
    if session is not None and session.training_iterator is None:
        session.training_iterator = iterator


def enumerate_epoch(original: Any, iterator: Any):
    """``EpochIterator._enumerate_iterator``: for the first epoch after a restore, replays the
    epochs before it and reads (without training) the batches already applied."""
    session = current()
    plan = session.take_plan(iterator) if session is not None else None
    if plan is None:
        yield from original(iterator)
        return
    for _ in range(plan.epoch - session.first_epoch):
        _replay_epoch(original, iterator)
    skipped = 0
    for item in original(iterator):
        begin, end, data = _compat.epoch_steps(item, iterator.steps_per_execution)
        if end < plan.steps:
            if not _read(data, iterator.steps_per_execution):
                raise _short_input(plan, skipped)
            skipped = session.steps_done = end + 1
            continue
        if skipped != plan.steps:
            raise _short_input(plan, skipped)
        yield item
    if skipped < plan.steps:
        raise _short_input(plan, skipped)


def _read(data: Any, count: int) -> bool:
    """Reads ``count`` elements from an iterator (False when it ran out first)."""
    import tensorflow as tf
    try:
        for _ in range(count):
            next(data)
    except (StopIteration, tf.errors.OutOfRangeError):
        return False
    return True


def _replay_epoch(original: Any, iterator: Any) -> None:
    """Takes the input through one epoch before the resumed one as Keras' fit loop would, without
    training: the same iterators are created (each new one advances the seeds of a pipeline that
    reshuffles every iteration), and batches are read only where Keras' position in the input
    depends on them (``steps_per_epoch``: one iterator continues across epochs; an input of unknown
    length: its end is found by reading)."""
    reading = iterator.steps_per_epoch is not None or iterator._num_batches is None
    with iterator.catch_stop_iteration():
        for item in original(iterator):
            _begin, _end, data = _compat.epoch_steps(item, iterator.steps_per_execution)
            if reading and not _read(data, iterator.steps_per_execution):
                raise StopIteration  # what Keras' train function raises at the end of the input


def _short_input(plan: ResumePlan, read: int) -> Exception:
    return ResumeError(
        f"cannot resume at epoch {plan.epoch} step {plan.steps}: the training input ran out "
        f"after {read} batches of that epoch. The resumed fit must get the input of the "
        "interrupted one (same data, batch size, steps_per_epoch and steps_per_execution).")
