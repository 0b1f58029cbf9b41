"""Tests of prophet_tf.cluster.resolve_cluster (TF_CONFIG parsing and validation)."""

from __future__ import annotations

import json
import warnings

import pytest

from prophet_tf.cluster import ClusterInfo, resolve_cluster
from prophet_tf.errors import ClusterConfigError, ProphetError

W3 = ["10.0.0.1:2222", "10.0.0.2:2222", "10.0.0.3:2222"]


def _set(monkeypatch: pytest.MonkeyPatch, cfg, token: str = "tok") -> None:
    monkeypatch.setenv("TF_CONFIG", cfg if isinstance(cfg, str) else json.dumps(cfg))
    monkeypatch.setenv("PROPHET_JOB_TOKEN", token)


def test_no_tf_config_is_single_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("PROPHET_JOB_TOKEN", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        info = resolve_cluster()
    assert info == ClusterInfo(rank=0, world_size=1, addresses=[], token="")
    assert info.is_chief
    monkeypatch.setenv("TF_CONFIG", "  ")
    assert resolve_cluster().world_size == 1


def test_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {"cluster": {"worker": W3}, "task": {"type": "worker", "index": 2}})
    info = resolve_cluster()
    assert (info.rank, info.world_size, info.addresses, info.token) == (2, 3, W3, "tok")
    assert not info.is_chief


def test_chief_is_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}
    _set(monkeypatch, {"cluster": cluster, "task": {"type": "chief", "index": 0}})
    info = resolve_cluster()
    assert (info.rank, info.world_size, info.addresses) == (0, 3, ["c:1", "w0:1", "w1:1"])
    _set(monkeypatch, {"cluster": cluster, "task": {"type": "worker", "index": 1}})
    assert resolve_cluster().rank == 2


def test_ipv6_and_string_index(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {"cluster": {"worker": ["[::1]:5000", "[::1]:5001"]},
                       "task": {"type": "worker", "index": "1"}})
    assert resolve_cluster().rank == 1


def test_empty_token_is_passed_on_without_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # The runtime refuses to start a multi-worker job without a token (tests/test_bootstrap.py).
    _set(monkeypatch, {"cluster": {"worker": W3[:2]}, "task": {"type": "worker", "index": 0}},
         token="")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_cluster().token == ""


@pytest.mark.parametrize("workers", [
    ["localhost:{p}", "127.0.0.1:{p}"],
    ["127.0.0.1:{p}", "LOCALHOST:{p}", "10.0.0.9:{p}"],
    ["[::1]:{p}", "[0:0:0:0:0:0:0:1]:{p}"],
])
def test_addresses_are_compared_after_resolution(monkeypatch: pytest.MonkeyPatch, workers) -> None:
    workers = [w.format(p=2222) for w in workers]
    _set(monkeypatch, {"cluster": {"worker": workers}, "task": GOOD_TASK})
    with pytest.raises(ClusterConfigError, match=r"same endpoint .*port 2222.*\(ranks 0 and 1\)"):
        resolve_cluster()


def test_same_host_different_ports_and_unresolvable_names_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    workers = ["localhost:2222", "127.0.0.1:2223", "no-such-host.invalid:2222", "other.invalid:2222"]
    _set(monkeypatch, {"cluster": {"worker": workers}, "task": GOOD_TASK})
    assert resolve_cluster().addresses == workers


def test_explicit_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorflow as tf
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("PROPHET_JOB_TOKEN", "t")
    spec = tf.train.ClusterSpec({"worker": ["a:1", "b:1"]})
    r = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=1)
    assert resolve_cluster(r) == ClusterInfo(1, 2, ["a:1", "b:1"], "t")

    bad = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["a:1", "a:1"]}), task_type="worker", task_id=0)
    with pytest.raises(ClusterConfigError, match="SimpleClusterResolver.*appears twice"):
        resolve_cluster(bad)
    sparse = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": {0: "a:1", 2: "b:1"}}), task_type="worker", task_id=0)
    with pytest.raises(ClusterConfigError, match="every task"):
        resolve_cluster(sparse)


GOOD_TASK = {"type": "worker", "index": 0}


@pytest.mark.parametrize("cfg, pattern", [
    ("{'cluster': {}}", r"not valid JSON.*double quotes"),
    ("[1, 2]", r"must be a JSON object"),
    ({"task": GOOD_TASK}, r"no 'cluster' key"),
    ({"cluster": {"worker": W3}}, r"no 'task' key.*\"task\""),
    ({}, r"no 'cluster' and no 'task'.*unset TF_CONFIG"),
    ({"cluster": {}, "task": GOOD_TASK}, r"non-empty object"),
    ({"cluster": {"worker": "a:1"}, "task": GOOD_TASK}, r"must be a list"),
    ({"cluster": {"worker": ["a:1", 5]}, "task": GOOD_TASK}, r"not a \"host:port\" string"),
    ({"cluster": {"worker": W3}, "task": {"index": 0}}, r"no \"type\""),
    ({"cluster": {"worker": W3}, "task": {"type": "worker"}}, r"no \"index\""),
    ({"cluster": {"worker": W3}, "task": {"type": "worker", "index": -1}}, r"non-negative integer"),
    ({"cluster": {"worker": W3}, "task": {"type": "worker", "index": 3}},
     r"index 3 .*out of range.*0\.\.2"),
    ({"cluster": {"worker": W3}, "task": {"type": "ps", "index": 0}},
     r"task type 'ps' is not supported.*'worker'"),
    ({"cluster": {"worker": W3}, "task": {"type": "evaluator", "index": 0}},
     r"'evaluator' is not supported"),
    ({"cluster": {"worker": W3, "ps": ["p:1"]}, "task": GOOD_TASK},
     r"job\(s\) \['ps'\].*no parameter servers"),
    ({"cluster": {"worker": ["a:1", "b:2", "a:1"]}, "task": GOOD_TASK},
     r"'a:1' appears twice \(ranks 0 and 2\).*own port"),
    ({"cluster": {"worker": ["a:1", "hostb"]}, "task": GOOD_TASK},
     r"'hostb' has no port.*\"hostb:2222\""),
    ({"cluster": {"worker": ["a:1", "b:70000"]}, "task": GOOD_TASK}, r"outside 1\.\.65535"),
    ({"cluster": {"worker": ["a:1", "b:0"]}, "task": GOOD_TASK}, r"port 0"),
    ({"cluster": {"worker": ["a:1", "b c:1"]}, "task": GOOD_TASK}, r"is not \"host:port\""),
    ({"cluster": {"chief": ["c:1", "d:1"], "worker": W3}, "task": GOOD_TASK},
     r"'chief' has 2 tasks"),
    ({"cluster": {"worker": W3}, "task": {"type": "chief", "index": 0}},
     r"no 'chief' job"),
])
def test_bad_configs(monkeypatch: pytest.MonkeyPatch, cfg, pattern: str) -> None:
    _set(monkeypatch, cfg)
    with pytest.raises(ClusterConfigError, match=pattern) as exc:
        resolve_cluster()
    assert isinstance(exc.value, ProphetError) and isinstance(exc.value, ValueError)
    assert isinstance(exc.value, RuntimeError)
