#!/usr/bin/env bash
# The whole first-GPU check in one command, under 8 minutes by construction (every sub-check has a time
# budget; see CHECKS in benchmarks/gpu_check.py for what each one does and its budget).
#
#   bash benchmarks/prepare_gpu_wheels.sh     # here, with network: wheels into .whl/ (git-ignored)
#   bash benchmarks/gpu_check.sh [RESULTS]    # there: device tool, carry [".whl"]
#
# RESULTS defaults to $OUT (the device tool's return folder) or benchmarks/results/gpu/<timestamp>.
# Steps: refuse without a CUDA GPU (exit 2) -> install the carried wheels with no index -> build the
# native CPU-Adam kernel -> warm DeepSpeed's JIT CPU Adam build in the background -> the sub-checks.
# Exit status: 0 all passed, 1 some failed, 2 no GPU, 3 setup failed.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PY=${PYTHON:-python3}
RESULTS=${1:-${OUT:-benchmarks/results/gpu/$(date -u +%Y%m%dT%H%M%SZ)}}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: NO GPU on this machine (torch.cuda.is_available() is False with $PY): nothing was checked." >&2
    echo "gpu_check: run it on a CUDA machine; a CPU dry run of the sub-checks: $PY benchmarks/gpu_check.py --device cpu --results /tmp/dry" >&2
    exit 2
fi
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/setup.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=/tmp/zero-offload-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "gpu_check: installing the carried wheels failed" >&2; exit 3; }
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_check: no .whl/ carried: cffi, torchao and deepspeed only if the image has them"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
"$PY" setup.py -q build_ext --inplace >/dev/null || { echo "gpu_check: building the native kernel failed" >&2; exit 3; }
"$PY" -c 'from lightning_zero_offload import kernels; print("native kernels:", kernels.backend())'

# DeepSpeed JIT-compiles its CPU Adam on first use (about a minute): start it now, off the critical path.
"$PY" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' >"$RESULTS/deepspeed_build.txt" 2>&1 &

LEFT=$((470 - ($(date +%s) - START)))
"$PY" benchmarks/gpu_check.py --results "$RESULTS" --budget "$LEFT"
STATUS=$?
echo "gpu_check: exit $STATUS after $(($(date +%s) - START)) s; results in $RESULTS"
exit $STATUS
