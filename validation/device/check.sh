#!/usr/bin/env bash
# dstrain's GPU check: the one prepared script a session runs first when a GPU machine is lent.
#
#   validation/device/check.sh prepare   # here, no GPU needed: build with CUDA, bundle into .device/
#   validation/device/check.sh run       # on the GPU machine (the device tool), writes under $OUT
#
# The GPU machine has CUDA, NCCL and Python but not dstrain's Debian dependencies (Open MPI,
# parallel HDF5, OpenBLAS, Kokkos, oneDNN, ...), and nothing can be installed there. So `prepare`
# builds with -DDSTRAIN_CUDA=ON (sm_90, for the H200) on this machine and bundles the binaries,
# every shared library they load except glibc, the driver and the CUDA/NCCL libraries, Open MPI's
# plugins and helpers (relocated with OPAL_PREFIX), the PyTorch reference cases and the data
# (about 150 MiB, carried as one xz archive under the device tool's 64 MiB). The device tool then
# carries it:
#   run(command="validation/device/check.sh run", carry=[".device"], timeout_s=540)
#
# `run` does, each step time-boxed, within a budget of 450 s (CHECK_BUDGET_S) so that the whole
# check with the machine's start fits in 8 minutes; the steps come in order of importance, so a
# run cut short has already reported the ones that matter most:
#   0. nvidia-smi, and the libraries each binary resolves (a missing one is named);
#   1. the CUDA op suite: every op of the backend table, fp32, bf16 and f16, at the small sizes
#      and at real ones (head dims 64, 128 and MLA's 192/128, vocabularies of 32k to 129k, GEMMs
#      of 256 to 4,096), against the CPU fp32 reference (BackendOps.Cuda*);
#   2. the reference cases (dense, V2, V3) trained on the GPU in fp32, bf16, fp16 with loss
#      scaling, ZeRO-3 and offload against the PyTorch reference (*OnTheGpu*);
#   3. a ~1.2B-parameter DeepSeek-LLM-style model (validation/device/bench_1b.json) in bf16:
#      tokens/s, MFU against the GPU's bf16 peak, and the time split; then a DeepSeek-V3-style
#      MoE model (validation/device/bench_v3.json: MLA, 64 routed experts top-6, MTP), the same;
#   4. NCCL: every communicator operation checked (--check), then all-reduce bus bandwidth;
#   5. dstrain calibrate on the GPU for bench_1b's shapes, and dstrain plan's prediction of its
#      step with the calibrated and the datasheet profile, beside the measured one.
# DSTRAIN_REQUIRE_GPU=1 is set for every step: a GPU test that finds no GPU fails instead of
# skipping, and a step whose output says SKIPPED fails too, so an invisible GPU cannot pass.
# Everything goes to $OUT (summary.txt first: each step's verdict, time and figures); the exit
# status is 0 only when every step passed. DSTRAIN_DEVICE_BUNDLE names another bundle directory
# than .device/ (tests/e2e/test_require_gpu.py runs `run` over stand-in programs).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUNDLE=${DSTRAIN_DEVICE_BUNDLE:-$ROOT/.device}  # where prepare writes and run reads the bundle
mode=${1:-run}

prepare() {
  set -e
  local build=build-device
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$ROOT} CCACHE_DIR=${CCACHE_DIR:-/var/tmp/ccache} CCACHE_NOHASHDIR=1
  local launcher=()
  if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSTRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DDSTRAIN_NATIVE=OFF "${launcher[@]}"
  ninja -C "$build" -j"$(nproc)" dstrain unit_tests reference_tests deepseek_reference_tests nccl_bandwidth
  # The PyTorch reference cases (Debian's python3-torch, here).
  ctest --test-dir "$build" -R 'reference\.make_case' --output-on-failure >/dev/null
  # Staged outside the repository, then carried as one compressed archive (the device tool
  # carries at most 64 MiB; the staged tree is about 150 MiB).
  local final=$BUNDLE
  BUNDLE=${TMPDIR:-/tmp}/dstrain-device-stage
  rm -rf "$BUNDLE" "$final"
  mkdir -p "$BUNDLE"/bin "$BUNDLE"/lib "$BUNDLE"/ompi/bin "$BUNDLE"/ompi/share "$BUNDLE"/data/fortunes "$final"
  cp "$build"/app/dstrain "$build"/tests/unit_tests "$build"/tests/reference_tests \
     "$build"/tests/deepseek_reference_tests "$build"/validation/nccl_bandwidth "$BUNDLE"/bin/
  strip --strip-unneeded "$BUNDLE"/bin/*
  cp -r "$build"/tests/reference_cases "$BUNDLE"/reference_cases
  cp data/fortunes/fortunes_text_document.bin data/fortunes/fortunes_text_document.idx "$BUNDLE"/data/fortunes/
  # Shared libraries, but not glibc's, the driver's or CUDA's (the GPU machine has its own).
  local skip='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread|libdl\.|librt\.|libcuda\.|libcudart|libcublas|libnccl|libnvidia)'
  for b in "$BUNDLE"/bin/*; do
    ldd "$b" | awk '/=> \//{print $1" "$3}' | while read -r name path; do
      [[ $name =~ $skip ]] || cp -Ln "$path" "$BUNDLE/lib/$name"
    done
  done
  # Open MPI's plugins, help texts and orted (a singleton MPI_Init starts one), relocated with
  # OPAL_PREFIX: Debian's /usr becomes $BUNDLE/ompi.
  mkdir -p "$BUNDLE"/ompi/lib/x86_64-linux-gnu
  cp -rL /usr/lib/x86_64-linux-gnu/openmpi "$BUNDLE"/ompi/lib/x86_64-linux-gnu/
  rm -rf "$BUNDLE"/ompi/lib/x86_64-linux-gnu/openmpi/include
  cp -r /usr/share/openmpi "$BUNDLE"/ompi/share/
  cp -L /usr/bin/orted "$BUNDLE"/ompi/bin/
  for p in "$BUNDLE"/ompi/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/*.so "$BUNDLE"/ompi/bin/orted; do
    ldd "$p" 2>/dev/null | awk '/=> \//{print $1" "$3}' | while read -r name path; do
      [[ $name =~ $skip ]] || cp -Ln "$path" "$BUNDLE/lib/$name" 2>/dev/null || true
    done
  done
  du -sh "$BUNDLE"
  tar -C "$BUNDLE" -cf - . | xz -T0 -6 >"$final/bundle.tar.xz"
  rm -rf "$BUNDLE"
  du -sh "$final/bundle.tar.xz"
  echo "prepared: run on the GPU machine with the device tool:"
  echo "  run(command=\"validation/device/check.sh run\", carry=[\".device\"], timeout_s=540)"
}

# CUDA's and NCCL's libraries on the GPU machine: the toolkit's, else PyTorch's wheels'.
cuda_library_path() {
  local dirs=() d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu; do
    [[ -d $d ]] && dirs+=("$d")
  done
  local py
  for py in python3 /opt/torch/.venv/bin/python3; do
    if command -v "$py" >/dev/null 2>&1; then
      while read -r d; do [[ -d $d ]] && dirs+=("$d"); done < <("$py" - <<'EOF' 2>/dev/null
import glob, os, site
for s in site.getsitepackages():
    for lib in sorted(glob.glob(os.path.join(s, "nvidia", "*", "lib"))):
        print(lib)
EOF
)
      break
    fi
  done
  local IFS=:
  echo "${dirs[*]}"
}

# The verdict on one step from its exit status and its output: "ok" only when the command
# exited 0 and nothing in its output says SKIPPED (a GPU test that found no GPU skips; under
# DSTRAIN_REQUIRE_GPU=1 it fails, and this catches any skip that slipped past that).
verdict() {  # verdict RC OUTPUT_FILE
  local rc=$1 file=$2
  if ((rc == 124 || rc == 137)); then
    echo "TIMED OUT"
  elif ((rc != 0)); then
    echo "FAILED (exit $rc)"
  elif grep -q 'SKIPPED' "$file" 2>/dev/null; then
    echo "FAILED ($(grep -c 'SKIPPED' "$file") SKIPPED line(s))"
  else
    echo ok
  fi
}

run() {
  local t_start=$SECONDS
  # The whole check fits in 8 minutes with the machine's start: the steps share this budget, in
  # order of importance, so that a run cut short has already reported the ones that matter most.
  local budget=${CHECK_BUDGET_S:-450}
  OUT=${OUT:-$ROOT/device-out}
  mkdir -p "$OUT"
  local summary=$OUT/summary.txt
  : >"$summary"
  note() { echo "$*" | tee -a "$summary"; }
  if [[ ! -f $BUNDLE/bundle.tar.xz ]]; then
    note "no bundle at $BUNDLE: run 'validation/device/check.sh prepare' first and carry .device"
    return 1
  fi
  local unpacked=${TMPDIR:-/tmp}/dstrain-device
  rm -rf "$unpacked" && mkdir -p "$unpacked" && xz -dc "$BUNDLE/bundle.tar.xz" | tar -C "$unpacked" -xf - || {
    note "cannot unpack $BUNDLE/bundle.tar.xz"
    return 1
  }
  BUNDLE=$unpacked
  export OPAL_PREFIX=$BUNDLE/ompi PATH=$BUNDLE/ompi/bin:$PATH
  export LD_LIBRARY_PATH=$BUNDLE/lib:$(cuda_library_path)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader
  export OMPI_MCA_plm_rsh_agent=false OMP_NUM_THREADS=8 DSTRAIN_REFERENCE_CASES_AT=$BUNDLE/reference_cases
  # No GPU test may skip here: a GPU that dstrain cannot see fails the check.
  export DSTRAIN_REQUIRE_GPU=1
  local failed=0
  step() {  # step NAME SECONDS COMMAND...: output to $OUT/NAME.txt, a line in the summary
    local name=$1 secs=$2
    shift 2
    local left=$((budget - (SECONDS - t_start)))
    if ((left < 10)); then
      failed=1
      note "$(printf '%-20s %-26s' "$name" "NOT RUN (budget spent)")"
      return 1
    fi
    ((secs > left)) && secs=$left
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$? v  # the status first: `local` itself would reset $?
    v=$(verdict "$rc" "$OUT/$name.txt")
    [[ $v == ok ]] || failed=1
    note "$(printf '%-20s %-26s %4ss  %s' "$name" "$v" $((SECONDS - t0)) "$OUT/$name.txt")"
  }
  figure() { sed 's/^/    /' | tee -a "$summary"; }  # a step's figures, indented under its line
  gtest_counts() {  # the pass/fail/skip counts of a GoogleTest output
    local f=$1
    echo "$(grep -c '^\[       OK \]' "$f") passed, $(grep -c '^\[  FAILED  \] [A-Za-z]' "$f") failed," \
         "$(grep -c '^\[  SKIPPED \] [A-Za-z]' "$f") skipped"
  }

  { date -u; uname -a; nvidia-smi; echo; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH";
    for b in "$BUNDLE"/bin/*; do echo "== $b"; ldd "$b" | grep -E 'not found|cublas|nccl|cudart|mpi' ; done; } \
    >"$OUT/environment.txt" 2>&1
  note "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi failed')"
  if grep -q '=> not found' "$OUT/environment.txt"; then
    note "missing libraries: $(grep '=> not found' "$OUT/environment.txt" | sort -u | tr -s ' \t' ' ' | paste -sd ';')"
  fi

  # 1. The op suite: every op of the backend table at the small and the real sizes, fp32, bf16
  #    and f16, against the CPU fp32 reference.
  step op_suite 120 "$BUNDLE"/bin/unit_tests --gtest_filter='BackendOps.*:Kernels.*Cast*:TimingOnGpu.*' --gtest_color=no
  gtest_counts "$OUT/op_suite.txt" | figure
  grep -E '^\[ backend ops \] cuda.*(:|FAILED)' "$OUT/op_suite.txt" | head -40 | figure
  grep -E '^\[ backend ops \] cuda' "$OUT/op_suite.txt" | grep -c ' ok$' | sed 's/$/ op slots ok/' | figure

  # 2. The reference cases (dense, V2, V3) trained on the GPU against the PyTorch reference.
  step reference_dense 100 "$BUNDLE"/bin/reference_tests --gtest_filter='*OnTheGpu*' --gtest_color=no
  gtest_counts "$OUT/reference_dense.txt" | figure
  step reference_deepseek 130 "$BUNDLE"/bin/deepseek_reference_tests --gtest_filter='*OnTheGpu*' --gtest_color=no
  gtest_counts "$OUT/reference_deepseek.txt" | figure
  grep -hE '^\[ .* on cuda|^\[  FAILED  \] [A-Za-z]' "$OUT"/reference_*.txt | head -40 | figure

  # 3. The ~1.2B dense model in bf16 (30 steps of 8 x 2048 tokens; medians of steps 6 and on),
  #    then a DeepSeek-V3-style MoE model (MLA, 64 experts top-6, MTP; 12 steps of 4 x 2048).
  local name
  for name in bench_1b bench_v3; do
    local dir=$OUT/$name secs=110 skip=5
    [[ $name == bench_v3 ]] && { secs=80; skip=3; }
    rm -rf "$dir"
    step "$name" $secs "$BUNDLE"/bin/dstrain train --config "validation/device/$name.json" \
      --set "data.train=\"$BUNDLE/data/fortunes/fortunes_text_document\"" --set "output.dir=\"$dir\""
    if [[ -f $dir/metrics.jsonl ]]; then
      python3 - "$dir/metrics.jsonl" "$name" "$skip" 2>&1 <<'EOF' | figure
import json, statistics, sys
path, name, skip = sys.argv[1], sys.argv[2], int(sys.argv[3])
steps = [r for r in map(json.loads, open(path)) if r.get("type") == "train" and r.get("step", 0) > skip]
if not steps:
    sys.exit(f"{name}: no steps after the {skip}th in metrics.jsonl")
med = lambda k: statistics.median(r[k] for r in steps if k in r)
t = {k: statistics.median(r["time_s"][k] for r in steps) for k in steps[0]["time_s"]}
print(f"{name}: {len(steps)} steps, {med('tokens_per_s'):.0f} tokens/s, MFU {100 * med('mfu'):.1f}% "
      f"(peak {steps[0].get('peak_flops', 0) / 1e12:.0f} TFLOP/s), step {med('step_time_s') * 1e3:.0f} ms, "
      f"loss {steps[-1].get('loss', float('nan')):.3f}")
print(f"{name} time split (s): " + ", ".join(f"{k} {v:.4f}" for k, v in t.items()))
g = [r["gpu"] for r in steps if "gpu" in r]
if g:
    print(f"{name} GPU: utilisation {statistics.median(x.get('utilization_percent', 0) for x in g):.0f}%, "
          f"dstrain memory {max(x.get('dstrain_peak_bytes', 0) for x in g) / 2**30:.1f} GiB")
EOF
    fi
    grep -E 'error|Error' "$OUT/$name.txt" | head -5 | figure
  done

  # 4. NCCL: every communicator operation checked (--check; one rank on one GPU: NCCL takes one
  #    rank per GPU), then all-reduce bus bandwidth.
  step nccl_check 40 "$BUNDLE"/bin/nccl_bandwidth --check --max-mib 256
  grep -iE 'check|error|fail' "$OUT/nccl_check.txt" | tail -n 5 | figure
  step nccl_bandwidth 40 "$BUNDLE"/bin/nccl_bandwidth --max-mib 1024
  tail -n 6 "$OUT/nccl_bandwidth.txt" | figure

  # 5. The performance model on the GPU: calibrate this GPU for bench_1b's shapes (bf16), then the
  #    predicted step beside the measured one above, with the calibrated and the datasheet profile.
  step calibrate 50 "$BUNDLE"/bin/dstrain calibrate --config validation/device/bench_1b.json \
    --set "data.train=\"$BUNDLE/data/fortunes/fortunes_text_document\"" --precisions bf16 --seconds-per-op 0.03 \
    --out "$OUT/calibrated-gpu.json"
  local profile
  for profile in "$OUT/calibrated-gpu.json" inputs/clusters/dgx-h100.json; do
    [[ -f $profile ]] || continue
    "$BUNDLE"/bin/dstrain plan --config validation/device/bench_1b.json --ranks 1 --cluster "$profile" \
      --set "data.train=\"$BUNDLE/data/fortunes/fortunes_text_document\"" 2>&1 | sed -n 3p |
      sed "s|^|plan ($(basename "$profile")): |" | figure
  done
  note "check.sh: $((SECONDS - t_start)) s; $([[ $failed == 0 ]] && echo 'every step passed' || echo 'some steps FAILED (see above)')"
  return $failed
}

case $mode in
  prepare) prepare ;;
  run) run ;;
  verdict) verdict "$2" "$3" ;;  # the step verdict alone (tests/e2e/test_require_gpu.py)
  *) echo "usage: validation/device/check.sh prepare | run" >&2; exit 2 ;;
esac
