"""How the Keras glue recognises a :class:`prophet_tf.ProphetStrategy` without importing it.

The strategy imports this package, never the other way: the hooks find a Prophet strategy by its
``extended`` being a :class:`KerasHost`, which ``ProphetExtended`` derives from.
"""

from __future__ import annotations

from typing import Any, Optional


class KerasHost:
    """Base of the strategy's ``extended`` (``prophet_tf.strategy.ProphetExtended``).

    The glue relies on these members of it:

    * who: ``_rank``, ``_world_size``, ``_multi`` (several workers), ``_communicates`` (several
      workers, or one recording a profile), ``_cross_barrier``, ``_compression``;
    * ``collectives`` (``prophet_tf._collectives.Collectives``): collectives named the same on
      every worker (``site(kind)``, ``push_pull``, ``broadcast``, ``allgather``) and Keras's
      cross-worker reductions (``reduce_metric_state``, ``all_finite``);
    * Keras's cross-worker steps: ``_optimizer_update_step``, ``clips_after_reduction``,
      ``_gathering_outputs``, ``_compiling_steps`` (``jit_compile=True``);
    * what the strategy was created with: ``_auto_schedule``, ``_step_reporter``,
      ``_checkpoint_dir``, ``_fit_count``.
    """


def host_of(strategy: Any) -> Optional[KerasHost]:
    """The ``extended`` of ``strategy`` when it is a ProphetStrategy (any number of workers), else
    None."""
    extended = getattr(strategy, "extended", None)
    return extended if isinstance(extended, KerasHost) else None


def communicating_host(strategy: Any) -> Optional[KerasHost]:
    """The ``extended`` of ``strategy`` when it is a ProphetStrategy whose steps communicate
    (several workers, or one recording a profile), else None."""
    host = host_of(strategy)
    return host if host is not None and host._communicates else None
