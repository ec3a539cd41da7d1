#!/usr/bin/env bash
# `pytest -m gpu`, one package at a time, each under its own wall-clock cap (issue 36 point 4:
# every package's GPU tests in under 5 minutes on an H100; one device call is capped at 600 s, so
# a full pass is several calls, e.g. PACKAGES="kernels optim parallel", "kernels-compile",
# "linear" (carry fla + tilelang: ../shared/gpu/bundle_fla.sh), "models", "data pack trainer root").
#   source benchmarks/device/setup.sh
#   PACKAGES="kernels models" CAP=290 bash benchmarks/device/gpu_tests.sh
# Writes $OUT/gpu_tests.txt (-rA: every test's outcome, --durations: the 25 slowest phases per
# package) and $OUT/gpu_junit.tgz (one JUnit XML per package); prints a summary line per package.
# Extra pytest arguments: PYTEST_ARGS (e.g. "-k 'not compiled'").
set -u
OUT=${OUT:-runs/gpu_tests}
mkdir -p "$OUT" /tmp/gpu_junit
CAP=${CAP:-290}
K=packages/lmms-kernels/tests M=packages/lmms-models/tests
# The groups that compile on first use run apart, each under its own cap: FA4's compiled
# variants (test_compile_gpu.py: 24 backend x head-dim x causal cases; 7 of them took 80 s on
# 2026-12-03) and fla's Triton kernels with TileLang's JIT on Hopper (linear attention: still
# compiling after 100 s in the 2026-12-05 H100 call). The rest of each package is plain kernels.
declare -A DIRS=(
  [kernels]="$K --ignore=$K/test_compile_gpu.py --ignore=$K/test_linear_attention.py"
  [kernels-compile]=$K/test_compile_gpu.py
  [linear]="$K/test_linear_attention.py $M/test_linear_families.py $M/test_linear_parallel.py"
  [models]="$M --ignore=$M/test_linear_families.py --ignore=$M/test_linear_parallel.py"
  [optim]=packages/lmms-optim/tests [parallel]=packages/lmms-parallel/tests
  [data]=packages/lmms-data/tests [pack]=packages/lmms-pack/tests
  [trainer]=apps/trainer/tests [root]=tests
)
for p in ${PACKAGES:-kernels kernels-compile linear models optim parallel data pack trainer root}; do
  d=${DIRS[$p]:-}
  [ -n "$d" ] || { echo "[$p] no such group"; continue; }
  t0=$(date +%s)
  echo "===== $p ($d), cap ${CAP}s" >> "$OUT/gpu_tests.txt"
  # shellcheck disable=SC2086
  timeout "$CAP" python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu -rA --durations=25 \
    --junitxml="/tmp/gpu_junit/$p.xml" ${PYTEST_ARGS:-} $d >> "$OUT/gpu_tests.txt" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  line=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)" "$OUT/gpu_tests.txt" | tail -1)
  [ "$rc" = 124 ] && line="TIMEOUT after ${CAP}s (the cap); see the log for the tests that ran"
  echo "[$p] rc=$rc ${dt}s: $line" | tee -a "$OUT/gpu_tests.txt"
done
tar czf "$OUT/gpu_junit.tgz" -C /tmp gpu_junit 2>/dev/null
