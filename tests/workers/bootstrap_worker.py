"""A long-lived worker for the start-up tests: starts the runtime as told, as often as told.

TensorFlow is imported once; then one JSON command per stdin line, each answered by one line
``RESULT {json}`` on stdout:

* ``{"op": "init", "rank": r, "world_size": n, "addresses": [...], "token": t, "kwargs": {...},
  "sum": true}``: ``runtime.init``; with ``sum``, one push_pull of ones (the job works end to end);
  then ``runtime.shutdown``. Answers ``{"ok": bool, "error": "Type: message", "seconds": s,
  "sum": [...]}`` where ``seconds`` is the time spent in ``runtime.init``.
* ``{"op": "exit"}``.
"""

import json
import sys
import time

import tensorflow as tf

from prophet_tf import ops, runtime
from prophet_tf._library import c_api


def run_init(cmd: dict) -> dict:
    result: dict = {"ok": False}
    start = time.monotonic()
    try:
        runtime.init(cmd["rank"], cmd["world_size"], cmd["addresses"], cmd["token"], **cmd.get("kwargs", {}))
        result["seconds"] = time.monotonic() - start
        if cmd.get("sum"):
            result["sum"] = ops.push_pull(tf.ones([4]), name="bootstrap/check").numpy().tolist()
        result["ok"] = True
    except Exception as e:  # reported to the test, which asserts on it
        result.setdefault("seconds", time.monotonic() - start)
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        runtime.shutdown()
    return result


def main() -> None:
    c_api()  # load the op library now, not inside the first timed start-up
    print("WORKER READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        print("RESULT " + json.dumps(run_init(cmd)), flush=True)


if __name__ == "__main__":
    main()
