"""The runtime's options, read from the one table that defines them (ops/core/engine_options.def,
exported by the TensorFlow-free library): what ``prophet_tf.runtime.init`` and ``ProphetStrategy``
accept, which of them the predictor models, how a value travels to the engine, and the README's
options table.

Nothing here keeps a default or a range of its own: the engine checks every value it is given
and answers with an error naming the option, what it accepts and what came.

``python -m prophet_tf._options --markdown`` prints the README's table of the runtime's options.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any, Optional, Sequence

from prophet_tf._library import runtime_constants

#: Where the README holds the generated table.
README_BEGIN = "<!-- runtime-options:begin (python -m prophet_tf._options --markdown) -->"
README_END = "<!-- runtime-options:end -->"


@dataclasses.dataclass(frozen=True)
class RuntimeOption:
    """One row of the engine's option table."""

    name: str
    type: str                          # int, uint, float, bool, string or list
    default: Any
    accepts: str                       # what the engine accepts beyond the type ("" if nothing)
    specials: tuple[tuple[float, str], ...]  # values outside the range with a meaning of their own
    choices: tuple[str, ...]           # the names a text option takes (empty: any text)
    job: bool                          # the job's identity (rank, addresses...), not a setting
    predicted: bool                    # the predictor models it (a PredictOptions field)
    env: Optional[str]                 # read when the caller gives no value
    doc: str


@functools.lru_cache(maxsize=None)
def runtime_options() -> dict[str, RuntimeOption]:
    """Every option of the engine by name, in the table's order."""
    return {row["name"]: RuntimeOption(
        name=row["name"], type=row["type"], default=row["default"], accepts=row["accepts"],
        specials=tuple((value, means) for value, means in row["specials"]),
        choices=tuple(row["choices"]), job=row["use"] == "job", predicted=bool(row["predicted"]),
        env=row["env"], doc=row["doc"]) for row in runtime_constants()["options"]}


def user_options() -> dict[str, RuntimeOption]:
    """The options a user sets (``runtime.init``'s and ``ProphetStrategy``'s keyword arguments)."""
    return {name: o for name, o in runtime_options().items() if not o.job}


def predicted_options() -> tuple[str, ...]:
    """The names of the options the predictor models (fields of ``PredictOptions``)."""
    return tuple(name for name, o in runtime_options().items() if o.predicted)


def from_environment(name: str) -> Optional[str]:
    """The value option ``name`` takes from its environment variable; None if it has none or
    the variable is unset or blank."""
    env = runtime_options()[name].env
    text = os.environ.get(env, "").strip() if env else ""
    return text or None


def to_text(name: str, value: Any) -> str:
    """``value`` of option ``name`` as the engine's ``key=value`` line takes it.

    Only the value's kind is checked here (the engine checks the rest and names what it accepts).

    Raises:
      ValueError: the value cannot be written as that option's kind of value.
    """
    option = runtime_options()[name]

    def refuse(why: str = "") -> ValueError:
        expected = option.accepts or {"int": "an integer", "uint": "a whole number",
                                      "float": "a number", "bool": "True or False",
                                      "list": "a list of names"}.get(option.type, "text")
        return ValueError(f"runtime option {name} must be {expected}, got {value!r}{why}")

    if isinstance(value, str):
        text = value
    elif option.type in ("int", "uint"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse()
        if isinstance(value, float) and not value.is_integer():
            raise refuse()
        text = str(int(value))
    elif option.type == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse()
        text = repr(float(value))
    elif isinstance(value, bool):
        text = "1" if value else "0"
    elif option.type == "list" and isinstance(value, Sequence):
        if any("," in str(item) for item in value):
            raise refuse(": a name holds a comma")
        text = ",".join(str(item) for item in value)
    elif isinstance(value, os.PathLike):
        text = os.fspath(value)
    else:
        raise refuse()
    if "\n" in text or "\r" in text:
        raise refuse(": it holds a line break")
    return text


def _bytes(value: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f"{value >> shift} {unit}"
    return str(value)


def _default_text(option: RuntimeOption) -> str:
    value = option.default
    for special, means in option.specials:
        if value == special:
            text = f"{_number(value)} ({means})"
            break
    else:
        if option.type == "bool":
            text = f"`{value}`"
        elif option.type == "list" or value == "":
            text = "none"
        elif option.type == "string":
            text = f'`"{value}"`'
        elif option.name.endswith("_bytes"):
            text = _bytes(int(value))
        elif option.name.endswith("_s"):
            text = f"{_number(value)} s"
        else:
            text = _number(value)
    return text + (f" (`${option.env}`)" if option.env else "")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def markdown_table() -> str:
    """The README's table of the runtime's options: name, default (and its environment
    variable), meaning and what the engine accepts."""
    rows = ["| option | default | what |", "|---|---|---|"]
    for option in user_options().values():
        what = option.doc + (f"; {option.accepts}" if option.accepts else "")
        rows.append(f"| `{option.name}` | {_default_text(option)} | {what} |")
    return "\n".join(rows) + "\n"


def readme_block(readme: str) -> Optional[str]:
    """The generated table's text in ``readme`` (between the markers); None without markers."""
    begin, end = readme.find(README_BEGIN), readme.find(README_END)
    if begin < 0 or end < begin:
        return None
    return readme[begin + len(README_BEGIN):end].strip("\n") + "\n"


def main(argv: Sequence[str]) -> int:
    """``--markdown``: print the README's table of the runtime's options."""
    if list(argv) != ["--markdown"]:
        print("usage: python -m prophet_tf._options --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
