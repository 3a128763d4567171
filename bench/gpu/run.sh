#!/usr/bin/env bash
# The GPU suite: one command on a fresh GPU machine, from the repository root or anywhere.
#
#   bash bench/gpu/run.sh            # everything: CUDA tests, MFU table, torchtitan ratio
#   SUITE_QUICK=1 bash bench/gpu/run.sh   # CUDA tests and the two Llama 3.2 1B rows at 4096
#   bash bench/gpu/run.sh check     # install the carried wheels and verify every import (a CPU dry run)
#
# It runs on the torch the machine already has (it never installs one), puts meshforge on
# PYTHONPATH instead of pip-installing it (no build step, no registry needed), installs the
# wheels carried in bench/gpu/wheels/ (made by bench/gpu/fetch_wheels.sh on a machine with
# a package registry) with --no-deps, and writes everything to $OUT (default bench/gpu/out):
# results.md (device, torch, date, test summary, MFU table) plus the raw logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/gpu/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

WHEELS=bench/gpu/wheels
PY=${PYTHON:-python3}  # the interpreter that runs the suite installs its wheels (never a bare pip)
SITE="$OUT/site"
mkdir -p "$SITE"
export PYTHONPATH="$PYTHONPATH:$PWD/$SITE"
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  # torchtitan by the machine's torch: 0.2.2 imports on 2.11, 0.3.0 needs >= 2.13
  TT=$($PY -c "import torch; v=tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); print('0.3.0' if v >= (2, 13) else '0.2.2')")
  for w in "$WHEELS"/*.whl; do
    dist=$(basename "$w" | cut -d- -f1); ver=$(basename "$w" | cut -d- -f2)
    [ "$dist" = torchtitan ] && [ "$ver" != "$TT" ] && continue
    $PY -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" >/dev/null 2>&1 && continue
    $PY -m pip install --no-index --no-deps --quiet --target "$SITE" "$w" >>"$OUT/pip.log" 2>&1 \
      || echo "could not install $w (see $OUT/pip.log)" | tee -a "$OUT/pip.log"
  done
fi
# every import the GPU run needs, before running anything
$PY - <<'PYEOF' | tee "$OUT/imports.txt"
import importlib
bad = []
for mod in ("torch", "meshforge", "meshforge.train", "transformers", "torchao", "torchao.float8", "torchtitan"):
    try:
        m = importlib.import_module(mod)
        print(f"import ok: {mod} {getattr(m, '__version__', '')}")
    except Exception as e:  # noqa: BLE001 - report every one
        bad.append(mod)
        print(f"import FAILED: {mod}: {type(e).__name__}: {e}")
print("not importable:", ", ".join(bad) if bad else "none")
PYEOF
[ "${1:-}" = check ] && { echo "check only: imports above"; exit 0; }

$PY - <<'EOF' | tee "$OUT/results.md"
import datetime, platform, torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"# GPU suite: {name}\n")
print(f"- date: {datetime.date.today()}  \n- torch: {torch.__version__} (CUDA {torch.version.cuda})  "
      f"\n- python: {platform.python_version()}  \n- GPUs visible: {torch.cuda.device_count()}\n")
for mod in ("torchao", "torchtitan", "transformers"):
    try:
        m = __import__(mod); print(f"- {mod}: {getattr(m, '__version__', '?')}  ")
    except Exception as e:  # noqa: BLE001 - report, don't stop the suite
        print(f"- {mod}: not importable ({type(e).__name__})  ")
print()
EOF

echo "## CUDA tests (pytest -m cuda)" >>"$OUT/results.md"
$PY -m pytest -m cuda -q -rs -p no:cacheprovider tests >"$OUT/pytest_cuda.txt" 2>&1
echo "exit $?" >>"$OUT/pytest_cuda.txt"
{ echo '```'; tail -n 25 "$OUT/pytest_cuda.txt"; echo '```'; echo; } >>"$OUT/results.md"

echo "## MFU (bench/gpu/bench_mfu.py)" >>"$OUT/results.md"
ONLY=()
[ -n "${SUITE_QUICK:-}" ] && ONLY=(--only 1b-4096-eager 1b-4096-compile)
$PY bench/gpu/bench_mfu.py --out "$OUT/mfu.md" "${ONLY[@]}" >"$OUT/bench_mfu.log" 2>&1
cat "$OUT/mfu.md" >>"$OUT/results.md" 2>/dev/null || tail -n 20 "$OUT/bench_mfu.log" >>"$OUT/results.md"
echo "written: $OUT/results.md"
