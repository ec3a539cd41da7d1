#!/usr/bin/env bash
# `pytest -m gpu`, one package at a time, each under its own wall-clock cap (issue 36 point 4:
# every package's GPU tests in under 5 minutes on an H100; one device call is capped at 600 s, so
# a full pass is several calls: PACKAGES="kernels optim" then "models" then "trainer root").
#   source benchmarks/device/setup.sh   # (or fla.sh for the linear-attention tests)
#   PACKAGES="kernels models" CAP=290 bash benchmarks/device/gpu_tests.sh
# Writes $OUT/gpu_tests.txt (-rA: every test's outcome, --durations: the 25 slowest phases per
# package) and $OUT/gpu_junit.tgz (one JUnit XML per package); prints a summary line per package.
# Extra pytest arguments: PYTEST_ARGS (e.g. "-k 'not compiled'").
set -u
OUT=${OUT:-runs/gpu_tests}
mkdir -p "$OUT" /tmp/gpu_junit
CAP=${CAP:-290}
declare -A DIRS=(
  [kernels]=packages/lmms-kernels/tests [optim]=packages/lmms-optim/tests
  [parallel]=packages/lmms-parallel/tests [models]=packages/lmms-models/tests
  [data]=packages/lmms-data/tests [pack]=packages/lmms-pack/tests
  [trainer]=apps/trainer/tests [root]=tests
)
for p in ${PACKAGES:-kernels optim parallel models data pack trainer root}; do
  d=${DIRS[$p]:-}
  [ -d "$d" ] || { echo "[$p] no tests folder"; continue; }
  t0=$(date +%s)
  echo "===== $p ($d), cap ${CAP}s" >> "$OUT/gpu_tests.txt"
  # shellcheck disable=SC2086
  timeout "$CAP" python3 -m pytest -q -p no:cacheprovider -m gpu -rA --durations=25 \
    --junitxml="/tmp/gpu_junit/$p.xml" ${PYTEST_ARGS:-} "$d" >> "$OUT/gpu_tests.txt" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  line=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)" "$OUT/gpu_tests.txt" | tail -1)
  [ "$rc" = 124 ] && line="TIMEOUT after ${CAP}s (the cap); see the log for the tests that ran"
  echo "[$p] rc=$rc ${dt}s: $line" | tee -a "$OUT/gpu_tests.txt"
done
tar czf "$OUT/gpu_junit.tgz" -C /tmp gpu_junit 2>/dev/null
