#!/bin/bash
# Scaling study: the same run at several node counts, each a job array of repeated runs (the
# median of repeats is what to compare on a shared cluster). Slurm gives every task of one
# array the same resources, so each node count is its own array.
#
#   slurm/sweep-nodes.sh CONFIG "1 2 4 8" [REPEATS=3] [BATCH_SCRIPT=slurm/dstrain-gpu.sbatch]
#
# Each run writes to runs/sweep/<nodes>n-<array index>/ (metrics.jsonl there holds tokens/s,
# step time and its split); validation/ plots read those files.
set -euo pipefail
if (( $# < 2 )); then
  echo "usage: $0 CONFIG \"NODE_COUNTS\" [REPEATS] [BATCH_SCRIPT]" >&2
  exit 2
fi
config=$1
counts=$2
repeats=${3:-3}
script=${4:-slurm/dstrain-gpu.sbatch}
command -v sbatch >/dev/null || { echo "$0: sbatch not found: run this on a Slurm login node" >&2; exit 2; }
[[ -f "$config" ]] || { echo "$0: $config does not exist" >&2; exit 2; }
mkdir -p runs/sweep
for n in $counts; do
  # Each array task is a fresh run (its own output dir), never resumed from another's files.
  jid=$(DSTRAIN_CONFIG="$config" \
        DSTRAIN_ARGS="--set output.dir=\"runs/sweep/${n}n-{array_task}\" checkpoint.save_final=false" \
        sbatch --parsable --nodes="$n" --array="0-$((repeats - 1))" --job-name="sweep-${n}n" \
               --output="runs/sweep/slurm-${n}n-%A_%a.out" "$script")
  echo "submitted ${n} node(s): job array $jid (${repeats} runs)"
done
