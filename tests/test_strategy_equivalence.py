"""ProphetStrategy on N workers gives the weights of one process training on the global batch."""

from __future__ import annotations

import pytest

TOLERANCE = 1e-5
ALL_CASES = ["sgd", "momentum", "adam", "embedding", "embedding_adam", "embedding_small_dense",
             "regularizers"]


def _check_case(run, case: str) -> None:
    per_rank = [run.one(rank, case=case) for rank in range(run.n)]
    first = per_rank[0]
    assert first["workers"] == run.n
    assert first["moved"] > 1e-3, f"{case}: training did not change the weights"
    for r in per_rank:
        # Same initial weights (broadcast from rank 0) and bitwise identical results everywhere.
        assert r["initial_digest"] == first["initial_digest"], f"{case}: initial weights differ"
        assert r["digest"] == first["digest"], f"{case}: final weights differ across workers"
        # Logged metrics are global (reduced across workers): the same on every worker...
        assert r["loss"] == first["loss"] and r["accuracy"] == first["accuracy"], case
    # ... and, weights and logs alike, what one process computes on the global batches (rank 0
    # trains that reference: every rank's weights and logs are bitwise rank 0's).
    assert first["maxdiff"] <= TOLERANCE, \
        f"{case}: max |w - w_reference| = {first['maxdiff']:.3g} > {TOLERANCE}"
    assert len(first["loss"]) == len(first["ref_loss"]) > 0, (case, first["loss"], first["ref_loss"])
    for got, want in zip(first["loss"], first["ref_loss"]):
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (case, first["loss"], first["ref_loss"])
    for got, want in zip(first["accuracy"], first["ref_accuracy"]):
        assert abs(got - want) <= 1e-6, (case, first["accuracy"], first["ref_accuracy"])


@pytest.fixture(scope="module")
def two_workers(run_workers):
    return run_workers("strategy_equivalence.py", 2, timeout=240).check_ok()


@pytest.mark.parametrize("case", ALL_CASES)
def test_two_workers_match_one_process(two_workers, case):
    _check_case(two_workers, case)


def test_two_level_push_pull_on_two_hosts_matches_one_process(run_workers):
    # Ranks 0 and 1 share host "a", rank 2 has host "b" (hosts of different sizes): every
    # gradient is summed on its host first, then across the hosts (ops/core/two_level.h); fused
    # small gradients (many_small) and synchronous averaged ones (adam) alike.
    cases = ["many_small", "adam"]
    run = run_workers("strategy_equivalence.py", 3, "--cases", ",".join(cases), "--hosts", "a,a,b",
                      timeout=240).check_ok()
    for case in cases:
        _check_case(run, case)
        # The engine took the two-level path over the two hosts.
        assert all(run.one(rank, case=case)["two_level_hosts"] == 2 for rank in range(3))


def test_under_auto_the_start_up_probe_chooses_the_path_and_it_matches_one_process(run_workers):
    # hierarchical auto (the default) over hosts a, a, b: the engines start on the two-level path,
    # the probe at the first step times both paths (two-level rounds, then flat) and every worker keeps
    # the one prophet_tf._link_probe.choose_two_level picks from the same gathered times.
    # One case (fused buckets, which take their members' path): each path's sums are checked
    # against one process by the tests of that path.
    from prophet_tf._link_probe import choose_two_level

    cases = ["many_small"]
    run = run_workers("strategy_equivalence.py", 3, "--cases", ",".join(cases), "--host_labels",
                      "a,a,b", "--fusion", "auto", timeout=240).check_ok()
    for case in cases:
        _check_case(run, case)
    results = [run.one(rank, case=case) for case in cases for rank in range(3)]
    link = results[0]["link"]
    print("path chosen:", link)
    assert link["two_level"] is not None and link["two_level_round_s"] > 0 and link["flat_round_s"] > 0
    assert link["two_level"] == choose_two_level(link["two_level_round_s"], link["flat_round_s"])
    for r in results:
        assert r["link"] == link, (r["link"], link)
        assert r["two_level_hosts"] == (2 if link["two_level"] else 0), r


def test_the_two_level_path_is_kept_unless_the_flat_one_is_clearly_faster():
    from prophet_tf._link_probe import choose_two_level, two_level_margin

    assert two_level_margin() == 0.05
    assert choose_two_level(0.010, 0.011) and choose_two_level(0.010, 0.010)
    assert choose_two_level(0.010, 0.010 * (1 - two_level_margin()) + 1e-9)
    assert not choose_two_level(0.010, 0.009)
    assert not choose_two_level(0.030, 0.004)


def test_lanes_match_one_process(run_workers):
    # io_threads=2: the 8 MiB kernel travels in two slices, one per lane (each lane's bytes show
    # them), the small gradients whole on their lanes or fused on lane 0.
    cases = ["wide", "many_small", "adam"]
    run = run_workers("strategy_equivalence.py", 3, "--cases", ",".join(cases), "--io_threads", "2",
                      timeout=240).check_ok()
    for case in cases:
        _check_case(run, case)
    # Each lane carried its slices of the kernel (8 steps of 4/3 x 4 MiB), far beyond the
    # start-up probe's (6 rounds of 4/3 x 2 MiB), and the explicit setting stayed.
    wide = run.one(0, case="wide")
    assert wide["io_threads"] == wide["lanes"] == 2, wide
    lanes = wide["lane_bytes_sent"]
    assert len(lanes) == 2 and min(lanes) > 2 * 6 * (2 << 20), lanes


@pytest.mark.parametrize("link_gbps", [None, "100"])
def test_auto_lanes_are_sized_by_the_start_up_probe_and_match_one_process(run_workers, link_gbps):
    # io_threads auto over three hosts (labels): the runtime's auto_lanes (8) connected; the
    # probe at the first step runs on all of them and every worker then uses the lanes the link
    # needs (prophet_tf._link_probe.lanes_for): the agreed rate, or $PROPHET_LINK_GBPS where the
    # user states it (100 Gbit/s needs 7-8 at this machine's cost), at the costliest worker's
    # CPU per byte; the same number everywhere.
    from prophet_tf._library import runtime_constants
    from prophet_tf._link_probe import lanes_for

    connected = runtime_constants()["auto_lanes"]
    cases = ["wide", "adam"]
    run = run_workers("strategy_equivalence.py", 3, "--cases", ",".join(cases), "--host_labels",
                      "a,b,c", timeout=240,
                      env={"PROPHET_LINK_GBPS": link_gbps} if link_gbps else None).check_ok()
    for case in cases:
        _check_case(run, case)
    results = [run.one(rank, case="wide") for rank in range(3)]
    link = results[0]["link"]
    gbps = float(link_gbps) if link_gbps else link["agreed_gbps"]
    expected = lanes_for(gbps * 1e9 / 8, link["cpu_ns_per_byte"] / 1e9, connected)
    print("auto lanes:", link, "->", expected)
    if link_gbps:
        assert expected >= 4, (link, expected)
    for r in results:
        assert r["lanes"] == connected and r["link"] == link, (r["lanes"], r["link"], link)
        assert r["io_threads"] == link["io_threads"] == expected, (r["io_threads"], link, expected)
    # The probe's 8 MiB took 6 rounds of 4/3 x 1 MiB on each lane; the lanes in use carried the
    # wide kernel's slices beyond that (8 steps of 4/3 x 8 MiB / lanes), the others nothing more.
    sent = results[0]["lane_bytes_sent"]
    probe = 6 * (3 << 20) // 2
    assert all(b > probe for b in sent[:expected]) and all(b <= probe for b in sent[expected:]), sent


def test_three_workers_match_one_process(run_workers):
    cases = ["momentum", "adam", "embedding"]
    run = run_workers("strategy_equivalence.py", 3, "--cases", ",".join(cases),
                      timeout=240).check_ok()
    for case in cases:
        _check_case(run, case)
