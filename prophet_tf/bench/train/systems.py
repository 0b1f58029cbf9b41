"""The systems the training benchmark compares, and how a system is named.

A system is a base system, optionally with modifiers and with ProphetStrategy options::

    SYSTEM   := BASE ("+" MODIFIER)* ["[" KEY "=" VALUE ("," KEY "=" VALUE)* "]"]

* ``BASE`` is one of :data:`BASE_SYSTEMS`: ``ProphetStrategy`` with a schedule and barrier
  crossing (:data:`PROPHET_BASES`), or TensorFlow's ``mwms``.
* ``MODIFIER`` names a bundle of ProphetStrategy options registered in :data:`MODIFIERS`: the
  gradient compressions, ``fp16`` and ``bf16`` (``prophet+bf16`` runs ``prophet`` with
  ``compression="bf16"``). ``--compression fp16,bf16`` adds ``BASE+fp16`` and ``BASE+bf16``
  after every ProphetStrategy system of the run (:func:`with_compressions`). A compressed
  system's bounds are its own: they count the bytes that travel (:attr:`System.compression`).
* ``[KEY=VALUE,...]`` sets ProphetStrategy keyword arguments for this system only, over
  ``--prophet_options``; each VALUE is read as JSON (numbers, ``true``/``false``, ``null``,
  quoted strings) or else taken as a plain string: ``prophet[socket_buffer_bytes=1048576]``.
  ``compression`` is not an option: the name must say it (``+fp16``), as the bounds depend on it.

Several variants of one base run side by side in one sweep, e.g. ``--systems
'prophet,prophet[socket_buffer_bytes=1048576],priority'``. A system's name, exactly as
:func:`parse_system` writes it back, is its key in the JSON ``results`` and its label in the
table. Only ProphetStrategy systems take modifiers and options.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

__all__ = ["BASE_SYSTEMS", "SYSTEMS", "PROPHET_BASES", "MODIFIERS", "COMPRESSION_OPTION",
           "QUICK_SYSTEMS", "EMULATED_DEFAULT_SYSTEMS", "System", "parse_system", "parse_systems",
           "split_systems", "compressions", "with_compressions"]

#: ProphetStrategy schedule and barrier crossing of each ProphetStrategy base system.
PROPHET_BASES = {
    "prophet": ("prophet", True),
    "prophet_nocross": ("prophet", False),
    "priority": ("priority", True),
    "fifo": ("fifo", True),
    "auto": ("auto", True),   # the schedule the predictor expects to be fastest (rank 0 decides)
    # The published schedulers as their code defines them (docs/design.md, "The published
    # schedulers"); both let the next forward pass start layer by layer, as their frameworks do.
    "bytescheduler": ("bytescheduler", True),
    "p3": ("p3", True),
}
#: The base systems: ProphetStrategy's and TensorFlow's MultiWorkerMirroredStrategy.
BASE_SYSTEMS = tuple(PROPHET_BASES) + ("mwms",)
#: Every base system, in the order of the table (the default with real compute and ``--full``).
SYSTEMS = BASE_SYSTEMS
#: ``--quick``'s systems: ``auto`` runs one of the others (the one the predictor picks), so the
#: quick run leaves it out unless ``--systems`` names it; one launch less.
QUICK_SYSTEMS = ("prophet", "prophet_nocross", "priority", "fifo", "mwms")
#: The emulated-compute sweeps' systems without ``--full``: what the goals compare (prophet
#: against priority, fifo, the published ByteScheduler and P3, and MultiWorkerMirroredStrategy);
#: ``prophet_nocross`` and ``auto`` add a launch per setting each and come with ``--full`` or
#: ``--systems``.
EMULATED_DEFAULT_SYSTEMS = ("prophet", "priority", "fifo", "bytescheduler", "p3", "mwms")
#: The ProphetStrategy option the compression modifiers set.
COMPRESSION_OPTION = "compression"


def compressions() -> tuple[str, ...]:
    """The gradient compressions the runtime offers (``"fp16"``, ``"bf16"``), from the core
    (the TensorFlow-free library: no TensorFlow needed to name a system)."""
    from prophet_tf._library import runtime_constants
    return tuple(runtime_constants()["compressions"])


#: Modifier -> the ProphetStrategy options it stands for (see the module docstring).
MODIFIERS: dict[str, dict[str, Any]] = {c: {COMPRESSION_OPTION: c} for c in compressions()}

_NAME = re.compile(r"^([a-z_][a-z0-9_]*)((?:\+[A-Za-z0-9_]+)*)(?:\[(.*)\])?$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class System:
    """One system of the sweep (see the module docstring)."""

    base: str
    modifiers: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()   # [KEY=VALUE,...], in the order given

    @property
    def name(self) -> str:
        """The canonical name: the JSON key and table label."""
        text = self.base + "".join(f"+{m}" for m in self.modifiers)
        if self.options:
            text += "[" + ",".join(f"{k}={_format_value(v)}" for k, v in self.options) + "]"
        return text

    @property
    def is_prophet(self) -> bool:
        """Runs ProphetStrategy (not TensorFlow's MultiWorkerMirroredStrategy)."""
        return self.base in PROPHET_BASES

    @property
    def schedule(self) -> Optional[str]:
        return PROPHET_BASES[self.base][0] if self.is_prophet else None

    @property
    def cross_barrier(self) -> Optional[bool]:
        return PROPHET_BASES[self.base][1] if self.is_prophet else None

    @property
    def compression(self) -> Optional[str]:
        """The gradient compression its modifiers ask for (None: exact)."""
        found = None
        for m in self.modifiers:
            found = MODIFIERS[m].get(COMPRESSION_OPTION, found)
        return found

    @property
    def is_variant(self) -> bool:
        """Has modifiers or options of its own."""
        return bool(self.modifiers or self.options)

    def strategy_options(self, common: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """ProphetStrategy keyword arguments: ``common`` (``--prophet_options``), then the
        modifiers' options, then this system's own (later ones win)."""
        out = dict(common or {})
        for m in self.modifiers:
            out.update(MODIFIERS[m])
        out.update(self.options)
        return out

    def __str__(self) -> str:
        return self.name


def _format_value(value: Any) -> str:
    if isinstance(value, str) and not _looks_like_json(value):
        return value
    return json.dumps(value, separators=(",", ":"))


def _looks_like_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_system(text: str) -> System:
    """``"prophet[socket_buffer_bytes=1048576]"`` -> :class:`System`.

    Raises:
      ValueError: the name is not of the form in the module docstring, the base or a modifier is
        unknown, an option is repeated or malformed, or a non-ProphetStrategy system has any.
    """
    text = text.strip()
    m = _NAME.match(text)
    if not m:
        raise ValueError(f"system {text!r}: expected BASE[+MODIFIER...][KEY=VALUE,...], e.g. "
                         "prophet or prophet[socket_buffer_bytes=1048576]")
    base, mods, body = m.group(1), m.group(2), m.group(3)
    if base not in BASE_SYSTEMS:
        raise ValueError(f"system {text!r}: unknown base system {base!r}; choose from "
                         f"{', '.join(BASE_SYSTEMS)}")
    modifiers = tuple(x for x in mods.split("+") if x)
    for mod in modifiers:
        if mod not in MODIFIERS:
            raise ValueError(f"system {text!r}: unknown modifier {mod!r} (known: "
                             f"{', '.join(MODIFIERS) or 'none yet'})")
    options: list[tuple[str, Any]] = []
    if body is not None:
        if not body.strip():
            raise ValueError(f"system {text!r}: empty [...]; give KEY=VALUE pairs or drop it")
        for item in _split_top_level(body):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not _KEY.match(key) or not value.strip():
                raise ValueError(f"system {text!r}: option {item!r} is not KEY=VALUE")
            if key == "schedule":
                raise ValueError(f"system {text!r}: the base system sets the schedule; name "
                                 f"another base ({', '.join(PROPHET_BASES)}) instead")
            if key == COMPRESSION_OPTION:
                raise ValueError(f"system {text!r}: name the compression as a modifier "
                                 f"({' or '.join(f'{base}+{c}' for c in compressions())}), so "
                                 "that its name and bounds say it")
            if any(k == key for k, _ in options):
                raise ValueError(f"system {text!r}: option {key!r} given twice")
            options.append((key, _parse_value(value.strip())))
    if sum(1 for m in modifiers if COMPRESSION_OPTION in MODIFIERS[m]) > 1:
        raise ValueError(f"system {text!r}: more than one compression")
    if (modifiers or options) and base not in PROPHET_BASES:
        raise ValueError(f"system {text!r}: only ProphetStrategy systems "
                         f"({', '.join(PROPHET_BASES)}) take modifiers or options")
    return System(base, modifiers, tuple(options))


def _split_top_level(text: str) -> list[str]:
    """Splits at the commas outside brackets and JSON strings."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, c in enumerate(text):
        if c == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif quoted:
            continue
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def split_systems(value: Union[str, Sequence[str]]) -> list[str]:
    """The system names in a ``--systems`` value: a comma-separated string, or the list absl's
    list flag made of it (which also cut at the commas inside ``[...]``: put back together)."""
    text = value if isinstance(value, str) else ",".join(value)
    return [p.strip() for p in _split_top_level(text) if p.strip()]


def parse_systems(value: Union[str, Sequence[str], Iterable[System]]) -> list[System]:
    """Every system of a ``--systems`` value (see :func:`split_systems`), in order; a name given
    twice is an error."""
    items = list(value) if not isinstance(value, str) else [value]
    if items and all(isinstance(s, System) for s in items):
        systems = list(items)
    else:
        systems = [parse_system(s) for s in split_systems([str(s) for s in items])]
    names = [s.name for s in systems]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"system(s) {', '.join(twice)} given twice")
    if not systems:
        raise ValueError("no system to run")
    return systems


def with_compressions(systems: Sequence[System], names: Sequence[str]) -> list[System]:
    """``systems`` with, after each ProphetStrategy system without a compression, the same
    system compressed with each of ``names`` (``--compression``): ``prophet, mwms`` with
    ``fp16, bf16`` -> ``prophet, prophet+fp16, prophet+bf16, mwms``. A system already in
    ``systems`` is not added twice.

    Raises:
      ValueError: an unknown compression name.
    """
    known = compressions()
    bad = [c for c in names if c not in known]
    if bad:
        raise ValueError(f"unknown compression(s) {bad}; choose from {', '.join(known)}")
    out: list[System] = []
    present = {s.name for s in systems}
    for s in systems:
        out.append(s)
        if not s.is_prophet or s.compression is not None:
            continue
        for c in names:
            extra = System(s.base, s.modifiers + (c,), s.options)
            if extra.name not in present:
                out.append(extra)
                present.add(extra.name)
    return out
