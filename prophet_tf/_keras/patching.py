"""Replacing a Keras method or function once, keeping the original callable."""

from __future__ import annotations

import functools
from typing import Any, Callable


def patch(owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """Replaces ``owner.<name>`` (a class's method or a module's function) by one that calls
    ``wrapper(original, *args, **kwargs)``, once: a second call finds it patched already."""
    original = getattr(owner, name)
    if getattr(original, "_prophet_patched", False):
        return

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    patched._prophet_patched = True
    setattr(owner, name, patched)
