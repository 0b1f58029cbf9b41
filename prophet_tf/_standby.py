"""A standby worker of an elastic job (``prophet_tf.launch.standby``): ``python -m
prophet_tf._standby MODULES [FD]`` imports ``MODULES`` (comma-separated; one that fails to import
is left to the program, which then fails on it with its own traceback), writes a byte to the
file descriptor FD and closes it (the launcher waits for that), reads one JSON line from
standard input (``{"env": {...}, "argv": ["script.py", ...] or ["-m", "module", ...]}``; at the
end of its input it exits 0, unused), and runs that program in this process as ``python -u``
would have run it, with exactly that environment."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from typing import Sequence


def _run_program(argv: Sequence[str]) -> None:
    """Runs ``script.py args`` or ``-m module args`` as ``python -u`` would, in this process."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main(modules: str, ready_fd: int = -1) -> None:
    """Imports ``modules``, says so on ``ready_fd``, waits for the program, runs it."""
    for name in filter(None, modules.split(",")):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the program imports it again and fails with the reason
            pass
    if ready_fd >= 0:
        try:
            os.write(ready_fd, b"1")
        except OSError:
            pass  # handed its program before it was ready: nobody waits for the byte
        finally:
            os.close(ready_fd)
    line = sys.stdin.buffer.readline()
    if not line:
        return  # the launcher no longer needs this standby
    order = json.loads(line)
    # The worker reads nothing from its standard input (a worker started afresh gets /dev/null).
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(order["env"])
    _run_program(order["argv"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "", int(sys.argv[2]) if len(sys.argv) > 2 else -1)
