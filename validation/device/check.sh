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
# `run` does, each step time-boxed, in under 8 minutes in all:
#   1. nvidia-smi, and the libraries each binary resolves (a missing one is named);
#   2. the CUDA op suite: every op of the backend table, fp32, bf16 and f16, against the CPU fp32
#      reference (BackendOps.CudaBackendMatchesTheCpuReference);
#   3. the reference cases (dense, V2, V3) trained 3 steps on the GPU in fp32, bf16, fp16 with
#      loss scaling, and fp32 under ZeRO-3 and ZeRO-3 offloaded, against the PyTorch reference
#      (*.OnTheGpu);
#   4. NCCL: every communicator operation checked (--check), then all-reduce bus bandwidth;
#   5. a ~1.2B-parameter DeepSeek-LLM-style model (validation/device/bench_1b.json) in bf16:
#      tokens/s, MFU against the GPU's bf16 peak, and the time split;
#   6. dstrain calibrate on the GPU for that model's shapes, and dstrain plan's prediction of its
#      step with the calibrated and the datasheet profile, beside the measured one.
# Everything goes to $OUT (summary.txt first); the exit status is 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUNDLE=$ROOT/.device
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

run() {
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
  local failed=0
  step() {  # step NAME SECONDS COMMAND...: output to $OUT/NAME.txt, a line in the summary
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    local verdict=ok
    if ((rc == 124 || rc == 137)); then verdict="TIMED OUT after ${secs}s"; elif ((rc != 0)); then verdict="FAILED (exit $rc)"; fi
    ((rc == 0)) || failed=1
    note "$(printf '%-22s %-22s %4ss  %s' "$name" "$verdict" $((SECONDS - t0)) "$OUT/$name.txt")"
  }

  { date -u; uname -a; nvidia-smi; echo; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH";
    for b in "$BUNDLE"/bin/*; do echo "== $b"; ldd "$b" | grep -E 'not found|cublas|nccl|cudart|mpi' ; done; } \
    >"$OUT/environment.txt" 2>&1
  note "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi failed')"
  if grep -q '=> not found' "$OUT/environment.txt"; then
    note "missing libraries: $(grep '=> not found' "$OUT/environment.txt" | sort -u | tr -s ' \t' ' ' | paste -sd ';')"
  fi

  step op_suite 150 "$BUNDLE"/bin/unit_tests --gtest_filter='BackendOps.*:Kernels.*Cast*' --gtest_color=no
  grep -E '^\[ backend ops \] cuda|FAILED' "$OUT/op_suite.txt" | head -60 >>"$summary"
  step reference_dense 150 "$BUNDLE"/bin/reference_tests --gtest_filter='*OnTheGpu*' --gtest_color=no
  step reference_deepseek 210 "$BUNDLE"/bin/deepseek_reference_tests --gtest_filter='*OnTheGpu*' --gtest_color=no
  grep -hE '^\[ .* on cuda' "$OUT"/reference_*.txt >>"$summary"
  step nccl_check 60 "$BUNDLE"/bin/nccl_bandwidth --check --max-mib 256
  step nccl_bandwidth 60 "$BUNDLE"/bin/nccl_bandwidth --max-mib 1024
  tail -n 14 "$OUT/nccl_bandwidth.txt" >>"$summary"

  # The ~1.2B model in bf16: 30 steps of 8 x 2048 tokens; the medians of steps 6 and on.
  local bench_dir=$OUT/bench_1b
  rm -rf "$bench_dir"
  step bench_1b 240 "$BUNDLE"/bin/dstrain train --config validation/device/bench_1b.json \
    --set "data.train=\"$BUNDLE/data/fortunes/fortunes_text_document\"" --set "output.dir=\"$bench_dir\""
  if [[ -f $bench_dir/metrics.jsonl ]]; then
    python3 - "$bench_dir/metrics.jsonl" >>"$summary" 2>&1 <<'EOF'
import json, statistics, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type") == "train" and r.get("step", 0) > 5]
if not steps:
    sys.exit("bench_1b: no steps after the 5th in metrics.jsonl")
med = lambda k: statistics.median(r[k] for r in steps if k in r)
t = {k: statistics.median(r["time_s"][k] for r in steps) for k in steps[0]["time_s"]}
print(f"bench_1b: {len(steps)} steps, {med('tokens_per_s'):.0f} tokens/s, MFU {100 * med('mfu'):.1f}% "
      f"(peak {steps[0].get('peak_flops', 0) / 1e12:.0f} TFLOP/s), step {med('step_time_s') * 1e3:.0f} ms")
print("bench_1b time split (s): " + ", ".join(f"{k} {v:.4f}" for k, v in t.items()))
g = [r["gpu"] for r in steps if "gpu" in r]
if g:
    print(f"bench_1b GPU: utilisation {statistics.median(x.get('utilization_percent', 0) for x in g):.0f}%, "
          f"dstrain memory {max(x.get('dstrain_peak_bytes', 0) for x in g) / 2**30:.1f} GiB")
EOF
  fi
  grep -E 'error|Error' "$OUT/bench_1b.txt" | head -5 >>"$summary"

  # The performance model on the GPU: calibrate this GPU for bench_1b's shapes (bf16), then the
  # predicted step beside the measured one above, with the calibrated and the datasheet profile.
  step calibrate 100 "$BUNDLE"/bin/dstrain calibrate --config validation/device/bench_1b.json \
    --set "data.train=\"$BUNDLE/data/fortunes/fortunes_text_document\"" --precisions bf16 --seconds-per-op 0.05 \
    --out "$OUT/calibrated-gpu.json"
  for profile in "$OUT/calibrated-gpu.json" inputs/clusters/dgx-h100.json; do
    [[ -f $profile ]] || continue
    "$BUNDLE"/bin/dstrain plan --config validation/device/bench_1b.json --ranks 1 --cluster "$profile" \
      --set "data.train=\"$BUNDLE/data/fortunes/fortunes_text_document\"" 2>&1 | sed -n 3p |
      sed "s|^|plan ($(basename "$profile")): |" >>"$summary"
  done
  note "check.sh: $([[ $failed == 0 ]] && echo 'every step passed' || echo 'some steps FAILED (see above)')"
  return $failed
}

case $mode in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: validation/device/check.sh prepare | run" >&2; exit 2 ;;
esac
