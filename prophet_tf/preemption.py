"""Coordinated preemption: a signal on any worker stops every worker at the same step of ``fit``.

Cloud machines that are taken back (spot and preemptible VMs, evicted Kubernetes pods) get a
SIGTERM and a short grace period before they are killed. Under a multi-worker
:class:`prophet_tf.ProphetStrategy`:

1. the signal handler (installed when the strategy is created, main thread only) only records
   the request (:func:`request` does the same for a program's own handler);
2. the request travels with a collective every training and validation step makes anyway: one
   more float in the step's metric reduction (a control-priority push_pull; a step without
   metrics gets its own one-float push_pull). Every worker gets the same sum in the same step,
   so every worker stops after that step: the other workers learn of the signal through the
   runtime, not through a dead peer;
3. inside ``model.fit``, after that step's batch-end callbacks, every worker writes one
   checkpoint: the ``BackupAndRestore`` backup when the fit has one, otherwise the strategy's own
   (model and optimizer state, in ``checkpoint_dir``); it records the epoch and the number of
   training steps of that epoch already applied, and a resumed ``fit`` continues exactly there
   (see ``prophet_tf/_keras/fit_session.py``);
4. each worker writes one line to stderr (:class:`Report`, parsed by the launcher) and exits with
   :data:`EXIT_PREEMPTED` by raising :class:`Preempted` (a ``SystemExit``: ``finally`` blocks of
   the program run). When that exception ends the program, the process leaves right after its
   exit handlers (``atexit``) ran and its open files are flushed, without the interpreter's final
   garbage collection, which takes seconds with TensorFlow loaded and would delay a restart
   (:data:`FAST_EXIT_ENV` = 0 turns this off).

A worker still alive ``grace_s`` after the signal (no step came: the program was outside
``fit``, or a step hangs) leaves with status 128 + the signal's number, as a shell reports a
process the signal killed, or with :data:`EXIT_PREEMPTED` when its checkpoint is already written. Work is lost only when a worker is
killed without a signal it can handle (SIGKILL, power loss).

A program's own handler for the same signal: one installed before the strategy is called after
the request is recorded (chained); one installed after the strategy replaces this one, and then a
signal runs only the program's handler, which may call :func:`request` to keep the coordinated
checkpoint. ``fit`` logs a warning when it finds the handler replaced.

A ``fit`` that ends with an error says where on stderr too (:class:`Failure`), for the launcher's
restarts. This module does not import TensorFlow (the launcher reads these lines).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import io
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

from prophet_tf import runtime

__all__ = ["EXIT_PREEMPTED", "DEFAULT_GRACE_S", "Preempted", "Report", "parse_report", "Failure",
           "parse_failure", "parse_received", "request", "requested", "SIGNALS_ENV", "GRACE_ENV",
           "CHECKPOINT_DIR_ENV", "FAST_EXIT_ENV"]

#: Exit status of a worker that stopped for a preemption (sysexits' EX_TEMPFAIL, "try again"):
#: its stderr says where the checkpoint is and at which epoch and step (:class:`Report`).
EXIT_PREEMPTED = 75
#: Seconds between the signal and the moment a worker that could not stop at a step leaves anyway
#: (Kubernetes' and GCE spot's default grace period is 30 s).
DEFAULT_GRACE_S = 30.0
#: Signals that ask for the coordinated stop, by name, comma-separated ("SIGTERM,SIGUSR1"; "none"
#: turns it off); the strategy's ``preemption_signals`` wins.
SIGNALS_ENV = "PROPHET_PREEMPTION_SIGNALS"
#: The grace period in seconds (the strategy's ``preemption_grace_s`` wins).
GRACE_ENV = "PROPHET_PREEMPTION_GRACE_S"
#: Where the strategy keeps its own checkpoint for a ``fit`` without ``BackupAndRestore`` (the
#: strategy's ``checkpoint_dir`` wins; ``prophetrun --checkpoint-dir`` sets it).
CHECKPOINT_DIR_ENV = "PROPHET_CHECKPOINT_DIR"
#: "0": a worker that ``Preempted`` ends leaves through the interpreter's ordinary exit (its final
#: garbage collection and module teardown) instead of right after its exit handlers.
FAST_EXIT_ENV = "PROPHET_PREEMPTION_FAST_EXIT"

SignalSpec = Union[None, int, str, Sequence[Union[int, str]]]

_REPORT_PREFIX = "prophet_tf: preempted:"
_REPORT = re.compile(
    r"prophet_tf: preempted: rank (?P<rank>\d+), (?P<signals>\d+) worker\(s\) asked to stop; "
    r"(?:stopped at epoch (?P<epoch>\d+) step (?P<step>\d+)|stopped outside model\.fit); "
    r"checkpoint: (?P<checkpoint>.*)$")


class Preempted(SystemExit):
    """Raised on every worker once the coordinated checkpoint is written: leaves the program with
    :data:`EXIT_PREEMPTED` (``finally`` blocks run; ``except Exception`` does not catch it)."""

    def __init__(self, report: "Report") -> None:
        super().__init__(EXIT_PREEMPTED)
        self.report = report

    @property
    def code(self) -> int:
        # The interpreter reads the status here when this exception ends the program (and so
        # does a framework that catches SystemExit to exit with its code): from then on the
        # process leaves right after its exit handlers (see _at_exit).
        _state.exiting = True
        return EXIT_PREEMPTED


@dataclasses.dataclass(frozen=True)
class Report:
    """What a preempted worker says on stderr, one line (the launcher parses it)."""

    rank: int
    signals: int                 # workers that asked to stop (summed in the step)
    epoch: Optional[int] = None  # None: stopped outside model.fit
    step: Optional[int] = None   # training steps of ``epoch`` applied before the stop
    checkpoint: Optional[str] = None  # where; None: no checkpoint written

    def line(self) -> str:
        where = (f"stopped at epoch {self.epoch} step {self.step}" if self.epoch is not None
                 else "stopped outside model.fit")
        return (f"{_REPORT_PREFIX} rank {self.rank}, {self.signals} worker(s) asked to stop; {where}; "
                f"checkpoint: {self.checkpoint or 'none'}")


def parse_report(line: str) -> Optional[Report]:
    """The :class:`Report` a line holds (with or without the launcher's ``[rank i]`` prefix)."""
    m = _REPORT.search(line.rstrip("\r\n"))
    if m is None:
        return None
    epoch = m.group("epoch")
    checkpoint = m.group("checkpoint")
    return Report(rank=int(m.group("rank")), signals=int(m.group("signals")),
                  epoch=None if epoch is None else int(epoch),
                  step=None if epoch is None else int(m.group("step")),
                  checkpoint=None if checkpoint == "none" else checkpoint)


_FAILURE_PREFIX = "prophet_tf: failed:"
_FAILURE = re.compile(r"prophet_tf: failed: rank (?P<rank>\d+) at epoch (?P<epoch>\d+) step "
                      r"(?P<step>\d+): (?P<error>.*)$")


@dataclasses.dataclass(frozen=True)
class Failure:
    """What a worker says on stderr when ``fit`` ends with an error: where (the launcher stops
    restarting a job that fails twice at the same step with the same error)."""

    rank: int
    epoch: int
    step: int   # training steps of ``epoch`` applied before the error
    error: str  # "Type: first line of the message"

    def line(self) -> str:
        return f"{_FAILURE_PREFIX} rank {self.rank} at epoch {self.epoch} step {self.step}: {self.error}"


_RECEIVED = re.compile(r"prophet_tf: rank (?P<rank>\d+) received (?P<what>\S+): every worker stops")


def parse_received(line: str) -> Optional[tuple[int, str]]:
    """(rank, signal name) from the line a worker writes when it receives a preemption signal."""
    m = _RECEIVED.search(line)
    return None if m is None else (int(m.group("rank")), m.group("what"))


def parse_failure(line: str) -> Optional[Failure]:
    """The :class:`Failure` a line holds (with or without the launcher's ``[rank i]`` prefix)."""
    m = _FAILURE.search(line.rstrip("\r\n"))
    if m is None:
        return None
    return Failure(int(m.group("rank")), int(m.group("epoch")), int(m.group("step")), m.group("error"))


def describe_error(error: BaseException) -> str:
    """``Type: first line of the message`` (TensorFlow's graph traceback left out)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()
             and not line.startswith(("Graph execution error", "Detected at node", "  File "))]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def signals_from(spec: SignalSpec) -> tuple[int, ...]:
    """Signal numbers from ``SIGTERM``, ``"SIGTERM,SIGUSR1"``, ``15``, a list of those, or
    None/"none" (none). ValueError names what it cannot read."""
    if spec is None:
        return ()
    items = spec.split(",") if isinstance(spec, str) else (
        [spec] if isinstance(spec, int) else list(spec))
    out = []
    for item in items:
        if isinstance(item, str):
            text = item.strip()
            if not text or text.lower() in ("none", "0", "off"):
                continue
            name = text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()
            try:
                number = int(text) if text.isdigit() else int(signal.Signals[name])
            except KeyError:
                raise ValueError(f"preemption signal {item!r} is not a signal name (e.g. SIGTERM, "
                                 f"SIGUSR1) or number") from None
        else:
            number = int(item)
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{signal.Signals(number).name} cannot be handled: it cannot ask for a "
                             "checkpoint (use SIGTERM or another catchable signal)")
        out.append(number)
    return tuple(dict.fromkeys(out))


def _signal_name(number: Optional[int]) -> str:
    if number is None:
        return "prophet_tf.preemption.request()"
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _State:
    """This process's preemption handling (one runtime per process, hence one of these)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.signals: tuple[int, ...] = ()
        self.grace_s = DEFAULT_GRACE_S
        self.rank = 0
        self.previous: dict[int, Any] = {}
        self.handler: Optional[Callable[[int, Any], None]] = None
        self.pid = 0  # the worker's: a forked child inherits the handlers, not the role
        self.requested_at: Optional[float] = None  # time.monotonic() of the first request
        self.requested_by: Optional[int] = None
        self.flag: Any = None        # tf.Variable(float32): 1.0 once the request entered a step
        self.flag_set = False
        self.checkpoint_done = False
        self.watchdog: Optional[threading.Thread] = None
        self.retired = threading.Event()  # set by _reset: this state's watchdog stands down
        self.leaving = False         # Preempted was raised (the fast exit is registered)
        self.exiting = False         # ... and it is ending the program (its code was read)


_state = _State()
_local = threading.local()
_flag_variable: Any = None


def armed() -> bool:
    """Whether this process handles preemption (a multi-worker strategy armed it)."""
    return _state.flag is not None


def requested() -> bool:
    """Whether a stop was asked for in this process (by a signal or :func:`request`)."""
    return _state.requested_at is not None


def request(signum: Optional[int] = None) -> None:
    """Asks every worker to stop after the next training or validation step and checkpoint.

    What the signal handler does; call it from a program's own signal handler (only records the
    request and starts the grace-period watchdog, so it is safe there)."""
    with _state.lock:
        if _state.requested_at is not None:
            return
        _state.requested_at = time.monotonic()
        _state.requested_by = signum
    grace = _state.grace_s
    write_stderr(f"prophet_tf: rank {_state.rank} received {_signal_name(signum)}: every worker "
                 f"stops after the next training step of model.fit and writes a checkpoint "
                 f"(grace period {grace:g} s)")
    if armed():
        watchdog = threading.Thread(target=_watchdog, args=(_state, grace),
                                    name="prophet-preemption", daemon=True)
        _state.watchdog = watchdog
        watchdog.start()


def _on_signal(signum: int, frame: Any) -> None:
    if os.getpid() != _state.pid:
        # A process forked from the worker (a multiprocessing pool's, as Keras starts for a
        # PyDataset with use_multiprocessing=True, which it ends with SIGTERM): not a worker of
        # the job, so the signal does what it would without the strategy.
        previous = _state.previous.get(signum)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    request(signum)
    previous = _state.previous.get(signum)
    if callable(previous):
        previous(signum, frame)  # the program's handler, installed before the strategy


def write_stderr(text: str) -> None:
    """Writes one line to stderr, also from a signal handler."""
    # os.write: safe where print() may be re-entered (a signal handler runs between bytecodes).
    try:
        os.write(2, (text + "\n").encode(errors="replace"))
    except OSError:
        pass


def _watchdog(state: _State, grace_s: float) -> None:
    """Ends the worker ``grace_s`` after the request if it is still alive."""
    if state.retired.wait(grace_s):
        return
    if state.checkpoint_done:
        write_stderr(f"prophet_tf: rank {state.rank}: still exiting {grace_s:g} s after the "
                     f"preemption request; leaving now with status {EXIT_PREEMPTED} (the checkpoint "
                     "is written)")
        os._exit(EXIT_PREEMPTED)
    signum = state.requested_by or signal.SIGTERM
    write_stderr(f"prophet_tf: rank {state.rank}: no step of model.fit came within the grace "
                 f"period ({grace_s:g} s after {_signal_name(state.requested_by)}): no "
                 "coordinated checkpoint; leaving as the signal would have ended this worker")
    try:
        runtime.timeline_flush()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    os._exit(128 + int(signum))  # the status a shell reports for a process the signal killed


def arm(signals: SignalSpec, grace_s: Optional[float], rank: int) -> bool:
    """Installs the handlers (idempotent); False when it cannot (not the main thread, no
    signals). Called by a multi-worker ProphetStrategy."""
    import tensorflow as tf

    numbers = signals_from(signals)
    grace = float(grace_s) if grace_s is not None else float(
        os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))
    if grace <= 0:
        raise ValueError(f"preemption_grace_s must be > 0, got {grace}")
    with _state.lock:
        _state.grace_s, _state.rank = grace, int(rank)
        if _state.flag is not None:
            return True
        if not numbers:
            return False
        if threading.current_thread() is not threading.main_thread():
            import logging
            logging.getLogger("prophet_tf").warning(
                "prophet_tf: the strategy was created outside the main thread, where signal "
                "handlers cannot be installed: a %s ends this worker without the coordinated "
                "checkpoint", "/".join(_signal_name(n) for n in numbers))
            return False
        _state.pid = os.getpid()
        for number in numbers:
            _state.previous[number] = signal.signal(number, _on_signal)
        _state.signals = numbers
        _state.handler = _on_signal
        # Read in every step's metric reduction; assigned once, before the first step after a
        # request (never from the handler, which may run in the middle of TensorFlow's Python).
        # One per process: traced step functions keep reading it across reset().
        global _flag_variable
        if _flag_variable is None:
            _flag_variable = tf.Variable(0.0, trainable=False, dtype=tf.float32,
                                         name="prophet_preemption_request")
        _flag_variable.assign(0.0)
        _state.flag = _flag_variable
    return True


def replaced_handlers() -> list[str]:
    """The armed signals whose handler the program replaced after the strategy armed them."""
    out = []
    for number in _state.signals:
        try:
            if signal.getsignal(number) is not _state.handler:
                out.append(_signal_name(number))
        except ValueError:
            pass
    return out


def before_step() -> None:
    """Puts a pending request into the flag the next step carries (cheap when there is none)."""
    if _state.requested_at is not None and not _state.flag_set and _state.flag is not None:
        _state.flag.assign(1.0)
        _state.flag_set = True


def run_carrying(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs a step function whose reductions (when it is traced now) carry the flag."""
    before = _local.__dict__.get("carrying", False)
    _local.carrying = True
    try:
        return function(*args, **kwargs)
    finally:
        _local.carrying = before


def flag_to_carry():
    """The local request (float32 scalar, 0 or 1) when the step being traced carries it."""
    if _state.flag is None or not _local.__dict__.get("carrying", False):
        return None
    import tensorflow as tf
    return tf.reshape(_state.flag.read_value(), [1])


def mark_checkpoint_written() -> None:
    _state.checkpoint_done = True


def leaving() -> None:
    """``Preempted`` is about to be raised: if it ends the program, the process leaves right after
    its exit handlers (unless ``$PROPHET_PREEMPTION_FAST_EXIT`` is 0)."""
    with _state.lock:
        if _state.leaving:
            return
        _state.leaving = True
    if os.environ.get(FAST_EXIT_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    atexit.register(_at_exit, _state)


def _at_exit(state: _State) -> None:
    """An exit handler (registered last, so it runs first): when ``Preempted`` is ending the
    program, arranges to leave at the interpreter's first garbage collection after the exit
    handlers (see :func:`_leave_before_teardown`)."""
    if state is not _state or not state.exiting:
        return  # the program caught Preempted and went on: an ordinary exit
    gc.callbacks.append(_leave_before_teardown)
    gc.enable()


def _leave_before_teardown(phase: str, info: dict) -> None:
    """A garbage-collector callback. The interpreter's final teardown starts with a collection,
    once every exit handler ran (the runtime's shutdown, logging's, the program's) and the
    interpreter is marked finalizing: there, every open file is flushed and the process leaves with
    :data:`EXIT_PREEMPTED`. What is skipped is that collection and the module teardown (seconds
    with TensorFlow loaded); nothing of the checkpoint waits for them (it was written, fsync'ed and
    agreed on by every worker before ``Preempted`` was raised). A collection during the exit
    handlers does nothing here (not finalizing yet)."""
    if phase != "start" or not sys.is_finalizing():
        return
    _flush_open_files()
    os._exit(EXIT_PREEMPTED)


def _flush_open_files() -> None:
    """What the interpreter's teardown would have done for files the program left open."""
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - a broken file must not keep the process alive
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def grace_s() -> float:
    return _state.grace_s


def signal_names() -> list[str]:
    return [_signal_name(n) for n in _state.signals]


def reset() -> None:
    """Back to an unarmed process (handlers restored), for tests and benchmarks that arm it
    several times in one process."""
    global _state
    _state.retired.set()
    for number, previous in _state.previous.items():
        try:
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        except (ValueError, OSError, TypeError):
            pass
    _state = _State()
