"""Standby workers: an elastic job's next workers start before they are needed.

When an elastic job forms again, its new workers spend most of the time before their first step
starting Python and importing TensorFlow and Keras: about 10 s of CPU each, 45 s of a worker's
55 s to its first step at a load of 10 on 2 cores (the strategy, the model, the restore and the
traced first step took the other 10 s). So a node's launcher keeps, for each of its worker slots,
one interpreter that already imported the modules the workers will need (``--preload``;
``prophet_tf.strategy`` by default: TensorFlow, Keras and the runtime) and waits:

- a node starts its standbys first and (unless it runs the master) joins the job once they are
  ready, so that a node that arrives while the job trains stops it only when its own workers can
  start at once;
- when the job forms, the launcher hands each slot's standby the attempt's environment and
  command, and the worker's program runs in it from its first line, as ``python -u script.py``
  or ``python -u -m module`` would run it;
- the standbys for the next attempt start :data:`STANDBY_DELAY_S` after the attempt's workers,
  so that they do not compete for the CPU with the workers' own start.

A standby is used only when its environment equals the new worker's apart from what each attempt
changes (:data:`PER_ATTEMPT_ENV`): what a module may read while it is imported (thread counts,
``CUDA_VISIBLE_DEVICES``, log levels) is then what the worker would have seen. Otherwise, and
when it died, the worker starts afresh as without standbys. Standbys import modules only; they
create no TensorFlow context (which would take memory on the GPU the running worker uses).

The standby process itself is ``python -m prophet_tf._standby MODULES FD`` (outside this
package, whose import it does not need).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

from prophet_tf.cluster import JOB_SEED_ENV

__all__ = ["StandbyPool", "DEFAULT_PRELOAD", "PER_ATTEMPT_ENV", "STANDBY_DELAY_S", "DELAY_ENV",
           "parse_preload"]

#: What a standby imports unless ``--preload`` says otherwise: the strategy's module, which
#: imports TensorFlow, Keras and the runtime's op library.
DEFAULT_PRELOAD = ("prophet_tf.strategy",)
#: The variables every attempt sets anew.
PER_ATTEMPT_ENV = ("TF_CONFIG", "PROPHET_JOB_TOKEN", JOB_SEED_ENV)
#: A standby starts without these: nothing it imports may see a cluster or a token that is not
#: decided yet.
_UNDECIDED_ENV = ("TF_CONFIG", "PROPHET_JOB_TOKEN")
#: Seconds after an attempt's workers started before the standbys for the next attempt start
#: (``$PROPHET_STANDBY_DELAY_S`` of the launcher): the workers of the attempt get the CPU for
#: their own start first (10-13 s from their start to their first step at a load of 15 on 2
#: cores, once their imports were done ahead).
STANDBY_DELAY_S = 15.0
DELAY_ENV = "PROPHET_STANDBY_DELAY_S"


def parse_preload(text: str) -> tuple[str, ...]:
    """``--preload``: comma-separated module names; ``none`` (or nothing): no standbys."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names in ((), ("none",)):
        return ()
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"--preload: {name!r} is not a module name (give MODULE[,MODULE...] "
                             "or none)")
    return names


def _stable(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in PER_ATTEMPT_ENV}


@dataclasses.dataclass
class _Standby:
    proc: subprocess.Popen
    env: dict  # the worker environment it was started for
    ready_fd: int  # readable (a byte, or end of file) once its imports are done or it died

    def ready(self, timeout: float = 0.0) -> bool:
        return bool(select.select([self.ready_fd], [], [], max(0.0, timeout))[0])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self.proc.stdin.close()
        self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError, ValueError):
                pipe.close()
        self.close_fd()

    def close_fd(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.ready_fd)


class StandbyPool:
    """One standby per local worker slot of a node, for the attempts of an elastic job.

    Args:
      modules: what each standby imports.
      wrap: ``f(argv) -> argv`` that starts a process as the launcher starts its workers (the
        stub that kills it when the launcher dies).
      delay_s: seconds between an attempt's start and its standbys' start (default
        ``$PROPHET_STANDBY_DELAY_S``, else :data:`STANDBY_DELAY_S`).
    """

    def __init__(self, modules: Sequence[str], wrap: Callable[[list[str]], list[str]],
                 delay_s: Optional[float] = None) -> None:
        self.modules = tuple(modules)
        self.delay_s = float(os.environ.get(DELAY_ENV, STANDBY_DELAY_S)) if delay_s is None else delay_s
        self._wrap = wrap
        self._lock = threading.Lock()
        self._ready: dict[int, _Standby] = {}
        self._requests: "queue.Queue[Optional[tuple[float, int, list[dict[str, str]]]]]" = queue.Queue()
        self._generation = 0
        self._closed = False
        # Every standby is started by this one thread, which lives as long as the launcher: the
        # stub's PR_SET_PDEATHSIG fires when the thread that started the process ends.
        self._thread = threading.Thread(target=self._run, name="prophet-standby", daemon=True)
        self._thread.start()

    @staticmethod
    def command_fits(cmd: Sequence[str]) -> bool:
        """Whether a standby can run this worker command (this interpreter, ``-u``)."""
        return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-u"

    def take(self, index: int, env: Mapping[str, str], cmd: Sequence[str]) -> Optional[subprocess.Popen]:
        """The standby of slot ``index``, handed ``env`` and ``cmd`` (a command that
        :meth:`command_fits`) and running it; None when there is none that fits (start the
        worker afresh)."""
        with self._lock:
            self._generation += 1  # a refill still waiting is for an attempt that is over
            standby = self._ready.pop(index, None)
        if standby is None:
            return None
        proc = standby.proc
        if proc.poll() is not None or _stable(standby.env) != _stable(env):
            standby.kill()
            return None
        order = json.dumps({"env": dict(env), "argv": list(cmd[2:])}) + "\n"
        try:
            proc.stdin.write(order.encode())
            proc.stdin.close()
        except (OSError, ValueError):
            standby.kill()
            return None
        proc.stdin = None  # as a worker started afresh: nothing to write to
        standby.close_fd()
        return proc

    def fill(self, envs: Sequence[Mapping[str, str]], delay_s: Optional[float] = None) -> None:
        """Starts, ``delay_s`` (default: the pool's) from now, a standby for every slot
        (``envs[i]``: slot i's worker environment of this attempt) that has none."""
        with self._lock:
            if self._closed:
                return
            self._generation += 1
            generation = self._generation
        wait = self.delay_s if delay_s is None else delay_s
        self._requests.put((time.monotonic() + wait, generation, [dict(e) for e in envs]))

    def wait_ready(self, slots: int, timeout: float, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Waits until slots 0..``slots``-1 have a standby that finished its imports (or died:
        its worker then starts afresh), at most ``timeout`` seconds or until ``cancelled()``;
        whether they all did."""
        deadline = time.monotonic() + timeout
        while not cancelled():
            with self._lock:
                standbys = [self._ready.get(i) for i in range(slots)]
            if all(s is not None and s.ready() for s in standbys):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            waiting = next((s for s in standbys if s is not None and not s.ready()), None)
            if waiting is not None:
                waiting.ready(min(0.2, left))
            else:
                time.sleep(min(0.05, left))
        return False

    def close(self) -> None:
        """Kills every standby; nothing starts any more."""
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, {}
        self._requests.put(None)
        for standby in ready.values():
            standby.kill()

    def _run(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            at, generation, envs = request
            while time.monotonic() < at:
                with self._lock:
                    if self._closed or generation != self._generation:
                        break
                time.sleep(min(0.1, max(0.0, at - time.monotonic())))
            for index, env in enumerate(envs):
                with self._lock:
                    if self._closed or generation != self._generation or index in self._ready:
                        continue
                standby = self._start(env)
                if standby is None:
                    return  # the workers start afresh, as without standbys
                with self._lock:
                    keep = not self._closed and generation == self._generation and index not in self._ready
                    if keep:
                        self._ready[index] = standby
                if not keep:
                    standby.kill()

    def _start(self, env: dict) -> Optional[_Standby]:
        start_env = {k: v for k, v in env.items() if k not in _UNDECIDED_ENV}
        ready_fd, write_fd = os.pipe()
        argv = self._wrap([sys.executable, "-u", "-m", "prophet_tf._standby", ",".join(self.modules),
                           str(write_fd)])
        try:
            proc = subprocess.Popen(argv, env=start_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, pass_fds=(write_fd,))
        except OSError:
            os.close(ready_fd)
            return None
        finally:
            os.close(write_fd)
        return _Standby(proc, env, ready_fd)
