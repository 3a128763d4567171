#!/usr/bin/env bash
# Download every wheel the GPU suite needs beyond torch into bench/gpu/wheels/, on a machine
# WITH a package registry, so that a GPU machine with no registry can install them from the
# tree. Nothing here installs anything, and torch, triton and nvidia-* are never downloaded:
# the GPU machine's own CUDA torch is the one the suite tests.
#
#   bash bench/gpu/fetch_wheels.sh                          # CPython 3.10, 3.11 and 3.12, no numpy
#   PYTHONS=3.12 WITH_NUMPY=1 bash bench/gpu/fetch_wheels.sh  # one Python, numpy too
#
# numpy is left out unless WITH_NUMPY=1: its wheels are ~16 MiB per Python version (three would
# take 49 of the 60 MiB the tree may carry), and the GPU machines' image already has it
# (/work/.library/device/KINDS.md: Python 3.12.3, numpy 2.5.2, torch 2.11.0+cu130, triton 3.6.0).
#
# Writes, per Python version X.Y, bench/gpu/wheels/requirements-cpXY.txt: the name of each
# package carried for that version. Install on the GPU machine with
#   pip install --no-index --find-links bench/gpu/wheels --no-deps -r bench/gpu/wheels/requirements-cp312.txt
# which installs what is missing and leaves what the image has (add --upgrade to force the carried
# versions). --no-deps because a few dependencies are left out on purpose (see DROP): they are
# needed only by command-line tools, hub downloads or dataloaders the suite does not use.
# torchtitan 0.3.0 requires Python >= 3.11: on 3.10 the torchtitan column cannot run.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEST=${DEST:-$HERE/wheels}
PYTHONS=${PYTHONS:-"3.10 3.11 3.12"}
LIMIT_MIB=${LIMIT_MIB:-60}
# glibc 2.28 or newer, as torch 2.11's own manylinux_2_28 wheels need; older tags are accepted too.
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any)

# Resolved with their whole dependency closure (none of these depends on torch):
# meshforge's dependencies, the test extras, and torchtitan's non-torch dependencies that it imports.
RESOLVED=(
    "safetensors>=0.4" "tokenizers>=0.15"
    "pytest>=7" "transformers==5.20.2"  # the newest that still supports 3.10: one wheel for all
    "tyro==1.0.17" "einops==0.8.2" "spmd_types==0.2.3" "protobuf" "absl-py"
)
# Downloaded alone: each requires torch (already on the GPU machine), or drags in far more than
# it imports (tensorboard: torchtitan imports torch.utils.tensorboard, which needs only
# tensorboard itself, protobuf and absl-py — not grpcio, pillow or its data server).
NO_DEPS=(
    "torchao==0.18.0"
    "torchdata==0.11.0" "torch_checkpointing==0.1.1" "tensorboard==2.21.0"
)
# pip evaluates markers against the Python running it, not --python-version: choose per version here.
only_310=("tomli>=2.0" "exceptiongroup")  # tomllib and ExceptionGroup are built in from 3.11 on
from_311=("torchtitan==0.3.0" "torchtitan==0.2.2")  # 0.3.0 for torch >= 2.13, 0.2.2 for 2.11 (run.sh picks); 0.3.0 needs Python >= 3.11
# Left out after resolution (not imported by anything the suite runs; checked by importing
# meshforge, transformers, pytest and torchtitan without them): hub download acceleration and
# the typer-based command-line interfaces of transformers / huggingface_hub.
# numpy too unless WITH_NUMPY=1 (then the entry reads "_numpy" and matches nothing).
DROP="${WITH_NUMPY:+_}numpy hf_xet typer rich pydantic pydantic_core annotated_types typing_inspection markdown_it_py mdurl shellingham annotated_doc"

mkdir -p "$DEST"
rm -f "$DEST"/*.whl "$DEST"/requirements-*.txt  # the folder holds exactly this run's set
for py in $PYTHONS; do
    tag=cp${py/./}
    target=(--python-version "$py" --implementation cp --abi "$tag" --abi abi3 --abi none "${PLATFORMS[@]}")
    list=$(mktemp -d)
    echo "== CPython $py" >&2
    if [ "$py" = 3.10 ]; then extra=("${only_310[@]}") alone=(); else extra=() alone=("${from_311[@]}"); fi
    python3 -m pip download --quiet --only-binary=:all: "${target[@]}" -d "$list" "${RESOLVED[@]}" "${extra[@]}"
    for spec in "${NO_DEPS[@]}" "${alone[@]}"; do
        python3 -m pip download --quiet --only-binary=:all: --no-deps "${target[@]}" -d "$list" "$spec"
    done
    req="$DEST/requirements-$tag.txt"
    : > "$req"
    for whl in "$list"/*.whl; do
        base=$(basename "$whl")
        name=${base%%-*}
        case " $DROP " in *" $name "*) continue ;; esac
        case "$name" in torch | triton | nvidia_*) echo "refusing $base" >&2; exit 1 ;; esac
        cp -n "$whl" "$DEST/"
        echo "$name" >> "$req"  # the version is in the wheel's file name
    done
    rm -rf "$list"
done

du -b "$DEST"/*.whl | awk -v lim="$LIMIT_MIB" '
    { total += $1 } END {
        printf "%d wheels, %.1f MiB in %s\n", NR, total / 1048576, "'"$DEST"'" > "/dev/stderr"
        if (total > lim * 1048576) { printf "over the %d MiB limit\n", lim > "/dev/stderr"; exit 1 }
    }'
