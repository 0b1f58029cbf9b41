"""Whether a ``tf.data`` input gives the same batches in the same order in another process.

A resumed ``fit`` skips the batches the checkpoint's weights already contain by counting them
(``prophet_tf/_keras/fit_session.py``). That is exact only if the restarted program's input yields
the same batches in the same order as the interrupted one's. :func:`describe` walks a dataset (its
input datasets and the functions of its ``map``/``flat_map``/``interleave``...) and lists what
decides the order:

* random operations (``shuffle``, ``Dataset.random``, ``tf.random.*`` in a ``map``, Keras'
  shuffling of arrays) with their seeds: the same seeds give the same order. Seeds are derived from
  TensorFlow's global seed, so a restart keeps the order when that seed is the same (a program
  that sets it, or ``$PROPHET_JOB_SEED``, the same for every attempt of a job);
* random operations without a seed (TensorFlow draws one per process): another order every time;
* ``deterministic=False`` (parallel ``map``/``interleave``/``batch``, or the dataset option):
  elements in the order they are ready, another one every time;
* Python code (``from_generator``, ``py_function``, ``tf.random.Generator`` state): cannot be
  checked from the pipeline.

The description is stored with every backup; :func:`problems` compares the resumed input's with
it. Not visible here: files whose contents or listing changed, and a pipeline that reads state
outside it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

# Op types that run Python or keep random state outside the graph.
_PYTHON_OPS = ("PyFunc", "PyFuncStateless", "EagerPyFunc")


@dataclasses.dataclass
class InputOrder:
    seeded: list = dataclasses.field(default_factory=list)     # "kind(seed,seed2)", walk order
    unseeded: list = dataclasses.field(default_factory=list)
    nondeterministic: list = dataclasses.field(default_factory=list)
    unverifiable: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Optional["InputOrder"]:
        if not isinstance(data, dict):
            return None
        return cls(**{f.name: list(data.get(f.name, [])) for f in dataclasses.fields(cls)})

    @property
    def random(self) -> bool:
        return bool(self.seeded or self.unseeded)


def describe(dataset: Any) -> InputOrder:
    """What decides the order of ``dataset``'s elements (see the module docstring)."""
    order = InputOrder()
    options = dataset.options()
    if getattr(options, "deterministic", None) is False:
        order.nondeterministic.append("options.deterministic=False")
    seen: set[int] = set()
    stack = [dataset]
    while stack:
        ds = stack.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        kind = type(ds).__name__.lstrip("_")
        seed, seed2 = getattr(ds, "_seed", None), getattr(ds, "_seed2", None)
        if seed is not None and seed2 is not None:
            _add_seeds(order, kind, int(seed), int(seed2))
        if getattr(ds, "_deterministic", None) == "false":
            order.nondeterministic.append(f"{kind}(deterministic=False)")
        for wrapper in _functions(ds):
            _describe_function(order, kind, wrapper)
        # Inputs in reverse so that the walk visits them in their order (a stack).
        stack.extend(reversed(list(_inputs(ds))))
    for name in ("unseeded", "nondeterministic", "unverifiable"):  # one line per kind of cause
        setattr(order, name, list(dict.fromkeys(getattr(order, name))))
    return order


def _inputs(ds: Any) -> list:
    try:
        return list(ds._inputs())
    except (AttributeError, NotImplementedError, TypeError):
        return []


def _functions(ds: Any) -> list:
    try:
        return list(ds._functions())
    except (AttributeError, NotImplementedError, TypeError):
        return []


def _add_seeds(order: InputOrder, kind: str, seed: int, seed2: int) -> None:
    if seed == 0 and seed2 == 0:
        order.unseeded.append(kind)
    else:
        order.seeded.append(f"{kind}({seed},{seed2})")


def _describe_function(order: InputOrder, owner: str, wrapper: Any) -> None:
    """Random and Python operations in a dataset function (and the functions it calls)."""
    try:
        graph_def = wrapper.function.graph.as_graph_def()
    except Exception:  # noqa: BLE001 - a function we cannot read is one we cannot check
        order.unverifiable.append(f"{owner}: a function that cannot be inspected")
        return
    bodies = [list(graph_def.node)] + [list(f.node_def) for f in graph_def.library.function]
    for nodes in bodies:
        by_name = {n.name: n for n in nodes}
        for node in nodes:
            _describe_node(order, owner, node, by_name)


def _describe_node(order: InputOrder, owner: str, node: Any, by_name: dict) -> None:
    op = node.op
    where = f"{owner}/{op}"
    if op in _PYTHON_OPS:
        order.unverifiable.append(f"{owner}: Python code ({op}: from_generator or py_function)")
    elif op.startswith("Stateless"):
        return  # seeds are inputs computed in the pipeline: same inputs, same values
    elif op.startswith("Stateful") or op.startswith("Rng"):
        order.unverifiable.append(f"{where}: a tf.random.Generator's state")
    elif "seed" in node.attr and "seed2" in node.attr:
        _add_seeds(order, where, int(node.attr["seed"].i), int(node.attr["seed2"].i))
    elif "Dataset" in op and ("Shuffle" in op or "Random" in op):
        seeds = _seed_inputs(node, by_name)
        if seeds is not None:
            _add_seeds(order, where, *seeds)
        else:
            order.unverifiable.append(f"{where}: seeds computed in the pipeline")
    if node.attr.get("deterministic") is not None and node.attr["deterministic"].s == b"false":
        order.nondeterministic.append(f"{where}(deterministic=False)")


def _seed_inputs(node: Any, by_name: dict) -> Optional[tuple[int, int]]:
    """The constant ``seed`` and ``seed2`` inputs of a dataset op, or None."""
    from tensorflow.python.framework import op_def_registry

    op_def = op_def_registry.get(node.op)
    if op_def is None:
        return None
    names = [arg.name for arg in op_def.input_arg]
    inputs = [i for i in node.input if not i.startswith("^")]
    if "seed" not in names or "seed2" not in names or len(inputs) < len(names):
        return None
    seed = _constant(by_name, inputs[names.index("seed")])
    seed2 = _constant(by_name, inputs[names.index("seed2")])
    return None if seed is None or seed2 is None else (seed, seed2)


def _constant(by_name: dict, reference: str) -> Optional[int]:
    """The integer a Const node feeding ``reference`` ("name:output:0", "name:0", "^name")
    holds, or None."""
    if reference.startswith("^"):
        return None
    node = by_name.get(reference.split(":")[0])
    if node is None or node.op != "Const":
        return None
    from tensorflow.python.framework import tensor_util
    try:
        value = tensor_util.MakeNdarray(node.attr["value"].tensor)
    except Exception:  # noqa: BLE001
        return None
    return int(value) if value.size == 1 else None


def problems(recorded: Optional[InputOrder], current: InputOrder) -> list[str]:
    """Why skipping batches by count would not continue the interrupted run's order (empty: it
    would, as far as the pipeline shows). ``recorded`` is the description stored with the
    backup (None for a backup without one)."""
    out = []
    if current.unseeded:
        out.append("random operations without a seed (another order in every process): "
                   + ", ".join(current.unseeded))
    if current.nondeterministic:
        out.append("elements in the order they are ready (another order every time): "
                   + ", ".join(current.nondeterministic))
    if recorded is not None and recorded.seeded != current.seeded:
        out.append("the random seeds of the input differ from those of the interrupted run "
                   f"(then {recorded.seeded}, now {current.seeded}): TensorFlow's global seed "
                   "changed")
    return out
