"""Exception types raised by prophet_tf.

Every error raised by the Python side of prophet_tf derives from :class:`ProphetError`, so callers
can catch one type. Messages name the problem and, where there is one, the fix.
"""

from __future__ import annotations

__all__ = ["ProphetError", "ClusterConfigError", "SaveError", "GradientReductionError", "ResumeError",
           "VariableMismatchError", "JitCompileError"]


class ProphetError(RuntimeError):
    """Base class of all prophet_tf errors (runtime, launcher, cluster set-up)."""


class ClusterConfigError(ProphetError, ValueError):
    """The cluster description (TF_CONFIG or a cluster resolver) is unusable.

    Also a ``ValueError``: the problem is in the configuration the user gave, not in the runtime.
    """


class SaveError(ProphetError):
    """A save failed on another worker, so this worker stops too (the message names the rank and
    its error). Raised instead of the other worker's own exception type when that type is not a
    built-in one."""


class GradientReductionError(ProphetError):
    """A trainable variable would be updated with a gradient that was not summed across workers
    exactly once (each worker would apply its own local gradient and the workers would silently
    diverge). The message names the variable and says how to fix the program.
    """

    # Raised while a tf.function is traced: autograph re-raises an error from user code as its own
    # type only when the type's __init__ is Exception.__init__ (otherwise as a StagingError).
    __init__ = Exception.__init__


class ResumeError(ProphetError):
    """A ``fit`` resumed from a mid-epoch checkpoint cannot continue where the interrupted run
    stopped: its input would not give the batches that run had not applied yet (the message names
    the cause in the input pipeline and the fix)."""


class VariableMismatchError(ProphetError, ValueError):
    """The workers created different variables under the strategy's scope (a model or optimizer
    built differently on some worker: a layer frozen, added or shaped differently there), so
    their initial values cannot be broadcast variable for variable. Raised on every worker at
    once; the message names the first variable that differs, what each rank created there, and
    the fix. Also a ``ValueError``: the program is at fault, not the runtime."""

    # Raised while a tf.function is traced (a step's first collective closes variable creation):
    # autograph re-raises it as its own type only with Exception.__init__ (see
    # GradientReductionError).
    __init__ = Exception.__init__


class JitCompileError(ProphetError, ValueError):
    """An exchange between workers (a sum, broadcast or gather of prophet_tf) inside a function
    that XLA compiles as a whole (``tf.function(jit_compile=True)``): XLA cannot compile an
    operation that waits for other processes. Raised while the function is traced, on every
    worker; the message says how to compile only the computation. Also a ``ValueError``: the
    program asks for something that cannot be compiled."""

    # Raised while a tf.function is traced: autograph re-raises it as its own type only with
    # Exception.__init__ (see GradientReductionError).
    __init__ = Exception.__init__
