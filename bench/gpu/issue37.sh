#!/usr/bin/env bash
# Issue 37's GPU check in one device command, about 8 minutes on one H100 or H200:
#   1. the CUDA tests of the eager-pass changes (tests/unit/test_eager_passes.py -m cuda: the fused
#      RMSNorm and the new RoPE launch fewer kernels, bf16 losses and gradients match)   ~0.5 min
#   2. run.sh part2: 1B seq 4096 eager and compiled, meshforge vs the strongest peer, each row
#      with its kernel diff (kdiff-part2.md)                                                 ~3.5 min
#   3. run.sh part5: fp8 1B and 3B, the same (kdiff-part5.md), in the time that is left      ~4 min
#
# Device tool: carry bench/gpu/wheels (PYTHONS=3.12 bash bench/gpu/fetch_wheels.sh first),
# command `bash bench/gpu/issue37.sh`, timeout_s 600. What comes back under $OUT (7 files at
# most, the tool brings back 8): results-part2.md, results-part5.md, kdiff-part2.md,
# kdiff-part5.md, cuda-tests.txt, timing.txt, logs.tgz (every log and table; no traces).
# TOTAL_S (default 500 s) is the budget from start to end; part 2 gets half of what the tests
# left, part 5 the rest. The interpreter is $PYTHON (default python3), as for run.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEST=${OUT:-bench/gpu/out}
WORK=${WORK:-/tmp/g37}  # run.sh installs the wheels under $WORK/site: kept out of $OUT
TOTAL_S=${TOTAL_S:-500}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$DEST" "$WORK"
S=$(date +%s)
left() { echo $((TOTAL_S - ($(date +%s) - S))); }

OUT=$WORK bash bench/gpu/run.sh install >"$WORK/install.log" 2>&1  # the wheels, every import checked
PYTHONPATH="$PWD/src:$WORK/site" timeout 150 $PY -m pytest -m cuda -q -rs -p no:cacheprovider \
  tests/unit/test_eager_passes.py >"$DEST/cuda-tests.txt" 2>&1
echo "exit $?" >>"$DEST/cuda-tests.txt"
echo "cuda tests: $(($(date +%s) - S)) s" >"$DEST/timing.txt"

B2=$(( $(left) / 2 ))  # part 2: two rows (eager, compiled), four runs; part 5 the same, larger
OUT=$WORK PART_BUDGET_S=$B2 SIDE_TIMEOUT_S=$((B2 / 2)) timeout $((B2 + 90)) bash bench/gpu/run.sh part2
echo "part2 done: $(($(date +%s) - S)) s" >>"$DEST/timing.txt"
R=$(left)
if [ "$R" -gt 120 ]; then
  OUT=$WORK PART_BUDGET_S=$((R - 40)) SIDE_TIMEOUT_S=$(((R - 40) / 2)) timeout "$R" bash bench/gpu/run.sh part5
fi
echo "part5 done: $(($(date +%s) - S)) s" >>"$DEST/timing.txt"

cp "$WORK"/results-part*.md "$WORK"/kdiff-part*.md "$DEST"/ 2>/dev/null
tar czf "$DEST/logs.tgz" -C "$WORK" --exclude=./site . 2>/dev/null
ls -la "$DEST"
