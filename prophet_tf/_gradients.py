"""A gradient's identity in a multi-worker `ProphetStrategy` run: which variable it belongs to, how
it was reduced, and that the update used it.

Keras applies gradients in ``TFOptimizer._backend_update_step(grads, variables, learning_rate)``:
it all-reduces the gradients (``ReplicaContext.all_reduce`` -> ``extended.batch_reduce_to``), then
calls ``extended.update(variable, apply_fn, (gradient, learning_rate))`` once per variable. One
:class:`GradientSite` describes one such call. It is keyed by the variable *objects* the step
updates (never by names: the TensorFlow name of a variable of a nested layer carries only the
outer layer's scope, and two variables may share it). For each it records how the gradient was
reduced:

* ``summed``: a dense ``push_pull`` in the step (synchronous);
* ``gathered``: ``tf.IndexedSlices`` (e.g. ``Embedding``): indices and values all-gathered, repeated
  indices kept, exactly what one process on the global batch would apply;
* ``deferred``: crossing the barrier; the step passes the LOCAL gradient on and the asynchronous
  update (``ProphetAsyncApply``) sums it before applying it;

and how many updates used it. The run fails closed (:class:`~prophet_tf.errors.
GradientReductionError`, naming the variable) when

1. the optimizer step runs outside this strategy's replica context (a cross-replica context, or
   a custom loop that does not call ``strategy.run``): Keras's all-reduce would return each
   worker's local gradients;
2. an update inside the optimizer step concerns a trainable variable whose gradient this step did
   not reduce (or reduced and already applied);
3. at the end of the step a gradient was not reduced exactly once and applied exactly once (a
   deferred gradient that no update consumed would silently skip that variable's update).

The checks run in Python: once per trace in a ``tf.function`` (nothing at run time), per call when
eager. Updates of trainable variables outside the optimizer step (weight decay, EMA, constraints,
direct ``assign`` calls in user code) are not checked: they are not gradient applications.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from prophet_tf.errors import GradientReductionError

SUMMED, GATHERED, DEFERRED = "summed", "gathered", "deferred"
_FIX = ("compute and apply the gradients inside `strategy.run(step_fn, args=...)` (model.fit and "
        "a Keras `train_step` already run there)")


def variable_path(v: Any) -> str:
    """A readable, worker-independent name of a (Keras or TensorFlow) variable."""
    path = getattr(v, "path", None)
    if not path:
        path = getattr(v, "name", None) or "variable"
        if path.endswith(":0"):
            path = path[:-2]
    return str(path)


def tf_variable(v: Any) -> Any:
    """The TensorFlow variable behind a Keras variable (the object ``extended.update`` receives)."""
    from keras.src import backend
    return v.value if isinstance(v, backend.Variable) else v


def _listing(paths: Iterable[str], limit: int = 6) -> str:
    paths = list(paths)
    shown = ", ".join(repr(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


@dataclass
class Gradient:
    """One gradient of one optimizer step."""
    variable: Any              # the tf.Variable the update receives
    path: str                  # its Keras path, for messages
    name: str                  # the collective's name, identical on every worker
    priority: int              # larger is sent earlier (first layer highest)
    reduced: str = ""          # SUMMED, GATHERED or DEFERRED once reduced
    applied: int = 0


@dataclass
class GradientSite:
    """The gradients of one ``_backend_update_step`` call, in Keras's order."""
    optimizer: Any
    gradients: list
    reduced: bool = False      # the step's gradient all-reduce has happened
    _by_variable: dict = field(default_factory=dict)

    @classmethod
    def create(cls, optimizer: Any, keras_variables: list, names: list) -> "GradientSite":
        n = len(keras_variables)
        grads = [Gradient(tf_variable(v), variable_path(v), name, n - i)
                 for i, (v, name) in enumerate(zip(keras_variables, names))]
        site = cls(optimizer, grads)
        for g in grads:
            site._by_variable.setdefault(id(g.variable), []).append(g)
        return site

    def __len__(self) -> int:
        return len(self.gradients)

    def paths(self) -> list:
        return [g.path for g in self.gradients]

    def take_for_update(self, variable: Any) -> Optional[Gradient]:
        """The reduced gradient an update of ``variable`` inside this step applies.

        Returns None for a non-trainable variable this step has no gradient for (not a gradient
        application). Raises GradientReductionError otherwise when there is no reduced, unused
        gradient for the variable.
        """
        candidates = self._by_variable.get(id(variable), [])
        if not candidates:
            if not getattr(variable, "trainable", False):
                return None
            raise GradientReductionError(
                f"ProphetStrategy: the optimizer step updates trainable variable "
                f"'{variable_path(variable)}', but it has no gradient among those this step summed "
                f"across workers ({_listing(self.paths())}): the update would use a local value "
                f"and the workers would diverge. Pass the variable and its gradient to the same "
                f"optimizer.apply() call; {_FIX}.")
        for g in candidates:
            if not g.applied:
                if not g.reduced:
                    raise GradientReductionError(
                        f"ProphetStrategy: the gradient of trainable variable '{g.path}' is about to "
                        f"be applied without having been summed across workers (each worker would "
                        f"apply its own local gradient and the workers would silently diverge); "
                        f"{_FIX}.")
                g.applied += 1
                return g
        raise GradientReductionError(
            f"ProphetStrategy: the optimizer step applies the gradient of trainable variable "
            f"'{candidates[0].path}' more often than it reduced it ({len(candidates)} time(s)).")

    def verify(self) -> collections.Counter:
        """Checks that every gradient was reduced and applied exactly once; returns the counts of
        each reduction kind."""
        if not self.reduced:
            raise GradientReductionError(
                f"ProphetStrategy: the gradients of {_listing(self.paths())} were applied without "
                f"being summed across workers (the optimizer's all-reduce did not reach this "
                f"strategy); {_FIX}.")
        unused = [g for g in self.gradients if g.applied != 1]
        if unused:
            deferred = [g.path for g in unused if g.reduced == DEFERRED]
            if deferred:
                raise GradientReductionError(
                    f"ProphetStrategy: the gradients of {_listing(deferred)} were handed to the "
                    f"asynchronous update but no update of these variables went through this "
                    f"strategy: their updates would be skipped. (Does a custom optimizer apply "
                    f"updates without `strategy.extended.update`?)")
            raise GradientReductionError(
                f"ProphetStrategy: the gradients of {_listing(g.path for g in unused)} were summed "
                f"across workers but not applied exactly once through this strategy's "
                f"`extended.update` (applied "
                f"{', '.join(str(g.applied) for g in unused[:6])} time(s)).")
        return collections.Counter(g.reduced for g in self.gradients)


def outside_replica_context_error(paths: list, cross_replica: bool) -> GradientReductionError:
    where = ("in a cross-replica context (inside `strategy.scope()` or a `merge_call`, but not in "
             "`strategy.run`)" if cross_replica else
             "outside the strategy (a custom loop that does not call `strategy.run`)")
    return GradientReductionError(
        f"ProphetStrategy: optimizer.apply()/apply_gradients() runs {where}, where gradients are not "
        f"summed across workers: every worker would update {_listing(paths)} with its own local "
        f"gradient and the workers would silently diverge. To fix: {_FIX}.")
