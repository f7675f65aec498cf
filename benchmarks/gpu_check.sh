#!/usr/bin/env bash
# The GPU check of issue 14, in one unattended run of a few minutes:
#   1. the GPU tests (tests/test_gpu.py; they skip without CUDA, so this script refuses first);
#   2. benchmarks/stall.py on CUDA tensors at 1, 4 and 16 GiB of model + AdamW state: the
#      device->host bound (copy into a cudaHostRegister'ed /dev/shm mapping, the
#      registered-memory bandwidth), flashckpt save() sync and overlap (first and steady, and the
#      wait in optimizer.step() after a forward/backward), DCP async_save with pinned-memory
#      staging (its best GPU configuration) and torch.save + fsync.
# Every step has its own timeout, and all of them together stay under $GPU_CHECK_BUDGET seconds
# (default 480): a step that would start with too little time left is skipped and says so.
#
# Usage (from anywhere):
#   bash benchmarks/gpu_check.sh [OUT_DIR]      # default: $OUT, else benchmarks/runs/gpu-<time>
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh   # a python whose torch has CUDA
#   GPU_CHECK_SIZES="1 4" bash benchmarks/gpu_check.sh     # fewer sizes
# Writes into OUT_DIR: gpu_check.json (what ran, exit codes, seconds), env.txt (nvidia-smi, torch,
# /dev/shm), test_gpu.log, stall-cuda-<size>gib.json and .log, report.md (markdown tables).
# Exit code: 0 all steps passed; 1 a step failed or timed out; 2 no CUDA device (nothing measured).
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
out_dir=${1:-${OUT:-$repo/benchmarks/runs/gpu-$(date -u +%Y%m%dT%H%M%SZ)}}
mkdir -p "$out_dir" || { echo "gpu_check.sh: cannot create $out_dir" >&2; exit 1; }
out_dir=$(cd "$out_dir" && pwd)
budget=${GPU_CHECK_BUDGET:-480}
sizes=${GPU_CHECK_SIZES:-1 4 16}
start=$(date +%s)

# The python to use: $PYTHON; else the first of these whose torch sees a CUDA device; else the
# first whose torch imports (it then says why there is no device).
py=${PYTHON:-}
if [ -z "$py" ]; then
    with_torch=""
    for cand in "$repo/.venv/bin/python" python3 python; do
        command -v "$cand" >/dev/null 2>&1 || continue
        "$cand" -c 'import torch' >/dev/null 2>&1 || continue
        with_torch=${with_torch:-$cand}
        if "$cand" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
            >/dev/null 2>&1; then
            py=$cand
            break
        fi
    done
    py=${py:-${with_torch:-python3}}
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$repo" || exit 1

steps_json=""
failed=0
record() { # name rc seconds note
    local sep=""
    [ -n "$steps_json" ] && sep=","
    steps_json="$steps_json$sep{\"step\": \"$1\", \"rc\": $2, \"seconds\": $3, \"note\": \"$4\"}"
}
write_json() { # ok reason
    cat >"$out_dir/gpu_check.json" <<EOF
{"ok": $1, "reason": "$2", "python": "$py", "out_dir": "$out_dir", "budget_s": $budget,
 "started": $start, "wall_s": $(($(date +%s) - start)), "steps": [$steps_json]}
EOF
}

cuda_info=$("$py" - 2>&1 <<'EOF'
import sys
try:
    import torch
except Exception as e:  # no torch at all
    print(f"torch does not import: {e}")
    sys.exit(1)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device")
    sys.exit(1)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} "
      f"device(s): {torch.cuda.get_device_name(0)}")
EOF
)
cuda_rc=$?
if [ $cuda_rc -ne 0 ]; then
    echo "gpu_check.sh: no CUDA device: $cuda_info (python: $py)." >&2
    echo "gpu_check.sh: nothing was measured; run it on a machine with a GPU, or point" \
        "PYTHON= at a python whose torch has CUDA." >&2
    record cuda 2 0 "no CUDA device: ${cuda_info//\"/\'}"
    write_json false "no CUDA device"
    exit 2
fi
echo "gpu_check.sh: $cuda_info; python $py; results in $out_dir; budget ${budget}s"
{
    echo "# $(date -u +%FT%TZ)"
    echo "$cuda_info"
    nvidia-smi 2>&1 || true
    df -h /dev/shm 2>&1
    free -g 2>&1
    nproc
    git -C "$repo" log -1 --oneline 2>&1
} >"$out_dir/env.txt"

# run_step NAME TIMEOUT LOG CMD...: runs with a timeout cut to the budget left.
run_step() {
    local name=$1 limit=$2 logf=$3
    shift 3
    local left=$((budget - ($(date +%s) - start)))
    if [ "$left" -lt 30 ]; then
        echo "gpu_check.sh: $name skipped: only ${left}s of the ${budget}s budget left" >&2
        record "$name" 124 0 "skipped: budget spent"
        failed=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "gpu_check.sh: $name (timeout ${limit}s)"
    local t0 rc
    t0=$(date +%s)
    timeout --signal=TERM --kill-after=30 "$limit" "$@" >"$logf" 2>&1
    rc=$?
    local note=""
    [ $rc -eq 124 ] && note="timed out after ${limit}s"
    [ $rc -ne 0 ] && failed=1 && echo "gpu_check.sh: $name failed (rc $rc $note); see $logf" >&2
    record "$name" $rc $(($(date +%s) - t0)) "$note"
    tail -n 3 "$logf"
}

run_step test_gpu 120 "$out_dir/test_gpu.log" \
    "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs

# Each size in a process of its own (its memory freed before the next); the biggest gets what
# the budget has left, and fewer samples (each 16 GiB torch.save writes 16 GiB to disk).
for size in $sizes; do
    case $size in
    1) limit=75 reps=3 ;;
    4) limit=120 reps=3 ;;
    *) limit=300 reps=2 ;;
    esac
    run_step "stall_${size}gib" $limit "$out_dir/stall-cuda-${size}gib.log" \
        "$py" benchmarks/stall.py --device cuda --sizes "$size" --only memcpy,fc,files,dcp \
        --repeats $reps --out "$out_dir/stall-cuda-${size}gib.json"
done

jsons=$(ls "$out_dir"/stall-cuda-*gib.json 2>/dev/null)
if [ -n "$jsons" ]; then
    # shellcheck disable=SC2086
    "$py" benchmarks/stall.py --report $jsons >"$out_dir/report.md" 2>&1 || true
fi
if [ $failed -ne 0 ]; then
    write_json false "a step failed or timed out"
    echo "gpu_check.sh: done with failures in $(($(date +%s) - start))s; see $out_dir" >&2
    exit 1
fi
write_json true ""
echo "gpu_check.sh: all steps passed in $(($(date +%s) - start))s; results in $out_dir"
