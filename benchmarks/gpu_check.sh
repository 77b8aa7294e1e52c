#!/usr/bin/env bash
# The whole first-GPU check in one command, under 8 minutes by construction: one deadline, START + 465 s,
# that every step respects. Set-up steps run under `timeout` within the first 150 s; gpu_check.py gets
# the deadline and gives each sub-check min(its budget, the time left), killing its whole process
# session when it runs out; a hard backstop stops gpu_check.py itself 10 s after the deadline.
#
#   bash benchmarks/prepare_gpu_wheels.sh     # here, with network: wheels into .whl/ (git-ignored)
#   bash benchmarks/gpu_check.sh [RESULTS]    # there: device tool, carry [".whl"]
#
# RESULTS defaults to $OUT (the device tool's return folder) or benchmarks/results/gpu/<timestamp>.
# Steps: refuse without a CUDA GPU (exit 2) -> install the carried wheels with no index (a failure is
# recorded, per wheel, and every check that can run without it still runs) -> build the native CPU-Adam
# kernel (a failure is recorded; the torch fallback is checked) -> the sub-checks, most important first,
# each leaving its result in RESULTS/summary.json as it ends (order and budgets: CHECKS in gpu_check.py).
# Exit status: 0 all passed, 1 something failed (set-up included), 2 no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_SECONDS:-465}))  # 480 s less 15 for the last kill, summary write and exit
SETUP_END=$((START + 150))
PY=${PYTHON:-python3}
RESULTS=${1:-${OUT:-benchmarks/results/gpu/$(date -u +%Y%m%dT%H%M%SZ)}}
ERRORS=()
# seconds a set-up step may take: its own limit, or what is left of the set-up's 150 s if that is less
budget() {
    local left=$((SETUP_END - $(date +%s)))
    ((left < $1)) && echo $((left > 1 ? left : 1)) || echo "$1"
}

if ! timeout 60 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: NO GPU on this machine (torch.cuda.is_available() is False with $PY): nothing was checked." >&2
    echo "gpu_check: run it on a CUDA machine; a CPU dry run of the sub-checks: $PY benchmarks/gpu_check.py --device cpu --results /tmp/dry" >&2
    exit 2
fi
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/setup.txt") 2>&1
timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader || true

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=/tmp/zero-offload-site
    pip_install() { timeout "$(budget "$1")" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "${@:2}"; }
    if ! pip_install 90 .whl/*.whl; then
        echo "gpu_check: installing the carried wheels together failed; installing them one by one"
        for wheel in .whl/*.whl; do
            pip_install 30 "$wheel" || ERRORS+=("wheel $(basename "$wheel") did not install")
        done
    fi
    export PYTHONPATH="$SITE:$PYTHONPATH"
else
    echo "gpu_check: no .whl/ carried: cffi, torchao and deepspeed only if the image has them"
fi
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
timeout "$(budget 90)" "$PY" setup.py -q build_ext --inplace >/dev/null \
    || ERRORS+=("building the native kernel failed: the torch fallback is what gets checked")
timeout "$(budget 30)" "$PY" -c 'from lightning_zero_offload import kernels; print("native kernels:", kernels.backend())' \
    || ERRORS+=("importing lightning_zero_offload failed")
((${#ERRORS[@]})) && printf 'gpu_check: set-up error: %s\n' "${ERRORS[@]}"
GPU_CHECK_SETUP_ERRORS=$(IFS=';'; echo "${ERRORS[*]:-}")
export GPU_CHECK_SETUP_ERRORS

timeout --kill-after=5 $((DEADLINE + 10 - $(date +%s))) \
    "$PY" benchmarks/gpu_check.py --results "$RESULTS" --deadline "$DEADLINE"
STATUS=$?
((STATUS == 0 && ${#ERRORS[@]})) && STATUS=1
echo "gpu_check: exit $STATUS after $(($(date +%s) - START)) s; results in $RESULTS"
exit $STATUS
