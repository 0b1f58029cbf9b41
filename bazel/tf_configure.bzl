"""Repository rule that exposes the pip-installed TensorFlow to Bazel.

Usage in WORKSPACE:

    load("//bazel:tf_configure.bzl", "tf_configure")
    tf_configure(name = "local_tf")

The Python interpreter is taken from PYTHON_BIN_PATH (pass it with
`--repo_env=PYTHON_BIN_PATH=/path/to/python3`, scripts/setup.sh writes it into
.bazelrc.user) and defaults to `python3` on PATH.  The rule asks
`tf.sysconfig` for the include dir, the lib dir and the compile flags,
symlinks the header tree and libtensorflow_framework.so.2 into the repository
and generates a BUILD file with three targets:

    @local_tf//:tf_headers     cc_library with the TF headers, -D flags as defines
    @local_tf//:tf_framework   cc_library wrapping libtensorflow_framework.so.2
    @local_tf//:tf_build_info  cc_library with tf_build_info.h: the TensorFlow version and C++
                               ABI built against (the op library embeds them; prophet_tf checks
                               them before loading it, see prophet_tf/_compat.py)

The rule is re-run whenever PYTHON_BIN_PATH or PROPHET_TF_FRAMEWORK_ID changes
(scripts/setup.sh sets the latter to the framework library's path, size and mtime, so that
TensorFlow upgraded in place is picked up); otherwise run `bazel sync --configure`.

The C++ standard: every TensorFlow 2.16-2.21 asks for C++17 (`--std=c++17` in its compile
flags), which .bazelrc sets for the whole build (the core needs it too). A TensorFlow that asks
for a newer standard fails here with a clear message instead of in its headers.
"""

_PYTHON_BIN_PATH = "PYTHON_BIN_PATH"
_FRAMEWORK_ID = "PROPHET_TF_FRAMEWORK_ID"

# The C++ standard set in .bazelrc (--cxxopt=-std=c++17).
_BUILD_CXX_STANDARD = 17

_QUERY = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
print("version=" + tf.__version__)
print("include=" + tf.sysconfig.get_include())
print("lib=" + tf.sysconfig.get_lib())
print("cxx11_abi=%d" % tf.sysconfig.CXX11_ABI_FLAG)
for flag in tf.sysconfig.get_compile_flags():
    print("cflag=" + flag)
for flag in tf.sysconfig.get_link_flags():
    print("lflag=" + flag)
"""

def _fail(msg):
    fail("\n%s[tf_configure] %s%s\n" % ("\033[0;31m", msg, "\033[0m"))

def _python_bin(ctx):
    python = ctx.os.environ.get(_PYTHON_BIN_PATH, "").strip()
    if not python:
        python = "python3"
    if "/" not in python:
        found = ctx.which(python)
        if not found:
            _fail("cannot find '%s' on PATH; pass --repo_env=%s=/path/to/python3 " %
                  (python, _PYTHON_BIN_PATH) + "(scripts/setup.sh writes it to .bazelrc.user)")
        return str(found)
    if not ctx.path(python).exists:
        _fail("%s=%s does not exist; rerun scripts/setup.sh or fix .bazelrc.user" %
              (_PYTHON_BIN_PATH, python))
    return python

def _tf_configure_impl(ctx):
    python = _python_bin(ctx)
    result = ctx.execute([python, "-c", _QUERY], quiet = True, timeout = 600)
    if result.return_code != 0:
        _fail(("'%s' could not import tensorflow (exit %d). Install it " +
               "(pip install -r requirements.txt) or point %s at the right interpreter.\n%s") %
              (python, result.return_code, _PYTHON_BIN_PATH, result.stderr))

    version = ""
    cxx11_abi = ""
    include_dir = ""
    lib_dir = ""
    cflags = []
    lflags = []
    for line in result.stdout.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "version":
            version = value
        elif key == "cxx11_abi":
            cxx11_abi = value
        elif key == "include":
            include_dir = value
        elif key == "lib":
            lib_dir = value
        elif key == "cflag":
            cflags.append(value)
        elif key == "lflag":
            lflags.append(value)
    if not include_dir or not lib_dir or not version:
        _fail("unexpected output from %s:\n%s" % (python, result.stdout))

    # Library name: from the "-l:libtensorflow_framework.so.2" link flag.
    lib_name = "libtensorflow_framework.so.2"
    for flag in lflags:
        if flag.startswith("-l:"):
            lib_name = flag[3:]
    lib_path = ctx.path(lib_dir + "/" + lib_name)
    if not lib_path.exists:
        _fail("%s does not exist" % lib_path)
    if not ctx.path(include_dir + "/tensorflow/core/framework/op_kernel.h").exists:
        _fail("no TensorFlow headers under %s" % include_dir)

    for flag in cflags:
        if "std=" in flag:
            standard = flag.split("std=")[1].replace("gnu++", "c++")
            number = standard.replace("c++", "")
            if number.isdigit() and int(number) > _BUILD_CXX_STANDARD and int(number) < 90:
                _fail(("TensorFlow %s asks for %s (tf.sysconfig.get_compile_flags()), this build " +
                       "uses c++%d: raise --cxxopt=-std= in .bazelrc") %
                      (version, flag, _BUILD_CXX_STANDARD))

    if cxx11_abi != "1":
        # The adapter would get TensorFlow's -D_GLIBCXX_USE_CXX11_ABI=0 (tf_headers' defines) but
        # the core, which shares std::string with it, the compiler's default (1).
        _fail(("TensorFlow %s was built with the pre-C++11 libstdc++ ABI " +
               "(tf.sysconfig.CXX11_ABI_FLAG=%s); prophet_tf supports TensorFlow >= 2.16, " +
               "built with the C++11 ABI (the pip packages)") % (version, cxx11_abi))

    defines = [f[2:] for f in cflags if f.startswith("-D")]
    copts = [f for f in cflags if not f.startswith("-D") and not f.startswith("-I") and
             "std=" not in f]

    ctx.symlink(include_dir, "include")
    ctx.symlink(lib_path, "lib/" + lib_name)

    ctx.file("BUILD.bazel", """\
# Generated by //bazel:tf_configure.bzl from {python}
# TensorFlow {version}
#   include: {include_dir}
#   lib:     {lib_path}
load("@rules_cc//cc:defs.bzl", "cc_library")

package(default_visibility = ["//visibility:public"])

cc_library(
    name = "tf_headers",
    # Every header is a Bazel target that is globbed and hashed (again after each server
    # start), so two big subtrees that op kernels never include are left out:
    #   include/external (~5.2k files, 150 MB: llvm, grpc, ... not reachable via -Iinclude)
    #   include/tensorflow/compiler (~1.5k files, 56 MB: XLA/MLIR bridge internals)
    # Including one of them fails with "undeclared inclusion(s)"; drop the exclude then.
    hdrs = glob(
        ["include/**"],
        exclude = [
            "include/external/**",
            "include/tensorflow/compiler/**",
            "include/**/*.py",
            "include/**/*.pyc",
        ],
    ),
    copts = {copts},
    defines = {defines},
    includes = ["include"],
)

cc_library(
    name = "tf_framework",
    srcs = ["lib/{lib_name}"],
)

cc_library(
    name = "tf_build_info",
    hdrs = ["tf_build_info.h"],
    includes = ["."],
)

exports_files(["tf_version.txt"])
""".format(
        python = python,
        version = version,
        include_dir = include_dir,
        lib_path = lib_path,
        copts = repr(copts),
        defines = repr(defines),
        lib_name = lib_name,
    ))
    ctx.file("tf_version.txt", version + "\n")
    ctx.file("tf_build_info.h", """\
// Generated by //bazel:tf_configure.bzl: the TensorFlow these headers and libraries belong to.
#ifndef PROPHET_TF_BUILD_INFO_H_
#define PROPHET_TF_BUILD_INFO_H_
#define PROPHET_BUILT_AGAINST_TF_VERSION "{version}"
#define PROPHET_BUILT_AGAINST_TF_CXX11_ABI "{cxx11_abi}"
#endif
""".format(version = version, cxx11_abi = cxx11_abi))
    ctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % ctx.name)

tf_configure = repository_rule(
    implementation = _tf_configure_impl,
    environ = [_PYTHON_BIN_PATH, _FRAMEWORK_ID],
    # Not `local`: re-run only when these variables change (or on
    # `bazel sync --configure` / `bazel clean --expunge`).
    configure = True,
    doc = "Exposes the pip-installed TensorFlow (headers + framework library).",
)
