"""Small control collectives by owners or by exchange: their predicted latency, the engine's choice.

    python -m prophet_tf.bench.control_latency PROFILE [--workers 2,3,4,...,256]
        [--bandwidth 10G] [--message_cost 6us] [--latency 25us] [--full]

PREDICTIONS ONLY (``prophet_tf.predict``: the runtime's own code replayed over a model of the
links). A control collective (the loss and metric sums, loss-scale flags, the step report's sum)
costs one owner N-1 frames in and N-1 out; by exchange (ops/core/small_allreduce.h) each worker
handles about log2(N) stages of one frame each way, one link latency each. Which is faster
depends on N, on the CPU a frame costs (``--message_cost``, at each end: the simulator's
``message_send_ns``/``message_receive_ns``; 6 us each, about what a frame costs the engine on
this project's test machine, ops/sim/simulator.h) and on the link latency (``--latency``, one
way).

For each N the table gives the latency of the step's control collectives alone (the profile's
compute with its gradients left out, so nothing hides them: the predicted step minus one worker's
step) by owners and by exchange, and the path the engine takes there (its rule,
``SmallAllreduceApplies``, decides with a model every worker assumes alike: 20 us per frame,
25 us latency, 10 Gbit/s). A profile without control collectives gets the three a Keras ``fit``
step makes (8, 8 and 16 bytes, as recorded from examples/keras_fit_demo.py). ``--full`` also
predicts the whole profile both ways (gradients included), whose step hides the control
collectives when the gradients take longer.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

__all__ = ["ControlPoint", "control_only", "control_points", "format_table", "main"]

#: What a Keras ``fit`` step sends as control collectives (the demo model's recorded profile).
KERAS_FIT_CONTROL = (("loss_count", 8), ("loss_tracker_rows", 8), ("metrics/float32/sum", 16))


@dataclasses.dataclass
class ControlPoint:
    """One N: the control collectives' predicted latency by each path and the engine's choice."""

    workers: int
    owners_s: float
    exchange_s: float
    engine: str                        # "exchange" or "owners": the path the engine takes
    full_owners_s: Optional[float] = None    # --full: the whole profile's step, by owners
    full_engine_s: Optional[float] = None    # and as the engine sends it


def control_only(profile):
    """The profile's compute and control collectives, without its gradients, every control
    collective ready at the end of the backward pass (so that no compute hides it; the Keras fit
    step's three if the profile has none)."""
    from prophet_tf.predict import ProfiledTensor
    from prophet_tf.runtime import control_priority
    limit = control_priority()
    control = [dataclasses.replace(t, ready_s=profile.backward_s) for t in profile.tensors
               if t.priority >= limit]
    if not control:
        control = [ProfiledTensor(name, size, limit, profile.backward_s)
                   for name, size in KERAS_FIT_CONTROL]
    return dataclasses.replace(profile, tensors=control)


def control_points(profile, workers: Sequence[int], bandwidth_bps: float, options,
                   full: bool = False) -> list[ControlPoint]:
    """Predicts a :class:`ControlPoint` for each N (``options``: a PredictOptions, the network
    and per-message cost model)."""
    from prophet_tf.predict import predict
    alone = control_only(profile)
    owners = dataclasses.replace(options, small_allreduce=False)
    engine = dataclasses.replace(options, small_allreduce=True)
    exchange = dataclasses.replace(options, small_allreduce="always")
    points = []
    for n in workers:
        def latency(settings) -> float:
            p = predict(alone, workers=n, bandwidth_bps=bandwidth_bps, schedule="priority",
                        options=settings)
            return p.step_s - p.single_step_s
        chosen = predict(alone, workers=n, bandwidth_bps=bandwidth_bps, schedule="priority",
                         options=engine)
        point = ControlPoint(n, latency(owners), latency(exchange),
                             "exchange" if chosen.exchanged_per_step > 0 else "owners")
        if full:
            point.full_owners_s = predict(profile, workers=n, bandwidth_bps=bandwidth_bps,
                                          options=owners).step_s
            point.full_engine_s = predict(profile, workers=n, bandwidth_bps=bandwidth_bps,
                                          options=engine).step_s
        points.append(point)
    return points


def format_table(points: Sequence[ControlPoint]) -> str:
    """Markdown: a row per N; ``*`` marks the path predicted faster."""
    full = any(p.full_owners_s is not None for p in points)
    lines = ["| N | owners us | exchange us | owners / exchange | engine takes |"
             + (" step, owners ms | step, engine ms |" if full else ""),
             "|---|---|---|---|---|" + ("---|---|" if full else "")]
    for p in points:
        faster = "exchange" if p.exchange_s < p.owners_s else "owners"
        agree = "" if p.engine == faster else " (predicted slower)"
        row = (f"| {p.workers} | {p.owners_s * 1e6:.1f} | {p.exchange_s * 1e6:.1f} | "
               f"{p.owners_s / max(p.exchange_s, 1e-12):.2f} | {p.engine}{agree} |")
        if full:
            row += f" {p.full_owners_s * 1e3:.1f} | {p.full_engine_s * 1e3:.1f} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def _define_flags() -> None:
    from absl import flags
    flags.DEFINE_list("workers", ["2", "3", "4", "5", "6", "8", "16", "32", "64", "128", "256"],
                      "Worker counts.")
    flags.DEFINE_string("bandwidth", "10G", "Link rate per worker and direction.")
    flags.DEFINE_string("message_cost", "6us", "CPU time of one frame on a worker's I/O thread: "
                        "SEND,RECEIVE or one value for each end.")
    flags.DEFINE_string("latency", "25us", "One-way link latency per frame.")
    flags.DEFINE_bool("full", False, "Also predict the whole profile (gradients included) both "
                      "ways.")


def main(argv: Sequence[str]) -> int:
    """Entry point (after absl parsed the flags)."""
    import sys
    from absl import flags
    from prophet_tf.predict import PredictError, PredictOptions, ProfileError, load_profile
    from prophet_tf.predict.cli import parse_duration, parse_rate
    FLAGS = flags.FLAGS
    if len(argv) != 2:
        print("usage: python -m prophet_tf.bench.control_latency PROFILE [flags]", file=sys.stderr)
        return 2
    try:
        workers = [int(w) for w in FLAGS.workers]
        cost = [parse_duration(v) for v in FLAGS.message_cost.split(",")]
        if len(cost) not in (1, 2) or any(n < 2 for n in workers):
            raise ValueError("--message_cost: SEND,RECEIVE or one duration; --workers: each at "
                             "least 2")
        options = PredictOptions(latency_s=parse_duration(FLAGS.latency), message_send_s=cost[0],
                                 message_receive_s=cost[-1])
        profile = load_profile(argv[1])
        points = control_points(profile, workers, parse_rate(FLAGS.bandwidth), options, FLAGS.full)
    except (ValueError, ProfileError, PredictError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"control collectives of {argv[1]} alone (gradients left out), {FLAGS.bandwidth}, "
          f"{FLAGS.message_cost} per frame, {FLAGS.latency} latency: their latency per step "
          "by owners and by exchange, and the path the engine takes")
    print(format_table(points))
    return 0


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
