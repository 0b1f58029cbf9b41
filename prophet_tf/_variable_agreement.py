"""Every worker creates the same variables: checked before each initial value is broadcast.

A variable created under ``ProphetStrategy.scope()`` gets rank 0's initial value through a
broadcast named by the variable's creation index (``init/<k>/<name>``). A model built differently
on one worker (a layer frozen there only, so that its optimizer makes fewer slot variables; an
extra layer; another shape) would make the workers pair different tensors, or wait for a broadcast
that never comes (rank 0's broadcasts end when its data is sent, so rank 0 does not even wait),
until the operation timeout. So before the k-th variable's broadcast every worker allgathers a
fixed-size record of it under ``init/<k>``: a digest of what must be the same everywhere
(the name the variable was created with, its shape and dtype) and a readable description. A
worker that has finished creating variables sends the record "no further variable" under the next
index before its next step or collective (``ProphetExtended._close_variable_creation``), so that
a worker that creates more variables than another is answered too. Every worker sees every
record, so all raise the same :class:`~prophet_tf.errors.VariableMismatchError` at the same
index, naming the first variable that differs and what each rank created there.

The digest covers exactly what the broadcasts already required to match (their name contains the
variable's name; the runtime refuses other shapes and dtypes), so no program that ran before is
refused, except one that created variables on some workers only and never read them.
"""

from __future__ import annotations

import hashlib

import numpy as np

from prophet_tf.errors import VariableMismatchError

#: Bytes of one worker's record (uint8): a digest, then the description (UTF-8, cut, NUL-padded).
RECORD_BYTES = 256
_DIGEST_BYTES = 8
_TEXT_BYTES = RECORD_BYTES - _DIGEST_BYTES

_FIX = ("Every worker must build the same model and optimizer under strategy.scope(), in the same "
        "order: the same layers with the same shapes and dtypes, and the same trainable variables "
        "(freeze a layer on every worker or on none: optimizers such as Adam or SGD with momentum "
        "make their slot variables for the trainable variables only).")


def _record(identity: str, description: str) -> np.ndarray:
    digest = hashlib.blake2b(identity.encode("utf-8"), digest_size=_DIGEST_BYTES).digest()
    text = description.encode("utf-8")[:_TEXT_BYTES]
    return np.frombuffer(digest + text.ljust(_TEXT_BYTES, b"\0"), dtype=np.uint8).copy()


def variable_record(name: str, scope: str, shape, dtype) -> np.ndarray:
    """The record of a variable created with ``name`` in name scope ``scope``, of static
    ``shape`` (a TensorShape, possibly partly unknown) and ``dtype`` (a tf.DType)."""
    dims = "unknown rank" if shape.rank is None else \
        "[" + ", ".join("?" if d is None else str(d) for d in shape.as_list()) + "]"
    identity = "\n".join(["variable", name, dims, dtype.name])
    path = f"{scope}/{name}" if scope else name
    return _record(identity, f"the variable '{path}' (shape {dims} {dtype.name})")


def end_record(created: int) -> np.ndarray:
    """The record of a worker that creates no further variable, having created ``created``."""
    return _record("end", f"no further variable ({created} created in all)")


def _text(record: np.ndarray) -> str:
    return bytes(record[_DIGEST_BYTES:]).rstrip(b"\0").decode("utf-8", errors="ignore")


def check(index: int, gathered: np.ndarray, world_size: int) -> None:
    """Raises VariableMismatchError unless every worker's record of the ``index``-th variable
    (``gathered``: the allgathered records, rank order) has the same digest."""
    records = np.asarray(gathered, dtype=np.uint8).reshape(world_size, RECORD_BYTES)
    digests = [bytes(r[:_DIGEST_BYTES]) for r in records]
    if len(set(digests)) == 1:
        return
    groups: dict[bytes, list[int]] = {}
    for rank, d in enumerate(digests):
        groups.setdefault(d, []).append(rank)
    sides = []
    for ranks in groups.values():
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        sides.append(f"{who}: {_text(records[ranks[0]])}")
    raise VariableMismatchError(
        "ProphetStrategy: the workers created different variables under strategy.scope(), so "
        f"their initial values cannot be broadcast from rank 0. Variable #{index} (in creation "
        f"order) is, on {'; on '.join(sides)}. {_FIX}")
