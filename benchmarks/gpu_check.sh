#!/usr/bin/env bash
# The GPU check of issue 14, in one unattended run of a few minutes:
#   1. the GPU tests (tests/test_gpu.py; they skip without CUDA, so this script refuses first):
#      the slots registered with CUDA at entry (cudaHostRegister, return codes checked) and
#      unregistered at exit, mode="auto" resolving to overlap on a CUDA state, device->host copies
#      on a side stream ordered after the caller's stream, restore host->device from registered
#      memory;
#   2. benchmarks/stall.py on CUDA tensors at 1, 4 and 16 GiB of model + AdamW state: the
#      device->host bound (copy into a cudaHostRegister'ed /dev/shm mapping, the
#      registered-memory bandwidth), flashckpt save() sync and overlap (first and steady, and the
#      wait in optimizer.step() after a forward/backward; overlap is what mode="auto", the
#      default, uses on a GPU), DCP async_save with pinned-memory staging (its best GPU
#      configuration) and torch.save + fsync;
#   3. issue 42's sharded framework paths that need a GPU (benchmarks/gpu_sharded_frameworks.py,
#      under torchrun on every GPU): Lightning's ModelParallelStrategy (FSDP2) with
#      FlashCheckpoint resumed and equal (torch.equal, every rank's pieces) to an uninterrupted
#      fit; Lightning's FSDPStrategy refused by the adapter naming ModelParallelStrategy; the HF
#      Trainer with accelerate's FSDP2 plugin and FlashCheckpoint resumed and equal (every
#      rank's pieces) to an uninterrupted run; its FSDP1 plugin refused, naming FSDP2.
# Every step has its own timeout, and all of them together stay under $GPU_CHECK_BUDGET seconds
# (default 480): a step that would start with too little time left is skipped and says so.
#
# Usage (from anywhere):
#   bash benchmarks/gpu_check.sh [OUT_DIR]      # default: $OUT, else benchmarks/runs/gpu-<time>
#   bash benchmarks/gpu_check.sh --dry-run      # check the settings, print the plan, run nothing
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh   # a python whose torch has CUDA
#   GPU_CHECK_SIZES="1 4" bash benchmarks/gpu_check.sh     # fewer sizes (GiB, positive numbers)
#   GPU_CHECK_BUDGET=300 bash benchmarks/gpu_check.sh      # seconds for everything (>= 60)
# Writes into OUT_DIR: gpu_check.json (what ran, exit codes, seconds), env.txt (nvidia-smi, torch,
# /dev/shm), test_gpu.log, stall-cuda-<size>gib.json and .log, report.md (markdown tables).
# Exit code: 0 all steps passed (or --dry-run found the settings good); 1 a step failed or timed
# out; 2 no CUDA device (nothing measured); 64 a bad option or setting (nothing run).
set -u

usage() {
    sed -n '/^# Usage/,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}
bad() { # message: a bad option or setting; nothing runs
    echo "gpu_check.sh: $1" >&2
    echo "gpu_check.sh: see bash benchmarks/gpu_check.sh --help" >&2
    exit 64
}
# Per size: the timeout of its stall.py run and its samples (each 16 GiB torch.save writes 16 GiB
# to disk, so the biggest gets fewer).
limit_of() { case $1 in 1) echo 75 ;; 4) echo 120 ;; *) echo 300 ;; esac }
reps_of() { case $1 in 1 | 4) echo 3 ;; *) echo 2 ;; esac }
dry=0
while [ $# -gt 0 ]; do
    case $1 in
    -h | --help) usage; exit 0 ;;
    -n | --dry-run) dry=1; shift ;;
    --) shift; break ;;
    -*) bad "unknown option $1" ;;
    *) break ;;
    esac
done
[ $# -le 1 ] || bad "one OUT_DIR at most, got: $*"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
budget=${GPU_CHECK_BUDGET:-480}
sizes=${GPU_CHECK_SIZES:-1 4 16}
case $budget in
'' | *[!0-9]*) bad "GPU_CHECK_BUDGET=$budget: give whole seconds, 60 or more" ;;
esac
[ "$budget" -ge 60 ] || bad "GPU_CHECK_BUDGET=$budget: give whole seconds, 60 or more"
[ -n "${sizes// /}" ] || bad "GPU_CHECK_SIZES is empty: give sizes in GiB such as \"1 4 16\""
for size in $sizes; do
    [[ $size =~ ^[0-9]+([.][0-9]+)?$ ]] && [[ ! $size =~ ^0+([.]0+)?$ ]] ||
        bad "GPU_CHECK_SIZES: '$size' is no size in GiB (a positive number such as 1 or 0.5)"
done
out_dir=${1:-${OUT:-$repo/benchmarks/runs/gpu-$(date -u +%Y%m%dT%H%M%SZ)}}
sharded_checks="lightning-mp lightning-fsdp1 hf-fsdp2 hf-fsdp1"
if [ $dry -eq 1 ]; then
    echo "gpu_check.sh: dry run: budget ${budget}s, sizes (GiB): $sizes, results would go to $out_dir"
    echo "gpu_check.sh: would run: ${PYTHON:-<python found>} -m pytest -q tests/test_gpu.py -rs"
    for check in $sharded_checks; do
        echo "gpu_check.sh: would run: ${PYTHON:-<python found>} -m torch.distributed.run" \
            "--standalone --nproc-per-node <GPUs> benchmarks/gpu_sharded_frameworks.py $check" \
            "(timeout 150s)"
    done
    for size in $sizes; do
        echo "gpu_check.sh: would run: ${PYTHON:-<python found>} benchmarks/stall.py --device cuda" \
            "--sizes $size --only memcpy,fc,files,dcp --repeats $(reps_of "$size")" \
            "--out $out_dir/stall-cuda-${size}gib.json (timeout $(limit_of "$size")s)"
    done
    exit 0
fi
mkdir -p "$out_dir" || { echo "gpu_check.sh: cannot create $out_dir" >&2; exit 1; }
out_dir=$(cd "$out_dir" && pwd)
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

# The sharded framework paths (issue 42), on every GPU of the machine.
ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 1)
for check in $sharded_checks; do
    run_step "sharded_$check" 150 "$out_dir/sharded-$check.log" \
        "$py" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" \
        benchmarks/gpu_sharded_frameworks.py "$check"
done

# Each size in a process of its own (its memory freed before the next); the biggest gets what
# the budget has left, and fewer samples (each 16 GiB torch.save writes 16 GiB to disk).
for size in $sizes; do
    limit=$(limit_of "$size")
    reps=$(reps_of "$size")
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
