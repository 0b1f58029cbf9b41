"""External repositories for prophet_tf (WORKSPACE mode)."""

load("//bazel:openssl_configure.bzl", "openssl_configure")
load("//bazel:tf_configure.bzl", "tf_configure")

_STAND_INS = "bazel/stand_ins"

def _bazel_major():
    """Major version of the running Bazel, or 0 when unknown (dev/distro builds)."""
    version = getattr(native, "bazel_version", "") or ""
    digits = ""
    for c in version.elems():
        if not c.isdigit():
            break
        digits += c
    return int(digits) if digits else 0

def prophet_tf_repositories():
    """Declares @local_tf, @local_openssl plus, for old Bazel, the offline stand-in repositories."""

    # Bazel 4 (incl. Debian's bazel-bootstrap 4.2.3, which reports no version)
    # downloads rules_cc / rules_java / remote_coverage_tools from its built-in
    # WORKSPACE suffix.  Same-named local repositories declared first win, which
    # keeps `bazel build` and `bazel test` fully offline.  Newer Bazel needs the
    # real rule sets (its built-in tools load much more from them), so there we
    # keep its defaults.
    if _bazel_major() < 6:
        native.local_repository(
            name = "rules_cc",
            path = _STAND_INS + "/rules_cc",
        )
        native.local_repository(
            name = "rules_java",
            path = _STAND_INS + "/rules_java",
        )
        native.local_repository(
            name = "remote_coverage_tools",
            path = _STAND_INS + "/remote_coverage_tools",
        )

    tf_configure(name = "local_tf")
    openssl_configure(name = "local_openssl")
