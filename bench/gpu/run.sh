#!/usr/bin/env bash
# The GPU suite: one command on a fresh GPU machine, from the repository root or anywhere.
#
#   bash bench/gpu/run.sh check     # install the carried wheels, verify every import, CPU smoke of both sides
#   bash bench/gpu/run.sh install   # install the carried wheels and verify every import, nothing else
#   bash bench/gpu/run.sh part1     # CUDA tests (pytest -m cuda)                         ~5 min
#   bash bench/gpu/run.sh part2     # 1B seq 4096 eager + compiled, gb 16 / mb 2, + peer   ~6 min
#   bash bench/gpu/run.sh part3     # 1B seq 32K and 64K, AC full, compiled, + peer        ~6 min
#   bash bench/gpu/run.sh part4     # 3B seq 8K, AC full, compiled + eager, + peer         ~7 min
#   bash bench/gpu/run.sh part5     # fp8 (torchao tensorwise) 1B and 3B, compiled, + peer ~6 min
#   bash bench/gpu/run.sh part6     # 8B with parallel.offload=cpu on one GPU, + peer      ~7 min
#   bash bench/gpu/run.sh all       # every part in one go (longer than one device command may run)
# Each part fits one 10-minute device command; run part2 first (the headline ratio), then 3, 4, 5, 6, 1.
#
# It runs on the torch the machine already has (it never installs one), puts meshforge on
# PYTHONPATH instead of pip-installing it (no build step, no registry needed), installs the
# wheels carried in bench/gpu/wheels/ (made by bench/gpu/fetch_wheels.sh on a machine with
# a package registry) with --no-deps, and writes everything to $OUT (default bench/gpu/out):
# results.md (device, torch, date, test summary, MFU table) plus the raw logs, and per part
# kdiff-partN.md: each row's kernel-by-kernel diff of the two traced steps (kernel_diff.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/gpu/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

WHEELS=${WHEELS:-bench/gpu/wheels}  # WHEELS=bench/gpu/wheels-cp311 for a dry run on Python 3.11
MODE=${1:-all}
PY=${PYTHON:-python3}  # the interpreter that runs the suite installs its wheels (never a bare pip)
SITE="$(cd "$OUT" && pwd)/site"  # absolute: $OUT may be relative or absolute
mkdir -p "$SITE"
export PYTHONPATH="$PYTHONPATH:$SITE"
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  # torchtitan by the machine's torch: 0.2.2 imports on 2.11, 0.3.0 needs >= 2.13
  TT=$($PY -c "import torch; v=tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); print('0.3.0' if v >= (2, 13) else '0.2.2')")
  todo=()
  for w in "$WHEELS"/*.whl; do
    dist=$(basename "$w" | cut -d- -f1); ver=$(basename "$w" | cut -d- -f2)
    [ "$dist" = torchtitan ] && [ "$ver" != "$TT" ] && continue
    $PY -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" >/dev/null 2>&1 && continue
    todo+=("$w")
  done
  pipi() { $PY -m pip install --no-index --no-deps --no-compile --quiet --upgrade --target "$SITE" "$@" >>"$OUT/pip.log" 2>&1; }
  if [ ${#todo[@]} -gt 0 ] && ! pipi "${todo[@]}"; then  # one by one only when the batch fails
    for w in "${todo[@]}"; do pipi "$w" || echo "could not install $w (see $OUT/pip.log)" | tee -a "$OUT/pip.log"; done
  fi
  echo "installed ${#todo[@]} carried wheels into $SITE (torchtitan $TT; packages the interpreter has are kept)"
fi
# every import the GPU run needs, before running anything
$PY - <<'PYEOF' | tee "$OUT/imports.txt"
import importlib, sys
bad = []
try:  # torchtitan imports HF datasets at module level; the peer stands it in the same way
    sys.path.insert(0, "bench/gpu")
    importlib.import_module("bench_torchtitan").install_datasets_placeholder()
except Exception as e:  # noqa: BLE001 - reported below
    bad.append("bench_torchtitan")
    print(f"import FAILED: bench_torchtitan: {type(e).__name__}: {e}")
mods = ("torch", "meshforge", "meshforge.train", "transformers", "torchao", "torchao.float8", "torchtitan",
        "torchtitan.models.llama3", "torch.distributed.fsdp", "torch.profiler",
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
for mod in mods:
    try:
        m = importlib.import_module(mod)
        print(f"import ok: {mod} {getattr(m, '__version__', '')}")
    except Exception as e:  # noqa: BLE001 - report every one
        bad.append(mod)
        print(f"import FAILED: {mod}: {type(e).__name__}: {e}")
print("not importable:", ", ".join(bad) if bad else "none")
PYEOF
[ "$MODE" = install ] && exit 0
if [ "$MODE" = check ]; then
  echo "== peer smoke (bench_torchtitan.py --smoke)"
  $PY bench/gpu/bench_torchtitan.py --smoke 2>"$OUT/peer_smoke.log" | tail -n 1
  echo "== table smoke (bench_mfu.py --smoke)"
  $PY bench/gpu/bench_mfu.py --smoke --out "$OUT/mfu-smoke.md" 2>&1 | tail -n 1
  exit 0
fi

header() {
  $PY - <<'EOF'
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
}

cuda_tests() {
  echo "## CUDA tests (pytest -m cuda)"
  $PY -m pytest -m cuda -q -rs -p no:cacheprovider tests >"$OUT/pytest_cuda.txt" 2>&1
  echo "exit $?" >>"$OUT/pytest_cuda.txt"
  echo '```'; tail -n 25 "$OUT/pytest_cuda.txt"; echo '```'; echo
}

mfu_part() {  # one part of the table: mfu-partN.md, ready for docs/benchmarks.md
  echo "## meshforge vs torchtitan's single-GPU recipe, part $1 (bench/gpu/bench_mfu.py)"
  PYTHONUNBUFFERED=1 $PY bench/gpu/bench_mfu.py --part "$1" --out "$OUT/mfu-part$1.md" \
    --kdiff-out "$OUT/kdiff-part$1.md" 2>"$OUT/bench_mfu-part$1.log"
  echo
}

case "$MODE" in
  part1) { header; cuda_tests; } | tee "$OUT/results-part1.md" ;;
  part[2-9]) { header; mfu_part "${MODE#part}"; } | tee "$OUT/results-$MODE.md" ;;
  all) { header; cuda_tests; for n in 2 3 4 5 6; do mfu_part "$n"; done; } | tee "$OUT/results.md" ;;
  *) echo "unknown mode '$MODE': install | check | part1..part6 | all" >&2; exit 2 ;;
esac
echo "written under $OUT"
