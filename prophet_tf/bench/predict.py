"""How well the predictor (``prophet_tf.predict``) predicts the training benchmark.

    python -m prophet_tf.bench.predict [--quick] [--modes emulated,real] [--out bench_out]
        [any flag of python -m prophet_tf.bench.train]
    python -m prophet_tf.bench.predict --measured bench_out/results.json[,part2/results.json]
        [--out bench_out]

For each compute mode (``--modes``; ``--quick``: emulated only) this runs the settings of
``python -m prophet_tf.bench.train`` with the same flags (its default sweep of that mode, or
``--quick``: one model, 2 workers, comm/comp 1, systems prophet, priority and fifo, 8 steps
after 4 warm-up steps, no re-runs of noisy launches), through its own code, except that emulated compute runs at twice the
benchmark's time scale (``--link_budget_gbps 2``, see :data:`LINK_BUDGET_GBPS`), and for every
setting:

1. **measured**: every system's median step time on the emulated cluster (the training
   benchmark's sweep: ``bench.train.run_sweep``);
2. **profile**: N one-worker ``ProphetStrategy`` runs at once, each recording its profile
   (``profile_path``), with the setting's model, batch, compute mode and time scale. N at once so
   that each worker gets the share of this machine's CPU it gets in the cluster run (real compute,
   the framework, the updates); worker 0's profile is used;
3. **predicted**: ``prophet_tf.predict`` for every system at the setting's link rate (the tc
   rate), modelling the emulated cluster: only egress is shaped (``tbf`` on each host's NIC,
   nothing limits what a host receives), TCP over tbf carries 1448 payload bytes per 1514 that
   tbf counts (``netem.TBF_FRAME_EFFICIENCY``; the acknowledgements going the other way are too
   few to count: GRO acknowledges many segments at once), TensorFlow runs updates on
   ``--inter_threads`` threads, and each socket commits what this machine's kernel lets it hold
   (the runtime's unsent limit plus what TCP queues below the socket, within the send buffer:
   autotuned up to ``net.ipv4.tcp_wmem``'s maximum, or twice a fixed ``socket_buffer_bytes``
   capped at ``net.core.wmem_max``; ``KernelSendBufferBytes`` in ``ops/sim/simulator.h``).

``--measured RESULTS.json`` skips step 1: it predicts the settings that a run of ``python -m
prophet_tf.bench.train`` measured (its ``results.json``, e.g. the default sweep's), recording the
profiles with that run's time scales, batches and options.

It prints predicted vs measured per setting and system, then ``prediction error: median X%,
max Y%`` (absolute relative error over every setting and system). ``--costs FILE`` (``python -m
prophet_tf.predict calibrate --out FILE``) also predicts every system with the workers' CPU
charged (per frame and per byte on their runtimes' I/O threads, which share this machine's
cores as the emulated cluster's workers do) and prints that error too. With an ``auto`` system in the
sweep it also prints how ``schedule="auto"`` compared with the best fixed schedule. Outputs in
``OUT/predict/``: ``predict.md``, ``predict.json`` and ``predict.png`` (predicted against
measured), plus the training benchmark's own outputs per mode and the recorded profiles.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Mapping, Optional, Sequence

from prophet_tf.bench import train

__all__ = ["predict_options", "record_profiles", "predict_setting",
           "errors", "format_table", "summary_line", "plot", "main"]

#: Emulated compute: the N links at comm/comp 1 together, bit/s (the training benchmark's default
#: is 4 Gbit/s): a time scale twice the benchmark's, so that this machine's CPU, which the
#: workers share with each other (and with whatever else runs), sets fewer step times. Every ratio
#: of the modelled cluster is unchanged.
LINK_BUDGET_GBPS = 2.0
#: --quick: these systems, this many steps after this many warm-up steps (five launches of
#: TensorFlow workers; about 2 minutes on an idle 2-core machine, see docs/benchmarks.md).
QUICK_SYSTEMS = ("prophet", "priority", "fifo")
QUICK_STEPS, QUICK_WARMUP = 8, 4
#: The predictor's schedule of each base system of the training benchmark (the same names;
#: ``auto`` has none: it runs one of the others).
SYSTEM_SCHEDULES = {"prophet": "prophet", "prophet_nocross": "prophet_nocross",
                    "priority": "priority", "fifo": "fifo", "bytescheduler": "bytescheduler",
                    "p3": "p3", "mwms": "mwms"}


def predict_options(opts: "train.SweepOptions", system: Optional["train.System"] = None) -> Any:
    """How the emulated cluster of ``opts`` is modelled (see the module docstring), with the
    runtime options of ``system`` (a variant's own over ``--prophet_options``)."""
    from prophet_tf._options import predicted_options
    from prophet_tf.bench.netem import TBF_FRAME_EFFICIENCY
    from prophet_tf.predict import (PredictOptions, kernel_autotuned_socket_buffer,
                                    kernel_socket_buffer_cap)
    runtime = (system.strategy_options(opts.prophet_options) if system is not None
               else dict(opts.prophet_options))
    options = PredictOptions(ingress_limited=False, payload_efficiency=TBF_FRAME_EFFICIENCY,
                             apply_threads=opts.inter_threads, warmup_steps=opts.warmup,
                             steps=opts.steps)
    # The runtime options the predictor models (prophet[hierarchical=on]: the two-level path,
    # over the run's hosts x workers per host).
    for key in predicted_options():
        if key in runtime:
            setattr(options, key, runtime[key])
    options.compression = runtime.get("compression")   # prophet+bf16: half the gradient bytes
    options.workers_per_host = opts.workers_per_host
    # The hosts share this machine's kernel.
    options.max_socket_buffer_bytes = kernel_socket_buffer_cap()
    options.autotuned_socket_buffer_bytes = kernel_autotuned_socket_buffer()
    return options


def record_profiles(setting: Mapping[str, Any], opts: "train.SweepOptions", directory: str,
                    timeout: float = 600.0) -> list[tuple[str, dict]]:
    """Runs ``setting["workers"]`` one-worker ProphetStrategy trainings at once, each recording a
    profile; returns ``(path, the worker's RESULT)`` for each (worker 0 first). Raises
    RuntimeError when one fails."""
    from prophet_tf.bench import models as models_mod
    model = setting["model"]
    cfg = models_mod.config_for(model, opts.compute, **opts.model_overrides.get(model, {}))
    batch = int(setting["global_batch"]) // int(setting["workers"])
    emulation = setting.get("emulation") or {}
    os.makedirs(directory, exist_ok=True)
    paths, procs = [], []
    for i in range(int(setting["workers"])):
        path = os.path.join(directory, f"{model}_n{setting['workers']}_worker{i}.json")
        worker = train.worker_config("prophet", cfg.to_dict(), batch, opts,
                                     _worker_emulation(emulation))
        worker["prophet_options"] = dict(worker.get("prophet_options") or {}, profile_path=path)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (train.repo_root(), os.environ.get("PYTHONPATH")) if p),
            TF_CPP_MIN_LOG_LEVEL="2", PYTHONWARNINGS="ignore")
        for key in ("TF_CONFIG", "PROPHET_TIMELINE", "PROPHET_PROFILE"):
            env.pop(key, None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "prophet_tf.bench.train", "--worker", json.dumps(worker)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        paths.append(path)
    failed, results = [], []
    for i, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        result = [json.loads(line[len("RESULT "):]) for line in out.splitlines()
                  if line.startswith("RESULT ")]
        if proc.returncode != 0 or not os.path.exists(paths[i]) or not result:
            failed.append(f"worker {i} (exit {proc.returncode}): " + "\n".join(out.splitlines()[-15:]))
        results.append(result[-1] if result else {})
    if failed:
        raise RuntimeError("recording a profile failed: " + "\n".join(failed))
    with open(os.path.join(directory, f"{model}_n{setting['workers']}_results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return list(zip(paths, results))


def _worker_emulation(facts: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The worker-config keys of emulated compute of a setting (its ``"emulation"`` facts), or
    None for real compute."""
    if not facts:
        return None
    return {"compute": "emulated", "accelerator_tflops": facts["accelerator_tflops"],
            "time_scale": facts["time_scale"], "spec_path": facts["spec_path"]}


def predict_setting(setting: Mapping[str, Any], profile: Any, opts: "train.SweepOptions",
                    systems: Sequence[str], costs: Optional[dict] = None) -> dict[str, Any]:
    """The prediction (``prophet_tf.predict.Prediction``) of every system of ``setting`` (None:
    the simulated runtime deadlocked; the reason is logged), each with its own runtime options.
    With ``costs`` (``prophet_tf.predict calibrate``) the workers' CPU is charged: their I/O
    threads share this machine's cores, as the emulated cluster's workers do."""
    from prophet_tf.predict import SimulatedDeadlock, predict
    from prophet_tf.predict.costs import apply_costs
    out: dict[str, Any] = {}
    for system in systems:
        spec = train.parse_system(system)
        schedule = SYSTEM_SCHEDULES.get(spec.base)
        if schedule is None:
            continue
        try:
            options = predict_options(opts, spec)
            if costs:
                options = apply_costs(options, costs)
                options.shared_cores = os.cpu_count() or 1
            out[system] = predict(profile, workers=int(setting["workers"]),
                                  bandwidth_bps=float(setting["bandwidth_bps"]), schedule=schedule,
                                  options=options)
        except SimulatedDeadlock as e:
            sys.stderr.write(f"  predicted deadlock: {e}\n")
            out[system] = None
    return out


def errors(rows: Sequence[Mapping[str, Any]], key: str = "predicted_s") -> list[float]:
    """Absolute relative errors |predicted - measured| / measured of the rows with both
    (``key``: ``predicted_cpu_s`` for the predictions with the CPU charged)."""
    return [abs(r[key] - r["measured_s"]) / r["measured_s"] for r in rows
            if r.get(key) and r.get("measured_s")]


def summary_line(rows: Sequence[Mapping[str, Any]], key: str = "predicted_s") -> str:
    errs = errors(rows, key)
    label = "prediction error" + (" with the CPU charged" if key == "predicted_cpu_s" else "")
    if not errs:
        return f"{label}: no setting with both a prediction and a measurement"
    return (f"{label}: median {100 * statistics.median(errs):.1f}%, "
            f"max {100 * max(errs):.1f}%")


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one row per (setting, system)."""
    lines = ["| compute | model | N | comm/comp | link | system | predicted ms | measured ms | error "
             "| stall breaks: predicted / measured |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred, meas = r.get("predicted_s"), r.get("measured_s")
        predicted = f"{pred * 1e3:.0f}" if pred else ("deadlock" if r.get("deadlock") else "n/a")
        measured = f"{meas * 1e3:.0f}" if meas else "n/a"
        err = f"{100 * (pred - meas) / meas:+.1f}%" if pred and meas else "n/a"
        system = r["system"] + (" (noisy)" if r.get("noisy") else "")
        if "predicted_cpu_s" in r:
            charged = r.get("predicted_cpu_s")
            predicted += " / " + (f"{charged * 1e3:.0f}" if charged else "n/a")
            if charged and meas:
                err += f" / {100 * (charged - meas) / meas:+.1f}%"
        breaks = " / ".join("n/a" if r.get(k) is None else str(r[k])
                            for k in ("predicted_stall_breaks", "measured_stall_breaks"))
        lines.append(f"| {r['compute']} | {r['model']} | {r['workers']} | {r['ratio']:g} | "
                     f"{train.format_bandwidth(r['bandwidth_bps'])} | {system} | {predicted} | "
                     f"{measured} | {err} | {breaks} |")
    if any("predicted_cpu_s" in r for r in rows):
        lines.append("\n(predicted and error: without / with the CPU charged)")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Mapping[str, Any]], path: str, title: str = "") -> None:
    """Predicted against measured step time, one marker per system, the diagonal and +-15%."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 6))
    points = [r for r in rows if r.get("predicted_s") and r.get("measured_s")]
    markers = {"emulated": "o", "real": "s"}
    for system in dict.fromkeys(r["system"] for r in points):
        for compute in ("emulated", "real"):
            mine = [r for r in points if r["system"] == system and r["compute"] == compute]
            if mine:
                ax.scatter([r["measured_s"] * 1e3 for r in mine], [r["predicted_s"] * 1e3 for r in mine],
                           marker=markers[compute], label=f"{system} ({compute})", alpha=0.8)
    if points:
        lo = min(min(r["measured_s"], r["predicted_s"]) for r in points) * 1e3 * 0.8
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in points) * 1e3 * 1.2
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="predicted = measured")
        for f, style in ((1.15, ":"), (1 / 1.15, ":")):
            ax.plot([lo, hi], [lo * f, hi * f], color="grey", linewidth=0.6, linestyle=style)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title or summary_line(rows), fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(color="#dddddd", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rows_for(settings: Sequence[Mapping[str, Any]], opts: "train.SweepOptions", directory: str,
              costs: Optional[dict] = None) -> tuple[list[dict], list[str]]:
    """Records a profile per (model, workers, time scale), predicts every setting."""
    from prophet_tf.predict import load_profile
    profiles: dict[tuple, Any] = {}
    rows: list[dict] = []
    notes: list[str] = []
    for st in settings:
        emulation = st.get("emulation") or {}
        key = (st["model"], st["workers"], emulation.get("time_scale"))
        if key not in profiles:
            print(f"  recording profiles: {st['model']}, {st['workers']} one-worker runs at once"
                  + (f", time scale {emulation['time_scale']:g}" if emulation else ""), flush=True)
            t0 = time.monotonic()
            try:
                recorded = record_profiles(st, opts, directory)
                profiles[key] = load_profile(recorded[0][0])
            except Exception as e:  # noqa: BLE001 - reported, the setting is skipped
                sys.stderr.write(f"  {e}\n")
                profiles[key] = None
            else:
                p = profiles[key]
                print(f"    {p.step_s * 1e3:.0f} ms/step on one worker ({p.forward} forward "
                      f"times), {train.launch_text(time.monotonic() - t0, recorded[0][1])}",
                      flush=True)
                notes.extend(n for n in p.notes if n not in notes)
        profile = profiles[key]
        predicted = predict_setting(st, profile, opts, list(st["results"])) if profile else {}
        charged = (predict_setting(st, profile, opts, list(st["results"]), costs)
                   if profile and costs else {})
        for system, res in st["results"].items():
            if train.parse_system(system).base not in SYSTEM_SCHEDULES:
                continue
            foreign = res.get("foreign_cores")
            prediction = predicted.get(system)
            rows.append({"compute": st.get("compute", opts.compute), "model": st["model"],
                         "workers": st["workers"], "ratio": st.get("comm_compute_ratio") or 0.0,
                         "bandwidth_bps": st["bandwidth_bps"], "system": system,
                         "measured_s": res.get("step_s_median"),
                         "predicted_s": prediction.step_s if prediction else None,
                         "deadlock": system in predicted and prediction is None,
                         # bytescheduler's windows opened for a deadlock (worker 0; the
                         # prediction's over its whole run, the measurement's over the launch)
                         "predicted_stall_breaks": prediction.stall_breaks if prediction else None,
                         "measured_stall_breaks": res.get("stall_breaks"),
                         "noisy": isinstance(foreign, (int, float)) and foreign > train.NOISY_CORES,
                         "profile_step_s": profile.step_s if profile else None,
                         **({"predicted_cpu_s": _step_s(charged.get(system))} if costs else {})})
    return rows, notes


def _step_s(prediction: Any) -> Optional[float]:
    return prediction.step_s if prediction else None


def auto_lines(settings: Sequence[Mapping[str, Any]]) -> list[str]:
    """``schedule="auto"`` against the best fixed schedule in every setting that ran it."""
    lines = []
    for st in settings:
        res = st["results"]
        auto = (res.get("auto") or {}).get("step_s_median")
        fixed = {s: (res.get(s) or {}).get("step_s_median") for s in ("prophet", "priority", "fifo")}
        fixed = {s: t for s, t in fixed.items() if t}
        if not auto or not fixed:
            continue
        best = min(fixed, key=fixed.get)
        lines.append(f"auto vs best fixed ({best}): {auto / fixed[best]:.3f} ({st['model']}, "
                     f"N={st['workers']}, comm/comp {st.get('comm_compute_ratio') or 0:g}; auto "
                     f"ran {(res['auto'].get('schedule_in_use') or '?')})")
    return lines


def _use_run_facts(opts: "train.SweepOptions", settings: Sequence[Mapping[str, Any]]) -> None:
    """Sets ``opts`` to what the run that measured ``settings`` used (their ``"run"`` facts:
    steps, threads, ProphetStrategy options); settings without them keep the flags' values."""
    runs = [st["run"] for st in settings if st.get("run")]
    if not runs:
        return
    first = runs[0]
    if any(r != first for r in runs):
        raise ValueError("the measured settings come from runs with different options; give "
                         "one run's results.json")
    opts.steps, opts.warmup = int(first["steps"]), int(first["warmup"])
    opts.intra_threads, opts.inter_threads = int(first["intra_threads"]), int(first["inter_threads"])
    opts.prophet_options = dict(first["prophet_options"])
    per_host = {int(st.get("workers_per_host") or 1) for st in settings}
    if len(per_host) > 1:
        raise ValueError("the measured settings have different workers per host; give one run's "
                         "results.json")
    opts.workers_per_host = per_host.pop() if per_host else 1


def _define_flags() -> None:
    from absl import flags
    train.define_flags()
    flags.DEFINE_list("modes", ["emulated", "real"], "Compute modes to validate (the training "
                      "benchmark's --compute); --quick: emulated.")
    flags.DEFINE_string("costs", None, "Also predict with the workers' CPU charged: the costs of "
                        "python -m prophet_tf.predict calibrate --out FILE, on the I/O threads of "
                        "workers that share this machine's cores.")
    flags.DEFINE_list("measured", None, "results.json of python -m prophet_tf.bench.train (one, "
                      "or the parts of one sweep, comma separated): predict its settings instead "
                      "of measuring them again.")


def main(argv: Sequence[str]) -> int:
    """Entry point (after absl parsed the flags)."""
    from absl import flags
    FLAGS = flags.FLAGS
    done = train.worker_or_bad_arguments(argv, FLAGS)
    if done is not None:
        return done
    modes = ["emulated"] if FLAGS.quick and FLAGS["modes"].using_default_value else list(FLAGS.modes)
    if FLAGS["link_budget_gbps"].using_default_value:
        FLAGS.link_budget_gbps = LINK_BUDGET_GBPS
    if FLAGS.quick:
        for name, value in (("systems", list(QUICK_SYSTEMS)), ("steps", QUICK_STEPS),
                            ("warmup", QUICK_WARMUP), ("retries", 0)):
            if FLAGS[name].using_default_value:
                setattr(FLAGS, name, value)
    bad = [m for m in modes if m not in train.COMPUTE_MODES]
    if bad:
        print(f"error: --modes: unknown {bad}; choose from {', '.join(train.COMPUTE_MODES)}",
              file=sys.stderr)
        return 2
    costs = None
    if FLAGS.costs:
        from prophet_tf.predict.costs import load_costs
        try:
            costs = load_costs(FLAGS.costs)
        except ValueError as e:
            print(f"error: --costs: {e}", file=sys.stderr)
            return 2
    measured: Optional[list] = None
    if FLAGS.measured:
        measured = []
        for path in FLAGS.measured:
            try:
                with open(path) as f:
                    part = json.load(f)
                train.validate_settings(part)
            except (OSError, ValueError) as e:
                print(f"error: --measured {path}: {e}", file=sys.stderr)
                return 2
            measured.extend(part)
        measured_from = ",".join(FLAGS.measured)
        modes = list(dict.fromkeys(st.get("compute", "real") for st in measured))
    out = os.path.join(FLAGS.out, "predict")
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    rows: list[dict] = []
    notes: list[str] = []
    all_settings: list[dict] = []
    for mode in modes:
        FLAGS.compute = mode
        FLAGS.out = os.path.join(out, mode)
        try:
            opts = train.options_from_flags(FLAGS)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        opts.contended = False  # the profiles below are recorded under the same sharing
        if measured is not None:
            settings = [st for st in measured if st.get("compute", "real") == mode]
            if not settings:
                continue
            try:
                _use_run_facts(opts, settings)
            except ValueError as e:
                print(f"error: --measured {measured_from}: {e}", file=sys.stderr)
                return 2
            print(f"[{mode} compute] {len(settings)} settings measured by {measured_from}",
                  flush=True)
        else:
            cells = "; ".join(f"{m} N={[n for n, _ in r]}" for m, r in train.sweep_cells(opts))
            print(f"[{mode} compute] measuring: {cells}; systems "
                  f"{', '.join(s.name for s in opts.systems)}", flush=True)
            try:
                settings = train.run_sweep(opts)
            except KeyboardInterrupt:
                print("\ninterrupted", file=sys.stderr)
                return 130
        all_settings.extend(settings)
        mode_rows, mode_notes = _rows_for(settings, opts, os.path.join(out, "profiles", mode),
                                          costs)
        rows.extend(mode_rows)
        notes.extend(n for n in mode_notes if n not in notes)
    table = format_table(rows)
    summary = summary_line(rows)
    if costs:
        summary += "\n" + summary_line(rows, "predicted_cpu_s")
    autos = auto_lines(all_settings)
    with open(os.path.join(out, "predict.md"), "w") as f:
        f.write(f"# Predicted vs measured step time (python -m prophet_tf.bench.predict "
                f"{' '.join(sys.argv[1:])})\n\n{table}\n" + "".join(f"- {n}\n" for n in notes)
                + "".join(f"{a}\n" for a in autos) + f"\n{summary}\n")
    with open(os.path.join(out, "predict.json"), "w") as f:
        json.dump({"rows": rows, "notes": notes, "auto": autos, "summary": summary}, f, indent=1)
    plot(rows, os.path.join(out, "predict.png"))
    print()
    print(table)
    for n in notes:
        print(f"- {n}")
    for a in autos:
        print(a)
    print(f"\ndone in {time.monotonic() - t0:.0f} s; results in {out}/ (predict.md, predict.json, "
          "predict.png)")
    print(summary)
    return 0 if errors(rows) else 1


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
