#!/usr/bin/env bash
# dstrain launched by Slurm's srun with PMIx: two ranks train a few steps of the quickstart
# model as one data-parallel job. Needs the local cluster of .ci/local-slurm (CI starts it).
set -euo pipefail
build=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
if ! sinfo -h >/dev/null 2>&1; then
  echo "test_srun: no Slurm controller answers; start one with: .ci/local-slurm start" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root"
.ci/prepare-fortunes "$build" >/dev/null
OMP_NUM_THREADS=1 timeout 300 srun --mpi=pmix -n 2 -O "$build/app/dstrain" train --config inputs/quickstart.json \
  --max-steps 3 --set train.train_batch_size=16 train.gradient_accumulation_steps=1 train.eval_interval=0 \
  'output.save_hf=""' 'generate.prompt=""' "output.dir=\"$work/out\"" > "$work/log" 2>&1 || {
  cat "$work/log"
  exit 1
}
cat "$work/log" | grep -E "^dstrain|^step"
grep -q "2 ranks on 1 node (2 per node): data 2" "$work/log"
grep -q "step      3/3" "$work/log"
test "$(grep -c '"type":"train"' "$work/out/metrics.jsonl")" -eq 3
