"""The TensorFlow and Keras releases prophet_tf supports, and every difference between them.

Supported: TensorFlow ``>= TENSORFLOW_MIN, < TENSORFLOW_BELOW`` (the ``tensorflow`` or
``tensorflow-cpu`` package) with Keras 3 ``>= KERAS_MIN, < KERAS_BELOW`` as ``tf.keras``. Each
TensorFlow of that range is built and tested with the newest Keras it installs and the oldest
Keras it claims to support by ``scripts/test_versions.sh`` (the table in
docs/compatibility.md is its output). ``setup.py`` reads the bounds from here.

Where releases differ, the code below detects the feature (an attribute, a module), never a
version string, and the rest of the package calls the helpers here.

Checks:

* :func:`check_installed_versions` (``import prophet_tf``): the TensorFlow and Keras that are
  installed, by their package metadata (TensorFlow itself is not imported: the launcher and the
  predictor do not need it), and ``TF_USE_LEGACY_KERAS`` (Keras 2 as ``tf.keras``).
* :func:`check_loaded_versions`: the same on the imported modules, when prophet_tf first uses
  them (metadata can disagree with what is imported when several TensorFlow packages are
  installed).
* :func:`check_library_matches_tensorflow`: before the op library is loaded, the TensorFlow
  version and C++ ABI it was built against (a string embedded in the file by
  ``ops/tf/build_stamp.cc``) against the imported TensorFlow's.

``PROPHET_TF_ALLOW_UNSUPPORTED=1`` turns the version errors (not the library check) into
warnings, to try a release outside the range.
"""

from __future__ import annotations

import importlib.metadata
import mmap
import os
import pathlib
import re
import sys
import warnings
from typing import Any, Optional

from prophet_tf.errors import ProphetError

__all__ = ["TENSORFLOW_MIN", "TENSORFLOW_BELOW", "KERAS_MIN", "KERAS_BELOW",
           "UnsupportedVersionError", "LibraryMismatchError", "supported_range_text",
           "check_installed_versions", "check_loaded_versions", "tf_keras_version",
           "read_build_stamp", "check_library_matches_tensorflow"]

TENSORFLOW_MIN = "2.16"
TENSORFLOW_BELOW = "2.22"
# Keras before 3.8 does not scale losses for tf.distribute (keras-team/keras#20609, in 3.8.0:
# summed over N replicas, regularization losses counted N times), and before 3.7 it lacks hooks
# patched here (BackupAndRestore._load_model, loss.reduce_values(sample_weight=...)).
KERAS_MIN = "3.8.0"
KERAS_BELOW = "4"

_ALLOW_VARIABLE = "PROPHET_TF_ALLOW_UNSUPPORTED"
# Distributions that install the `tensorflow` package, most common first.
_TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel",
                             "tensorflow-macos", "tf-nightly", "tf-nightly-cpu")
_KERAS_DISTRIBUTIONS = ("keras", "keras-nightly")


class UnsupportedVersionError(ProphetError, ImportError):
    """The installed TensorFlow or Keras is outside the range prophet_tf supports (the message
    names the range and what was found). Also an ``ImportError``: it is raised by
    ``import prophet_tf``."""


class LibraryMismatchError(ProphetError, ImportError):
    """The op library was built against another TensorFlow than the one imported (the message
    gives the command that rebuilds it)."""


def _release(version: str) -> tuple[int, ...]:
    """(2, 18, 1) of "2.18.1", "2.18.1rc0", "2.19.0-dev20250101": the leading numbers."""
    numbers = re.match(r"^\s*(\d+(?:\.\d+)*)", version)
    return tuple(int(n) for n in numbers.group(1).split(".")) if numbers else ()


def _in_range(version: str, minimum: str, below: str) -> bool:
    release = _release(version)
    return bool(release) and _release(minimum) <= release < _release(below)


def supported_range_text() -> str:
    return (f"TensorFlow >={TENSORFLOW_MIN},<{TENSORFLOW_BELOW} with Keras 3 "
            f">={KERAS_MIN},<{KERAS_BELOW} as tf.keras (the tested pairs are in "
            f"docs/compatibility.md)")


def _distribution_version(names: tuple[str, ...]) -> tuple[Optional[str], Optional[str]]:
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def _legacy_keras_requested() -> bool:
    return os.environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes")


def _problems(tensorflow: Optional[str], keras: Optional[str]) -> list[str]:
    problems = []
    if tensorflow is not None and not _in_range(tensorflow, TENSORFLOW_MIN, TENSORFLOW_BELOW):
        problems.append(f"found TensorFlow {tensorflow}")
    if keras is not None and not _in_range(keras, KERAS_MIN, KERAS_BELOW):
        problems.append(f"found Keras {keras}")
    if _legacy_keras_requested():
        problems.append("TF_USE_LEGACY_KERAS is set, which makes tf.keras Keras 2 (tf_keras); "
                        "unset it")
    return problems


def _report(problems: list[str], found: str) -> None:
    if not problems:
        return
    message = (f"prophet_tf supports {supported_range_text()}, but " + "; ".join(problems)
               + f" ({found}). Install a supported pair, e.g. `pip install "
               f"'tensorflow-cpu>={TENSORFLOW_MIN},<{TENSORFLOW_BELOW}' "
               f"'keras>={KERAS_MIN},<{KERAS_BELOW}'`, and rebuild the op library "
               f"(`bash scripts/setup.sh`). To try this combination anyway set "
               f"{_ALLOW_VARIABLE}=1.")
    if os.environ.get(_ALLOW_VARIABLE) == "1":
        warnings.warn(message.replace("prophet_tf supports", "prophet_tf (unsupported versions "
                                      f"allowed by {_ALLOW_VARIABLE}) supports"), stacklevel=3)
        return
    raise UnsupportedVersionError(message)


def check_installed_versions() -> None:
    """Raises :class:`UnsupportedVersionError` when the installed TensorFlow or Keras (by package
    metadata; imported modules win) is outside the supported range. Nothing installed is not an
    error here: the TensorFlow-free parts (launcher, predictor) work without it."""
    tf_module, keras_module = sys.modules.get("tensorflow"), sys.modules.get("keras")
    tf_dist, tensorflow = _distribution_version(_TENSORFLOW_DISTRIBUTIONS)
    keras_dist, keras = _distribution_version(_KERAS_DISTRIBUTIONS)
    tensorflow = getattr(tf_module, "__version__", None) or tensorflow
    keras = getattr(keras_module, "__version__", None) or keras
    _report(_problems(tensorflow, keras),
            f"installed: {tf_dist or 'tensorflow'} {tensorflow or 'none'}, "
            f"{keras_dist or 'keras'} {keras or 'none'}, for {sys.executable}")


def tf_keras_version() -> str:
    """The version of the Keras that ``tf.keras`` is (Keras 3.0 gives ``tf.keras`` no
    ``__version__``; Keras 2, i.e. ``tf_keras``, has its own)."""
    import keras
    import tensorflow as tf

    if getattr(tf.keras, "Model", None) is keras.Model:
        return keras.__version__
    return getattr(tf.keras, "__version__", None) or "2 (tf_keras)"


def check_loaded_versions() -> None:
    """Like :func:`check_installed_versions`, on the imported TensorFlow and its ``tf.keras``."""
    import tensorflow as tf

    keras_version = tf_keras_version()
    _report(_problems(tf.__version__, keras_version),
            f"imported: TensorFlow {tf.__version__} from {os.path.dirname(tf.__file__)}, "
            f"tf.keras {keras_version}")


# ---- the op library's build stamp --------------------------------------------------------------

_STAMP_START = b"PROPHET_TF_BUILD_STAMP "
_STAMP = re.compile(rb"PROPHET_TF_BUILD_STAMP tensorflow=([^ ;\x00]+) cxx11_abi=([^ ;\x00]+);")


def read_build_stamp(path: os.PathLike | str) -> Optional[dict[str, str]]:
    """``{"tensorflow": "2.21.0", "cxx11_abi": "1"}`` embedded in the library at ``path`` by
    ``ops/tf/build_stamp.cc``, read from the file without loading it (None when absent)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at = data.find(_STAMP_START)
        found = _STAMP.match(data[at:at + 256]) if at >= 0 else None
    if found is None:
        return None
    return {"tensorflow": found.group(1).decode(), "cxx11_abi": found.group(2).decode()}


def _rebuild_command(path: pathlib.Path, variable: str) -> str:
    checkout = pathlib.Path(__file__).resolve().parents[1]
    if (checkout / "WORKSPACE").is_file() and (checkout / "scripts" / "setup.sh").is_file():
        command = f"`PYTHON_BIN_PATH={sys.executable} bash {checkout / 'scripts' / 'setup.sh'}`"
    else:
        command = ("`PROPHET_TF_REBUILD_OPS=1 pip install --no-build-isolation --force-reinstall "
                   "<prophet_tf source checkout>` with this interpreter")
    if os.environ.get(variable) and pathlib.Path(os.environ[variable]) == path:
        return (f"{command}, or point ${variable} (it names {path}) at a library built for this "
                f"TensorFlow, or unset it")
    return command


def check_library_matches_tensorflow(path: pathlib.Path, variable: str = "PROPHET_OPS_LIBRARY") -> None:
    """Raises :class:`LibraryMismatchError` unless the op library at ``path`` was built against
    the imported TensorFlow (same version, same C++ ABI). Called before loading it: loading a
    mismatched library fails with an undefined symbol at best."""
    import tensorflow as tf

    stamp = read_build_stamp(path)
    running = {"tensorflow": tf.__version__, "cxx11_abi": str(int(tf.sysconfig.CXX11_ABI_FLAG))}
    if stamp == running:
        return
    if stamp is None:
        built = "an unknown TensorFlow (it has no build stamp: it predates the check)"
    else:
        built = f"TensorFlow {stamp['tensorflow']} (C++11 ABI {stamp['cxx11_abi']})"
    raise LibraryMismatchError(
        f"prophet_tf: the op library {path} was built against {built}, but this process imported "
        f"TensorFlow {running['tensorflow']} (C++11 ABI {running['cxx11_abi']}) from "
        f"{os.path.dirname(tf.__file__)}. An op library only loads into the TensorFlow it was "
        f"compiled against. Rebuild it for this TensorFlow: {_rebuild_command(path, variable)}.")


def epoch_steps(item: tuple, steps_per_execution: int) -> tuple[int, int, Any]:
    """One item of Keras' ``EpochIterator._enumerate_iterator`` as ``(begin, end, iterator)``.

    Keras 3.8 yields ``(step, iterator)`` (the execution's first step); later releases yield
    ``(begin_step, end_step, iterator)`` with ``end_step`` the last step of the execution.
    """
    if len(item) == 3:
        return item
    begin, data = item
    return begin, begin + steps_per_execution - 1, data
