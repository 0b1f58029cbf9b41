"""Command line of the predictor.

    python -m prophet_tf.predict PROFILE.json [--workers 2,4,8,16,64] [--bandwidth 1G,10G,25G]
        [--schedule all] [--compression fp16|bf16] [--output predict.png] [--json results.json]
        [--timeline trace.json] [--time_scale S|profile] [--workers_per_host K [--[no]hierarchical]]
        [--costs costs.json [--cost_scale F]]
    python -m prophet_tf.predict calibrate [--out costs.json]

PROFILE.json is a trace recorded by one worker with ``PROPHET_PROFILE=PROFILE.json`` (or worker
0's ``PROPHET_TIMELINE`` trace of a multi-worker run), or a profile saved with ``--save_profile``.
Prints a table of the predicted step time and the speed-up over one worker per schedule, number
of workers and link rate, and draws it (step time and speed-up against workers, one line per
schedule and link rate). ``--timeline`` writes the synthetic Chrome trace of one setting, drawable
next to a real one with ``python -m prophet_tf.timeline``. ``--compression`` predicts
``ProphetStrategy(compression=...)``: the gradients travel in half the bytes (``mwms`` stays
uncompressed); the ideal column is then the bound of the compressed bytes. ``--time_scale``
divides every time of the profile (an emulated benchmark run's, slowed S times, gives the modelled
accelerator's; ``profile``: the S the run recorded). ``--workers_per_host K`` puts K workers on
each host (they share its NIC, loopback between them); under the runtime's default
``hierarchical="auto"`` they take the two-level path (sum on the host first) unless the flat one is
predicted more than 5% faster, as the start-up probe chooses; ``--hierarchical`` forces it
(``"on"``), ``--nohierarchical`` predicts the flat path (``"off"``). ``--costs`` charges the CPU
of each worker's I/O thread that ``calibrate`` measured on this machine (``prophet_tf.predict.costs``).
"""

# absl prints this module's docstring for --help: the usage stays here.
import sys

from absl import app

from prophet_tf.predict.cli import define_flags, main

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "calibrate":
        from prophet_tf.predict.costs import calibrate_main
        sys.exit(calibrate_main(sys.argv[2:]))
    define_flags()
    app.run(main)
