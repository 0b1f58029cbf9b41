"""Packaging for prophet_tf.

`pip install .` (and `pip wheel .`) ships prophet_tf (and its subpackages but the benchmarks,
prophet_tf.bench, which run from a source checkout) with its native libraries as package data: the
TensorFlow op library prophet_tf/_prophet_ops.so and the predictor prophet_tf/_prophet_predict.so,
plus the launcher command `prophetrun`.

The build step runs `bazel build` for both libraries against the TensorFlow that the target
environment's interpreter imports (the op library's ABI must match that TensorFlow), and copies
them in; Bazel rebuilds only what changed. Install TensorFlow into the environment first
(`pip install tensorflow-cpu==2.21.0`, or `tensorflow` for GPUs). Set
PROPHET_TF_USE_BUILT_OPS=1 to package the libraries already in prophet_tf/ (scripts/setup.sh puts
them there) without running Bazel.
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
# Bazel target -> file name in the package.
LIBRARIES = {"//ops/tf:_prophet_ops.so": "_prophet_ops.so",
             "//ops/predict:_prophet_predict.so": "_prophet_predict.so"}


def _supported_range():
    """The supported TensorFlow and Keras bounds, from their one home (prophet_tf/_compat.py;
    read as text: importing the package here would need its dependencies)."""
    with open(os.path.join(ROOT, "prophet_tf", "_compat.py")) as f:
        text = f.read()
    bounds = dict(re.findall(r'^(TENSORFLOW_MIN|TENSORFLOW_BELOW|KERAS_MIN|KERAS_BELOW) = "([^"]+)"',
                             text, re.M))
    return (">={TENSORFLOW_MIN},<{TENSORFLOW_BELOW}".format(**bounds),
            ">={KERAS_MIN},<{KERAS_BELOW}".format(**bounds))


TENSORFLOW_RANGE, KERAS_RANGE = _supported_range()


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


def _target_tensorflow(python):
    """The TensorFlow version `python` imports (outside pip's isolated build environment), or
    exits with what to install."""
    probe = [python, "-c", "import tensorflow as tf; print(tf.__version__)"]
    result = subprocess.run(probe, env=_bazel_env(), capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(
            "prophet_tf: the op library is built against the TensorFlow of the environment it is "
            "installed into, but %s cannot import tensorflow (%s).\n"
            "Install TensorFlow there first, e.g. `%s -m pip install tensorflow-cpu==2.21.0` "
            "(or `tensorflow` on a machine with GPUs), then install prophet_tf again."
            % (python, last, python))
    return result.stdout.strip()


def build_ops_library():
    bazel = shutil.which("bazel")
    if bazel is None:
        raise SystemExit(
            "prophet_tf: %s is missing and `bazel` is not on PATH.\n"
            "Run `bash scripts/setup.sh` (installs bazel-bootstrap and builds the libraries) "
            "and retry." % ", ".join(_in_package(n) for n in LIBRARIES.values()))
    # The interpreter pip installs into (its isolated build runs this file with it); on the
    # command line, this wins over .bazelrc.user.
    python = os.environ.get("PYTHON_BIN_PATH") or sys.executable
    version = _target_tensorflow(python)
    cmd = [bazel, "build", "--repo_env=PYTHON_BIN_PATH=" + python, *LIBRARIES]
    print("prophet_tf: building the libraries against TensorFlow %s of %s: %s"
          % (version, python, " ".join(cmd)), flush=True)
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
        if os.environ.get("PROPHET_TF_USE_BUILT_OPS") != "1" or missing:
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
    # The benchmarks (prophet_tf.bench) reproduce the measurements of docs/benchmarks.md and run
    # from a source checkout (`python -m prophet_tf.bench.X`), where Bazel builds the
    # benchmark-only ops too. A user of the package runs the strategy, `prophetrun`,
    # `python -m prophet_tf.predict` and `python -m prophet_tf.timeline`: that is what installs.
    packages=find_packages(include=["prophet_tf", "prophet_tf.*"],
                           exclude=["prophet_tf.bench", "prophet_tf.bench.*"]),
    package_data={"prophet_tf": list(LIBRARIES.values())},
    include_package_data=False,
    zip_safe=False,
    python_requires=">=3.9",
    # TensorFlow itself is an extra: `tensorflow`, `tensorflow-cpu` (and nightlies) are different
    # distributions of the same `tensorflow` package, and requiring one would install it over the
    # other. `import prophet_tf` checks the range whichever is installed, and the op library
    # checks that it was built against the TensorFlow imported (prophet_tf/_compat.py).
    install_requires=["numpy", "absl-py", "keras" + KERAS_RANGE],
    extras_require={
        "cpu": ["tensorflow-cpu" + TENSORFLOW_RANGE],
        "gpu": ["tensorflow[and-cuda]" + TENSORFLOW_RANGE],
        "plot": ["matplotlib"],
        "test": ["pytest"],
    },
    entry_points={"console_scripts": ["prophetrun = prophet_tf.launch:main"]},
    cmdclass={"build_py": BuildPyWithOps},
    distclass=BinaryDistribution,
)
