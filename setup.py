"""Packaging for prophet_tf.

`pip install .` ships prophet_tf (and subpackages) with its native libraries as package data:
the TensorFlow op library prophet_tf/_prophet_ops.so and the predictor
prophet_tf/_prophet_predict.so.  If one is missing (fresh checkout, scripts/setup.sh not run),
the build step runs `bazel build` for both and copies them in.  Set PROPHET_TF_REBUILD_OPS=1 to
always rebuild.
"""

import os
import shutil
import subprocess
import sys

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
# Bazel target -> file name in the package.
LIBRARIES = {"//ops/tf:_prophet_ops.so": "_prophet_ops.so",
             "//ops/predict:_prophet_predict.so": "_prophet_predict.so"}


def _in_package(name):
    return os.path.join(ROOT, "prophet_tf", name)


def _in_bazel_bin(target):
    package, name = target[2:].split(":")
    return os.path.join(ROOT, "bazel-bin", package, name)


def _bazel_env():
    # pip's isolated build environment sets these; they would hide the real site-packages
    # (and TensorFlow) from the interpreter that Bazel's tf_configure runs.
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME", "PYTHONSAFEPATH"):
        env.pop(var, None)
    return env


def build_ops_library():
    bazel = shutil.which("bazel")
    if bazel is None:
        raise SystemExit(
            "prophet_tf: %s is missing and `bazel` is not on PATH.\n"
            "Run `bash scripts/setup.sh` (installs bazel-bootstrap and builds the libraries) "
            "and retry." % ", ".join(_in_package(n) for n in LIBRARIES.values()))
    cmd = [bazel, "build"]
    python = os.environ.get("PYTHON_BIN_PATH")
    if not python and not os.path.exists(os.path.join(ROOT, ".bazelrc.user")):
        python = sys.executable  # otherwise .bazelrc.user (scripts/setup.sh) names it
    if python:
        cmd.append("--repo_env=PYTHON_BIN_PATH=" + python)
    cmd.extend(LIBRARIES)
    print("prophet_tf: running " + " ".join(cmd), flush=True)
    try:
        subprocess.check_call(cmd, cwd=ROOT, env=_bazel_env())
    except subprocess.CalledProcessError as e:
        raise SystemExit("prophet_tf: `%s` failed with exit code %d" % (" ".join(cmd), e.returncode))
    for target, name in LIBRARIES.items():
        built, packaged = _in_bazel_bin(target), _in_package(name)
        if not os.path.isfile(built):
            raise SystemExit("prophet_tf: bazel did not produce " + built)
        if os.path.exists(packaged):
            os.remove(packaged)  # bazel-bin outputs are read-only; never write through them
        shutil.copyfile(built, packaged)
        os.chmod(packaged, 0o755)
        print("prophet_tf: copied %s -> %s" % (built, packaged), flush=True)


class BuildPyWithOps(build_py):
    """build_py that makes sure the native libraries exist before copying package data."""

    def run(self):
        missing = [n for n in LIBRARIES.values() if not os.path.isfile(_in_package(n))]
        if os.environ.get("PROPHET_TF_REBUILD_OPS") == "1" or missing:
            build_ops_library()
        super().run()


class BinaryDistribution(Distribution):
    """The wheel carries a native library: tag it for the platform, not py3-none-any."""

    def has_ext_modules(self):
        return True


setup(
    name="prophet_tf",
    version="0.1.0",
    description="Prophet-style gradient communication scheduling for TensorFlow (custom ops)",
    packages=find_packages(include=["prophet_tf", "prophet_tf.*"]),
    package_data={"prophet_tf": list(LIBRARIES.values())},
    include_package_data=False,
    zip_safe=False,
    python_requires=">=3.9",
    install_requires=["numpy", "absl-py"],
    extras_require={
        # The op library is built against TensorFlow 2.21 (ABI must match).
        "cpu": ["tensorflow-cpu==2.21.0"],
        "plot": ["matplotlib"],
        "test": ["pytest"],
    },
    cmdclass={"build_py": BuildPyWithOps},
    distclass=BinaryDistribution,
)
