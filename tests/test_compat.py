"""Clear errors outside the supported TensorFlow / Keras range (prophet_tf/_compat.py): at
``import prophet_tf``, and before an op library built against another TensorFlow is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, _worker_env
from prophet_tf import _compat
from prophet_tf._library import library_path


def _import_prophet_tf(tmp_path, *, tensorflow=None, keras=None, env=None):
    """``import prophet_tf`` in a fresh interpreter that sees fake package metadata first."""
    for name, version in (("tensorflow", tensorflow), ("keras", keras)):
        if version is not None:
            info = tmp_path / f"{name}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    run_env = _worker_env(env)
    run_env["PYTHONPATH"] = f"{tmp_path}:{run_env['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-c", "import prophet_tf"], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("tensorflow, keras, found", [
    ("2.15.1", None, "found TensorFlow 2.15.1"),
    ("2.22.0", None, "found TensorFlow 2.22.0"),
    (None, "2.15.0", "found Keras 2.15.0"),
])
def test_import_names_the_supported_range_and_what_was_found(tmp_path, tensorflow, keras, found):
    proc = _import_prophet_tf(tmp_path, tensorflow=tensorflow, keras=keras)
    assert proc.returncode != 0
    assert "UnsupportedVersionError" in proc.stderr, proc.stderr[-2000:]
    assert found in proc.stderr, proc.stderr[-2000:]
    assert (f"TensorFlow >={_compat.TENSORFLOW_MIN},<{_compat.TENSORFLOW_BELOW} with Keras 3 "
            f">={_compat.KERAS_MIN},<{_compat.KERAS_BELOW}") in proc.stderr, proc.stderr[-2000:]


def test_import_refuses_legacy_keras(tmp_path):
    proc = _import_prophet_tf(tmp_path, env={"TF_USE_LEGACY_KERAS": "1"})
    assert proc.returncode != 0
    assert "TF_USE_LEGACY_KERAS is set" in proc.stderr, proc.stderr[-2000:]


def test_unsupported_versions_can_be_tried_on_request(tmp_path):
    proc = _import_prophet_tf(tmp_path, tensorflow="2.22.0",
                              env={"PROPHET_TF_ALLOW_UNSUPPORTED": "1", "PYTHONWARNINGS": "default"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "found TensorFlow 2.22.0" in proc.stderr, proc.stderr[-2000:]


def test_supported_versions_import_quietly(tmp_path):
    # What is checked is prophet_tf's own silence: TensorFlow's C++ start-up lines (printed at
    # TF_CPP_MIN_LOG_LEVEL 0 and 1, whatever the caller's environment has) are held back.
    proc = _import_prophet_tf(tmp_path, tensorflow=_compat.TENSORFLOW_MIN + ".0",
                              keras=_compat.KERAS_MIN,
                              env={"PYTHONWARNINGS": "default", "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""


def test_the_built_library_carries_the_tensorflow_it_was_built_against():
    import tensorflow as tf

    assert _compat.read_build_stamp(library_path()) == {
        "tensorflow": tf.__version__, "cxx11_abi": str(int(tf.sysconfig.CXX11_ABI_FLAG))}
    _compat.check_library_matches_tensorflow(library_path())  # the library the tests use


def _copy_with(tmp_path, old: bytes, new: bytes):
    data = library_path().read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    copy = tmp_path / "_prophet_ops.so"
    copy.write_bytes(data.replace(old, new))
    return copy


def test_a_library_built_against_another_tensorflow_is_refused_with_the_rebuild_command(
        tmp_path, monkeypatch):
    import tensorflow as tf

    version = tf.__version__.encode()
    other = b"9" * len(version)  # same length: the file stays a valid library
    copy = _copy_with(tmp_path, b"tensorflow=" + version + b" ", b"tensorflow=" + other + b" ")
    monkeypatch.setenv("PROPHET_OPS_LIBRARY", str(copy))
    with pytest.raises(_compat.LibraryMismatchError) as raised:
        _compat.check_library_matches_tensorflow(copy)
    message = str(raised.value)
    assert f"built against TensorFlow {other.decode()}" in message
    assert f"imported TensorFlow {tf.__version__}" in message
    assert f"PYTHON_BIN_PATH={sys.executable} bash" in message and "scripts/setup.sh" in message
    assert "$PROPHET_OPS_LIBRARY" in message


def test_a_library_without_a_build_stamp_is_refused(tmp_path):
    copy = _copy_with(tmp_path, b"PROPHET_TF_BUILD_STAMP ", b"PROPHET_TF_XXXXX_STAMP ")
    with pytest.raises(_compat.LibraryMismatchError, match="no build stamp"):
        _compat.check_library_matches_tensorflow(copy)


def test_version_ranges():
    assert _compat._in_range("2.16.0", "2.16", "2.22")
    assert _compat._in_range("2.21.9", "2.16", "2.22")
    assert _compat._in_range("2.19.0-dev20250101", "2.16", "2.22")
    assert _compat._in_range("2.21.0rc1", "2.16", "2.22")
    assert not _compat._in_range("2.15.1", "2.16", "2.22")
    assert not _compat._in_range("2.22.0", "2.16", "2.22")
    assert not _compat._in_range("nightly", "2.16", "2.22")
