"""Exception types raised by prophet_tf.

Every error raised by the Python side of prophet_tf derives from :class:`ProphetError`, so callers
can catch one type. Messages name the problem and, where there is one, the fix.
"""

from __future__ import annotations

__all__ = ["ProphetError", "ClusterConfigError"]


class ProphetError(RuntimeError):
    """Base class of all prophet_tf errors (runtime, launcher, cluster set-up)."""


class ClusterConfigError(ProphetError, ValueError):
    """The cluster description (TF_CONFIG or a cluster resolver) is unusable.

    Also a ``ValueError``: the problem is in the configuration the user gave, not in the runtime.
    """
