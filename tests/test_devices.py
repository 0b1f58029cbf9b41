"""Where replicas and ops are placed: what a machine without GPUs can check (the replica's device
from the visible devices, the ops' placement in graphs built with GPU device names, a deferred
update of a variable on another device)."""

from __future__ import annotations

import json
import subprocess

import pytest
import tensorflow as tf

from conftest import ROOT, WORKERS, _worker_env, worker_python
from prophet_tf import _devices, ops

GPU = "/job:localhost/replica:0/task:0/device:GPU:0"


def test_the_replica_goes_on_the_workers_gpu_when_it_sees_one(monkeypatch) -> None:
    assert _devices.replica_device([]) == "/cpu:0"
    assert _devices.replica_device(["/device:GPU:0"]) == "/gpu:0"  # the launcher's one GPU
    gpus = ["/device:GPU:0", "/device:GPU:1"]
    assert [_devices.replica_device(gpus, r) for r in range(3)] == ["/gpu:0", "/gpu:1", "/gpu:0"]
    monkeypatch.setenv("PROPHET_LOCAL_RANK", "1")
    assert _devices.replica_device(gpus) == "/gpu:1"
    monkeypatch.delenv("PROPHET_LOCAL_RANK")
    assert _devices.replica_device(gpus) == "/gpu:0"
    if not tf.config.list_logical_devices("GPU"):
        assert _devices.default_device() == "/cpu:0"


@pytest.mark.parametrize("op", ["push_pull", "broadcast", "allgather"])
def test_ops_run_on_the_host_between_gpu_computations(op: str) -> None:
    # Traced, not run: TensorFlow records the requested devices without a GPU.
    def body(x):
        with tf.device(GPU):
            gradient = x * 2.0
            if op == "push_pull":
                out = ops.push_pull(gradient, name="g", priority=1)
            elif op == "broadcast":
                out = ops.broadcast(gradient, name="g")
            else:
                out = ops.allgather(gradient, name="g")
            return out * 3.0

    graph = tf.function(body).get_concrete_function(tf.TensorSpec([4], tf.float32)).graph
    by_type = {o.type: o for o in graph.get_operations()}
    comm = next(o for t, o in by_type.items() if t.startswith("Prophet"))
    assert comm.device.endswith("device:CPU:0"), comm.device
    producer = comm.inputs[0].op
    consumer = next(o for o in graph.get_operations() if o.type == "Mul" and o.inputs[0].op is comm)
    assert producer.type == "Mul" and producer.device == GPU  # computed on the GPU, copied once
    assert consumer.device == GPU  # the result goes back once, where the model runs


@pytest.mark.parametrize("multi_device", ["0", "1"], ids=["as_placed", "multi_device_function"])
def test_a_deferred_update_is_applied_to_a_variable_on_another_device(multi_device: str) -> None:
    # multi_device_function: the update runs the way it does when its variables live on a GPU
    # (instantiated as a multi-device function), here with every device a CPU.
    env = _worker_env({"PROPHET_TEST_MULTI_DEVICE_UPDATE": multi_device})
    r = subprocess.run([worker_python(), str(WORKERS / "crossing_device.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    result = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert result["device"].endswith("device:CPU:1")
    assert result["value"] == [0.25] * 4  # 1 - 0.5 * 1.5 (one worker: the sum is the gradient)
