"""The training benchmark's orchestrator: builds the emulated clusters, launches every system of
every setting as N worker processes (:mod:`prophet_tf.bench.train.worker`), re-runs disturbed
launches, computes the bounds and collects the settings (:mod:`prophet_tf.bench.train.settings`)
that the report (:mod:`prophet_tf.bench.train.report`) writes."""

from __future__ import annotations

import datetime
import io
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, Mapping, Optional, Sequence, TextIO

from prophet_tf._library import stale_libraries
from prophet_tf.bench.train.report import (format_bandwidth, launch_text, noise_text,
                                           rate_change_summary, write_outputs)
from prophet_tf.bench.train.settings import (NETNS_PREFIX, SweepOptions, available_memory_bytes,
                                             choose_bandwidths, default_batch,
                                             emulated_time_scale, ideal_bound, lower_bound_s,
                                             make_setting, median, spec_path, sweep_cells,
                                             worker_memory_bytes)
from prophet_tf.bench.train.systems import System, parse_system

__all__ = ["run_sweep", "format_plan", "LaunchFailed", "Interrupted", "parse_results", "timeline_pattern",
           "worker_config", "repo_root", "safe_name", "cpu_fraction", "foreign_cores",
           "describe_specs"]

_RESULT_RE = re.compile(r"^\[rank (\d+)\] RESULT (\{.*\})\s*$")


def cpu_fraction(results: Mapping[int, Mapping[str, Any]], cores: int) -> tuple[Optional[float],
                                                                               Optional[float]]:
    """``(machine, workers)``: share of this machine's ``cores`` that were busy during rank 0's
    measured window, in total and with the workers' own processes."""
    r0 = results.get(0, {})
    window, busy = r0.get("window_s"), r0.get("window_machine_busy_s")
    own = [r.get("window_cpu_s") for r in results.values()]
    if not window or cores < 1:
        return None, None
    machine = None if busy is None else busy / window / cores
    workers = None if any(o is None for o in own) else sum(own) / window / cores
    return machine, workers


def foreign_cores(results: Mapping[int, Mapping[str, Any]]) -> Optional[float]:
    """Average number of cores busy with work other than the workers', during rank 0's window.

    ``machine busy time - sum of the workers' own CPU time``, over the window, divided by its
    length. Includes the kernel's network processing that is not charged to the workers (small).
    """
    r0 = results.get(0, {})
    window, busy = r0.get("window_s"), r0.get("window_machine_busy_s")
    own = [r.get("window_cpu_s") for r in results.values()]
    if not window or busy is None or any(o is None for o in own):
        return None
    return max(0.0, (busy - sum(own)) / window)


class _Tee(io.TextIOBase):
    """Collects launcher output (and echoes it when verbose)."""

    def __init__(self, echo: Optional[TextIO]) -> None:
        super().__init__()
        self.lines: list[str] = []
        self._buf = ""
        self._echo = echo
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            self._buf += s
            *done, self._buf = self._buf.split("\n")
            self.lines.extend(done)
            if self._echo is not None:
                self._echo.write(s)
                self._echo.flush()
        return len(s)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.lines + ([self._buf] if self._buf else []))


class LaunchFailed(RuntimeError):
    """A system's launch did not produce a result."""


class Interrupted(KeyboardInterrupt):
    """The sweep was stopped by SIGINT/SIGTERM (workers and namespaces are cleaned up)."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = signum


def parse_results(lines: Iterable[str]) -> dict[int, dict]:
    """``{rank: result}`` from ``[rank i] RESULT {json}`` launcher output lines."""
    out: dict[int, dict] = {}
    for line in lines:
        m = _RESULT_RE.match(line.strip())
        if m:
            out[int(m.group(1))] = json.loads(m.group(2))
    return out


def _leftover_namespace_pids(cluster: Any) -> list[int]:
    pids: list[int] = []
    for ns in getattr(cluster, "namespaces", []):
        r = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        pids += [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    return pids


def _reap_namespaces(cluster: Any) -> int:
    """Kills any process still inside the cluster's namespaces; returns how many there were."""
    pids = _leftover_namespace_pids(cluster)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(pids)


def timeline_pattern(base: str, launch_name: str) -> str:
    """Where a launch writes its timeline (``{rank}`` = the worker's rank).

    ``base`` is a directory, or a ``.json`` path whose stem then prefixes every launch's files.
    """
    if base.endswith(".json"):
        return f"{base[:-len('.json')]}.{launch_name}.{{rank}}.json"
    return os.path.join(base, f"{launch_name}.{{rank}}.json")


def worker_config(system: str, cfg: Mapping[str, Any], batch: int, opts: SweepOptions,
                  emulation: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The configuration a worker of ``system`` gets (see :func:`run_worker`)."""
    return {"system": system, "model": dict(cfg), "batch_per_worker": batch,
            "steps": opts.steps, "warmup": opts.warmup, "intra_threads": opts.intra_threads,
            "inter_threads": opts.inter_threads, "prophet_options": opts.prophet_options,
            **(emulation or {"compute": "real"})}


def _launch_system(system: str, n: int, cluster: Any, cfg: Mapping[str, Any], batch: int,
                   opts: SweepOptions, timeout: float, log_name: str = "",
                   emulation: Optional[Mapping[str, Any]] = None) -> dict[int, dict]:
    """Runs one system as ``n`` worker processes; returns ``{rank: result}`` (rank 0 always).

    ``emulation``: the worker-config keys of emulated compute (``compute``, ``time_scale``, ...);
    None = real compute. The workers' output goes to ``OUT/logs/LOG_NAME.log``.
    """
    from prophet_tf.launch import launch

    log_name = safe_name(log_name or f"{cfg['name']}_{system}_n{n}")
    config = worker_config(system, cfg, batch, opts, emulation)
    argv = ["-m", "prophet_tf.bench.train", "--worker", json.dumps(config)]
    timeline = (timeline_pattern(opts.timeline, log_name)
                if opts.timeline and _is_prophet(system) else "")
    if timeline:
        os.makedirs(os.path.dirname(os.path.abspath(timeline)), exist_ok=True)
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (repo_root(), os.environ.get("PYTHONPATH"))
                                         if p),
           # gRPC (mwms) must not try a proxy from inside the namespaces
           "no_proxy": "*", "NO_PROXY": "*", "grpc_proxy": "", "http_proxy": "",
           "https_proxy": "",
           # One trace per launch (an inherited PROPHET_TIMELINE would be overwritten by each)
           "PROPHET_TIMELINE": timeline}
    kwargs: dict[str, Any] = {}
    if cluster is not None and n > 1 and not opts.loopback:
        kwargs = _placement(cluster, n, opts.workers_per_host)
        if opts.rate_change is not None:
            step, factor = opts.rate_change
            # Each worker changes its own host's link at the start of step K (all hosts within
            # one step of each other), so the change lands at a known point of training.
            new_bps = cluster.bandwidth_bps * factor
            argv[-1] = json.dumps({**config, "rate_change": {
                "step": step, "bandwidth_bps": new_bps,
                "argv": cluster.rate_change_argv(new_bps)}})
    tee = _Tee(sys.stderr if opts.verbose else None)
    t_launch = time.monotonic()
    try:
        code = launch(argv, n, timeout=timeout, env=env, threads=None, stdout=tee, stderr=tee,
                      grace=3.0, **kwargs)
    finally:
        _save_log(opts, log_name, tee.text(), time.monotonic() - t_launch)
    if cluster is not None and not opts.loopback and n > 1:
        left = _reap_namespaces(cluster)
        if left:
            sys.stderr.write(f"  (killed {left} process(es) left in the namespaces)\n")
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        raise Interrupted(f"interrupted during {system}", code - 128)
    results = parse_results(tee.lines + [tee.text().rsplit("\n", 1)[-1]])
    if code != 0 or 0 not in results:
        tail = "\n".join(tee.text().splitlines()[-25:])
        raise LaunchFailed(f"{system}: launcher exit status {code}"
                           f"{' (timeout)' if code == 124 else ''}; last output:\n{tail}")
    return results


def _placement(cluster: Any, n: int, per_host: int) -> dict[str, Any]:
    """The launcher's ``hosts`` and ``wrap_argv`` (and ports) placing ``n`` workers on the
    emulated cluster, ``per_host`` per host: worker w on host w // per_host. The workers of a
    host share its namespace, address and shaped link, and talk to each other over its loopback;
    they listen on distinct ports (a fresh namespace has every port free)."""
    placement: dict[str, Any] = {
        "hosts": [cluster.host_address(w // per_host) for w in range(n)],
        "wrap_argv": lambda rank, argv: cluster.exec_argv(rank // per_host, argv)}
    if per_host > 1:
        placement["base_port"] = EMULATED_BASE_PORT
    return placement


#: The first port of the workers of an emulated host with several workers (nothing else listens
#: in its namespace).
EMULATED_BASE_PORT = 23450


def _save_log(opts: SweepOptions, name: str, text: str, seconds: float) -> None:
    try:
        d = os.path.join(opts.out, "logs")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, safe_name(name) + ".log"), "w") as f:
            f.write(text)
            f.write(f"\n[bench] launch took {seconds:.1f} s\n")
    except OSError:
        pass


def repo_root() -> str:
    """The checkout this package runs from (the workers get it on their PYTHONPATH)."""
    here = os.path.abspath(__file__)   # REPO/prophet_tf/bench/train/sweep.py
    for _ in range(4):
        here = os.path.dirname(here)
    return here


def safe_name(text: str) -> str:
    """``text`` as a file name: a system's ``[...]`` and other unusual characters become ``_``."""
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", text).strip("_")


def _is_prophet(system: str) -> bool:
    """A ProphetStrategy system (not mwms, nor the internal ``single`` and ``specs`` tasks)."""
    return system not in ("single", "specs") and parse_system(system).is_prophet


def _source_state() -> str:
    """``commit`` plus the files that differ from it (the tree may be edited while we run)."""
    root = repo_root()
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10)
        st = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    changed = [line[3:] for line in st.stdout.splitlines() if line.strip()]
    state = head.stdout.strip() + (f" with local changes in {', '.join(changed)}" if changed else "")
    stale = stale_libraries(pathlib.Path(root))
    if stale:
        state += f"; {', '.join(stale)} in prophet_tf/ differ from bazel-bin's (run scripts/setup.sh)"
        print(f"warning: the workers load {', '.join(stale)} from prophet_tf/, not the ones in "
              "bazel-bin: the results are of the source those were built from, not of "
              f"{head.stdout.strip()}. `bash scripts/setup.sh` copies the built ones.",
              file=sys.stderr)
    return state


def _make_cluster(n: int, bandwidth_bps: Optional[float], loopback: bool,
                  prefix: str = NETNS_PREFIX) -> Any:
    from prophet_tf.bench.netem import EmulatedCluster, LoopbackCluster
    if loopback:
        return LoopbackCluster(n)
    return EmulatedCluster(n, bandwidth_bps=bandwidth_bps, prefix=prefix)


class _Progress:
    """Progress lines on stdout: ``[k/total] elapsed ... what``."""

    def __init__(self, total: int, stream: TextIO = sys.stdout) -> None:
        self.total, self.done, self.t0, self.stream = total, 0, time.monotonic(), stream

    def start(self, what: str) -> None:
        el = time.monotonic() - self.t0
        self.stream.write(f"[{self.done + 1}/{self.total}  {el:5.0f} s] {what} ... ")
        self.stream.flush()

    def finish(self, text: str) -> None:
        self.done += 1
        self.stream.write(text + "\n")
        self.stream.flush()


def _measure(system: str, n: int, cluster: Any, cfg: Any, batch: int, opts: SweepOptions,
             timeout: float, log: str, progress: _Progress,
             emulation: Optional[Mapping[str, Any]] = None) -> tuple[dict[int, dict], dict]:
    """One launch of ``system``, repeated (up to ``opts.retries`` times) while other programs
    used more than ``opts.noise_cores`` cores during the measured steps; keeps the quietest.

    Returns ``({rank: result}, facts)`` with facts ``foreign_cores``, ``attempts``, ``launch_s``.
    Raises :class:`LaunchFailed` when no attempt produced a result.
    """
    best: Optional[tuple[dict[int, dict], dict]] = None
    for attempt in range(1 + max(0, opts.retries)):
        t0 = time.monotonic()
        runs = _launch_system(system, n, cluster, cfg.to_dict(), batch, opts, timeout,
                              log + (f"_retry{attempt}" if attempt else ""), emulation)
        foreign = foreign_cores(runs)
        machine_cpu, workers_cpu = cpu_fraction(runs, os.cpu_count() or 1)
        facts = {"foreign_cores": foreign, "attempts": attempt + 1,
                 "launch_s": time.monotonic() - t0, "machine_cpu": machine_cpu,
                 "workers_cpu": workers_cpu}
        kept = None if best is None else best[1]["foreign_cores"]
        if best is None or (foreign is not None and (kept is None or foreign < kept)):
            best = (runs, facts)
        best[1]["attempts"] = attempt + 1
        if foreign is None or foreign <= opts.noise_cores or attempt >= opts.retries:
            break
        progress.stream.write(f"(other programs used {foreign:.2f} cores: again) ")
        progress.stream.flush()
    assert best is not None
    return best


def run_sweep(opts: SweepOptions) -> list[dict]:
    """Runs every setting; returns the list of setting objects (see :func:`make_setting`)."""
    from prophet_tf.bench import models as models_mod

    if opts.plan and opts.compute != "emulated":
        raise ValueError("--plan estimates emulated-compute sweeps (real compute's step time is "
                         "only known once measured): add --compute emulated")
    if not opts.loopback and not opts.plan:
        from prophet_tf.bench.netem import EmulatedCluster
        EmulatedCluster.check_available()   # NetemUnavailableError says: root or --loopback
    opts.meta.update(started=datetime.datetime.now().isoformat(timespec="seconds"),
                     loadavg_start=os.getloadavg(), t0=time.monotonic(), source=_source_state())
    emulated = opts.compute == "emulated"
    cells = sweep_cells(opts)

    def systems_at(ratio: Optional[float],
                   pool: Optional[Sequence[System]] = None) -> list[System]:
        return [s for s in (opts.systems if pool is None else pool)
                if s.base != "mwms" or opts.mwms_ratios is None or ratio is None
                or ratio in opts.mwms_ratios]

    def per_n(ratios: Sequence[float]) -> int:
        # [one worker alone (emulated, with --alone: its time scale depends on N)], [N uncoupled
        # workers], the settings
        return ((1 if emulated and opts.alone else 0) + (1 if opts.contended else 0)
                + (len(opts.systems) if opts.loopback
                   else sum(len(systems_at(r)) for r in ratios)))

    # Per model: the layer specs (emulated compute runs them; real compute on shaped links needs
    # them for the ideal bound), and with real compute one worker alone.
    want_specs = emulated or not opts.loopback
    per_model = (1 if want_specs else 0) + (0 if emulated else 1)
    progress = _Progress(sum(per_model + sum(per_n(r) for _, r in runs) for _, runs in cells))
    settings: list[dict] = []
    for model, runs in cells:
        cfg = models_mod.config_for(model, opts.compute, **opts.model_overrides.get(model, {}))
        batch = opts.batch or default_batch(model, opts.compute)
        single: Optional[tuple[float, int, dict]] = None
        described = _describe(model, cfg, batch, opts, progress) if want_specs else None
        if emulated and described is None:
            progress.done += sum(per_n(r) for _, r in runs)
            continue
        if not emulated:
            single = _measure_single(model, 1, cfg, batch, opts, progress, None)
            if single is None:
                progress.done += sum(per_n(r) for _, r in runs)
                continue
        for n, ratios in runs:
            # The links are the hosts': with several workers per host, comm/comp, the time scale
            # and the bounds are those of the hosts' links.
            hosts = n // opts.workers_per_host
            gbytes_known = (described or {}).get("gradient_bytes") or (single or (0, 0))[1]
            have = available_memory_bytes()
            fitting = [s for s in opts.systems
                       if have is None or n * worker_memory_bytes(gbytes_known, s) <= 0.9 * have]
            for s in opts.systems:
                if s in fitting:
                    continue
                need = n * worker_memory_bytes(gbytes_known, s)
                why = (f"{model} with {n} workers: {s.name} skipped: its workers need about "
                       f"{need / 1e9:.0f} GB of memory, {have / 1e9:.0f} GB are available")
                print(f"  ({why})", flush=True)
                opts.meta.setdefault("skipped", []).append(why)
            if not fitting:
                progress.done += per_n(ratios)
                continue
            plan_ratios = [None] if opts.loopback else list(ratios)
            progress.done += sum(len(systems_at(r)) - len(systems_at(r, fitting))
                                 for r in plan_ratios)
            emulation: Optional[dict] = None
            if emulated:
                assert described is not None
                scale = opts.time_scale or emulated_time_scale(
                    described["gradient_bytes"], hosts, described["accelerator_s"],
                    opts.link_budget_bps)
                emulation = {"compute": "emulated", "accelerator_tflops": opts.accelerator_tflops,
                             "time_scale": scale, "spec_path": described["spec_path"]}
                # The bound's and the bandwidths' compute time is the emulated accelerator's:
                # no system can be faster, and it does not depend on this machine's load.
                single = (described["accelerator_s"] * scale, int(described["gradient_bytes"]),
                          {})
                if opts.alone and not opts.plan:
                    alone = _measure_single(model, n, cfg, batch, opts, progress, emulation)
                    if alone is not None:
                        single[2].update(alone[2], step_s_median=alone[0])
            assert single is not None
            compute_s, gbytes, single_info = single
            step_profile = _step_profile(described, batch, opts, compute_s)
            contended, contended_info = (_measure_contended(model, n, cfg, batch, opts, progress,
                                                            emulation)
                                         if opts.contended and not opts.plan else (None, {}))
            if opts.loopback:
                plan: list[tuple[Optional[float], Optional[float]]] = [(None, None)]
            else:
                bws = choose_bandwidths(gbytes, hosts, compute_s, ratios)
                plan = list(zip(ratios, bws))
            for ratio, bw in plan:
                ideal = _ideal(step_profile, n, bw, opts, compute_s)
                compressed = _compressed_bounds(step_profile, n, bw, opts, compute_s,
                                                systems_at(ratio, fitting))
                if opts.plan:
                    opts.meta.setdefault("plan", []).append(_plan_setting(
                        model, n, ratio, bw, compute_s, gbytes, systems_at(ratio, fitting), opts,
                        emulation, ideal))
                    continue
                st = _run_setting(model, n, cfg, batch, ratio, bw, compute_s, gbytes,
                                  systems_at(ratio, fitting), opts, progress, emulation, ideal,
                                  compressed)
                st["compute_contended_s"] = contended
                # The same bound with the compute time of N workers sharing this machine.
                st["lower_bound_contended_s"] = (None if contended is None else
                                                 lower_bound_s(contended, gbytes, hosts, bw))
                st["compute_single"] = single_info
                st["compute_contended"] = contended_info
                # What a later run needs to model this one (bench.predict --measured).
                st["run"] = {"steps": opts.steps, "warmup": opts.warmup,
                             "intra_threads": opts.intra_threads,
                             "inter_threads": opts.inter_threads,
                             "prophet_options": dict(opts.prophet_options)}
                if emulation is not None and described is not None:
                    st["emulation"] = _emulation_facts(described, emulation, bw)
                settings.append(st)
                write_outputs(settings, opts, final=False)
    if not opts.plan:
        write_outputs(settings, opts, final=True)
    return settings


#: --plan's estimate of a launch: start-up and the first step (tracing) take about 13 s of CPU
#: per worker (measured 2026-11-26: 5 + 2-7 s at N=2 for ResNet50, VGG16 and BERT-base; 6 + 8 s
#: at N=8), and the workers share the machine's cores; ...
PLAN_STARTUP_CPU_S = 13.0
#: ... a ProphetStrategy system's step about 1.25 x the ideal bound (quiet machine, 2026-11-26:
#: 1.01-1.31), an mwms step about 3.1 x the lower bound (3.03-3.11 at comm/comp 1).
PLAN_PROPHET_OVER_IDEAL = 1.25
PLAN_MWMS_OVER_BOUND = 3.1


def _plan_setting(model: str, n: int, ratio: Optional[float], bw: Optional[float],
                  compute_s: float, gbytes: int, systems: Sequence[System], opts: SweepOptions,
                  emulation: Optional[Mapping[str, Any]],
                  ideal: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """--plan: what one setting would run and about how long it would take (see the PLAN_
    constants), without running it."""
    lb = lower_bound_s(compute_s, gbytes, n // opts.workers_per_host, bw)
    ib = (ideal or {}).get("step_s") or lb
    startup = PLAN_STARTUP_CPU_S * max(n, os.cpu_count() or 1) / (os.cpu_count() or 1)
    steps = opts.warmup + opts.steps + 1
    seconds = sum(startup + steps * (lb * PLAN_MWMS_OVER_BOUND if s.base == "mwms"
                                     else ib * PLAN_PROPHET_OVER_IDEAL) for s in systems)
    return {"model": model, "workers": n, "ratio": ratio, "bandwidth_bps": bw,
            "time_scale": (emulation or {}).get("time_scale"), "compute_s": compute_s,
            "lower_bound_s": lb, "ideal_bound_s": (ideal or {}).get("step_s"),
            "systems": [s.name for s in systems], "estimated_s": seconds}


def format_plan(plan: Sequence[Mapping[str, Any]], skipped: Sequence[str] = ()) -> str:
    """--plan's table: a row per setting with its systems and estimated minutes, then the total
    and what does not fit."""
    lines = ["| model | N | comm/comp | link | time scale | compute ms | bound ms | ideal ms | "
             "systems | estimate |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in plan:
        ideal = f"{p['ideal_bound_s'] * 1e3:.0f}" if p["ideal_bound_s"] else "n/a"
        ratio = f"{p['ratio']:g}" if p["ratio"] else "n/a"
        scale = f"{p['time_scale']:g}" if p["time_scale"] else "n/a"
        lines.append(f"| {p['model']} | {p['workers']} | {ratio} | "
                     f"{format_bandwidth(p['bandwidth_bps'])} | {scale} | "
                     f"{p['compute_s'] * 1e3:.0f} | {p['lower_bound_s'] * 1e3:.0f} | {ideal} | "
                     f"{', '.join(p['systems'])} | {p['estimated_s'] / 60:.1f} min |")
    total = sum(p["estimated_s"] for p in plan)
    lines.append(f"\n{len(plan)} settings, {sum(len(p['systems']) for p in plan)} launches: about "
                 f"{total / 3600:.1f} hours on an idle 2-core machine (plus the layer specs, "
                 "about 30 s per model the first time)")
    lines += [f"- {why}" for why in skipped]
    return "\n".join(lines)


def _step_profile(described: Optional[Mapping[str, Any]], batch: int, opts: SweepOptions,
                  compute_s: float) -> Optional[Any]:
    """The setting's step for the ideal bound: the layer specs' forward and backward times,
    scaled so that they add up to ``compute_s`` (emulated: exactly the emulated accelerator's
    times; real: this machine's measured step split among the layers by their FLOPs, an
    estimate). None without specs."""
    if not described or not described.get("accelerator_s"):
        return None
    from prophet_tf.bench import emulated
    scale = compute_s / described["accelerator_s"]
    return emulated.emulated_profile(described["specs"], batch, opts.accelerator_tflops, scale)


def _ideal(profile: Optional[Any], n: int, bw: Optional[float], opts: SweepOptions,
           compute_s: float, compression: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The ideal bound of a setting and what it is made of: on unshaped links the compute time;
    otherwise from the step profile (None without one). With ``compression``, the bound of the
    systems that compress their gradients so (``gradient_bytes``: the bytes that travel)."""
    if not bw:
        return {"step_s": compute_s, "wait_s": 0.0, "comm_s": 0.0, "binding_layer": None,
                "payload_efficiency": None, "per_layer": None, "gradient_bytes": None}
    if profile is None:
        return None
    from prophet_tf.bench.netem import TBF_FRAME_EFFICIENCY
    efficiency = TBF_FRAME_EFFICIENCY
    try:
        b = ideal_bound(profile, n, bw, efficiency, compression, opts.workers_per_host)
    except Exception as e:  # noqa: BLE001 - the bound is reported missing, the run goes on
        sys.stderr.write(f"  (no ideal bound: {type(e).__name__}: {e})\n")
        return None
    return {"step_s": b.step_s, "wait_s": b.wait_s, "comm_s": b.comm_s,
            "binding_layer": b.binding_layer, "payload_efficiency": efficiency,
            "gradient_bytes": b.gradient_bytes,
            # where the layers' times come from: the emulated accelerator's, or the measured
            # step split by FLOPs
            "per_layer": "accelerator" if opts.compute == "emulated" else "flops"}


def _compressed_bounds(profile: Optional[Any], n: int, bw: Optional[float], opts: SweepOptions,
                       compute_s: float, systems: Sequence[System]
                       ) -> dict[str, dict[str, Any]]:
    """Per gradient compression among ``systems`` (``prophet+bf16``): the bytes its gradients
    travel in and its ideal bound (:func:`make_setting`'s ``compressed``); the lower bound
    follows from the bytes."""
    out: dict[str, dict[str, Any]] = {}
    for c in dict.fromkeys(s.compression for s in systems if s.compression):
        ideal = _ideal(profile, n, bw, opts, compute_s, c)
        out[c] = {"gradient_bytes": (ideal or {}).get("gradient_bytes"),
                  "ideal_bound_s": (ideal or {}).get("step_s"), "ideal": ideal}
    return out


def _emulation_facts(described: Mapping[str, Any], emulation: Mapping[str, Any],
                     bw: Optional[float]) -> dict[str, Any]:
    """What an emulated setting stands for: the modelled accelerator's step and link rate."""
    scale = float(emulation["time_scale"])
    return {"time_scale": scale, "accelerator_tflops": emulation["accelerator_tflops"],
            "spec_path": emulation["spec_path"],
            "accelerator_s": described["accelerator_s"] * scale,
            "modelled_accelerator_s": described["accelerator_s"],
            "modelled_bandwidth_bps": bw * scale if bw else None,
            "step_flops": described["step_flops"], "layers": described["layers"],
            "num_gradients": described["num_gradients"]}


def describe_specs(specs: Sequence[Any], batch: int, tflops: float) -> dict[str, Any]:
    """What the orchestrator needs from a model's layer specs: gradient bytes and count,
    parameters, FLOPs per step and the accelerator's time per step (time scale 1)."""
    from prophet_tf.bench import emulated
    grads = [w for s in specs for w in s.weights if w.trainable]
    return {"layers": len(specs), "num_gradients": len(grads),
            "gradient_bytes": sum(s.gradient_bytes() for s in specs),
            "params": sum(math.prod(w.shape) for w in grads),
            "step_flops": emulated.step_flops(specs, batch),
            "accelerator_s": emulated.accelerator_step_s(specs, batch, tflops)}


def _describe(model: str, cfg: Any, batch: int, opts: SweepOptions,
              progress: _Progress) -> Optional[dict]:
    """The model's layer specs (built once from the real model, by a worker process, and kept in
    ``OUT/specs/`` under a name that depends on the model's configuration) and what the
    orchestrator needs from them (gradient bytes, accelerator time, the specs for the ideal
    bound). Emulated compute runs these layers; real compute uses them for the ideal bound."""
    from prophet_tf.bench import emulated
    path = spec_path(opts.out, model, cfg)
    progress.start(f"{model}: layer specs from the real model (variables, FLOPs)")
    if not os.path.exists(path):
        task = {"compute": opts.compute, "accelerator_tflops": opts.accelerator_tflops,
                "time_scale": 1.0, "spec_path": path}
        try:
            _launch_system("specs", 1, None, cfg.to_dict(), batch, opts, opts.launch_timeout,
                           f"{model}_specs", task)
        except LaunchFailed as e:
            progress.finish("FAILED")
            sys.stderr.write(f"{e}\n")
            return None
    with open(path) as f:
        specs = emulated.specs_from_json(f.read())
    info = dict(describe_specs(specs, batch, opts.accelerator_tflops), spec_path=path,
                specs=specs)
    progress.finish(f"{info['params'] / 1e6:.1f}M parameters in {info['num_gradients']} tensors "
                    f"({info['gradient_bytes'] / 1e6:.1f} MB of gradients), {info['layers']} "
                    f"layers, {info['step_flops'] / 1e12:.2f} TFLOP per step = "
                    f"{info['accelerator_s'] * 1e3:.1f} ms at {opts.accelerator_tflops:g} TFLOP/s")
    return info


def _measure_single(model: str, n: int, cfg: Any, batch: int, opts: SweepOptions,
                    progress: _Progress, emulation: Optional[Mapping[str, Any]]
                    ) -> Optional[tuple[float, int, dict]]:
    """One worker alone, no strategy: ``(compute_s, gradient_bytes, facts)`` or None."""
    what = f"{model}: one worker alone, batch {batch} (compute time"
    log = f"{model}_single"
    if emulation is not None:
        what += f" for N={n}: emulated, time scale {emulation['time_scale']:g}"
        log = f"{model}_n{n}_single"
    progress.start(what + ")")
    try:
        runs, facts = _measure("single", 1, None, cfg, batch, opts, opts.launch_timeout, log,
                               progress, emulation)
    except LaunchFailed as e:
        progress.finish("FAILED")
        sys.stderr.write(f"{e}\n")
        return None
    single = runs[0]
    compute_s, gbytes = single["step_s_median"], int(single["gradient_bytes"])
    progress.finish(f"{compute_s * 1e3:.0f} ms/step, {single['params'] / 1e6:.1f}M "
                    f"parameters in {single['num_gradients']} tensors, {gbytes / 1e6:.1f} MB "
                    f"of gradients{noise_text(facts)}")
    info = {k: single.get(k) for k in ("step_s", "params", "num_gradients", "busy_s_median",
                                       "cpu_s_per_step")}
    info.update(facts)
    return compute_s, gbytes, info


def _measure_contended(model: str, n: int, cfg: Any, batch: int, opts: SweepOptions,
                       progress: _Progress, emulation: Optional[Mapping[str, Any]]
                       ) -> tuple[Optional[float], dict]:
    """N uncoupled single workers at once: the compute time when N workers share this machine."""
    progress.start(f"{model}: {n} independent workers at once (compute time when sharing the "
                   "machine, no communication)")
    try:
        runs, facts = _measure("single", n, None, cfg, batch, opts, opts.launch_timeout,
                               f"{model}_contended_n{n}", progress, emulation)
    except LaunchFailed as e:
        progress.finish("FAILED")
        sys.stderr.write(f"{e}\n")
        return None, {}
    contended = median([r["step_s_median"] for r in runs.values()])
    info = {"step_s_medians": [runs[r]["step_s_median"] for r in sorted(runs)],
            "cpu_s_per_step": [runs[r].get("cpu_s_per_step") for r in sorted(runs)], **facts}
    progress.finish(f"{contended * 1e3:.0f} ms/step{noise_text(facts)}")
    return contended, info


def _run_setting(model: str, n: int, cfg: Any, batch: int, ratio: Optional[float],
                 bw: Optional[float], compute_s: float, gbytes: int, systems: Sequence[System],
                 opts: SweepOptions, progress: _Progress,
                 emulation: Optional[Mapping[str, Any]] = None,
                 ideal: Optional[Mapping[str, Any]] = None,
                 compressed: Optional[Mapping[str, Mapping[str, Any]]] = None) -> dict:
    step_s: dict[str, Optional[float]] = {}
    extra: dict[str, dict[str, Any]] = {}
    per_host = opts.workers_per_host
    where = f"{model}, N={n}" + (f" ({n // per_host} hosts x {per_host})" if per_host > 1 else "") + ", " + (f"comm/comp {ratio:g} at {format_bandwidth(bw)}" if bw
                                   else "loopback (unshaped)")
    def bounds_text(gradient_bytes: Optional[float], ideal: Optional[Mapping[str, Any]]) -> str:
        lb = (lower_bound_s(compute_s, gradient_bytes or 0, n // opts.workers_per_host, bw)
              if gradient_bytes or not bw else None)
        return (f"bound {lb * 1e3:.0f} ms" if lb else "bound n/a") + (
            f", ideal {ideal['step_s'] * 1e3:.0f} ms" if ideal else "")

    bounds = bounds_text(gbytes, ideal)
    # Worst case of the slowest system, plus start-up; generous.
    expected = compute_s * (1 + (ratio or 0)) * (opts.warmup + opts.steps + 1)
    timeout = min(opts.launch_timeout, max(300.0, 120.0 + 4.0 * expected))
    with _make_cluster(n // per_host, bw, opts.loopback, opts.netns_prefix) as cluster:
        for spec in systems:
            system = spec.name
            progress.start(f"{where}: {system}")
            load_before = os.getloadavg()[0]
            log = f"{model}_n{n}_" + (f"ratio{ratio:g}" if ratio else "loopback") + f"_{system}"
            try:
                runs, facts = _measure(system, n, cluster, cfg, batch, opts, timeout, log,
                                       progress, emulation)
            except LaunchFailed as e:
                progress.finish("FAILED")
                sys.stderr.write(f"{e}\n")
                step_s[system] = None
                extra[system] = {"error": str(e).splitlines()[0]}
                continue
            res = runs[0]
            step_s[system] = res["step_s_median"]
            rss = [r.get("max_rss_bytes") for r in runs.values() if r.get("max_rss_bytes")]
            info: dict[str, Any] = {"step_s_all": res.get("step_s"),
                                    "busy_s_median": res.get("busy_s_median"),
                                    "startup_s": res.get("startup_s"),
                                    "first_step_s": res.get("first_step_s"),
                                    "startup_cpu_s": res.get("startup_cpu_s"),
                                    "first_step_cpu_s": res.get("first_step_cpu_s"),
                                    "fit_s": res.get("fit_s"),
                                    "cpu_s_per_step": res.get("cpu_s_per_step"),
                                    "max_rss_bytes": max(rss) if rss else None,
                                    "cpu_allocator": res.get("cpu_allocator"),
                                    "loadavg_1m_before": load_before, **facts}
            if spec.is_prophet:
                info["schedule_effective"] = res.get("schedule_effective")
                info["cross_barrier"] = res.get("cross_barrier")
                info["compression"] = res.get("compression")
                if res.get("runtime_options"):
                    info["runtime_options"] = res["runtime_options"]
                # Summed over the workers that reported: the first whose timer fires opens a
                # deadlock for all, so one worker's count misses rounds another broke first.
                breaks = [r["stall_breaks"] for r in runs.values()
                          if r.get("stall_breaks") is not None]
                info["stall_breaks"] = sum(breaks) if breaks else None
                if spec.base == "auto" and res.get("schedule_in_use"):
                    info["schedule_in_use"] = res["schedule_in_use"]
                    info["schedule_decisions"] = res.get("schedule_decisions")
                    info["note"] = f"ran {res['schedule_in_use']}"
                if res.get("schedule_effective") not in (None, spec.schedule):
                    info["note"] = f"ran {res.get('schedule_effective')}"
                if opts.timeline:
                    info["timeline"] = timeline_pattern(
                        opts.timeline, safe_name(log) + (f"_retry{facts['attempts'] - 1}"
                                                         if facts["attempts"] > 1 else ""))
                    picture = _draw_one_step(info["timeline"], n, opts.warmup + opts.steps // 2,
                                             f"{where}: {system}, one measured step")
                    if picture:
                        info["timeline_png"] = picture
                    if opts.rate_change is not None and bw:
                        k = opts.rate_change[0]
                        info["timeline_png_rate_change"] = [
                            p for s in (k - 1, k, k + 1, k + 2, opts.warmup + opts.steps - 1)
                            if (p := _draw_one_step(info["timeline"], n, s,
                                                    f"{where}: {system}, step {s} (link rate "
                                                    f"changes at step {k})"))]
            extra[system] = info
            after = ""
            if opts.rate_change is not None and bw:
                info["rate_change"] = rate_change_summary(
                    res.get("step_s") or [], opts.warmup, opts.rate_change, compute_s, gbytes, n,
                    bw)
                after = " " + info["rate_change"]["text"]
            own = bounds
            if spec.compression:  # its own bounds: the bytes that travel
                c = (compressed or {}).get(spec.compression) or {}
                own = f"{spec.compression} " + bounds_text(c.get("gradient_bytes"), c.get("ideal"))
            breaks = extra[system].get("stall_breaks")
            if breaks:
                after += f" [{breaks} stall breaks]"
            progress.finish(f"{res['step_s_median'] * 1e3:.0f} ms/step ({own}; "
                            f"launch {launch_text(facts['launch_s'], res)}){after}"
                            f"{noise_text(facts)}")
    return make_setting(model, n, bw, compute_s, gbytes, batch, step_s, ratio=ratio, extra=extra,
                        compute=opts.compute, ideal_bound_s=(ideal or {}).get("step_s"),
                        ideal=ideal, compressed=compressed, workers_per_host=opts.workers_per_host)


def _draw_one_step(pattern: str, n: int, step: int, title: str) -> Optional[str]:
    """Draws step ``step`` of a launch's timeline (all workers) next to its files; returns the
    PNG's path, or None when the traces cannot be drawn (the reason goes to stderr)."""
    from prophet_tf import timeline
    paths = [pattern.replace("{rank}", str(r)) for r in range(n)]
    out = pattern.replace(".{rank}.json", f".step{step}.png")
    try:
        traces = [timeline.load_trace(p) for p in paths]
        window = timeline.step_window(traces[0], step)
        timeline.plot_timeline(traces, out, title=title, window_us=window)
    except (timeline.TraceError, ImportError) as e:
        sys.stderr.write(f"  (no timeline picture: {e})\n")
        return None
    return out
