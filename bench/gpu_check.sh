#!/usr/bin/env bash
# GPU check: build elastic_emb with CUDA in place, run the GPU tests, run the
# GPU kernel benchmark. For a GPU machine without TensorFlow or internet
# (python3, nvcc, CuPy); finishes within 5 minutes (every step has a timeout).
#
#   bench/gpu_check.sh            # logs to $OUT when set, else bench/results/gpu_check/
#   PYTHON=python3.12 bench/gpu_check.sh
#
# Needs numpy, pybind11 and setuptools to build, pytest to test, CuPy for the
# device-array tests and the benchmark. A machine that lacks pytest or
# pybind11 can use pure-Python copies made beforehand on a dev machine:
#
#   PYTHON=path/to/venv/bin/python bench/gpu_check.sh --pylib   # fills build/pylib
#
# then ship build/pylib along (it is git-ignored); this script puts it on
# PYTHONPATH when pytest or pybind11 is missing.
#
# Exit status: 0 when the build and the tests pass (benchmark targets are
# reported, not enforced), 1 otherwise.
set -uo pipefail

cd "$(dirname "$0")/.."
REPO="$(pwd)"
PY="${PYTHON:-python3}"
PYLIB="$REPO/build/pylib"

if [ "${1:-}" = "--pylib" ]; then
  site="$("$PY" -c 'import os, pytest; print(os.path.dirname(os.path.dirname(pytest.__file__)))')" || {
    echo "gpu_check --pylib: $PY has no pytest" >&2
    exit 1
  }
  rm -rf "$PYLIB" && mkdir -p "$PYLIB"
  for pkg in pytest _pytest pluggy iniconfig packaging pygments pybind11 py.py; do
    if [ -e "$site/$pkg" ]; then
      cp -r "$site/$pkg" "$PYLIB/"
    fi
  done
  find "$PYLIB" -name __pycache__ -prune -exec rm -rf {} +
  echo "gpu_check --pylib: $(du -sh "$PYLIB" | cut -f1) in $PYLIB ($(ls "$PYLIB" | tr '\n' ' '))"
  exit 0
fi

LOGS="${OUT:-$REPO/bench/results/gpu_check}"
mkdir -p "$LOGS"
SUMMARY="$LOGS/summary.txt"
: >"$SUMMARY"
DEADLINE=$((SECONDS + 290))

say() { echo "gpu_check: $*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE - SECONDS)); }
# Seconds for the next step: what is left minus what later steps reserve, capped.
budget() {
  local b=$(($(left) - $1))
  [ "$b" -gt "$2" ] && b="$2"
  [ "$b" -lt 10 ] && b=10
  echo "$b"
}

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
status=0

# 1. Facts about the machine.
{
  echo "date: $(date -u +%FT%TZ)"
  echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)' 2>&1)"
  echo "nvcc: $(nvcc --version 2>&1 | tail -n 2 | head -n 1)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  for mod in numpy pybind11 setuptools pytest cupy torch tensorflow keras grpc; do
    echo "$mod: $("$PY" -c "import $mod; print(getattr($mod, '__version__', 'present'))" 2>/dev/null || echo missing)"
  done
} >"$LOGS/facts.txt" 2>&1
cat "$LOGS/facts.txt"

missing=""
for mod in numpy pybind11 setuptools pytest; do
  "$PY" -c "import $mod" 2>/dev/null || missing="$missing $mod"
done
if [ -n "$missing" ] && [ -d "$PYLIB" ]; then
  say "missing:$missing; adding $PYLIB to PYTHONPATH"
  export PYTHONPATH="$PYTHONPATH:$PYLIB"
  missing=""
  for mod in numpy pybind11 setuptools pytest; do
    "$PY" -c "import $mod" 2>/dev/null || missing="$missing $mod"
  done
fi
for mod in numpy pybind11 setuptools; do
  case " $missing " in
    *" $mod "*)
      say "FAIL: cannot build: Python module '$mod' is missing for $PY (pip install $mod, or ship build/pylib made by 'bench/gpu_check.sh --pylib' on a dev machine)"
      exit 1
      ;;
  esac
done

# 2. Build with CUDA, in place.
say "building with ELASTIC_EMB_CUDA=1 (log: build.log)"
start=$SECONDS
if ELASTIC_EMB_CUDA=1 timeout -k 5 "$(budget 150 150)" "$PY" setup.py build_ext --inplace -j "$(nproc)" \
  >"$LOGS/build.log" 2>&1; then
  say "build ok in $((SECONDS - start)) s"
else
  say "FAIL: build (exit $?) after $((SECONDS - start)) s; last lines of build.log:"
  tail -n 30 "$LOGS/build.log" | tee -a "$SUMMARY"
  exit 1
fi

# 3. What was built (no TensorFlow needed).
if ! "$PY" -c '
import elastic_emb as ee, elastic_emb._core as c
print("with_cuda", c.with_cuda, "cuda_device_count", c.cuda_device_count())
print("build_info", ee.build_info())
' 2>&1 | tee -a "$SUMMARY"; then
  say "FAIL: import elastic_emb._core"
  exit 1
fi

# 4. GPU tests.
case " $missing " in
  *" pytest "*)
    say "FAIL: pytest is missing for $PY: the GPU tests did not run (pip install pytest, or ship build/pylib made by 'bench/gpu_check.sh --pylib')"
    status=1
    ;;
  *)
    say "tests: pytest -m gpu tests/test_gpu.py (log: tests.log)"
    start=$SECONDS
    timeout -k 5 "$(budget 75 170)" "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -rs \
      --durations=5 >"$LOGS/tests.log" 2>&1
    rc=$?
    [ "$rc" -eq 124 ] && say "tests TIMED OUT"
    grep -E "^(FAILED|ERROR|SKIPPED)" "$LOGS/tests.log" | head -n 40 | tee -a "$SUMMARY"
    tail -n 1 "$LOGS/tests.log" | tee -a "$SUMMARY"
    if [ "$rc" -eq 0 ]; then
      say "tests ok in $((SECONDS - start)) s"
    elif [ "$rc" -eq 5 ]; then
      say "FAIL: no GPU test ran (module skipped: no CUDA build or no visible device; see above)"
      status=1
    else
      say "FAIL: tests (exit $rc) after $((SECONDS - start)) s"
      status=1
    fi
    ;;
esac

# 5. Kernel bandwidth benchmark.
say "benchmark: bench/gpu_bench.py (results: bench.md, progress: bench.log)"
start=$SECONDS
timeout -k 5 "$(budget 0 150)" "$PY" bench/gpu_bench.py >"$LOGS/bench.md" 2>"$LOGS/bench.log"
rc=$?
tee -a "$SUMMARY" <"$LOGS/bench.md"
if [ "$rc" -ne 0 ]; then
  say "benchmark failed or timed out (exit $rc) after $((SECONDS - start)) s; last lines of bench.log:"
  tail -n 20 "$LOGS/bench.log" | tee -a "$SUMMARY"
else
  say "benchmark done in $((SECONDS - start)) s"
fi

say "total $SECONDS s; logs in $LOGS; exit $status"
exit "$status"
