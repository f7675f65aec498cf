#!/usr/bin/env bash
# Submits a flashckpt training job to Slurm (deploy/slurm/flashckpt.sbatch); --dry-run prints the
# sbatch command and what each allocation would run, without submitting anything.
#
#   deploy/slurm/submit.sh --nodes 5 --min-nodes 4 --job-id gpt-run1 \
#       --storage s3://bucket/gpt-run1 [--dry-run] -- train.py --lr 3e-4
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() {
    cat <<USAGE
usage: $(basename "$0") [options] [--] TRAINING_SCRIPT [ARGS...]
  --nodes N            machines to allocate (default 2)
  --min-nodes M        fewest machines the job trains on; the others are hot spares
                       (default N-1)
  --job-id ID          job id: names the snapshots; keep it across resubmissions (required)
  --storage URL        checkpoint root URL (required)
  --rdzv-endpoint H:P  an etcd v3 to use (default: one started for the job)
  --nproc-per-node X   workers per machine: a number, gpu, cpu or auto (default gpu)
  --shm-dir DIR        where the node agents keep snapshots (default /dev/shm)
  --run-dir DIR        the node agents' socket and log directory (default /tmp/flashckpt-UID)
  --agent MODE         launcher (default) or systemd (deploy/systemd's unit)
  --partition P, --time T, --account A   passed to sbatch
  --wait               wait for the job to end; exit with its status (sbatch --wait)
  --dry-run            print what would run; submit nothing
USAGE
}

nodes=2 min_nodes='' job_id='' storage='' endpoint='' nproc=gpu shm_dir='' run_dir='' agent=launcher
dry_run=0
sbatch_extra=()
while [ "$#" -gt 0 ]; do
    case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --min-nodes) min_nodes=$2; shift 2 ;;
    --job-id) job_id=$2; shift 2 ;;
    --storage) storage=$2; shift 2 ;;
    --rdzv-endpoint) endpoint=$2; shift 2 ;;
    --nproc-per-node) nproc=$2; shift 2 ;;
    --shm-dir) shm_dir=$2; shift 2 ;;
    --run-dir) run_dir=$2; shift 2 ;;
    --agent) agent=$2; shift 2 ;;
    --partition | --time | --account) sbatch_extra+=("$1=$2"); shift 2 ;;
    --wait) sbatch_extra+=(--wait); shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "unknown option $1" >&2; usage >&2; exit 2 ;;
    *) break ;;
    esac
done
if [ "$#" -lt 1 ] || [ -z "$job_id" ] || [ -z "$storage" ]; then
    usage >&2
    exit 2
fi
if ! [ "$nodes" -ge 1 ] 2>/dev/null; then
    echo "--nodes $nodes: a number >= 1" >&2
    exit 2
fi
: "${min_nodes:=$((nodes > 1 ? nodes - 1 : 1))}"
if ! [ "$min_nodes" -ge 1 ] 2>/dev/null || [ "$min_nodes" -gt "$nodes" ]; then
    echo "--min-nodes $min_nodes: a number from 1 to --nodes ($nodes)" >&2
    exit 2
fi

# The job's settings travel as FC_* variables (sbatch --export); the script reads them.
settings=(FC_JOB_ID="$job_id" FC_STORAGE="$storage" FC_MIN_NODES="$min_nodes"
    FC_NPROC_PER_NODE="$nproc" FC_AGENT="$agent")
[ -n "$endpoint" ] && settings+=(FC_RDZV_ENDPOINT="$endpoint")
[ -n "$shm_dir" ] && settings+=(FC_SHM_DIR="$shm_dir")
[ -n "$run_dir" ] && settings+=(FC_RUN_DIR="$run_dir")
export_list=ALL
for s in "${settings[@]}"; do
    export_list+=",$s"
done
cmd=(sbatch --nodes="$nodes" --job-name="$job_id" "${sbatch_extra[@]}" --export="$export_list"
    "$here/flashckpt.sbatch" "$@")

if [ "$dry_run" = 1 ]; then
    echo "# would submit:"
    printf '%q ' "${cmd[@]}" | sed 's/ $//'
    echo
    hosts=()
    for i in $(seq "$nodes"); do
        hosts+=("node$i")
    done
    echo "# and, on an allocation of ${hosts[*]}, the job would run:"
    env "${settings[@]}" FC_DRY_RUN=1 FC_HOSTS="${hosts[*]}" SLURM_JOB_ID=12345 \
        bash "$here/flashckpt.sbatch" "$@"
    exit 0
fi
exec "${cmd[@]}"
