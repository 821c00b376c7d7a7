#!/usr/bin/env bash
# Run jaxvrl training on NVIDIA GPUs: one node, or several nodes (one process per node).
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/gpu.sh [options] -- TRAIN_ARGS...

One node (all its GPUs form the mesh):
  launch/gpu.sh -- --config configs/tprl.py --config.workdir=/data/runs/tprl

Several nodes, started by hand: run the same line on every node, each with its rank
  launch/gpu.sh --nodes 4 --node-rank 0 --coordinator node0:12345 -- --config configs/tprl.py ...
  launch/gpu.sh --nodes 4 --node-rank 1 --coordinator node0:12345 -- ...

Several nodes under SLURM (one task per node; jax.distributed reads the SLURM environment):
  sbatch -N 4 --gpus-per-node=8 --wrap "launch/gpu.sh --slurm -- --config configs/tprl.py ..."

Options:
  --nodes N              number of nodes (processes); default 1
  --node-rank R          this node's rank, 0..N-1 (required with --nodes > 1 unless --slurm)
  --coordinator H:P      address of rank 0's coordinator service (required with --nodes > 1)
  --slurm                launch one task per node with srun; ranks come from SLURM
  --gpus LIST            CUDA_VISIBLE_DEVICES for this node (default: all)
  --install              pip install "jax[cuda12]" and this checkout first
  --dry-run              print the command instead of running it
  -h, --help             this help

The workdir must be shared by every node (NFS, or gs:// with credentials). Checkpoints are
written by every process (orbax), logs by process 0 only.
EOF
}

NODES=1 RANK="" COORD="" SLURM=0 GPUS="" INSTALL=0 DRY_RUN=0
TRAIN_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) NODES="$2"; shift 2 ;;
    --node-rank) RANK="$2"; shift 2 ;;
    --coordinator) COORD="$2"; shift 2 ;;
    --slurm) SLURM=1; shift ;;
    --gpus) GPUS="$2"; shift 2 ;;
    --install) INSTALL=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; TRAIN_ARGS=("$@"); break ;;
    *) echo "gpu.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "gpu.sh: $*" >&2; exit 2; }
[[ ${#TRAIN_ARGS[@]} -gt 0 ]] || die "give the train arguments after --, e.g. -- --config configs/grpo.py"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got $NODES"

run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
if [[ "$INSTALL" == 1 ]]; then
  run python3 -m pip install -U "jax[cuda12]"
  run python3 -m pip install -e .
fi

[[ -n "$GPUS" ]] && export CUDA_VISIBLE_DEVICES="$GPUS"
# Overlap collectives with compute; let XLA take most of the GPU memory up front.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"

CMD=(python3 -m jaxvrl.train "${TRAIN_ARGS[@]}")
if [[ "$SLURM" == 1 ]]; then
  # jax.distributed.initialize() finds coordinator, process count and id in SLURM_* vars
  run srun --ntasks-per-node=1 "${CMD[@]}" --config.distributed.enable=True
elif [[ "$NODES" -gt 1 ]]; then
  [[ -n "$RANK" ]] || die "--node-rank is required with --nodes $NODES"
  [[ -n "$COORD" ]] || die "--coordinator host:port is required with --nodes $NODES"
  [[ "$RANK" =~ ^[0-9]+$ && "$RANK" -lt "$NODES" ]] || die "--node-rank must be in 0..$((NODES - 1))"
  run "${CMD[@]}" --config.distributed.enable=True \
    "--config.distributed.coordinator_address=$COORD" \
    "--config.distributed.num_processes=$NODES" \
    "--config.distributed.process_id=$RANK"
else
  run "${CMD[@]}"
fi
