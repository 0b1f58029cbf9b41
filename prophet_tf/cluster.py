"""Discover this process's place in the job: rank, world size, peer addresses and job token.

The cluster comes from a ``tf.distribute.cluster_resolver.ClusterResolver``. By default that is
``TFConfigClusterResolver`` reading the ``TF_CONFIG`` environment variable, which is what
``python -m prophet_tf.launch``, a Kubeflow ``TFJob`` and a hand-written multi-machine set-up
provide. Any other resolver (e.g. ``SlurmClusterResolver``) can be passed instead.

Rank order: the ``chief`` task (if the cluster has one) is rank 0, followed by the ``worker`` tasks
in index order. prophet_tf has no parameter servers or evaluators; any other job is rejected.

Without ``TF_CONFIG`` (and without a resolver) the process is a single worker: rank 0 of 1.

The job token comes from ``PROPHET_JOB_TOKEN``; every worker of one job must use the same value.
A job of several workers refuses to start without one unless the user opts out explicitly
(``PROPHET_ALLOW_NO_TOKEN=1`` or ``runtime.init(..., allow_no_token=True)``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import socket
from typing import Any, Mapping, Optional, Sequence

from prophet_tf.errors import ClusterConfigError

__all__ = ["ClusterInfo", "resolve_cluster", "check_distinct_addresses", "TOKEN_ENV", "TF_CONFIG_ENV",
           "JOB_SEED_ENV", "ELASTIC_ENV", "SUPPORTED_JOBS"]

TF_CONFIG_ENV = "TF_CONFIG"
TOKEN_ENV = "PROPHET_JOB_TOKEN"
#: A job's seed (an integer), the same for every attempt of the job (the launcher draws one per
#: job unless it is set): without a seed of the program's own, every worker uses it as
#: TensorFlow's global seed, so that a resumed run's input has the interrupted run's order.
JOB_SEED_ENV = "PROPHET_JOB_SEED"
#: "1" in the workers of an elastic job (``prophetrun --nnodes MIN:MAX``): an attempt of one worker
#: coordinates as one of several does (the job's seed, the coordinated preemption checkpoint,
#: step-exact resume), so that the job may shrink to one worker and grow again.
ELASTIC_ENV = "PROPHET_ELASTIC"
#: Job names prophet_tf understands, in rank order.
SUPPORTED_JOBS = ("chief", "worker")

_EXAMPLE = ('{"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
            '"task": {"type": "worker", "index": 0}}')
_FIX_UNSET = "or unset TF_CONFIG to run a single worker"


@dataclasses.dataclass
class ClusterInfo:
    """Where this process sits in the job.

    Attributes:
      rank: this worker's rank, ``0 <= rank < world_size`` (the chief, if any, is rank 0).
      world_size: number of workers in the job.
      addresses: ``"host:port"`` of every worker in rank order (``addresses[rank]`` is where this
        worker listens). Empty for a single worker without a cluster description.
      token: the job token shared by all workers (``PROPHET_JOB_TOKEN``); empty when unset (the
        runtime then refuses to start a multi-worker job unless told to allow it).
    """

    rank: int
    world_size: int
    addresses: list[str]
    token: str = ""

    @property
    def is_chief(self) -> bool:
        """True on rank 0, the worker that writes checkpoints and summaries."""
        return self.rank == 0


def resolve_cluster(cluster_resolver: Optional[Any] = None) -> ClusterInfo:
    """Returns this process's :class:`ClusterInfo`.

    Args:
      cluster_resolver: a ``tf.distribute.cluster_resolver.ClusterResolver``. ``None`` reads
        ``TF_CONFIG`` through ``TFConfigClusterResolver``; when ``TF_CONFIG`` is unset or empty
        the result is a single worker (rank 0, world size 1, no addresses).

    Raises:
      ClusterConfigError: the description is malformed (not JSON, missing ``cluster``/``task``,
        unsupported task type, index out of range, duplicated address, address without port...).
        The message names the problem and the fix.
    """
    token = os.environ.get(TOKEN_ENV, "")
    if cluster_resolver is None:
        raw = os.environ.get(TF_CONFIG_ENV, "")
        if not raw.strip():
            return ClusterInfo(rank=0, world_size=1, addresses=[], token=token)
        _validate_tf_config_text(raw)
        import tensorflow as tf  # lazy: heavy, and not needed for a single worker
        cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        source = "TF_CONFIG"
    else:
        source = f"cluster resolver {type(cluster_resolver).__name__}"

    try:
        # cluster_spec() first: SlurmClusterResolver only sets task_type/task_id in it.
        spec = cluster_resolver.cluster_spec().as_dict()
        task_type = cluster_resolver.task_type
        task_id = cluster_resolver.task_id
    except ClusterConfigError:
        raise
    except Exception as e:  # resolvers raise all sorts of things (KeyError, RuntimeError, ...)
        raise ClusterConfigError(
            f"{source}: could not read the cluster description: {type(e).__name__}: {e}. "
            f"Fix the resolver's configuration (for TF_CONFIG, e.g. {_EXAMPLE}).") from e

    return _info_from_spec(spec, task_type, task_id, token, source)


def _validate_tf_config_text(raw: str) -> None:
    """Checks the structure of the raw TF_CONFIG JSON, with messages that say what to change."""
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        snippet = raw if len(raw) <= 80 else raw[:77] + "..."
        raise ClusterConfigError(
            f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
            f"{snippet!r}. Set it to a JSON object such as {_EXAMPLE} (mind the shell quoting: "
            f"JSON needs double quotes), {_FIX_UNSET}.") from None
    if not isinstance(cfg, dict):
        raise ClusterConfigError(
            f"TF_CONFIG must be a JSON object, got {type(cfg).__name__}. Use e.g. {_EXAMPLE}, "
            f"{_FIX_UNSET}.")
    missing = [k for k in ("cluster", "task") if k not in cfg]
    if missing:
        raise ClusterConfigError(
            f"TF_CONFIG has no {' and no '.join(repr(k) for k in missing)} key. Multi-worker jobs "
            f"need both, e.g. {_EXAMPLE}; {_FIX_UNSET}.")
    cluster, task = cfg["cluster"], cfg["task"]
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterConfigError(
            'TF_CONFIG["cluster"] must be a non-empty object mapping job names to address lists, '
            f'e.g. {{"worker": ["host0:2222", "host1:2222"]}}; got {cluster!r}.')
    for job, tasks in cluster.items():
        if isinstance(tasks, str) or not isinstance(tasks, (list, dict)):
            raise ClusterConfigError(
                f'TF_CONFIG["cluster"]["{job}"] must be a list of "host:port" strings, got '
                f'{tasks!r}. Write e.g. "{job}": ["host0:2222", "host1:2222"].')
        values = tasks.values() if isinstance(tasks, dict) else tasks
        for a in values:
            if not isinstance(a, str):
                raise ClusterConfigError(
                    f'TF_CONFIG["cluster"]["{job}"] contains {a!r}, which is not a "host:port" '
                    "string. Quote every address.")
    if not isinstance(task, dict):
        raise ClusterConfigError(
            f'TF_CONFIG["task"] must be an object like {{"type": "worker", "index": 0}}, '
            f"got {task!r}.")
    for key in ("type", "index"):
        if key not in task:
            raise ClusterConfigError(
                f'TF_CONFIG["task"] has no "{key}". Give every process its own task, e.g. '
                '"task": {"type": "worker", "index": 0} on the first host, index 1 on the next.')
    index = task["index"]
    if isinstance(index, bool) or not ((isinstance(index, int) and index >= 0) or
                                       (isinstance(index, str) and index.strip().isdigit())):
        raise ClusterConfigError(
            f'TF_CONFIG["task"]["index"] must be a non-negative integer, got {index!r}.')


# host:port with host a name, an IPv4 address or a bracketed IPv6 address.
_ADDR_RE = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>[0-9]+)$")


def _check_address(addr: str, where: str) -> str:
    a = addr.strip()
    m = _ADDR_RE.match(a)
    if m is None:
        if a and ":" not in a:
            raise ClusterConfigError(
                f'{where}: address {addr!r} has no port. Write "host:port", e.g. "{a}:2222" '
                "(the port every worker's engine listens on; pick one that is free on that host).")
        raise ClusterConfigError(
            f'{where}: address {addr!r} is not "host:port" (IPv6 hosts need brackets: '
            '"[::1]:2222").')
    port = int(m.group("port"))
    if not 0 < port < 65536:
        raise ClusterConfigError(
            f"{where}: address {addr!r} has port {port}, outside 1..65535. Use a fixed, free "
            "port (port 0 cannot be used: peers must know the port in advance).")
    return a


def check_distinct_addresses(addresses: Sequence[str], source: str) -> None:
    """Raises ClusterConfigError if two ranks name the same endpoint.

    Addresses are compared as written and, where two share a port, after name resolution:
    ``localhost:2222`` and ``127.0.0.1:2222`` are one endpoint. A name that does not resolve here
    (yet: in Kubernetes a pod's name appears when the pod starts) is compared as written.
    """
    def duplicate(first: int, second: int, what: str) -> ClusterConfigError:
        return ClusterConfigError(
            f"{source}: {what} (ranks {first} and {second}); two workers cannot listen on the same "
            "host:port. Give each task its own port (or host).")

    seen: dict[str, int] = {}
    by_port: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)
    for rank, a in enumerate(addresses):
        key = a.strip().lower()
        if key in seen:
            raise duplicate(seen[key], rank, f"address {a!r} appears twice")
        seen[key] = rank
        m = _ADDR_RE.match(a.strip())
        if m is not None:
            by_port[int(m.group("port"))].append((rank, m.group("host").strip("[]")))
    for port, entries in by_port.items():
        if len(entries) < 2:
            continue
        owner: dict[str, int] = {}
        for rank, host in entries:
            for ip in _resolve(host, port):
                if ip in owner and owner[ip] != rank:
                    raise duplicate(owner[ip], rank,
                                    f"addresses {addresses[owner[ip]]!r} and {addresses[rank]!r} are the "
                                    f"same endpoint ({ip} port {port})")
                owner[ip] = rank


def _resolve(host: str, port: int) -> set[str]:
    """The IP addresses ``host`` resolves to; empty if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return set()
    return {info[4][0] for info in infos}


def _job_list(spec: Mapping[str, Any], job: str, source: str) -> list[str]:
    tasks = spec.get(job)
    if tasks is None:
        return []
    if isinstance(tasks, Mapping):  # sparse ClusterSpec: {index: address}
        try:
            idx = sorted(int(k) for k in tasks)
        except (TypeError, ValueError):
            raise ClusterConfigError(
                f"{source}: job {job!r} has non-integer task indices {list(tasks)!r}.") from None
        if idx != list(range(len(idx))):
            raise ClusterConfigError(
                f"{source}: job {job!r} has task indices {idx}, but prophet_tf needs every task "
                f"0..{len(idx) - 1} listed (all workers take part in every all-reduce).")
        by_int = {int(k): v for k, v in tasks.items()}
        tasks = [by_int[i] for i in idx]
    return [_check_address(a, f"{source}: job {job!r} task {i}") if isinstance(a, str) else
            _raise_not_str(a, job, i, source) for i, a in enumerate(tasks)]


def _raise_not_str(a: Any, job: str, i: int, source: str) -> str:
    raise ClusterConfigError(
        f'{source}: job {job!r} task {i} has address {a!r}, which is not a "host:port" string.')


def _info_from_spec(spec: Mapping[str, Any], task_type: Optional[str], task_id: Optional[int],
                    token: str, source: str) -> ClusterInfo:
    """Validates a cluster spec dict plus task and turns it into a ClusterInfo."""
    if not spec:
        raise ClusterConfigError(
            f"{source}: the cluster is empty. Describe every worker, e.g. {_EXAMPLE}, "
            f"{_FIX_UNSET}.")
    other = sorted(j for j in spec if j not in SUPPORTED_JOBS)
    if other:
        raise ClusterConfigError(
            f"{source}: the cluster has job(s) {other} that prophet_tf does not use: it is "
            "data-parallel only, every process is a 'worker' (optionally one 'chief', which becomes "
            "rank 0); there are no parameter servers or evaluators. Remove those jobs or turn "
            "them into workers.")
    chief = _job_list(spec, "chief", source)
    workers = _job_list(spec, "worker", source)
    if len(chief) > 1:
        raise ClusterConfigError(
            f"{source}: job 'chief' has {len(chief)} tasks; there can be at most one. Make the "
            "others 'worker' tasks.")
    addresses = chief + workers
    if not addresses:
        raise ClusterConfigError(
            f"{source}: the cluster has no 'worker' (or 'chief') tasks. Add them, e.g. {_EXAMPLE}.")
    check_distinct_addresses(addresses, source)

    if task_type is None or task_type == "":
        raise ClusterConfigError(
            f"{source}: no task type for this process. Set e.g. "
            '"task": {"type": "worker", "index": 0}.')
    task_type = str(task_type)
    if task_type not in SUPPORTED_JOBS:
        raise ClusterConfigError(
            f"{source}: task type {task_type!r} is not supported; prophet_tf runs only 'worker' "
            "tasks (plus at most one 'chief', rank 0). Start this process as a worker, or do not "
            "start it at all (parameter servers and evaluators are not used).")
    if task_id is None:
        raise ClusterConfigError(
            f'{source}: no task index for this process. Set "task": {{"type": "{task_type}", '
            '"index": N}.')
    try:
        task_id = int(task_id)
    except (TypeError, ValueError):
        raise ClusterConfigError(
            f"{source}: task index {task_id!r} is not an integer.") from None
    job_tasks = chief if task_type == "chief" else workers
    if not 0 <= task_id < len(job_tasks):
        if not job_tasks:
            detail = f"the cluster has no {task_type!r} job"
        else:
            detail = f"job {task_type!r} has {len(job_tasks)} task(s): valid indices are " \
                     f"0..{len(job_tasks) - 1}"
        raise ClusterConfigError(
            f"{source}: task index {task_id} of type {task_type!r} is out of range: {detail}. "
            "Give each host its own index and list every host in the cluster.")
    rank = task_id if task_type == "chief" else len(chief) + task_id
    return ClusterInfo(rank=rank, world_size=len(addresses), addresses=addresses, token=token)
