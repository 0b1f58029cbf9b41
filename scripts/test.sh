#!/usr/bin/env bash
# Full test run: setup (build), C++ tests through Bazel, Python tests through pytest.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

log() { printf '\033[1;34m[test]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[test] ERROR:\033[0m %s\n' "$*" >&2; exit 1; }

bash scripts/setup.sh || die "scripts/setup.sh failed"

PY="${PYTHON_BIN_PATH:-python3}"

# --- C++ tests (one cc_test per ops/**/*_test.cc) ------------------------------------------------
log "bazel test //ops/..."
rc=0
bazel test //ops/... || rc=$?
if [ "$rc" -eq 4 ] && [ -z "$(find ops -name '*_test.cc' -print -quit)" ]; then
  log "no C++ tests yet (no ops/**/*_test.cc)"           # bazel: 4 = no test targets found
elif [ "$rc" -ne 0 ]; then
  die "bazel test //ops/... failed (exit $rc)"
fi

# --- Fuzz targets with AddressSanitizer + UBSan (short fixed-seed runs; see ops/core/fuzz/BUILD) ---
log "bazel test --config=asan //ops/core/fuzz/..."
bazel test --config=asan //ops/core/fuzz/... || die "fuzz targets failed under the sanitizers"

# --- Python tests ------------------------------------------------------------------------------
if [ ! -d tests ]; then
  log "no tests/ directory; skipping pytest"
  exit 0
fi
# Test files run side by side (pytest-xdist), a file's tests in one process so that its shared
# launches run once. Most multi-worker tests wait on sockets, timeouts and sleeps as much as they
# compute, so more processes than cores shortens the run; PROPHET_TEST_JOBS=1 runs them in turn.
JOBS="${PROPHET_TEST_JOBS:-3}"
log "$PY -m pytest -q -n $JOBS --dist loadfile tests/"
rc=0
"$PY" -m pytest -q -n "$JOBS" --dist loadfile --durations=12 tests/ || rc=$?  # the slowest tests: where suite time goes
if [ "$rc" -eq 5 ]; then
  # 5 = no tests collected: an error only if there are test files to collect.
  if [ -n "$(find tests \( -name 'test_*.py' -o -name '*_test.py' \) -print -quit)" ]; then
    die "pytest collected no tests although tests/ has test files"
  fi
  log "no Python tests yet"
  exit 0
fi
[ "$rc" -eq 0 ] || die "pytest failed (exit $rc)"
log "all tests passed"
