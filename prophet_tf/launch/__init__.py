"""Start prophet_tf workers: ``prophetrun`` (the same program as ``python -m prophet_tf.launch``).

Usage::

    prophetrun -n 2 [options] [--] script.py [script args]        # 2 workers on this machine
    prophetrun -np 2 script.py                                      # horovodrun spelling
    prophetrun -n 2 -- -m package.module [args]                    # run a module
    prophetrun -n 2 -- /path/to/executable [args]                  # anything else
    prophetrun --nnodes 2 --node-rank R --master HOST:PORT -n 4 train.py   # on every node
    prophetrun -H node1:4,node2:4 train.py                          # over ssh, from one machine
    prophetrun -n 4 --max-restarts 3 train.py                      # restart after a preemption/failure
    prophetrun --nnodes 2:4 [--node-rank R] --master HOST:PORT -n 4 train.py   # elastic (see ``elastic``)

Each worker gets ``TF_CONFIG`` (``{"cluster": {"worker": [...]}, "task": {"type": "worker",
"index": rank}}``), the job token ``PROPHET_JOB_TOKEN`` (fresh for each job), ``PYTHONUNBUFFERED=1``,
``PROPHET_LOCAL_RANK`` / ``PROPHET_LOCAL_SIZE`` (its index among the workers of its node, their
number), ``CUDA_VISIBLE_DEVICES`` = its own GPU (its local rank) unless that variable is set, and
``PYTHONPATH`` led by the directory this ``prophet_tf`` was imported from when it is not installed
(so a script anywhere on disk imports the same package). Every output line is prefixed with
``[rank i]`` (stdout stays stdout, stderr stays stderr); ``--log-dir D`` also writes each rank's
output to ``D/rank.i.log``. When a worker exits non-zero the others are stopped (SIGTERM, then
SIGKILL after ``--grace`` seconds), and the launcher reports the worker that failed FIRST (the one
whose Python traceback, or death, came earliest: the others usually fail because it died) with the
tail of its stderr. SIGINT and SIGTERM are forwarded to the workers (SIGKILL after the grace, or
at once on a second signal); SIGTERM asks them for the coordinated preemption checkpoint, and they
get their preemption grace period for it.

Restarts (``--max-restarts N``, see ``restarts``): after a worker ended an attempt (a preemption or
a failure) every worker is restarted, on fresh ports with a fresh token, and the unchanged program
resumes from its checkpoint; not after the same failure at the same place twice, a timeout or a
signal to the launcher. The launcher sets ``PROPHET_JOB_SEED`` once per job (unless it is set),
the same in every attempt, and ``PROPHET_CHECKPOINT_DIR`` with ``--checkpoint-dir``.

Several machines: every node's launcher meets the master's (node 0's, at ``--master``), which
assigns the ranks node by node (node 0 gets ranks 0..K-1), collects each node's worker addresses
(free ports unless ``--base-port``) and hands every worker the same fresh token derived from
``PROPHET_JOB_TOKEN`` (the shared secret every node's launcher needs; ``-H`` creates one and hands
it over ssh). A failure on any node stops every node's workers, and every launcher names the same
first failure and exits with its status. See ``rendezvous`` for the protocol and its rules.

Elastic jobs (``--nnodes MIN:MAX``, see ``elastic``): the job runs with the nodes present and
forms again from its checkpoint when one is lost (killed, cut off), leaves (its launcher got
SIGTERM) or arrives; the workers of an elastic job get ``PROPHET_ELASTIC=1``.

Exit status: 0 success; the failing worker's status (128+signal if it was killed) on a worker
failure (the last one when restarts are used up or refused); 75 when a launcher got SIGTERM and
every worker wrote its preemption checkpoint (run the job again to resume it), also on a node
that left an elastic job; 124 on ``--timeout``; 128+signal when a launcher was interrupted; 1 when
the job failed outside any worker (the rendezvous did not complete, a node or the master was
lost); 69 when an elastic job had fewer than MIN nodes for ``--rdzv-timeout``; 127 when a worker
could not be started; 2 on usage errors.

Programmatic use (tests, benchmarks): :func:`launch` (one machine, every attempt). One attempt of
one node's workers is :func:`prophet_tf.launch.workers.run_workers`; one node of a multi-node job,
every attempt, :func:`prophet_tf.launch.node.run_node`.
"""

from prophet_tf.launch.cli import launch, main
from prophet_tf.launch.workers import (EXIT_JOB_FAILED, EXIT_TIMEOUT, free_ports, package_root,
                                       worker_envs)

__all__ = ["launch", "main", "free_ports", "worker_envs", "package_root", "EXIT_TIMEOUT",
           "EXIT_JOB_FAILED"]
