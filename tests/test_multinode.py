"""Jobs of several nodes (prophetrun --nnodes/--node-rank/--master, -H): two "nodes" on this
machine (loopback) and one launcher per emulated host (network namespaces, root only). Worker
scripts are tiny Python programs (no TensorFlow) except in the one emulated training job."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional, Sequence, Union

import pytest

from conftest import alive
from prophet_tf.launch import free_ports, hosts as hosts_mod
from prophet_tf.launch.rendezvous import PROTOCOL, VERSION, _Inbox, _canonical, _mac, _send
from prophet_tf.launch.workers import visible_gpu, worker_envs

ROOT = Path(__file__).resolve().parents[1]
SECRET = "multinode-test-secret"
IS_ROOT = os.geteuid() == 0
HAVE_IP = shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(not (IS_ROOT and HAVE_IP),
                                reason="emulated hosts need root and iproute2 (ip, tc)")

# argv: OUT FAIL_RANK SLEEP_S. Records its environment in OUT/rank<r>.json; rank FAIL_RANK exits 3
# once every rank has recorded itself; the others sleep SLEEP_S (a SIGTERM is recorded).
PROBE = textwrap.dedent("""\
    import json, os, signal, sys, time
    cfg = json.loads(os.environ["TF_CONFIG"])
    rank, world = cfg["task"]["index"], len(cfg["cluster"]["worker"])
    out, fail_rank, sleep_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    def on_term(signum, frame):
        open(os.path.join(out, f"term{rank}"), "w").write(signal.Signals(signum).name)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    record = {"rank": rank, "pid": os.getpid(), "workers": cfg["cluster"]["worker"],
              "token": os.environ["PROPHET_JOB_TOKEN"], "local": os.environ["PROPHET_LOCAL_RANK"],
              "local_size": os.environ["PROPHET_LOCAL_SIZE"],
              "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}
    with open(os.path.join(out, f"rank{rank}.tmp"), "w") as f:
        json.dump(record, f)
    os.rename(os.path.join(out, f"rank{rank}.tmp"), os.path.join(out, f"rank{rank}.json"))
    print(f"hello from rank {rank}")
    if rank == fail_rank:
        while not all(os.path.exists(os.path.join(out, f"rank{r}.json")) for r in range(world)):
            time.sleep(0.01)
        print("failing on purpose", file=sys.stderr)
        sys.exit(3)
    time.sleep(sleep_s)
    """)


def _env(token: Optional[str] = SECRET) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PROPHET_JOB_TOKEN", None)
    if token is not None:
        env["PROPHET_JOB_TOKEN"] = token
    return env


class Node:
    """One node's launcher (a process), its output in files."""

    def __init__(self, tmp: Path, rank: Optional[int], nnodes: Union[int, str], master: str, n: int,
                 script: Sequence[str], extra: Sequence[str] = (), token: Optional[str] = SECRET,
                 wrap: Sequence[str] = ()) -> None:
        name = f"node{rank}" if rank is not None else f"node-{len(list(tmp.glob('node-*.out')))}"
        self.out_path, self.err_path = tmp / f"{name}.out", tmp / f"{name}.err"
        placed = ["--node-rank", str(rank)] if rank is not None else []  # elastic: the master assigns
        argv = [*wrap, sys.executable, "-m", "prophet_tf.launch", "--nnodes", str(nnodes),
                *placed, "--master", master, "-n", str(n), "--grace", "2",
                *extra, "--", *script]
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=_env(token), cwd=tmp,
                                         start_new_session=True)
        self.started = time.monotonic()
        self.seconds: Optional[float] = None

    def wait(self, timeout: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"node did not end within {timeout} s:\n{self.output}")
        self.seconds = time.monotonic() - self.started
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    @property
    def output(self) -> str:
        return self.out_path.read_text() + self.err_path.read_text()


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for node in started:
        node.kill()


def _probe(tmp: Path, fail_rank: int = -1, sleep_s: float = 0.0) -> list[str]:
    script = tmp / "probe.py"
    script.write_text(PROBE)
    (tmp / "out").mkdir(exist_ok=True)
    return [str(script), str(tmp / "out"), str(fail_rank), str(sleep_s)]


def _records(tmp: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (tmp / "out").glob("rank*.json")}


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _master() -> str:
    return f"127.0.0.1:{free_ports(1)[0]}"


# ------------------------------------------------------------------------------------------------
# Two nodes on this machine


def test_two_nodes_on_one_host_form_one_job(tmp_path: Path, nodes: list) -> None:
    master, script = _master(), _probe(tmp_path)
    logs = tmp_path / "logs"
    for rank in (1, 0):  # the order of start does not matter
        nodes.append(Node(tmp_path, rank, 2, master, 2, script, ["--log-dir", str(logs)]))
    codes = [n.wait() for n in nodes]
    assert codes == [0, 0], "\n".join(n.output for n in nodes)
    records = _records(tmp_path)
    assert sorted(records) == [0, 1, 2, 3]
    workers = records[0]["workers"]
    assert len(set(workers)) == 4 and all(r["workers"] == workers for r in records.values())
    tokens = {r["token"] for r in records.values()}
    assert len(tokens) == 1 and SECRET not in tokens  # a fresh token derived for the workers
    # Ranks node by node: node 0 has ranks 0 and 1, node 1 ranks 2 and 3; GPUs by local rank.
    assert [(records[r]["local"], records[r]["cuda"], records[r]["local_size"]) for r in range(4)] == \
        [("0", "0", "2"), ("1", "1", "2"), ("0", "0", "2"), ("1", "1", "2")]
    assert "ranks 0..1 of 4" in nodes[1].output and "ranks 2..3 of 4" in nodes[0].output
    for rank in range(4):
        assert (logs / f"rank.{rank}.log").read_text() == f"hello from rank {rank}\n"
        assert f"[rank {rank}] hello from rank {rank}" in nodes[0 if rank >= 2 else 1].output


def test_a_worker_failure_on_one_node_stops_every_node(tmp_path: Path, nodes: list) -> None:
    master, script = _master(), _probe(tmp_path, fail_rank=3, sleep_s=120)
    nodes += [Node(tmp_path, r, 2, master, 2, script) for r in (0, 1)]
    codes = [n.wait() for n in nodes]
    assert codes == [3, 3], "\n".join(n.output for n in nodes)  # the failing worker's status
    for n in nodes:  # the same first failure, named everywhere, with its stderr
        report = n.output.split("the job failed: ")[-1]
        assert report.startswith("worker rank 3 ") and "on node 1" in report, n.output
        assert "failing on purpose" in report
    # The others slept 120 s: they were stopped.
    assert not any(alive(r["pid"]) for r in _records(tmp_path).values())
    assert max(n.seconds for n in nodes) < 60


def test_a_node_with_another_token_is_told_and_named(tmp_path: Path, nodes: list) -> None:
    master, script = _master(), _probe(tmp_path)
    nodes.append(Node(tmp_path, 0, 2, master, 1, script, ["--rdzv-timeout", "6"]))
    nodes.append(Node(tmp_path, 1, 2, master, 1, script, ["--rdzv-timeout", "60"], token="another"))
    assert nodes[1].wait() == 1
    assert "job token mismatch" in nodes[1].output, nodes[1].output
    assert nodes[1].seconds < 30  # at once, not at its own 60 s rendezvous timeout
    assert nodes[0].wait() == 1
    text = nodes[0].output
    assert "node(s) 1 never joined" in text and "rejected meanwhile" in text, text
    assert "job token mismatch" in text.split("rejected meanwhile")[-1], text
    assert not _records(tmp_path)  # no worker started


def test_a_node_that_never_shows_up_bounds_the_wait(tmp_path: Path, nodes: list) -> None:
    master, script = _master(), _probe(tmp_path)
    nodes.append(Node(tmp_path, 0, 3, master, 1, script, ["--rdzv-timeout", "2"]))
    assert nodes[0].wait(60) == 1
    assert "node(s) 1, 2 never joined the rendezvous" in nodes[0].output, nodes[0].output
    # A node whose master never shows up: the same bound, and what it tried.
    nodes.append(Node(tmp_path, 1, 2, _master(), 1, script, ["--rdzv-timeout", "2"]))
    assert nodes[1].wait(60) == 1
    assert "could not reach the master" in nodes[1].output and "connection refused" in nodes[1].output


def test_strangers_cannot_stop_the_rendezvous(tmp_path: Path, nodes: list) -> None:
    master, script = _master(), _probe(tmp_path)
    host, port = master.rsplit(":", 1)
    nodes.append(Node(tmp_path, 0, 2, master, 1, script, ["--rdzv-timeout", "60"]))

    def converse(*messages: dict, join_fields: Optional[dict] = None, token: str = "") -> dict:
        deadline = time.monotonic() + 30
        while True:
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with s:
            inbox = _Inbox(1 << 20)
            answers: list[dict] = []
            for m in messages:
                _send(s, m)
                while not answers:
                    data = s.recv(65536)
                    if not data:
                        return {"t": "closed"}
                    answers = inbox.feed(data)
                if join_fields is not None and answers[0].get("t") == "challenge":
                    nonce_m = answers.pop(0)["nonce"]
                    _send(s, {"t": "join", "fields": join_fields,
                              "mac": _mac(token, "node", m["nonce"], nonce_m, _canonical(join_fields))})
                    while not answers:
                        answers = inbox.feed(s.recv(65536))
            return answers[0]

    nonce = secrets.token_hex(32)
    hello = {"t": "hello", "proto": PROTOCOL, "version": VERSION, "nonce": nonce}
    assert converse(dict(hello, version=VERSION + 1))["t"] == "reject"
    fields = {"node_rank": 1, "nnodes": 2, "round": 0, "host": "127.0.0.1", "ports": [1234]}
    forged = converse(hello, join_fields=fields, token="not-the-secret")
    assert forged["t"] == "reject" and "job token mismatch" in forged["reason"]
    wrong_size = converse(dict(hello, nonce=secrets.token_hex(32)), join_fields=dict(fields, nnodes=5),
                          token=SECRET)
    assert wrong_size["t"] == "reject" and "--nnodes 5" in wrong_size["reason"]
    with socket.create_connection((host, int(port))) as garbage:
        garbage.sendall(os.urandom(64))
    # Still waiting for the real node 1.
    nodes.append(Node(tmp_path, 1, 2, master, 1, script))
    assert [n.wait() for n in nodes] == [0, 0], "\n".join(n.output for n in nodes)
    assert "rejected a connection" in nodes[0].output


def test_a_dead_node_is_named_and_its_workers_die_with_it(tmp_path: Path, nodes: list) -> None:
    master, script = _master(), _probe(tmp_path, sleep_s=120)
    nodes += [Node(tmp_path, r, 2, master, 1, script, ["--node-timeout", "30"]) for r in (0, 1)]
    _wait_for(lambda: len(_records(tmp_path)) == 2)
    killed = time.monotonic()
    os.kill(nodes[1].proc.pid, signal.SIGKILL)  # the launcher only
    assert nodes[0].wait() == 1
    waited = time.monotonic() - killed
    assert "node 1" in nodes[0].output and "was lost" in nodes[0].output, nodes[0].output
    assert waited < 20, waited  # the closed connection, not the 30 s node timeout
    records = _records(tmp_path)
    _wait_for(lambda: not alive(records[1]["pid"]), 10)  # killed with its launcher
    assert not alive(records[0]["pid"])


def test_signals_are_forwarded_to_every_nodes_workers(tmp_path: Path, nodes: list) -> None:
    master, script = _master(), _probe(tmp_path, sleep_s=120)
    nodes += [Node(tmp_path, r, 2, master, 1, script) for r in (0, 1)]
    _wait_for(lambda: len(_records(tmp_path)) == 2)
    os.kill(nodes[0].proc.pid, signal.SIGTERM)
    assert [n.wait() for n in nodes] == [143, 143], "\n".join(n.output for n in nodes)
    assert (tmp_path / "out" / "term0").read_text() == "SIGTERM"  # forwarded, not SIGKILL
    assert "got SIGTERM" in nodes[1].output


def _attempts_script(tmp: Path, plan: dict) -> list[str]:
    from test_launch import ATTEMPTS

    script = tmp / "attempts.py"
    script.write_text(ATTEMPTS)
    (tmp / "out").mkdir()
    return [str(script), str(tmp / "out"), json.dumps(plan)]


def test_every_node_restarts_together_when_the_master_says_so(tmp_path: Path, nodes: list) -> None:
    from test_launch import _starts

    # Attempt 1: rank 1 (node 1) is preempted; attempt 2: rank 0 (node 0) is killed; then done.
    script = _attempts_script(tmp_path, {"0": {"1": "preempt"}, "1": {"0": "kill"}})
    master = _master()
    nodes += [Node(tmp_path, r, 2, master, 1, script, ["--max-restarts", "3"]) for r in (0, 1)]
    assert [n.wait() for n in nodes] == [0, 0], "\n".join(n.output for n in nodes)
    starts = _starts(tmp_path / "out")
    assert sorted(starts) == [(r, a) for r in (0, 1) for a in range(3)]
    for attempt in range(3):  # one job per attempt: the same addresses and token on both nodes
        assert starts[(0, attempt)]["workers"] == starts[(1, attempt)]["workers"]
        assert starts[(0, attempt)]["token"] == starts[(1, attempt)]["token"]
    assert len({starts[(0, a)]["token"] for a in range(3)}) == 3  # fresh per attempt
    assert len({s["seed"] for s in starts.values()}) == 1  # the master's job seed, kept
    for n in nodes:  # every node says what the master decided
        said = [line for line in n.output.splitlines() if "Restarting every worker" in line]
        assert len(said) == 2, n.output
        assert "the job was preempted" in said[0] and "(restart 1 of at most 3)" in said[0]
        assert "worker rank 0" in said[1] and "SIGKILL" in said[1] and "(restart 2 of" in said[1]


def test_a_sigterm_to_one_nodes_launcher_preempts_the_job_without_restart(
        tmp_path: Path, nodes: list) -> None:
    from test_launch import _starts

    script = _attempts_script(tmp_path, {"0": {"0": "wait", "1": "wait"}})
    master = _master()
    nodes += [Node(tmp_path, r, 2, master, 1, script, ["--max-restarts", "3"]) for r in (0, 1)]
    _wait_for(lambda: len(_starts(tmp_path / "out")) == 2)
    os.kill(nodes[1].proc.pid, signal.SIGTERM)
    assert [n.wait() for n in nodes] == [75, 75], "\n".join(n.output for n in nodes)
    assert sorted(_starts(tmp_path / "out")) == [(0, 0), (1, 0)]
    for n in nodes:
        assert "the launcher of node 1 got SIGTERM; every worker stopped at epoch 1 step 3" in n.output, n.output
        assert "not restarting" in n.output and "Restarting" not in n.output


def test_dash_H_with_local_hosts(tmp_path: Path) -> None:
    script = _probe(tmp_path)
    r = subprocess.run([sys.executable, "-m", "prophet_tf.launch", "-H", "localhost:2,127.0.0.1:1",
                        "--", *script], capture_output=True, text=True, env=_env(None), cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    records = _records(tmp_path)
    assert sorted(records) == [0, 1, 2] and len({x["token"] for x in records.values()}) == 1


def test_dash_H_restarts_every_node_together(tmp_path: Path) -> None:
    from test_launch import _starts

    # Rank 2 (node 1) is killed in attempt 1, then the same bug at the same place twice: the -H
    # launcher's master restarts both nodes once for the kill, once after the first bug, and
    # stops at the second, naming it.
    script = _attempts_script(tmp_path, {"0": {"2": "kill"}, "1": {"0": "bug"}, "2": {"2": "bug"}})
    r = subprocess.run([sys.executable, "-m", "prophet_tf.launch", "-H", "localhost:2,127.0.0.1:1",
                        "--max-restarts", "5", "--grace", "2", "--", *script], capture_output=True,
                       text=True, env=_env(None), cwd=tmp_path, timeout=120)
    said = r.stdout + r.stderr
    assert r.returncode == 1, said
    starts = _starts(tmp_path / "out")
    assert sorted(starts) == [(rank, a) for rank in range(3) for a in range(3)], said
    for attempt in range(3):  # one job per attempt: every node's workers saw the same cluster
        assert len({starts[(rank, attempt)]["token"] for rank in range(3)}) == 1
    assert said.count("Restarting every worker") == 2 * 2, said  # both nodes say it, twice
    assert "a bug, not a fault" in said and "epoch 1 step 4: ValueError: a bug" in said


# ------------------------------------------------------------------------------------------------
# Pieces


def test_hosts_slots_and_the_remote_command() -> None:
    assert hosts_mod.parse_hosts("a:4,b:4") == [("a", 4), ("b", 4)]
    assert hosts_mod.parse_hosts("a,[fe80::1]:2,10.0.0.3:1") == [("a", 1), ("fe80::1", 2), ("10.0.0.3", 1)]
    for bad in ("a:0", "a:x", ",", "a:b:c"):
        with pytest.raises(ValueError):
            hosts_mod.parse_hosts(bad)
    assert hosts_mod.assign_slots([("a", 4), ("b", 4)], 6) == [("a", 4), ("b", 2)]
    assert hosts_mod.assign_slots([("a", 4), ("b", 4)], None) == [("a", 4), ("b", 4)]
    with pytest.raises(ValueError):
        hosts_mod.assign_slots([("a", 1)], 2)
    argv = hosts_mod.node_argv(1, 2, 4, "10.0.0.1:29400", ["train.py", "--lr", "a b"], ["--threads", "2"])
    assert argv[1:] == ["-u", "-m", "prophet_tf.launch", "--nnodes", "2", "--node-rank", "1", "--master",
                        "10.0.0.1:29400", "-n", "4", "--token-stdin", "--join-only", "--threads", "2", "--",
                        "train.py", "--lr", "a b"]
    command = hosts_mod.remote_command(argv, "/work/my project")
    assert command.startswith("cd '/work/my project' && exec ")
    assert "'a b'" in command and "--token-stdin" in command and SECRET not in command
    # The shell runs it as written (quoting survives): print the argv instead of running it.
    shown = subprocess.run(["sh", "-c", command.replace("exec ", "exec printf '%s\\n' ", 1)
                            .replace("cd '/work/my project'", "cd /")],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert shown[-3:] == ["train.py", "--lr", "a b"]
    assert hosts_mod.is_local_host("localhost") and not hosts_mod.is_local_host("10.255.0.7")


def test_one_gpu_per_local_rank_unless_the_user_chose() -> None:
    envs = worker_envs(3, ["h:1", "h:2", "h:3"], "t", base_env={})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2"]
    assert [e["PROPHET_LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    chosen = worker_envs(2, ["h:1", "h:2"], "t", base_env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in chosen] == ["2,3", "2,3"]
    flag = worker_envs(2, ["h:1", "h:2"], "t", {"CUDA_VISIBLE_DEVICES": ""}, base_env={})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in flag] == ["", ""]
    assert [visible_gpu(r, 2) for r in range(4)] == ["0", "1", "0", "1"]  # 4 workers, 2 GPUs
    ranks = worker_envs(2, ["a:1", "a:2", "b:1", "b:2"], "t", base_env={}, ranks=[2, 3])
    assert [json.loads(e["TF_CONFIG"])["task"]["index"] for e in ranks] == [2, 3]
    assert [e["PROPHET_LOCAL_RANK"] for e in ranks] == ["0", "1"]


# ------------------------------------------------------------------------------------------------
# One launcher per emulated host


@pytest.fixture
def cluster():
    from prophet_tf.bench.netem import EmulatedCluster

    with EmulatedCluster(2, 0, prefix=f"lch{os.getpid() % 100000}") as cl:
        yield cl


def _node_in(cl, tmp: Path, rank: int, n: int, script: Sequence[str], port: int, extra: Sequence[str] = (),
             token: str = SECRET) -> Node:
    return Node(tmp, rank, 2, f"{cl.host_address(0)}:{port}", n, script, extra, token,
                wrap=cl.exec_argv(rank, []))


@needs_root
def test_two_nodes_of_two_workers_train_on_emulated_hosts(cluster, tmp_path: Path, nodes: list,
                                                           zygote_interpreter) -> None:
    # Each node's launcher, and so its workers, fork from a zygote inside the emulated host.
    script = [str(ROOT / "examples" / "keras_fit_demo.py"), "--epochs", "1", "--samples", "256"]
    port = free_ports(1)[0]
    logs = tmp_path / "logs"
    nodes += [_node_in(cluster, tmp_path, r, 2, script, port, ["--threads", "1", "--log-dir", str(logs)])
              for r in (0, 1)]
    codes = [n.wait(600) for n in nodes]
    assert codes == [0, 0], "\n".join(n.output[-3000:] for n in nodes)
    # What the job promises, not what a library happens to log: each launcher started its two
    # workers (a log file per rank) and saw every one exit 0; rank 0's strategy counted 4 workers,
    # so fit's collectives, which need every rank, completed with all four.
    assert sorted(p.name for p in logs.glob("rank.*.log")) == [f"rank.{r}.log" for r in range(4)]
    assert "[rank 0] 4 worker(s), schedule prophet" in nodes[0].output, nodes[0].output[-3000:]
    # Two hosts of two workers: under the runtime's default (hierarchical="auto") the start-up
    # probe timed both paths and every worker kept the faster.
    assert re.search(r"path: (two-level over 2 hosts|flat) \(chosen by the start-up probe: [0-9.]+ ms a "
                     r"round on the two-level path, [0-9.]+ ms on the flat one\)", nodes[0].output), \
        nodes[0].output[-3000:]
    assert "[rank 0] validation: loss" in nodes[0].output, nodes[0].output[-3000:]
    assert f"node 1 ({cluster.host_address(1)}" in nodes[0].output  # the rendezvous crossed hosts
    assert "ranks 2..3 of 4 on " + cluster.host_address(1) in nodes[1].output


@needs_root
def test_failures_on_emulated_hosts_are_named_within_bounds(cluster, tmp_path: Path, nodes: list) -> None:
    port = free_ports(1)[0]
    # A node with the wrong token: told at once; the master names it at its rendezvous timeout.
    case = tmp_path / "token"
    case.mkdir()
    bad = _node_in(cluster, case, 1, 1, _probe(case), port, ["--rdzv-timeout", "60"], token="other")
    good = _node_in(cluster, case, 0, 1, _probe(case), port, ["--rdzv-timeout", "5"])
    nodes += [bad, good]
    assert bad.wait() == 1 and "job token mismatch" in bad.output and bad.seconds < 30, bad.output
    assert good.wait() == 1 and "rejected meanwhile" in good.output, good.output
    assert f"{cluster.host_address(1)}:" in good.output.split("rejected meanwhile")[-1]

    # A node that never shows up: a bounded wait, and a message naming it.
    case = tmp_path / "missing"
    case.mkdir()
    alone = _node_in(cluster, case, 0, 1, _probe(case), port + 1 if port < 65000 else port - 1,
                     ["--rdzv-timeout", "3"])
    nodes.append(alone)
    assert alone.wait() == 1 and "node(s) 1 never joined" in alone.output, alone.output
    assert alone.seconds < 3 + 20

    # A dead node (its launcher killed) and a vanished host (its link down): named by the others.
    for kind in ("killed", "vanished"):
        case = tmp_path / kind
        case.mkdir()
        script = _probe(case, sleep_s=120)
        port = free_ports(1)[0]
        pair = [_node_in(cluster, case, r, 1, script, port, ["--node-timeout", "3"]) for r in (0, 1)]
        nodes += pair
        _wait_for(lambda: len(_records(case)) == 2, 120)
        gone = time.monotonic()
        if kind == "killed":
            os.kill(pair[1].proc.pid, signal.SIGKILL)
        else:
            cluster.run(1, ["ip", "link", "set", "eth0", "down"], check=True)
        assert pair[0].wait() == 1
        assert "node 1" in pair[0].output and "was lost" in pair[0].output, pair[0].output
        assert time.monotonic() - gone < 3 + 20
        if kind == "vanished":
            assert "nothing heard from its launcher for 3 s" in pair[0].output
            cluster.run(1, ["ip", "link", "set", "eth0", "up"], check=True)
            pair[1].wait(60)  # it lost the master the same way
            assert "lost the master" in pair[1].output, pair[1].output


@needs_root
def test_dash_H_starts_the_nodes_over_ssh_on_emulated_hosts(cluster, tmp_path: Path) -> None:
    # An ssh stand-in that runs the command on the emulated host the way sshd would (sh -c,
    # standard input passed on): the launcher's side of -H over ssh, without an ssh server.
    fake_ssh = tmp_path / "fake_ssh.py"
    fake_ssh.write_text(textwrap.dedent(f"""\
        import os, sys
        namespaces = {{{cluster.host_address(0)!r}: {cluster.namespace(0)!r},
                       {cluster.host_address(1)!r}: {cluster.namespace(1)!r}}}
        host, command = sys.argv[-2], sys.argv[-1]
        assert "-o" in sys.argv  # the options of --ssh-command come first
        os.execvp("ip", ["ip", "netns", "exec", namespaces[host], "sh", "-c", command])
        """))
    script = _probe(tmp_path)
    hosts = f"{cluster.host_address(0)}:2,{cluster.host_address(1)}:1"
    r = subprocess.run(cluster.exec_argv(0, [sys.executable, "-m", "prophet_tf.launch", "-H", hosts,
                                             "--ssh-command", f"{sys.executable} {fake_ssh} -o BatchMode=yes",
                                             "--", *script]),
                       capture_output=True, text=True, env=_env(None), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    records = _records(tmp_path)
    assert sorted(records) == [0, 1, 2]
    assert records[2]["workers"][2].startswith(cluster.host_address(1) + ":")
