"""Elastic jobs (prophetrun --nnodes MIN:MAX): the job forms again without a node that is lost or
leaves, and with one that arrives; below MIN it ends with a status that says so. Node launchers
on this machine (loopback) with a tiny worker program (no TensorFlow) that trains by counting
steps and keeps its position in a checkpoint file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prophet_tf.launch.cli import main as cli_main
from prophet_tf.launch.elastic import EXIT_TOO_FEW_NODES, NodeRange, parse_nnodes
from prophet_tf.launch.standby import DEFAULT_PRELOAD, DELAY_ENV, StandbyPool, parse_preload
from prophet_tf.launch.workers import with_death_stub
from conftest import alive
from test_multinode import Node, _env, _master, _wait_for, nodes  # noqa: F401 (nodes: a fixture)

# argv: OUT TOTAL_STEPS. Each start records (world size, rank, position it starts from, pids) in
# OUT/start.<attempt token>.<rank>. A "step" takes 10 ms (and waits while OUT/hold exists: the job
# trains on until a test lets it); rank 0 saves the position every 5 steps
# (the last BackupAndRestore save). SIGTERM: the coordinated stop (rank 0 saves the position
# where it is, every worker says where it stopped, exit 75). At the end rank 0 writes OUT/done.
TRAIN = textwrap.dedent("""\
    import json, os, signal, sys, time
    cfg = json.loads(os.environ["TF_CONFIG"])
    rank, world = cfg["task"]["index"], len(cfg["cluster"]["worker"])
    out, total = sys.argv[1], int(sys.argv[2])
    ckpt = os.path.join(out, "ckpt")
    def save(step):
        with open(ckpt + f".tmp{os.getpid()}", "w") as f:
            f.write(str(step))
        os.replace(ckpt + f".tmp{os.getpid()}", ckpt)
    step = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
    def stop(signum, frame):
        if rank == 0:
            save(step)
        print(f"prophet_tf: preempted: rank {rank}, 1 worker(s) asked to stop; stopped at epoch 0 "
              f"step {step}; checkpoint: {ckpt}", file=sys.stderr, flush=True)
        os._exit(75)
    signal.signal(signal.SIGTERM, stop)
    token = os.environ["PROPHET_JOB_TOKEN"][:12]
    record = {"world": world, "rank": rank, "from": step, "pid": os.getpid(),
              "launcher": os.getppid(), "t": time.time(), "seed": os.environ.get("PROPHET_JOB_SEED")}
    with open(os.path.join(out, f"tmp.{token}.{rank}"), "w") as f:
        json.dump(record, f)
    os.rename(os.path.join(out, f"tmp.{token}.{rank}"), os.path.join(out, f"start.{token}.{rank}"))
    while step < total:
        time.sleep(0.01)
        while os.path.exists(os.path.join(out, "hold")):
            time.sleep(0.01)
        step += 1
        if rank == 0 and step % 5 == 0:
            save(step)
    if rank == 0:
        open(os.path.join(out, "done"), "w").write(str(world))
    """)


def _train(tmp: Path, total: int = 800) -> list[str]:
    script = tmp / "train.py"
    script.write_text(TRAIN)
    (tmp / "out").mkdir(exist_ok=True)
    return [str(script), str(tmp / "out"), str(total)]


def _attempts(tmp: Path) -> list[dict[int, dict]]:
    """Every attempt's workers, in the order the attempts started: [{rank: record}]."""
    by_token: dict[str, dict[int, dict]] = {}
    for p in (tmp / "out").glob("start.*.*"):
        _, token, rank = p.name.split(".")
        by_token.setdefault(token, {})[int(rank)] = json.loads(p.read_text())
    return sorted(by_token.values(), key=lambda a: min(r["t"] for r in a.values()))


def _complete(tmp: Path, world: int):
    """The condition: an attempt of ``world`` workers has every worker started."""
    def check() -> bool:
        return any(len(a) == world and all(r["world"] == world for r in a.values())
                   for a in _attempts(tmp))
    return check


# These workers do not use TensorFlow: no standbys importing it.
NO_STANDBY = ["--preload", "none"]
# MAX nodes start the job at once; fewer would wait 60 s for more.
ELASTIC = ["--join-wait", "60", "--node-timeout", "5", *NO_STANDBY]


def _standbys(launcher: int) -> list[int]:
    """The pids of the standby workers a node's launcher started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and b"prophet_tf._standby" in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_a_killed_node_shrinks_the_job_and_an_arriving_one_grows_it(
        tmp_path: Path, nodes: list, monkeypatch) -> None:
    # Standbys importing a light module, soon after each attempt starts.
    monkeypatch.setenv(DELAY_ENV, "0.2")
    extra = ["--join-wait", "60", "--node-timeout", "5", "--preload", "json"]
    master, script = _master(), _train(tmp_path)
    nodes += [Node(tmp_path, r, "2:3", master, 1, script, extra) for r in (0, 1, 2)]
    _wait_for(_complete(tmp_path, 3))
    # The workers run in standbys too (started with their nodes): the next ones are the others.
    working = {r["pid"] for r in _attempts(tmp_path)[0].values()}

    def ahead_of(node: Node) -> list[int]:
        return [pid for pid in _standbys(node.proc.pid) if pid not in working]

    _wait_for(lambda: all(ahead_of(n) for n in nodes[:2]))
    ahead = {r: ahead_of(nodes[r]) for r in (0, 1)}
    os.killpg(nodes[2].proc.pid, signal.SIGKILL)  # the node dies: its launcher, its worker
    nodes[2].proc.wait()
    _wait_for(_complete(tmp_path, 2))
    # A node arrives without a rank (the master assigns one); the job takes it in (it is still
    # training when the node, which joins once its standby is ready, comes).
    hold = tmp_path / "out" / "hold"
    hold.write_text("")
    nodes.append(Node(tmp_path, None, "2:3", master, 1, script, extra))
    _wait_for(lambda: "arrived: every worker stops" in nodes[0].output, 120)
    hold.unlink()
    codes = [n.wait(120) for n in (nodes[0], nodes[1], nodes[3])]
    said = "\n".join(n.output for n in nodes)
    assert codes == [0, 0, 0], said
    attempts = _attempts(tmp_path)
    assert [len(a) for a in attempts] == [3, 2, 3], said
    assert [sorted(a) for a in attempts] == [[0, 1, 2], [0, 1], [0, 1, 2]]
    for a in attempts:  # one job per attempt: its world size on every worker
        assert {r["world"] for r in a.values()} == {len(a)}
    # Every attempt continued from the checkpoint the last one left (never from the start).
    assert attempts[1][0]["from"] > 0 and attempts[2][0]["from"] >= attempts[1][0]["from"]
    assert len({r["seed"] for a in attempts for r in a.values()}) == 1  # one job seed
    master_said = nodes[0].output
    assert "node 2 (" in master_said and "was lost" in master_said, master_said
    assert "arrived: every worker stops at one step and checkpoints" in master_said
    assert "the job forms with 2 node(s), 2 worker(s)" in master_said
    assert "the job forms with 3 node(s), 3 worker(s)" in master_said
    assert (tmp_path / "out" / "done").read_text() == "3"
    # The job without node 2 ran in the standbys its nodes had started before the loss (with the
    # new TF_CONFIG: the world sizes above).
    assert {r: [attempts[1][r]["pid"]] for r in (0, 1)} == ahead
    # It got the lowest node rank free (node 2's, lost).
    assert "as node 2;" in nodes[3].output and "enters it at its next checkpoint" in nodes[3].output


def test_a_node_preempted_with_sigterm_leaves_and_the_others_go_on_from_its_step(
        tmp_path: Path, nodes: list) -> None:
    master, script = _master(), _train(tmp_path)
    nodes += [Node(tmp_path, r, "1:2", master, 1, script, ["--join-wait", "60", *NO_STANDBY])
              for r in (0, 1)]
    _wait_for(_complete(tmp_path, 2))
    time.sleep(0.3)
    os.kill(nodes[1].proc.pid, signal.SIGTERM)  # the launcher of node 1: its machine goes away
    assert nodes[1].wait(60) == 75, nodes[1].output
    assert "node 1 left the job" in nodes[1].output, nodes[1].output
    assert nodes[0].wait(120) == 0, nodes[0].output
    attempts = _attempts(tmp_path)
    assert [len(a) for a in attempts] == [2, 1], nodes[0].output
    said = nodes[0].output
    assert "node 1 left the job: the launcher of node 1 got SIGTERM" in said, said
    assert "continues from the coordinated checkpoint (every worker stopped at epoch 0 step" in said
    # The next attempt starts where the workers stopped (here rank 0's step: it saved it; these
    # workers, without a runtime, do not agree on one).
    stopped = int(said.split("[rank 0] prophet_tf: preempted: ")[1].split(" step ")[1].split(";")[0])
    assert attempts[1][0]["from"] == stopped > 0


def test_below_min_the_job_waits_a_bounded_time_then_exits_saying_why(tmp_path: Path, nodes: list) -> None:
    master, script = _master(), _train(tmp_path, total=100000)
    extra = ["--rdzv-timeout", "4", "--node-timeout", "5", *NO_STANDBY]
    nodes += [Node(tmp_path, r, "2:2", master, 1, script, extra) for r in (0, 1)]
    _wait_for(_complete(tmp_path, 2))
    os.killpg(nodes[1].proc.pid, signal.SIGKILL)
    assert nodes[0].wait(60) == EXIT_TOO_FEW_NODES, nodes[0].output
    said = nodes[0].output
    assert "fewer than 2 node(s) (--nnodes 2:2) for 4 s (--rdzv-timeout) after the job lost nodes" in said
    assert len(_attempts(tmp_path)) == 1
    workers = [r["pid"] for a in _attempts(tmp_path) for r in a.values()]
    _wait_for(lambda: not any(alive(p) for p in workers), 10)


def test_the_start_waits_for_min_then_join_wait_for_more(tmp_path: Path, nodes: list) -> None:
    # Alone, below MIN: the same bound and status at the start.
    alone = tmp_path / "alone"
    alone.mkdir()
    nodes.append(Node(alone, 0, "2:3", _master(), 1, _train(alone), ["--rdzv-timeout", "2", *NO_STANDBY]))
    assert nodes[-1].wait(60) == EXIT_TOO_FEW_NODES and "at the start" in nodes[-1].output
    # MIN = 1 present, a second node comes within --join-wait: the job starts with both.
    master, script = _master(), _train(tmp_path, total=50)
    nodes.append(Node(tmp_path, 0, "1:3", master, 1, script, ["--join-wait", "4", *NO_STANDBY]))
    time.sleep(1.0)
    nodes.append(Node(tmp_path, None, "1:3", master, 1, script, ["--join-wait", "4", *NO_STANDBY]))
    assert [n.wait(120) for n in nodes[-2:]] == [0, 0], "\n".join(n.output for n in nodes)
    assert [len(a) for a in _attempts(tmp_path)] == [2]


def test_dash_H_elastic_goes_on_without_a_lost_host_and_takes_it_back(tmp_path: Path) -> None:
    script = _train(tmp_path, total=1000)
    proc = subprocess.Popen([sys.executable, "-m", "prophet_tf.launch", "-H", "localhost:1,127.0.0.1:1",
                             "--nnodes", "1:2", "--join-wait", "0", "--host-retry", "8", "--grace", "2",
                             *NO_STANDBY,
                             "--", *script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(None), cwd=tmp_path, start_new_session=True)
    try:
        _wait_for(_complete(tmp_path, 2))
        (first,) = [a for a in _attempts(tmp_path) if len(a) == 2]
        os.kill(first[1]["launcher"], signal.SIGKILL)  # node 1's launcher (its worker dies with it)
        said, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, said
    # Without node 1, then with it again: the -H launcher started a node on its host 8 s later.
    # (--join-wait 0: where node 1's launcher joined after node 0's, the job first formed with
    # node 0 alone and grew when node 1 arrived, before the 2-worker attempt above.)
    sizes = [len(a) for a in _attempts(tmp_path)]
    first_of_two = sizes.index(2)
    assert sizes[first_of_two:] == [2, 1, 2] and set(sizes[:first_of_two]) <= {1}, (sizes, said)
    assert "was lost" in said and "the job forms with 1 node(s), 1 worker(s)" in said
    assert "starting a node there again in 8 s" in said and "node(s) 1 arrived" in said


def test_after_a_change_of_n_the_weights_are_those_of_a_fresh_job_of_the_new_n(zygote_interpreter):
    """TensorFlow: 2 nodes of one worker train; node 1's launcher gets SIGTERM; every worker stops
    at one step and checkpoints, and node 0 goes on alone (one worker that coordinates as several
    do) from that step. Its final weights equal, bitwise, those of a fresh one-worker job resumed
    from a copy of the same checkpoint."""
    from prophet_tf.bench import elastic_trials

    said: list[str] = []
    (trial,) = elastic_trials.run(1, seed=3, quick=True, deadline_s=400, kinds=["sigterm"],
                                  emulated=False, nodes=2, log=said.append)
    report = "\n".join(said)
    assert trial.kept_training and (trial.workers_before, trial.workers_after) == (2, 1), report
    assert trial.redone == 0, report  # continued at the step where every worker stopped
    assert trial.bitwise, report


SHOW = textwrap.dedent("""\
    import json, os, sys
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__,
                      "env": dict(os.environ), "stdin": sys.stdin.read(),
                      "preloaded": "json" in sys.modules}))
    sys.exit(int(sys.argv[1]))
    """)


def test_a_standby_runs_the_program_as_python_would_with_the_new_environment(
        tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "show.py").write_text(SHOW)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "show.py").write_text(SHOW)
    pool = StandbyPool(["json"], with_death_stub, delay_s=0.0)
    started = dict(_env(None), KEPT="1", PYTHONUNBUFFERED="1")
    try:
        def run(cmd: list, env: dict) -> tuple[int, dict]:
            pool.fill([started])
            _wait_for(lambda: 0 in pool._ready)
            proc = pool.take(0, env, cmd)
            assert proc is not None
            out, _ = proc.communicate(timeout=60)
            return proc.returncode, json.loads(out.decode().splitlines()[-1])

        env = dict(started, TF_CONFIG='{"cluster": {}}', PROPHET_JOB_TOKEN="t2")
        code, seen = run([sys.executable, "-u", str(tmp_path / "show.py"), "3", "b"], env)
        assert code == 3 and seen["env"] == env  # exactly the new environment
        assert seen["argv"] == [str(tmp_path / "show.py"), "3", "b"] and seen["name"] == "__main__"
        assert seen["path0"] == str(tmp_path.resolve()) and seen["stdin"] == "" and seen["preloaded"]
        monkeypatch.chdir(tmp_path)
        code, seen = run([sys.executable, "-u", "-m", "pkg.show", "0"], env)
        assert code == 0 and seen["argv"] == [str(tmp_path / "pkg" / "show.py"), "0"]
        assert seen["path0"] == str(tmp_path) and seen["name"] == "__main__"
        # Another environment than the one it imported with (here KEPT): not used.
        pool.fill([started])
        _wait_for(lambda: 0 in pool._ready)
        assert pool.take(0, dict(env, KEPT="2"), [sys.executable, "-u", "x.py"]) is None
    finally:
        pool.close()
    # Handed its program while still importing: it runs it once the imports are done.
    go = tmp_path / "go"
    (tmp_path / "slow.py").write_text(f"import os, time\nwhile not os.path.exists({str(go)!r}):\n"
                                      "    time.sleep(0.02)\n")
    pool = StandbyPool(["slow"], with_death_stub, delay_s=0.0)
    started["PYTHONPATH"] += os.pathsep + str(tmp_path)
    try:
        pool.fill([started])
        _wait_for(lambda: 0 in pool._ready)
        proc = pool.take(0, dict(started, TF_CONFIG="{}"), [sys.executable, "-u", str(tmp_path / "show.py"), "0"])
        go.write_text("")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and json.loads(out.decode().splitlines()[-1])["env"]["TF_CONFIG"] == "{}"
    finally:
        pool.close()


def test_the_default_preload_creates_no_tensorflow_context(zygote_interpreter) -> None:
    # A standby waits beside the running worker: a context would take memory on its GPU. Forked
    # from a zygote, which has imported TensorFlow and Keras but made no context either: what the
    # import of prophet_tf.strategy adds shows as it would in a standby.
    code = ("import prophet_tf.strategy\n"
            "from tensorflow.python.eager import context\n"
            "assert not context.context()._initialized\n")
    run = subprocess.run([zygote_interpreter, "-c", code], env=_env(None),
                         capture_output=True, text=True, timeout=1800)  # a hang, not a slow start
    assert run.returncode == 0, run.stderr[-2000:]
    assert DEFAULT_PRELOAD == ("prophet_tf.strategy",)


def test_preload_is_module_names_or_none() -> None:
    assert parse_preload("prophet_tf.strategy") == ("prophet_tf.strategy",)
    assert parse_preload("numpy, json") == ("numpy", "json")
    assert parse_preload("none") == () and parse_preload("") == ()
    with pytest.raises(ValueError, match="--preload"):
        parse_preload("train-data")


def test_nnodes_is_a_number_or_a_range() -> None:
    assert parse_nnodes("3") == NodeRange(3, 3, False) and parse_nnodes(2).spec == 2
    assert parse_nnodes("2:4") == NodeRange(2, 4, True) and parse_nnodes("2:4").spec == "2:4"
    assert parse_nnodes("2:2").elastic  # the range form: a lost node is waited for, not fatal
    for bad in ("0", "3:2", "a", "1:x", "0:2"):
        with pytest.raises(ValueError, match="--nnodes"):
            parse_nnodes(bad)


@pytest.mark.parametrize("argv,message", [
    (["--nnodes", "2:3", "-n", "1", "x.py"], "needs --master"),
    (["--nnodes", "2:x", "--master", "127.0.0.1:1", "-n", "1", "x.py"], "is not N or MIN:MAX"),
    (["-H", "a:1,b:1", "--nnodes", "2", "x.py"], "unless it is MIN:MAX"),
    (["-H", "a:1,b:1", "--nnodes", "1:2", "-n", "2", "x.py"], "leave out -n"),
])
def test_elastic_usage_errors_say_what_to_change(argv: list, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
