#!/usr/bin/env bash
# Run jaxvrl training on a Cloud TPU VM slice (one host or a multi-host pod slice).
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_vm.sh --name NAME --zone ZONE --workdir gs://BUCKET/RUN [options] -- TRAIN_ARGS...

Creates (or reuses) a TPU VM slice, copies this checkout to every worker, installs it,
runs the same `python -m jaxvrl.train TRAIN_ARGS...` on all workers at once (multi-host:
jax.distributed is initialised from the TPU metadata), streams the logs here, and deletes
the slice at the end unless --keep or --reuse.

Required:
  --name NAME            TPU VM name
  --zone ZONE            e.g. us-east5-a (v5p), us-west4-a (v5e)
  --workdir gs://...     checkpoints, metrics and markdown logs (shared by all workers)

Options:
  --type TYPE            accelerator type (default v5litepod-8; e.g. v5litepod-16, v5p-32)
  --version VERSION      TPU software version (default v2-alpha-tpuv5-lite; v5p: v2-alpha-tpuv5)
  --project PROJECT      gcloud project (default: the gcloud config's)
  --spot                 create a spot (preemptible) slice; a preempted run resumes from
                         its last checkpoint in --workdir when relaunched with the same args
  --reuse                use the existing VM NAME (never created, never deleted here)
  --keep                 keep the VM after the run (default: delete what this script created)
  --log-dir DIR          where the streamed log is written (default ./logs)
  --dry-run              print the gcloud commands instead of running them
  -h, --help             this help

Everything after `--` goes to jaxvrl.train, e.g.
  launch/tpu_vm.sh --name rl-7b --zone us-east5-a --type v5p-32 --version v2-alpha-tpuv5 \
    --workdir gs://my-bucket/tprl-7b -- --config configs/tprl.py \
    --config.model.path=gs://my-bucket/Qwen2.5-VL-7B-Instruct --config.mesh.fsdp=-1
EOF
}

NAME="" ZONE="" WORKDIR="" TYPE="v5litepod-8" VERSION="v2-alpha-tpuv5-lite" PROJECT=""
SPOT=0 REUSE=0 KEEP=0 DRY_RUN=0 LOG_DIR="./logs"
TRAIN_ARGS=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) NAME="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --type) TYPE="$2"; shift 2 ;;
    --version) VERSION="$2"; shift 2 ;;
    --project) PROJECT="$2"; shift 2 ;;
    --log-dir) LOG_DIR="$2"; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --reuse) REUSE=1; shift ;;
    --keep) KEEP=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; TRAIN_ARGS=("$@"); break ;;
    *) echo "tpu_vm.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "tpu_vm.sh: $*" >&2; exit 2; }
[[ -n "$NAME" ]] || die "--name is required"
[[ -n "$ZONE" ]] || die "--zone is required"
[[ "$WORKDIR" == gs://* ]] || die "--workdir must be a gs:// path (every worker writes there)"
[[ ${#TRAIN_ARGS[@]} -gt 0 ]] || die "give the train arguments after --, e.g. -- --config configs/grpo.py"

GCLOUD=(gcloud compute tpus tpu-vm)
LOC=(--zone "$ZONE")
[[ -n "$PROJECT" ]] && LOC+=(--project "$PROJECT")

run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CREATED=0
cleanup() {
  if [[ "$CREATED" == 1 && "$KEEP" == 0 ]]; then
    echo "deleting TPU VM $NAME" >&2
    run "${GCLOUD[@]}" delete "$NAME" "${LOC[@]}" --quiet || true
  fi
}
trap cleanup EXIT

# 1. the slice
if [[ "$REUSE" == 1 ]]; then
  echo "reusing TPU VM $NAME" >&2
elif [[ "$DRY_RUN" == 0 ]] && "${GCLOUD[@]}" describe "$NAME" "${LOC[@]}" >/dev/null 2>&1; then
  echo "TPU VM $NAME exists: reusing it (not deleted at the end)" >&2
else
  CREATE=("${GCLOUD[@]}" create "$NAME" "${LOC[@]}" --accelerator-type "$TYPE" --version "$VERSION")
  [[ "$SPOT" == 1 ]] && CREATE+=(--spot)
  run "${CREATE[@]}"
  CREATED=1
fi

# 2. this checkout (tracked files at HEAD plus uncommitted changes) onto every worker
TARBALL="$(mktemp -t jaxvrl-XXXXXX).tar.gz"
if [[ "$DRY_RUN" == 0 ]]; then
  (cd "$REPO_ROOT" && git ls-files -z --cached --others --exclude-standard \
    | tar --null -czf "$TARBALL" -T -)
fi
run "${GCLOUD[@]}" scp "$TARBALL" "$NAME:~/jaxvrl.tar.gz" "${LOC[@]}" --worker=all

# 3. install (jax with the TPU runtime, then jaxvrl from the copy)
INSTALL='set -e; rm -rf ~/jaxvrl && mkdir -p ~/jaxvrl && tar -xzf ~/jaxvrl.tar.gz -C ~/jaxvrl
python3 -m pip install -q -U pip
python3 -m pip install -q -U "jax[tpu]"
python3 -m pip install -q -e ~/jaxvrl'
run "${GCLOUD[@]}" ssh "$NAME" "${LOC[@]}" --worker=all --command "$INSTALL"

# 4. the same command on every worker; process 0 logs, all write checkpoints to the workdir
printf -v ARGS ' %q' "${TRAIN_ARGS[@]}"
TRAIN="cd ~/jaxvrl && python3 -m jaxvrl.train${ARGS} --config.workdir=${WORKDIR} --config.distributed.enable=True"
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/$NAME-$(date +%Y%m%d-%H%M%S).log"
echo "streaming the workers' output to $LOG" >&2
run "${GCLOUD[@]}" ssh "$NAME" "${LOC[@]}" --worker=all --command "$TRAIN" 2>&1 | tee "$LOG"
rm -f "$TARBALL"
