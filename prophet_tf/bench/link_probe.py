"""The start-up link probe of automatic fusion: the rate it agrees on and what it costs.

    python -m prophet_tf.bench.link_probe [--rates 1G,500M] [--workers 2] [--probes 5]
        [--loopback] [--netns_prefix lprobe]

For each link rate, ``--workers`` workers start on an emulated cluster (one network namespace per
worker, ``tbf`` at that rate on its egress; root only) or, with ``--loopback``, on this machine's
loopback (no shaping; ``--rates`` then only labels the run). Each creates a ``ProphetStrategy``
(without ``$PROPHET_LINK_GBPS``) and runs its link probe as fusion's first declaration would
(``prophet_tf/_link_probe.py``), then ``--probes`` - 1 more probes, to show how much the agreed
rate moves from one probe to the next. One row per probe: every worker's measured rate, the
agreed (slowest) one, the rate buckets are sized for, and the probe's time (the slowest worker's:
the start-up cost). Run under ``flock /work/locks/bench.lock nice -n 5`` on a shared machine.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import time
from typing import Any, Sequence

__all__ = ["format_rows", "main"]


def _worker(probes: int) -> None:
    """One worker: the strategy's probe, then ``probes`` - 1 more; a RESULT line each."""
    from prophet_tf import _link_probe
    from prophet_tf.runtime import LINK_GBPS_ENV, control_priority
    from prophet_tf.strategy import ProphetStrategy

    os.environ.pop(LINK_GBPS_ENV, None)
    strategy = ProphetStrategy()
    for k in range(probes):
        if k == 0:
            strategy.extended.collectives.fusion_link_Bps()  # what fusion's first declaration runs
            rate = strategy.fusion_link_rate
        else:
            rate = _link_probe.probe(strategy.world_size, control_priority())
        print("RESULT " + json.dumps({"probe": k, "rank": strategy.rank, **dataclasses.asdict(rate)}),
              flush=True)


def _launch(n: int, bandwidth_bps: float, probes: int, loopback: bool, prefix: str) -> list[dict]:
    from prophet_tf.bench.netem import EmulatedCluster, LoopbackCluster
    from prophet_tf.bench.train.sweep import parse_results, repo_root
    from prophet_tf.launch import launch

    cluster = LoopbackCluster(n) if loopback else EmulatedCluster(n, bandwidth_bps=bandwidth_bps,
                                                                  prefix=prefix)
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONWARNINGS": "ignore", "PROPHET_LINK_GBPS": "",
           "PYTHONPATH": os.pathsep.join(p for p in (repo_root(), os.environ.get("PYTHONPATH")) if p)}
    out = io.StringIO()
    with cluster:
        placement: dict[str, Any] = {}
        if not loopback:
            placement = {"hosts": [cluster.host_address(w) for w in range(n)],
                         "wrap_argv": lambda rank, argv: cluster.exec_argv(rank, argv)}
        code = launch(["-m", "prophet_tf.bench.link_probe", "--worker", "--probes", str(probes)], n,
                      timeout=300, env=env, threads=1, stdout=out, stderr=out, grace=3.0, **placement)
    if code != 0:
        raise SystemExit(f"workers failed (exit {code}):\n" + "\n".join(out.getvalue().splitlines()[-25:]))
    rows = []
    for line in out.getvalue().splitlines():
        rank_result = parse_results([line])
        for rank, result in rank_result.items():
            rows.append({**result, "rank": rank})
    return rows


def format_rows(label: str, rows: Sequence[dict]) -> list[str]:
    """One line per probe: measured per rank, agreed, sized for, the slowest worker's time."""
    lines = []
    for k in sorted({r["probe"] for r in rows}):
        of_probe = sorted((r for r in rows if r["probe"] == k), key=lambda r: r["rank"])
        measured = " ".join(f"{r['measured_gbps']:.3f}" for r in of_probe)
        agreed = {r["agreed_gbps"] for r in of_probe}
        sized = {r["gbps"] for r in of_probe}
        same = "" if len(agreed) == len(sized) == 1 else "  DIFFERS ACROSS WORKERS"
        lines.append(f"{label:>10}  probe {k}  measured [{measured}] Gbit/s  agreed "
                     f"{min(agreed):.3f}  sized for {min(sized):g} Gbit/s  "
                     f"{max(r['probe_seconds'] for r in of_probe) * 1e3:.0f} ms{same}")
    return lines


def _define_flags() -> None:
    from absl import flags
    flags.DEFINE_list("rates", ["1G"], "Link rates per worker and direction (e.g. 1G, 500M, 10G).")
    flags.DEFINE_integer("workers", 2, "Workers (one emulated host each).")
    flags.DEFINE_integer("probes", 5, "Probes per launch: the strategy's, then more of the same.")
    flags.DEFINE_bool("loopback", False, "Workers on loopback, unshaped (no root needed).")
    flags.DEFINE_string("netns_prefix", "lprobe", "Prefix of the emulated cluster's namespaces.")
    flags.DEFINE_bool("worker", False, "(internal) run as one worker of the launch.")


def main(argv: Sequence[str]) -> int:
    """Entry point (after absl parsed the flags)."""
    from absl import flags
    from prophet_tf.predict.cli import parse_rate

    FLAGS = flags.FLAGS
    if FLAGS.worker:
        _worker(FLAGS.probes)
        return 0
    for text in FLAGS.rates:
        t0 = time.monotonic()
        rows = _launch(FLAGS.workers, parse_rate(text), FLAGS.probes, FLAGS.loopback,
                       FLAGS.netns_prefix)
        label = "loopback" if FLAGS.loopback else text
        print("\n".join(format_rows(label, rows)) + f"   (launch {time.monotonic() - t0:.0f} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    from absl import app
    _define_flags()
    sys.exit(app.run(main))
