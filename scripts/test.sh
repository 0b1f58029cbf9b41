#!/usr/bin/env bash
# Full test run: setup (install, build the libraries), then the C++ tests through Bazel and the
# Python tests through pytest, side by side.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

log() { printf '\033[1;34m[test]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[test] ERROR:\033[0m %s\n' "$*" >&2; exit 1; }

# The Bazel server that setup.sh starts also runs the C++ tests below, beside pytest, at a lower
# priority: its compilers inherit its niceness, so it starts niced (a server already running, at
# whatever priority, is stopped first). On its own the build takes the same time niced; one server
# instead of two saves a cold start and a second analysis (about 30 CPU-s).
T0=$SECONDS
bazel shutdown 2>/dev/null || true
nice -n 10 bash scripts/setup.sh || die "scripts/setup.sh failed"
T_SETUP=$SECONDS

PY="${PYTHON_BIN_PATH:-python3}"

# --- C++ tests, beside the Python tests ---------------------------------------------------------
# One cc_test per ops/**/*_test.cc, then the fuzz targets with AddressSanitizer + UBSan (short
# fixed-seed runs; see ops/core/fuzz/BUILD). They need nothing from the Python tests nor these
# from them, so they build and run at the same time, at a lower priority: the compiler takes the
# cores the Python tests leave while their workers wait on sockets and each other.
# Four tests at a time on 2 cores: several mostly wait (transport_test: 19 s for 2 CPU-s alone;
# two_level_test 15 s for 9), and what is left when pytest ends should keep both cores busy.
cc_tests() {
  local rc=0
  log "bazel test --local_test_jobs=4 //ops/..."
  bazel test --local_test_jobs=4 //ops/... || rc=$?
  if [ "$rc" -eq 4 ] && [ -z "$(find ops -name '*_test.cc' -print -quit)" ]; then
    log "no C++ tests yet (no ops/**/*_test.cc)"         # bazel: 4 = no test targets found
  elif [ "$rc" -ne 0 ]; then
    log "bazel test //ops/... failed (exit $rc)"; return 1
  fi
  log "bazel test --config=asan //ops/core/fuzz/..."
  bazel test --config=asan //ops/core/fuzz/... || { log "fuzz targets failed under the sanitizers"; return 1; }
}
CC_LOG="$(mktemp "${TMPDIR:-/tmp}/prophet_tf-cc-tests.XXXXXX")"
log "C++ tests in the background (output: $CC_LOG)"
nice -n 10 bash -c "$(declare -f log cc_tests); cc_tests" >"$CC_LOG" 2>&1 &
CC_PID=$!
trap 'pkill -P "$CC_PID" 2>/dev/null; kill "$CC_PID" 2>/dev/null || true' EXIT  # a failed pytest ends them
cc_result() {  # waits for the C++ tests; prints their outcome; dies if they failed
  local rc=0
  wait "$CC_PID" || rc=$?
  trap - EXIT
  if [ "$rc" -ne 0 ]; then
    cat "$CC_LOG" >&2
    die "C++ tests failed (exit $rc; output above, also in $CC_LOG)"
  fi
  grep -E '\[test\]|Executed|PASSED|FAILED|NO STATUS|no C\+\+ tests' "$CC_LOG" || true
  log "C++ tests passed"
}

# --- Python tests ------------------------------------------------------------------------------
if [ ! -d tests ]; then
  log "no tests/ directory; skipping pytest"
  cc_result
  exit 0
fi
# Test files run side by side (pytest-xdist), a file's tests in one process so that its shared
# launches run once. Most multi-worker tests wait on sockets, timeouts and sleeps as much as they
# compute, so more processes than cores shortens the run; PROPHET_TEST_JOBS=1 runs them in turn.
JOBS="${PROPHET_TEST_JOBS:-3}"
log "$PY -m pytest -q -n $JOBS --dist loadfile tests/"
rc=0
"$PY" -m pytest -q -n "$JOBS" --dist loadfile --durations=12 tests/ || rc=$?  # the slowest tests: where suite time goes
T_PYTEST=$SECONDS
if [ "$rc" -eq 5 ]; then
  # 5 = no tests collected: an error only if there are test files to collect.
  if [ -n "$(find tests \( -name 'test_*.py' -o -name '*_test.py' \) -print -quit)" ]; then
    die "pytest collected no tests although tests/ has test files"
  fi
  log "no Python tests yet"
  cc_result
  exit 0
fi
[ "$rc" -eq 0 ] || die "pytest failed (exit $rc)"
cc_result
# Where the wall time went (the goal: at most 12 minutes from a fresh clone, build included).
log "time: setup $((T_SETUP - T0)) s, pytest $((T_PYTEST - T_SETUP)) s, then the C++ tests" \
    "$((SECONDS - T_PYTEST)) s more; $((SECONDS - T0)) s in all"
log "all tests passed"
