#!/bin/bash
# Scaling study: the same run at several node (or rank) counts, each a job array of repeated
# runs (the median of repeats is what to compare on a shared cluster). Slurm gives every task of
# one array the same resources, so each count is its own array.
#
#   slurm/sweep-nodes.sh [OPTIONS] CONFIG "1 2 4 8" [REPEATS=3] [BATCH_SCRIPT=slurm/dstrain-gpu.sbatch] [-- SBATCH_ARGS]
#
#   --mode strong   (default) the global batch stays that of the smallest count: the config's
#                   train.train_batch_size (or --global-batch), split over more ranks
#   --mode weak     the batch per rank stays fixed: the global batch at count N is the base
#                   global batch x N / (smallest count)
#   --unit nodes    (default) a count is nodes (sbatch --nodes=N; ranks per node from the script)
#   --unit ranks    a count is ranks on one node (sbatch --nodes=1 --ntasks=N): for single-node
#                   studies and the local test cluster
#   --overcommit    with --unit ranks: more ranks than a node has cores. The job asks for at most
#                   as many tasks as a node has CPUs (sinfo) and srun starts all N ranks with
#                   --overcommit, so ranks beyond the cores share them: only counts up to the
#                   core count measure scaling; the others show the cost of oversubscription.
#                   Such runs get OMPI_MCA_mpi_yield_when_idle=1 (unless set): Open MPI ranks
#                   that wait yield their core instead of spinning (20x faster at 4 ranks on 2 cores)
#   --global-batch B  the global batch at the smallest count (default: the config's train_batch_size)
#   --out DIR       where the runs go (default runs/sweep)
#   --serial        one run at a time, so runs never share nodes: each array runs one task at a
#                   time, and all serial sweep jobs are named dstrain-sweep with a singleton
#                   dependency, so a weak sweep submitted after a strong one waits for it.
#                   Always on with --unit ranks
#   --wait          return when every run has ended: status 0 when all completed, 1 (naming
#                   their logs) when any did not
#   after --        arguments for sbatch itself, e.g. --partition=... --account=...
#
# Each run writes to DIR/<mode>-<count><n|r>-<repeat>/ (e.g. runs/sweep/weak-4r-0/): metrics.jsonl
# there holds tokens/s, step time and its split, and sweep.json what the sweep asked for (mode,
# count, global batch, config and overrides). validation/scaling_report.py turns DIR into a
# speedup and efficiency table with plots. DSTRAIN_ARGS set by the caller is passed on to every run.
set -euo pipefail
me=$(basename "$0")
usage() {
  echo "usage: $me [--mode strong|weak] [--unit nodes|ranks] [--overcommit] [--global-batch B] [--out DIR]" \
       "[--serial] [--wait] CONFIG \"COUNTS\" [REPEATS] [BATCH_SCRIPT] [-- SBATCH_ARGS]" >&2
  exit 2
}
die() { echo "$me: $*" >&2; exit 2; }

mode=strong unit=nodes global_batch="" out=runs/sweep serial=0 overcommit=0 wait=0
positional=() sbatch_extra=()
while (( $# )); do
  case $1 in
    --mode) (( $# >= 2 )) || die "--mode needs a value: strong or weak"; mode=$2; shift 2 ;;
    --mode=*) mode=${1#*=}; shift ;;
    --unit) (( $# >= 2 )) || die "--unit needs a value: nodes or ranks"; unit=$2; shift 2 ;;
    --unit=*) unit=${1#*=}; shift ;;
    --global-batch) (( $# >= 2 )) || die "--global-batch needs a value"; global_batch=$2; shift 2 ;;
    --global-batch=*) global_batch=${1#*=}; shift ;;
    --out) (( $# >= 2 )) || die "--out needs a directory"; out=$2; shift 2 ;;
    --out=*) out=${1#*=}; shift ;;
    --serial) serial=1; shift ;;
    --overcommit) overcommit=1; shift ;;
    --wait) wait=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    --) shift; sbatch_extra=("$@"); break ;;
    -*) echo "$me: unknown option $1" >&2; usage ;;
    *) positional+=("$1"); shift ;;
  esac
done
(( ${#positional[@]} >= 2 && ${#positional[@]} <= 4 )) || usage
config=${positional[0]}
counts=${positional[1]}
repeats=${positional[2]:-3}
script=${positional[3]:-slurm/dstrain-gpu.sbatch}

[[ $mode == strong || $mode == weak ]] || die "--mode is '$mode'; it must be strong or weak"
[[ $unit == nodes || $unit == ranks ]] || die "--unit is '$unit'; it must be nodes or ranks"
[[ $overcommit == 0 || $unit == ranks ]] ||
  die "--overcommit needs --unit ranks (it starts more ranks than one node has cores)"
[[ $repeats =~ ^[1-9][0-9]*$ ]] || die "REPEATS is '$repeats'; it must be a positive integer (runs per count)"
[[ -z $global_batch || $global_batch =~ ^[1-9][0-9]*$ ]] ||
  die "--global-batch is '$global_batch'; it must be a positive integer (sequences per optimizer step)"
read -r -a count_list <<< "$counts"
(( ${#count_list[@]} )) || die "COUNTS is empty; give the node or rank counts, e.g. \"1 2 4\""
declare -A seen
for n in "${count_list[@]}"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || die "COUNTS holds '$n'; counts must be positive integers, e.g. \"1 2 4\""
  [[ -z ${seen[$n]:-} ]] || die "COUNTS holds $n twice; give each count once (REPEATS sets the runs per count)"
  seen[$n]=1
done
[[ -f "$config" ]] || die "CONFIG $config does not exist"
[[ -f "$script" ]] || die "BATCH_SCRIPT $script does not exist (slurm/dstrain-cpu.sbatch or slurm/dstrain-gpu.sbatch)"
command -v sbatch >/dev/null || die "sbatch not found: run this on a Slurm login node"
command -v python3 >/dev/null || die "python3 not found: it reads the batch keys of $config"

# The config's batch keys: train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
# ("-" when absent or null). dstrain configs may hold // and /* */ comments.
read -r cfg_batch cfg_micro cfg_accum < <(python3 - "$config" <<'PY' || echo "! ! !"
import json, re, sys
try:
    with open(sys.argv[1]) as f:
        text = re.sub(r'("(?:\\.|[^"\\])*")|//[^\n]*|/\*.*?\*/', lambda m: m.group(1) or "", f.read(), flags=re.S)
    train = json.loads(text).get("train", {})
except (OSError, ValueError, AttributeError) as e:
    sys.exit(f"{sys.argv[1]}: cannot read it as a JSON object: {e}")
values = []
for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
    v = train.get(key) if isinstance(train, dict) else None
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
        sys.exit(f"{sys.argv[1]}: train.{key} is {json.dumps(v)}; it must be a positive integer or null")
    values.append("-" if v is None else str(v))
print(" ".join(values))
PY
)
[[ $cfg_batch != "!" ]] || die "cannot read the batch keys of CONFIG $config (see the message above)"
cfg_batch=${cfg_batch#-} cfg_micro=${cfg_micro#-} cfg_accum=${cfg_accum#-}
base_batch=${global_batch:-$cfg_batch}
if [[ -z $base_batch ]]; then
  die "$config sets no train.train_batch_size, and the sweep sets the global batch of every count from it:" \
      "add train_batch_size to the config or pass --global-batch B (the global batch at the smallest count)"
fi
if [[ $mode == strong && -n $cfg_micro && -n $cfg_accum && ${#count_list[@]} -gt 1 ]]; then
  die "$config sets both train_micro_batch_size_per_gpu and gradient_accumulation_steps: with the global" \
      "batch fixed (strong mode) one of them must follow the rank count; remove gradient_accumulation_steps" \
      "(or set it to null) so dstrain derives it"
fi

smallest=${count_list[0]}
for n in "${count_list[@]}"; do
  if (( n < smallest )); then smallest=$n; fi
done
# The global batch of each count.
declare -A batches
for n in "${count_list[@]}"; do
  if [[ $mode == weak ]]; then
    (( base_batch * n % smallest == 0 )) ||
      die "weak mode: global batch $base_batch x $n / $smallest is not an integer;" \
          "choose counts that are multiples of $smallest"
    batches[$n]=$((base_batch * n / smallest))
  else
    batches[$n]=$base_batch
  fi
done
suffix=${unit:0:1}  # n or r
mkdir -p "$out"
out=$(cd "$out" && pwd)
[[ $out != *[[:space:]]* ]] ||
  die "--out $out contains a space; DSTRAIN_ARGS is split on spaces, so choose a path without"
# Every run is fresh: an earlier sweep's directory would be resumed from (--resume auto).
for n in "${count_list[@]}"; do
  for ((r = 0; r < repeats; r++)); do
    d="$out/$mode-$n$suffix-$r"
    [[ ! -e $d ]] || die "$d exists from an earlier sweep; move it aside (or pass --out DIR) so runs start fresh"
  done
done
if [[ $unit == ranks ]]; then serial=1; fi  # the runs would share the one node
cores=0
if (( overcommit )); then
  cores=$(sinfo -h -o %c 2>/dev/null | sort -n | head -n 1)
  [[ $cores =~ ^[1-9][0-9]*$ ]] ||
    die "--overcommit: sinfo -h -o %c gave no CPU count per node ('$cores'); is the controller up?"
fi

# The sbatch options of count $1 in layout=(), the extra srun options in srun_args, and the
# environment of its jobs in job_env=().
set_layout() {
  local n=$1 tasks=$1
  srun_args=""
  job_env=()
  if [[ $unit == nodes ]]; then
    layout=(--nodes="$n")
    return
  fi
  if (( overcommit && n > cores )); then
    tasks=$cores
    srun_args="--ntasks=$n --overcommit"
    job_env=(OMPI_MCA_mpi_yield_when_idle="${OMPI_MCA_mpi_yield_when_idle:-1}")
  fi
  layout=(--nodes=1 --ntasks="$tasks" --ntasks-per-node="$tasks")
}

# Slurm's verdict on every count before anything is submitted, so a sweep is never half queued.
for n in "${count_list[@]}"; do
  set_layout "$n"
  if ! msg=$(sbatch --test-only "${layout[@]}" "${sbatch_extra[@]}" "$script" 2>&1); then
    hint=""
    if [[ $unit == ranks && $overcommit == 0 ]]; then
      hint=" If the node has fewer than $n cores, pass --overcommit to start more ranks than cores."
    fi
    die "sbatch refuses the job for count $n (${layout[*]}): ${msg}.$hint"
  fi
done

config_abs=$(cd "$(dirname "$config")" && pwd)/$(basename "$config")
jobs=() logs=()
for n in "${count_list[@]}"; do
  batch=${batches[$n]}
  name="$mode-$n$suffix"
  overrides=("output.dir=\"$out/$name-{array_task}\"" "checkpoint.save_final=false" "train.train_batch_size=$batch")
  set_layout "$n"
  array="0-$((repeats - 1))"
  order=(--job-name="sweep-$name")
  if (( serial )); then
    array+="%1"
    order=(--job-name=dstrain-sweep --dependency=singleton)
  fi
  srun_env=${DSTRAIN_SRUN_ARGS:-}
  [[ -z $srun_args ]] || srun_env+="${srun_env:+ }$srun_args"
  jid=$(env "${job_env[@]}" DSTRAIN_CONFIG="$config" DSTRAIN_SRUN_ARGS="$srun_env" \
        DSTRAIN_ARGS="${DSTRAIN_ARGS:+$DSTRAIN_ARGS }--set ${overrides[*]}" \
        sbatch --parsable "${layout[@]}" --array="$array" "${order[@]}" \
               --output="$out/slurm-$name-%A_%a.out" "${sbatch_extra[@]}" "$script")
  jid=${jid%%;*}  # --parsable prints "id;cluster" on multi-cluster setups
  launch="sbatch ${layout[*]}${srun_args:+; srun $srun_args}${job_env:+; ${job_env[*]}}"
  for ((r = 0; r < repeats; r++)); do
    mkdir -p "$out/$name-$r"
    python3 - "$out/$name-$r/sweep.json" "$mode" "$unit" "$n" "$smallest" "$r" "$batch" "$config_abs" "$PWD" \
      "${jid}_$r" "$launch" "$script" "${DSTRAIN_ARGS:-}" "${overrides[@]//\{array_task\}/$r}" <<'PY'
import json, sys
(path, mode, unit, count, smallest, repeat, batch, config, submit_dir, job, layout, script, args,
 *overrides) = sys.argv[1:]
with open(path, "w") as f:
    json.dump({"mode": mode, "unit": unit, "count": int(count), "smallest_count": int(smallest),
               "repeat": int(repeat), "global_batch": int(batch), "config": config, "submit_dir": submit_dir,
               "overrides": overrides, "dstrain_args": args, "job": job, "layout": layout,
               "batch_script": script}, f, indent=1)
    f.write("\n")
PY
  done
  echo "submitted $mode $n $unit (global batch $batch): job array $jid (${repeats} runs) -> $out/$name-*"
  jobs+=("$jid")
  logs+=("$out/slurm-$name-${jid}_")
done

if (( wait )); then
  echo "waiting for job arrays ${jobs[*]}"
  ids=$(IFS=,; echo "${jobs[*]}")
  while squeue -h -j "$ids" 2>/dev/null | grep -q .; do sleep 5; done
  # The batch scripts end every completed run with this line; a failed or cancelled run lacks it.
  failed=()
  for prefix in "${logs[@]}"; do
    for ((r = 0; r < repeats; r++)); do
      grep -q "^=== training complete" "$prefix$r.out" 2>/dev/null || failed+=("$prefix$r.out")
    done
  done
  if (( ${#failed[@]} )); then
    echo "$me: ${#failed[@]} run(s) did not complete; see ${failed[*]}" >&2
    exit 1
  fi
  echo "all $(( ${#jobs[@]} * repeats )) runs completed"
fi
