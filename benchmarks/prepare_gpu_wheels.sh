#!/usr/bin/env bash
# Wheels for what the GPU machine's image lacks (it has no network): cffi + pycparser (the native CPU-Adam
# kernel), torchao (CPUOffloadOptimizer) and DeepSpeed with the dependencies the image does not have.
# Written to .whl/ (git-ignored); benchmarks/gpu_check.sh installs them there with --no-index --no-deps.
#
#   bash benchmarks/prepare_gpu_wheels.sh            # then carry ".whl" to the GPU machine
#   bash benchmarks/prepare_gpu_wheels.sh --check    # also install them into a fresh folder and import each
#
# Target: python3 3.12 (cp312), manylinux x86_64, torch 2.11 already installed there. DeepSpeed ships only
# an sdist, so its wheel is built here with DS_BUILD_OPS=0 (no op compiled: its CPU Adam is JIT-built
# there with the image's nvcc/ninja). Wheels already in .whl/ stay; only other versions of the packages
# fetched here are replaced (two versions of one package in --no-deps installs would both be installed).
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=.whl
PY=${PYTHON:-python3}   # any python with pip, for the downloads
# DeepSpeed's setup.py imports torch: BUILD_PYTHON, else this checkout's .venv, else $PY, if torch imports there
BUILD_PY=${BUILD_PYTHON:-}
if [ -z "$BUILD_PY" ]; then
    BUILD_PY=$PY
    [ -x .venv/bin/python ] && BUILD_PY=.venv/bin/python
fi
if ! "$BUILD_PY" -c 'import torch' 2>/dev/null; then
    echo "prepare_gpu_wheels: torch does not import with $BUILD_PY (DeepSpeed's setup.py needs it):" \
        "set BUILD_PYTHON to a python that has torch, e.g. BUILD_PYTHON=.venv/bin/python after make setup" >&2
    exit 1
fi

CFFI=cffi==2.0.0
PYCPARSER=pycparser==2.23
TORCHAO=torchao==0.17.0
DEEPSPEED=deepspeed==0.18.9
# DeepSpeed's requirements that the image lacks (it has ninja, numpy, packaging, psutil, py-cpuinfo, tqdm,
# msgpack, einops, nvidia-ml-py, typing-extensions): hjson and pydantic v2 with its own pins.
DS_DEPS=(hjson==3.1.0 pydantic==2.11.7 pydantic-core==2.33.2 annotated-types==0.7.0 typing-inspection==0.4.1)

mkdir -p "$WHL"
fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# Into a fresh folder first: a failed download or build leaves .whl/ as it was.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$fresh" "$CFFI" "$PYCPARSER" "$TORCHAO" "${DS_DEPS[@]}"
ds_wheel=$(compgen -G "$WHL/deepspeed-${DEEPSPEED#deepspeed==}-*.whl" | head -1 || true)
if [ -n "$ds_wheel" ]; then
    echo "keeping $ds_wheel (already built)"
    cp "$ds_wheel" "$fresh"/
else
    DS_BUILD_OPS=0 "$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$fresh" "$DEEPSPEED"
fi
for w in "$fresh"/*.whl; do
    name=$(basename "$w")
    for old in "$WHL/${name%%-*}"-*.whl; do  # other versions of the same distribution only
        if [ -e "$old" ] && [ "$(basename "$old")" != "$name" ]; then
            echo "replacing $old"
            rm -f "$old"
        fi
    done
    mv -f "$w" "$WHL/$name"
done

echo "wheels in $WHL ($(du -sh "$WHL" | cut -f1)):"
ls -1 "$WHL"
echo "requirements they declare (none may be missing on the GPU image):"
for w in "$WHL"/*.whl; do
    unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed "s|^|  $(basename "$w"): |" || true
done

if [ "${1:-}" = "--check" ]; then
    # A fair proxy for the GPU machine: install into an empty target exactly as gpu_check.sh does, then
    # import each package from there (this machine's python and torch, not 3.12 / torch 2.11).
    # The cp312 binary wheels (cffi, pydantic-core) are swapped for the same versions built for this python.
    target=$(mktemp -d)
    local_whl=$(mktemp -d)
    for w in "$WHL"/*.whl; do
        case "$w" in
            *-cp312-cp312-*)
                name_version=$(basename "$w" | cut -d- -f1,2 | sed 's/-/==/; s/_/-/g')
                "$BUILD_PY" -m pip download -q --no-deps --only-binary=:all: -d "$local_whl" "$name_version" ;;
            *) cp "$w" "$local_whl"/ ;;
        esac
    done
    # What the image has and this python may lack (DeepSpeed's other requirements): for the check only.
    "$BUILD_PY" -m pip download -q --no-deps --only-binary=:all: -d "$local_whl" py-cpuinfo einops msgpack ninja
    "$BUILD_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
        "$local_whl"/*.whl
    DS_ACCELERATOR=cpu PYTHONPATH="$target" "$BUILD_PY" - <<'EOF'
import importlib, sys
for name in ("cffi", "pycparser", "torchao.optim", "hjson", "pydantic", "deepspeed", "deepspeed.ops.adam"):
    module = importlib.import_module(name)
    print(f"  import {name}: ok ({getattr(module, '__version__', '')}) from {module.__file__}")
from torchao.optim import CPUOffloadOptimizer  # noqa: F401
from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
EOF
    rm -rf "$target" "$local_whl"
    echo "check: every wheel installed into a fresh target and imported"
fi
