#!/usr/bin/env bash
# The TensorFlow x Keras version matrix: builds the op libraries against every TensorFlow release
# prophet_tf supports and runs the conformance programs, the saving tests and one emulated-compute
# training launch per schedule on each. Too long for CI's default run (tens of minutes per
# TensorFlow on 2 cores the first time); it runs unattended from a fresh clone.
#
#   bash scripts/test_versions.sh                     # 2.16.2 2.17.1 2.18.1 2.19.1 2.20.0 2.21.0
#   bash scripts/test_versions.sh 2.18.1,2.21.0       # some of them (comma or space separated)
#   bash scripts/test_versions.sh --prepare [VERSIONS]  # only the environments (downloads, installs)
#
# For each TensorFlow version V (package tensorflow-cpu):
#   1. the Keras versions: the newest that pip installs beside tensorflow-cpu==V, and the oldest
#      Keras release that V's own metadata claims to support (its Requires-Dist: keras>=X). When
#      that is older than prophet_tf's KERAS_MIN (prophet_tf/_compat.py), the oldest tested is
#      KERAS_MIN, and the claimed one is checked to be refused by `import prophet_tf` with an
#      error naming the supported and the found versions;
#   2. one virtual environment per (V, Keras) under $CACHE/venvs, reused when present;
#   3. the op libraries built against V: Bazel's tf_configure pointed at that interpreter
#      (--repo_env=PYTHON_BIN_PATH), one Bazel output base per V ($CACHE/bazel/tf-V, so builds
#      neither thrash each other nor the checkout's own bazel-bin), the libraries copied to
#      $CACHE/libs/tf-V and used through $PROPHET_OPS_LIBRARY / $PROPHET_PREDICT_LIBRARY;
#   4. with the first version only, the C++ tests (they do not use TensorFlow); with every version,
#      that an op library built against another TensorFlow (from the cache) is refused before it
#      is loaded, with the rebuild command;
#   5. per Keras: tests/test_conformance.py, tests/test_unseen_programs.py, tests/test_saving.py;
#      with the newest Keras, one emulated-compute training launch per schedule
#      (prophet_tf.bench.train --compute emulated: ResNet50, 2 workers, comm/comp 1, a few steps);
# then prints the table (also written to $CACHE/runs/<time>/table.md). Exit status 0 only when
# every build, test and launch passed.
#
# Environment:
#   PROPHET_VERSIONS_CACHE      cache folder (default ~/.cache/prophet_tf/versions)
#   PYTHON                      base interpreter of the environments (default python3)
#   PROPHET_VERSIONS_LOCK       a file to hold with flock while pytest runs (a shared machine's
#                               suite lock), unset: no lock
#   PROPHET_VERSIONS_BENCH_LOCK a file to hold with flock during the emulated launches
#   PROPHET_VERSIONS_NETNS_PREFIX  name prefix of the emulated cluster's namespaces (default ptfv)
#   PROPHET_VERSIONS_NICE       nice level of builds, tests and launches (default 15)
#   PROPHET_VERSIONS_STEPS      measured steps per emulated launch (default 5, after 2 warm-up)
#   PROPHET_VERSIONS_SKIP_BENCH=1  no emulated launches
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DEFAULT_VERSIONS="2.16.2 2.17.1 2.18.1 2.19.1 2.20.0 2.21.0"
CACHE="${PROPHET_VERSIONS_CACHE:-$HOME/.cache/prophet_tf/versions}"
BASE_PY="${PYTHON:-python3}"
NICE="${PROPHET_VERSIONS_NICE:-15}"
NETNS_PREFIX="${PROPHET_VERSIONS_NETNS_PREFIX:-ptfv}"
STEPS="${PROPHET_VERSIONS_STEPS:-5}"
SCHEDULES="prophet priority fifo"
TESTS="tests/test_conformance.py tests/test_unseen_programs.py tests/test_saving.py"

log() { printf '\033[1;34m[versions]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31m[versions] ERROR:\033[0m %s\n' "$*" >&2; exit 2; }

PREPARE_ONLY=0
if [ "${1:-}" = "--prepare" ]; then PREPARE_ONLY=1; shift; fi
VERSIONS="$(echo "${*:-$DEFAULT_VERSIONS}" | tr ',' ' ')"
for v in $VERSIONS; do
  [[ "$v" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "not a TensorFlow version: '$v' (want e.g. 2.18.1)"
done
command -v "$BASE_PY" >/dev/null 2>&1 || die "no '$BASE_PY' on PATH (set PYTHON)"
command -v bazel >/dev/null 2>&1 || die "bazel is not on PATH: run 'bash scripts/setup.sh' once (it installs bazel-bootstrap)"

# The oldest Keras prophet_tf supports (prophet_tf/_compat.py, its one home).
KERAS_MIN="$(sed -n 's/^KERAS_MIN = "\(.*\)"$/\1/p' prophet_tf/_compat.py)"
[ -n "$KERAS_MIN" ] || die "cannot read KERAS_MIN from prophet_tf/_compat.py"

RUN="$CACHE/runs/$(date +%Y%m%d-%H%M%S)-$$"  # two runs may start in one second
mkdir -p "$CACHE/venvs" "$CACHE/bazel" "$CACHE/libs" "$RUN" || die "cannot create $CACHE"
RESULTS="$RUN/results.tsv"   # one line per (tf, keras): the table's cells
: > "$RESULTS"
log "cache: $CACHE; this run's logs: $RUN"
START=$(date +%s)

quiet_nice() { nice -n "$NICE" "$@"; }

# --- Keras versions for one TensorFlow --------------------------------------------------------
# A pip dry run in an empty environment resolves "tensorflow-cpu==V keras" (the newest Keras that
# V's dependencies allow) and reports V's metadata (Requires-Dist: keras>=X: the oldest it claims).
RESOLVER="$CACHE/resolver"
resolve_keras() {  # V -> prints "NEWEST OLDEST"
  local v="$1" report="$CACHE/resolve-tf-$1.json"
  if [ ! -x "$RESOLVER/bin/python" ]; then
    "$BASE_PY" -m venv "$RESOLVER" >&2 || return 1
  fi
  if ! quiet_nice "$RESOLVER/bin/python" -m pip install --disable-pip-version-check --dry-run \
      --quiet --report "$report.tmp" "tensorflow-cpu==$v" keras >"$RUN/resolve-tf-$v.log" 2>&1; then
    if [ -s "$report" ]; then
      log "tf $v: pip could not resolve now (see $RUN/resolve-tf-$v.log); using the resolution cached in $report"
    else
      return 1
    fi
  else
    mv -f "$report.tmp" "$report"
  fi
  "$BASE_PY" - "$report" <<'EOF'
import json, re, sys
report = json.load(open(sys.argv[1]))
versions = {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]
            for i in report["install"]}
tf = versions["tensorflow-cpu"]
oldest = None
for req in tf.get("requires_dist") or []:
    m = re.match(r"^keras\s*\(?\s*>=\s*([0-9][0-9.]*)", req.strip())
    if m and ";" not in req:
        oldest = m.group(1)
if oldest is None:
    sys.exit(f"tensorflow-cpu {tf['version']} names no 'keras>=' requirement: {tf.get('requires_dist')}")
print(versions["keras"]["version"], oldest)
EOF
}

# --- one virtual environment per (TensorFlow, Keras) --------------------------------------------
venv_for() { echo "$CACHE/venvs/tf-$1-keras-$2"; }
NEWEST=""  # the newest Keras of the TensorFlow at hand

ensure_venv() {  # V K -> 0 when $(venv_for V K) is complete
  local v="$1" k="$2" dir; dir="$(venv_for "$1" "$2")"
  if [ -f "$dir/.complete" ]; then
    log "tf $v keras $k: reusing $dir"
    return 0
  fi
  rm -rf "$dir"  # an environment left unfinished
  local minor sibling="" install
  minor="$(echo "$v" | cut -d. -f1,2)"
  # The environment with the newest Keras first (the others would leave their Keras's extra
  # dependencies behind).
  for candidate in "$(venv_for "$v" "$NEWEST")/.complete" "$CACHE/venvs/tf-$v-keras-"*/.complete; do
    [ -f "$candidate" ] && sibling="$(dirname "$candidate")" && break
  done
  if [ -n "$sibling" ]; then
    # Same TensorFlow: a hard-linked copy of that environment (seconds and no disk instead of
    # minutes and 1.5 GB), then only Keras changes. pip replaces files (unlinks, writes new
    # ones), so the copy never writes through a link into the other environment; everything is
    # run through bin/python, whose absolute path is the copy's own.
    log "tf $v keras $k: creating $dir from $sibling"
    install=(cp -al "$sibling" "$dir")
  else
    log "tf $v keras $k: creating $dir (pip install; a few minutes)"
    install=("$BASE_PY" -m venv "$dir")
  fi
  {
    "${install[@]}" && rm -f "$dir/.complete" &&
    PIP_ROOT_USER_ACTION=ignore quiet_nice "$dir/bin/python" -m pip install --no-compile \
      --disable-pip-version-check "tensorflow-cpu==$v" "keras==$k" "tensorboard~=$minor.0" \
      absl-py pytest matplotlib &&
    "$dir/bin/python" - "$v" "$k" <<'EOF'
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras, tensorflow as tf
want_tf, want_keras = sys.argv[1:]
assert tf.__version__ == want_tf, (tf.__version__, want_tf)
assert keras.__version__ == want_keras, (keras.__version__, want_keras)
assert tf.keras.Model is keras.Model, "tf.keras is not this Keras"
print("tensorflow", tf.__version__, "keras", keras.__version__)
EOF
  } >"$RUN/venv-tf-$v-keras-$k.log" 2>&1 || {
    log "tf $v keras $k: environment FAILED (see $RUN/venv-tf-$v-keras-$k.log)"
    return 1
  }
  "$dir/bin/python" -m pip freeze > "$dir/.complete"
}

version_lt() {  # A B -> 0 when version A < version B
  [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$1" ]
}

check_refused() {  # V K -> 0 when `import prophet_tf` refuses Keras K, naming both sides
  local v="$1" k="$2" py log
  py="$(venv_for "$v" "$k")/bin/python" log="$RUN/refused-tf-$v-keras-$k.log"
  (cd "$ROOT" && "$py" -c "import prophet_tf") >"$log" 2>&1 && return 1
  grep -q "UnsupportedVersionError" "$log" && grep -q "found Keras $k" "$log" &&
    grep -q "Keras 3 >=$KERAS_MIN" "$log"
}

# --- the op libraries against one TensorFlow ---------------------------------------------------
bazel_v() {  # V bazel-args... (its own output base; no bazel-* symlinks in the checkout)
  local v="$1"; shift
  local cmd="$1"; shift
  quiet_nice bazel --output_base="$CACHE/bazel/tf-$v" "$cmd" --symlink_prefix=/ \
    --repo_env=PYTHON_BIN_PATH="$PY_FOR_BUILD" "$@"
}

build_libs() {  # V -> builds and copies the libraries to $CACHE/libs/tf-V
  local v="$1" out bin
  out="$CACHE/libs/tf-$v"
  bazel_v "$v" build //ops/tf:_prophet_ops.so //ops/predict:_prophet_predict.so \
    //ops/tf_bench:_prophet_bench_ops.so >"$RUN/build-tf-$v.log" 2>&1 || return 1
  bin="$(bazel_v "$v" info bazel-bin 2>>"$RUN/build-tf-$v.log")" || return 1
  mkdir -p "$out"
  install -m 0755 "$bin/ops/tf/_prophet_ops.so" "$out/_prophet_ops.so" &&
  install -m 0755 "$bin/ops/predict/_prophet_predict.so" "$out/_prophet_predict.so" &&
  install -m 0755 "$bin/ops/tf_bench/_prophet_bench_ops.so" "$out/_prophet_bench_ops.so"
}

check_foreign_library() {  # V -> prints "refused X" / "FAILED X" / "-": another TF's library
  local v="$1" py other lib log
  py="$PY_FOR_BUILD" log="$RUN/foreign-library-tf-$v.log"
  for lib in "$CACHE"/libs/tf-*/_prophet_ops.so; do
    other="$(basename "$(dirname "$lib")")"; other="${other#tf-}"
    [ "$other" != "$v" ] && break
    other=""
  done
  if [ -z "$other" ]; then echo "-"; return; fi
  if (cd "$ROOT" && PROPHET_OPS_LIBRARY="$lib" TF_CPP_MIN_LOG_LEVEL=3 nice -n "$NICE" "$py" -c \
      "from prophet_tf import _library; _library.op_module()") >"$log" 2>&1; then
    echo "FAILED:$other"; return  # it loaded: not detected
  fi
  if grep -q "LibraryMismatchError: .*built against TensorFlow $other .*imported TensorFlow $v" "$log" &&
     grep -q "scripts/setup.sh" "$log"; then
    echo "refused:$other"
  else
    echo "FAILED:$other"
  fi
}

# --- tests and launches in one environment ----------------------------------------------------
with_lock() {  # LOCK_FILE_OR_EMPTY command...
  local lock="$1"; shift
  if [ -n "$lock" ]; then flock "$lock" "$@"; else "$@"; fi
}

run_tests() {  # V K -> prints "PASSED FAILED" (from pytest's JUnit XML)
  local v="$1" k="$2" py xml
  py="$(venv_for "$v" "$k")/bin/python" xml="$RUN/pytest-tf-$v-keras-$k.xml"
  # shellcheck disable=SC2086
  with_lock "${PROPHET_VERSIONS_LOCK:-}" env PROPHET_OPS_LIBRARY="$CACHE/libs/tf-$v/_prophet_ops.so" \
      PROPHET_PREDICT_LIBRARY="$CACHE/libs/tf-$v/_prophet_predict.so" \
      PROPHET_BENCH_OPS_LIBRARY="$CACHE/libs/tf-$v/_prophet_bench_ops.so" \
      nice -n "$NICE" "$py" -m pytest -q -p no:cacheprovider --junitxml="$xml" $TESTS \
      >"$RUN/pytest-tf-$v-keras-$k.log" 2>&1
  "$BASE_PY" - "$xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 ?"); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
total = sum(int(s.get("tests", 0)) for s in suites)
bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(total - bad - skipped, bad + skipped)  # a skip is not a pass here
EOF
}

run_launches() {  # V K -> prints "prophet=0.845s priority=... fifo=..." (median step times)
  local v="$1" k="$2" py out net=() systems
  py="$(venv_for "$v" "$k")/bin/python" out="$RUN/bench-tf-$v"
  systems="$(echo $SCHEDULES | tr ' ' ',')"
  if [ "$(id -u)" -ne 0 ]; then net=(--loopback); fi  # no namespaces without root
  # One process, one launch per schedule (the model's layer specs are made once).
  with_lock "${PROPHET_VERSIONS_BENCH_LOCK:-}" env \
    PROPHET_OPS_LIBRARY="$CACHE/libs/tf-$v/_prophet_ops.so" \
    PROPHET_PREDICT_LIBRARY="$CACHE/libs/tf-$v/_prophet_predict.so" \
    PROPHET_BENCH_OPS_LIBRARY="$CACHE/libs/tf-$v/_prophet_bench_ops.so" TF_CPP_MIN_LOG_LEVEL=2 \
    nice -n "$NICE" "$py" -m prophet_tf.bench.train --compute emulated --models resnet50 \
    --workers 2 --ratios 1 --systems "$systems" --steps "$STEPS" --warmup 2 --retries 0 \
    --netns_prefix "$NETNS_PREFIX" --out "$out" --json "$out.json" "${net[@]}" \
    >"$out.log" 2>&1
  "$BASE_PY" - "$out.json" $SCHEDULES <<'EOF'
import json, sys
try:
    settings = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    settings = []
cells = []
for schedule in sys.argv[2:]:
    times = [s["results"][schedule].get("step_s_median") for s in settings
             if schedule in s.get("results", {})]
    cells.append(f"{schedule}=" + (f"{times[0]:.3f}s" if times and times[0] else "FAILED"))
print(" ".join(cells))
EOF
}

# --- the matrix ----------------------------------------------------------------------------------
failed=0
cpp_done=""
for v in $VERSIONS; do
  t0=$(date +%s)
  if ! read -r newest oldest < <(resolve_keras "$v"); then
    log "tf $v: cannot resolve its Keras versions (see $RUN/resolve-tf-$v.log)"
    printf '%s\t-\tresolve FAILED\t-\t-\t-\n' "$v" >> "$RESULTS"; failed=1; continue
  fi
  log "tf $v: Keras $newest (newest it accepts) and $oldest (oldest it claims)"
  NEWEST="$newest"
  refused=""
  if version_lt "$oldest" "$KERAS_MIN"; then
    refused="$oldest"; oldest="$KERAS_MIN"
    log "tf $v: Keras $refused is older than prophet_tf's minimum: testing $oldest, and that $refused is refused"
  fi
  kerases="$newest"; [ "$oldest" != "$newest" ] && kerases="$newest $oldest"
  if [ -n "$refused" ]; then
    if ensure_venv "$v" "$newest" && ensure_venv "$v" "$refused"; then
      if check_refused "$v" "$refused"; then cell="refused at import: ok"; else
        cell="refused at import: FAILED"; failed=1
      fi
    else cell="venv FAILED"; failed=1; fi
    [ "$PREPARE_ONLY" = "1" ] || printf '%s\t%s\t%s\t-\t-\t-\n' "$v" "$refused" "$cell" >> "$RESULTS"
  fi
  ok_venvs=""
  for k in $kerases; do
    if ensure_venv "$v" "$k"; then ok_venvs+="$k "; else
      printf '%s\t%s\tvenv FAILED\t-\t-\t-\n' "$v" "$k" >> "$RESULTS"; failed=1
    fi
  done
  [ -n "$ok_venvs" ] || continue
  [ "$PREPARE_ONLY" = "1" ] && continue
  PY_FOR_BUILD="$(venv_for "$v" "${ok_venvs%% *}")/bin/python"
  tb=$(date +%s)
  if build_libs "$v"; then build="ok ($(( $(date +%s) - tb )) s)"; else
    build="FAILED"; failed=1
    log "tf $v: build FAILED (see $RUN/build-tf-$v.log)"
  fi
  log "tf $v: build $build"
  if [ "$build" != "FAILED" ]; then
    foreign="$(check_foreign_library "$v")"
    case "$foreign" in
      refused:*) build+="; ${foreign#refused:}'s library refused" ;;
      FAILED:*) build+="; ${foreign#FAILED:}'s library NOT refused"; failed=1
                log "tf $v: the library built against TensorFlow ${foreign#FAILED:} was not refused (see $RUN/foreign-library-tf-$v.log)" ;;
    esac
  fi
  if [ -z "$cpp_done" ] && [ "$build" != "FAILED" ]; then
    cpp_done="tf $v"
    if bazel_v "$v" test //ops/... >"$RUN/cpp-tests.log" 2>&1; then
      log "C++ tests: passed ($(grep -c ' PASSED ' "$RUN/cpp-tests.log") targets; log $RUN/cpp-tests.log)"
    else
      log "C++ tests: FAILED (see $RUN/cpp-tests.log)"; failed=1; cpp_done="FAILED"
    fi
  fi
  for k in $ok_venvs; do
    if [ "$build" = "FAILED" ]; then
      printf '%s\t%s\t%s\t-\t-\t-\n' "$v" "$k" "$build" >> "$RESULTS"; continue
    fi
    log "tf $v keras $k: pytest $TESTS"
    read -r passed bad < <(run_tests "$v" "$k")
    [ "$bad" = "0" ] || failed=1
    log "tf $v keras $k: $passed passed, $bad failed or skipped (log $RUN/pytest-tf-$v-keras-$k.log)"
    if [ "${PROPHET_VERSIONS_SKIP_BENCH:-0}" = "1" ]; then steps="not run"
    elif [ "$k" != "${ok_venvs%% *}" ]; then steps="-"  # launches with the newest Keras only
    else
      log "tf $v keras $k: emulated launches ($SCHEDULES)"
      steps="$(run_launches "$v" "$k")"
      [[ "$steps" == *FAILED* ]] && failed=1
      log "tf $v keras $k: step times $steps"
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$v" "$k" "$build" "$passed" "$bad" "$steps" >> "$RESULTS"
  done
  bazel --output_base="$CACHE/bazel/tf-$v" shutdown >/dev/null 2>&1 || true
  log "tf $v: done in $(( $(date +%s) - t0 ))s"
done

# --- the table ---------------------------------------------------------------------------------
if [ "$PREPARE_ONLY" = "1" ]; then
  log "environments ready in $(( $(date +%s) - START ))s"; exit "$failed"
fi
WALL=$(( $(date +%s) - START ))
"$BASE_PY" - "$RESULTS" "$WALL" "${cpp_done:-not run}" "$SCHEDULES" > "$RUN/table.md" <<'EOF'
import sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
wall, cpp, schedules = int(sys.argv[2]), sys.argv[3], sys.argv[4].split()
print("| TensorFlow | Keras | build | tests passed | failed | "
      + " | ".join(f"step {s}" for s in schedules) + " |")
print("|---|---|---|---|---|" + "---|" * len(schedules))
for tf, keras, build, passed, bad, steps in rows:
    cells = dict(c.split("=", 1) for c in steps.split() if "=" in c)
    print(f"| {tf} | {keras} | {build} | {passed} | {bad} | "
          + " | ".join(cells.get(s, steps if "=" not in steps else "-") for s in schedules) + " |")
print()
print(f"C++ tests: {'passed with ' + cpp if cpp not in ('FAILED', 'not run') else cpp}. "
      f"Wall time: {wall // 60} min {wall % 60} s.")
EOF
cat "$RUN/table.md"
log "table: $RUN/table.md"
exit "$failed"
