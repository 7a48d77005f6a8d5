#!/usr/bin/env bash
# The GPU check: builds kvpipe on a machine with one NVIDIA GPU (sm_90, an H100/H200), runs
# the GPU tests and a set of measurements, and prints one Markdown table of results, in one
# unattended run that fits a fixed time budget.
#
#   scripts/gpu_check.sh [--out DIR] [--dry-run] [--build-dir DIR] [--jobs N] [--skip-build]
#                        [--budget SECONDS]
#
#   --out DIR         results (default out/gpu_check): summary.md, summary.csv, tests.csv,
#                     bench.csv and gpu_check.log (every command and its output), at most
#                     16 MiB each
#   --dry-run         every step on the CPU with the tiny preset, against an already configured
#                     build directory (kvpipe and the unit tests built if out of date, never
#                     reconfigured or cleaned)
#   --build-dir DIR   build directory (default build/gpu)
#   --jobs N          build and test parallelism (default: the number of CPUs)
#   --skip-build      use the build directory as it is
#   --budget SECONDS  wall-clock budget of the whole run (default 560, for a 600 s slot; each
#                     step is time-boxed inside it and later steps get what is left)
#
# The machine needs the compiler, CMake, the CUDA toolkit (nvcc; $CUDA_HOME or
# /usr/local/cuda, else the nvcc on PATH) and a python3 whose torch is the CUDA build kvpipe
# links (.venv/bin/python when it imports torch, else python3). kvpipe's other dependencies
# may come as .deb files fetched beforehand on Debian 12 by scripts/gpu_deps.sh: they are
# unpacked with dpkg-deb -x into .gpu_deps/root (never into /) and found from there.
#
# Steps, most telling first; a step that fails or runs out of time is recorded and the next runs:
#   deps       unpack .gpu_deps/debs/*.deb (skipped when there are none)
#   configure  cmake, Release, TORCH_CUDA_ARCH_LIST=9.0 (Ninja when present)
#   build      kvpipe and kvpipe_gpu_tests (the executable of the gpu tests alone), in one
#              parallel build
#   sm_90      cuobjdump --list-elf: the kvpipe binary carries sm_90 code
#   tests      ctest -L gpu (must pass, not skip, on a GPU)
#   bandwidth  device-to-device copy bandwidth (a 4 GiB at::copy_ timed with CUDA events,
#              benchmarks/peers/torch_decode.py --copy-bandwidth): every floor is stated
#              against it and against the 4.8 TB/s datasheet figure
#   a. decode  batch-1 decode tokens/s (kvpipe bench: 1000 / the median decode step after a
#              warm-up request) against the floor bandwidth / weight bytes per step; its decode
#              steps must take the paged kernel
#   a2.        the same with runtime.cuda_graphs: true: its decode steps must replay graphs,
#              and its greedy tokens must equal a's
#   a3. peer   the same decode in plain PyTorch (random Llama-3-8B weights, bfloat16, static KV
#              cache, CUDA graph; benchmarks/peers/torch_decode.py): kvpipe / PyTorch tokens/s
#   e. bf16    an init-model folder (small preset, bfloat16) run greedy on cuda in bfloat16
#              and on the CPU in float32: the chosen tokens' logprobs and the tokens compared
#   b. batch   decode tokens/s at batch 1, 8, 64 with 1k and 8k contexts (kvpipe bench, distinct
#              prompts; batch x 1000 / the median decode step at the full batch), each against
#              its floor (weight bytes + batch x context x KV bytes per token) / bandwidth, and
#              batch 64 / batch 1
#   d. parity  `mpirun -np 2` (share_gpu, parallel.backend mpi) against one rank: greedy
#              tokens and the full --logprobs-out vectors compared
#   d2.        the same for two tensor ranks of one stage (parallel.tensor: 2): their
#              all-reduces stage through host memory over MPI
#   c. prefill tokens/s of 512- and 4096-token prompts (prompt length / TTFT, output 1 token)
#   memcheck   compute-sanitizer --tool memcheck over the GpuPagedDecode* and GpuDecodeGraphs*
#              tests
# a-d run dummy:llama3-8b (Llama-3-8B's shape, random weights) in bfloat16 on cuda, each kvpipe
# with a KV pool sized to its step (8 GiB; the batch points what their contexts need). The unit
# label is CI's: it does not run here. The exit code is 1 when any check failed.
# shellcheck disable=SC2317  # finish, cleanup and unpack_deb run from traps and subshells
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

# Paths given on the command line are relative to the working directory; the defaults to the
# checkout.
out=$root/out/gpu_check dry_run=0 build_dir=$root/build/gpu jobs="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)" skip_build=0 budget=560
usage() { sed -n '6,19p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --skip-build) skip_build=1; shift ;;
    --budget) budget=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check: --jobs needs a positive integer" >&2; exit 2; }
[[ $budget =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check: --budget needs a positive integer" >&2; exit 2; }

start=$(date +%s)
deadline=$((start + budget))
mkdir -p "$out" "$build_dir" || { echo "gpu_check: cannot create $out or $build_dir" >&2; exit 2; }
out="$(cd "$out" && pwd)"
build_dir="$(cd "$build_dir" && pwd)"
cd "$root" || exit 2
log="$out/gpu_check.log"
summary_md="$out/summary.md" summary_csv="$out/summary.csv" tests_csv="$out/tests.csv" bench_csv="$out/bench.csv"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/kvpipe-gpu-check.XXXXXX")"
: >"$log"
echo "check,value,target,status,note" >"$summary_csv"
echo "label,test,status,seconds" >"$tests_csv"
echo "check,case,metric,value" >"$bench_csv"
rows=()
failed=0
declare -A ctest_pid=()   # background ctest runs (ctest_start), by name

# --- helpers -------------------------------------------------------------------------------

say() { echo "$*"; echo "$*" >>"$log"; }
logln() { echo "[$(($(date +%s) - start))s] $*" >>"$log"; }
csv_field() {
  local v=${1//$'\n'/ }
  if [[ $v == *[,\"]* ]]; then v=${v//\"/\"\"}; printf '"%s"' "$v"; else printf '%s' "$v"; fi
}
csv_row() {
  local file=$1 sep="" f
  shift
  { for f in "$@"; do printf '%s' "$sep"; csv_field "$f"; sep=","; done; printf '\n'; } >>"$file"
}
# record CHECK VALUE TARGET STATUS [NOTE]: one row of the summary (STATUS: pass, fail, info, skip).
record() {
  local check=$1 value=$2 target=$3 status=$4 note=${5:-}
  note=${note//$'\n'/ }
  [ ${#note} -gt 200 ] && note="${note:0:197}..."
  rows+=("$check"$'\x1f'"$value"$'\x1f'"$target"$'\x1f'"$status"$'\x1f'"$note")
  csv_row "$summary_csv" "$check" "$value" "$target" "$status" "$note"
  [ "$status" = fail ] && failed=1
  logln "RESULT $check | $value | $target | $status | $note"
  echo "  -> $check: $value ($status)${note:+ - $note}"
}
bench_row() { csv_row "$bench_csv" "$@"; }
# Seconds a step capped at $1 may take now, keeping 10 s for the summary.
cap() {
  local left=$((deadline - $(date +%s) - 10))
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
# run CAP CMD...: CMD time-boxed, its output appended to the log. Returns CMD's exit code;
# 124 when it ran out of time, 125 when no time was left to start it.
run() {
  local c
  c=$(cap "$1"); shift
  if [ "$c" -lt 5 ]; then logln "not started (no time left): $*"; return 125; fi
  logln "\$ $* (time box ${c}s)"
  timeout -k 10 "$c" "$@" >>"$log" 2>&1
  local rc=$?
  logln "exit $rc"
  return $rc
}
# run_io CAP STDOUT STDERR CMD...: as run, with standard output and error kept in files (and
# copied into the log).
run_io() {
  local c o=$2 e=$3
  c=$(cap "$1"); shift 3
  if [ "$c" -lt 5 ]; then logln "not started (no time left): $*"; : >"$o"; echo "no time left" >"$e"; return 125; fi
  logln "\$ $* (time box ${c}s)"
  timeout -k 10 "$c" "$@" >"$o" 2>"$e"
  local rc=$?
  { head -c 20000 "$o"; head -c 20000 "$e"; } >>"$log"
  logln "exit $rc"
  return $rc
}
# Why a step failed, in one line: the last kvpipe error, else the last line of its stderr.
why() {
  local rc=$1 err=${2:-/dev/null} line
  case $rc in
    124|137) echo "timed out"; return ;;
    125) echo "not run: out of time"; return ;;
  esac
  line=$(grep -E 'kvpipe(: rank [0-9]+)?: error' "$err" 2>/dev/null | tail -1)
  [ -z "$line" ] && line=$(grep -v '^\s*$' "$err" 2>/dev/null | tail -1)
  echo "exit $rc${line:+: $line}"
}
# Comma-separated token ids 0..n-1 of a vocabulary of v entries (a fixed pseudo-random walk).
ids() { awk -v n="$1" -v v="$2" 'BEGIN { for (i = 0; i < n; i++) printf "%s%d", (i ? "," : ""), (i * 7919 + 13) % (v - 3) + 3 }'; }

cleanup() { rm -rf "$tmp"; }
finish() {
  local status=$?
  trap - EXIT INT TERM
  if [ "$status" -gt 128 ]; then
    record "gpu_check" "stopped by signal $((status - 128))" "" fail
  elif [ "$status" != 0 ]; then
    record "gpu_check" "ended early (exit $status)" "" fail "see gpu_check.log"
  fi
  {
    echo "| check | value | target | status | note |"
    echo "|---|---|---|---|---|"
    local r check value target st note
    for r in "${rows[@]}"; do
      IFS=$'\x1f' read -r check value target st note <<<"$r"
      printf '| %s | %s | %s | %s | %s |\n' "${check//|//}" "${value//|//}" "${target//|//}" \
        "$st" "${note//|//}"
    done
  } >"$summary_md"
  # A ctest still running in the background (stopped early): its time box ends it now.
  local f
  for f in "$tmp"/*.pid; do [ -e "$f" ] && [ ! -e "${f%.pid}.rc" ] && kill "$(cat "$f")" 2>/dev/null; done
  [ ${#ctest_pid[@]} -gt 0 ] && wait "${ctest_pid[@]}" 2>/dev/null
  cleanup
  local elapsed=$(($(date +%s) - start))
  {
    echo
    echo "## kvpipe GPU check$([ "$dry_run" = 1 ] && echo ' (dry run, CPU)'): ${gpu_name:-no GPU}, ${elapsed} s"
    echo
    cat "$summary_md"
    echo
    echo "results: $out (summary.md, summary.csv, tests.csv, bench.csv, gpu_check.log)"
  } | tee -a "$log"
  # What comes back from the machine is bounded: a file past the limit keeps its head and tail.
  for f in "$out"/*; do
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt "$max_out_bytes" ] || continue
    { head -c $((max_out_bytes / 2)) "$f"; printf '\n[... cut to %d bytes ...]\n' "$max_out_bytes"
      tail -c $((max_out_bytes / 2 - 4096)) "$f"; } >"$f.cut" && mv "$f.cut" "$f"
  done
  exit "$failed"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- what runs where -------------------------------------------------------------------------

if [ $dry_run = 1 ]; then
  mode="dry run on the CPU"
  model='{path: "dummy:tiny", dtype: float32}' device=cpu vocab=512
  cache_memory=64MiB parity_cache=64MiB e2e_preset=tiny e_cpu_cache=64MiB e_dev_cache=64MiB
  decode_prompt=16 decode_tokens=8
  batches=(1 2) contexts=(32 64) bench_output=4 prefills=(32 64)
  parity_tokens=6 e2e_tokens=8 bench_cap=60 step_cap=60
  peer_args=(--device cpu --tiny --prompt 16 --tokens 8 --warmup 2)
  # The CPU's decode steps take its own paged kernel: the path check of a and a2 checks that
  # here (the variable pins it, as on the GPU).
  attention_env=(KVPIPE_ATTENTION=paged)
else
  mode="on the GPU"
  model='{path: "dummy:llama3-8b", dtype: bfloat16}' device=cuda vocab=128256
  cache_memory=8GiB parity_cache=8GiB e2e_preset=small e_cpu_cache=256MiB e_dev_cache=1GiB
  decode_prompt=128 decode_tokens=128
  batches=(1 8 64) contexts=(1024 8192) bench_output=64 prefills=(512 4096)
  parity_tokens=16 e2e_tokens=32 bench_cap=90 step_cap=120
  peer_args=(--device cuda --prompt 128 --tokens 128)
  attention_env=()
fi
datasheet_bytes_per_s=4.8e12  # H200 HBM3e, NVIDIA's figure
floor_ratio_target=0.85      # batch-1 decode / the floor at the measured bandwidth
batch_ratio_target_1k=20     # decode tok/s at batch 64 / batch 1, 1k context
batch_ratio_target_8k=4      # the same at 8k context (KV reads dominate)
parity_tolerance=1e-3        # 2 ranks vs 1: |logprob| difference, full vocabulary
# 2 tensor ranks vs 1: each rank's partial sums are rounded to the compute dtype (bfloat16 on a
# GPU) before the all-reduce adds them
tensor_parity_tolerance=$([ $dry_run = 1 ] && echo 1e-3 || echo 5e-2)
e2e_tolerance=2e-2           # bfloat16 on cuda vs float32 on CPU: chosen tokens' |logprob| difference
max_out_bytes=$((16 << 20))  # no file of --out grows past this

kvpipe="$build_dir/launch/kvpipe"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Containers often refuse cross-memory attach (process_vm_readv); shared memory copies work.
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"
# mpirun insists on an ssh/rsh agent even for local ranks; any program will do when none is there.
runnable() { local p; p=$(command -v "$1") && [ -f "$p" ] && [ -x "$p" ]; }
if ! runnable ssh && ! runnable rsh; then
  export OMPI_MCA_plm_rsh_agent="${OMPI_MCA_plm_rsh_agent:-false}"
fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
if [ -z "${CUDA_HOME:-}" ] && [ ! -x /usr/local/cuda/bin/nvcc ] && command -v nvcc >/dev/null; then
  CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
  export CUDA_HOME
fi

# The Python whose torch provides LibTorch (as CMakeLists.txt picks it when not told).
kvpython=""
if [ -x .venv/bin/python ] && timeout 120 .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
  kvpython="$root/.venv/bin/python"
else
  kvpython="$(command -v python3 || true)"
fi

# --- machine -------------------------------------------------------------------------------

gpu_name=""
if command -v nvidia-smi >/dev/null; then
  timeout 30 nvidia-smi >>"$log" 2>&1
  gpu_name=$(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
fi
if [ -z "$gpu_name" ] && [ -n "$kvpython" ]; then
  gpu_name=$(timeout 120 "$kvpython" -c 'import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("%s, %.0f GiB (torch %s)" % (p.name, p.total_memory / 2**30, torch.__version__))' 2>>"$log" | tail -1)
fi
say "kvpipe GPU check ($mode): GPU: ${gpu_name:-none found}"
say "machine: $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo) RAM," \
    "$(getconf GNU_LIBC_VERSION 2>/dev/null), budget ${budget}s, build $build_dir, results $out"
{
  echo "--- environment"
  uname -a; head -4 /etc/os-release 2>/dev/null
  for t in c++ g++ cmake ninja nvcc ccache mpirun python3 dpkg-deb; do
    printf '%s: %s\n' "$t" "$(command -v $t || echo missing)"
  done
  c++ --version 2>&1 | head -1; cmake --version 2>&1 | head -1
  nvcc --version 2>&1 | tail -2; "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>&1 | tail -1
  echo "python for torch: $kvpython"
} >>"$log" 2>&1
if [ -n "$gpu_name" ]; then
  record "GPU" "$gpu_name" "" info
elif [ $dry_run = 1 ]; then
  record "GPU" "none (dry run)" "" info
else
  record "GPU" "none found" "one CUDA GPU" fail "nvidia-smi and torch see no GPU"
fi

# --- deps: unpack the .deb files -----------------------------------------------------------

deps_root="$root/.gpu_deps/root"
shopt -s nullglob
debs=("$root"/.gpu_deps/debs/*.deb)
shopt -u nullglob
have_debs=0
[ ${#debs[@]} -gt 0 ] && have_debs=1
unpack_deb() {
  if command -v dpkg-deb >/dev/null; then dpkg-deb -x "$1" "$2"; return; fi
  # Without dpkg: a .deb is an ar archive holding data.tar.{xz,zst,gz}.
  local member
  member=$(ar t "$1" | grep '^data\.tar') || return 1
  case $member in
    *.xz) ar p "$1" "$member" | tar -xJ -C "$2" ;;
    *.zst) ar p "$1" "$member" | zstd -dc | tar -x -C "$2" ;;
    *.gz) ar p "$1" "$member" | tar -xz -C "$2" ;;
    *) ar p "$1" "$member" | tar -x -C "$2" ;;
  esac
}
setup_deps() {
  local d=$deps_root f n lib so
  local mlib=$d/usr/lib/x86_64-linux-gnu
  rm -rf "$d" && mkdir -p "$d" || return 1
  for f in "${debs[@]}"; do
    timeout 60 bash -c "$(declare -f unpack_deb); unpack_deb \"\$1\" \"\$2\"" _ "$f" "$d" >>"$log" 2>&1 ||
      { echo "cannot unpack $(basename "$f")" >&2; return 1; }
  done
  # What update-alternatives would have linked on install.
  for n in mpirun mpiexec mpicc mpicxx mpic++ mpiCC; do
    [ -e "$d/usr/bin/$n.openmpi" ] && ln -sfn "$n.openmpi" "$d/usr/bin/$n"
  done
  [ -e "$d/usr/bin/pkgconf" ] && [ ! -e "$d/usr/bin/pkg-config" ] && ln -sfn pkgconf "$d/usr/bin/pkg-config"
  [ -e "$d/usr/lib/libpsm1/libpsm_infinipath.so.1.16" ] &&
    ln -sfn ../libpsm1/libpsm_infinipath.so.1.16 "$mlib/libpsm_infinipath.so.1"
  # pkg-config files name /usr; the packages' CMake files locate themselves and need nothing.
  find "$d" -name '*.pc' -type f -exec sed -i -e "s#=/usr\\(/\\|\$\\)#=$d/usr\\1#g" \
    -e "s#-I/usr/#-I$d/usr/#g" -e "s#-L/usr/#-L$d/usr/#g" {} +
  # Libraries the machine may have already, with stable interfaces, that kvpipe does not link
  # itself (OpenSSL, gfortran's runtime, RDMA and netlink): the machine's copy is used, so that
  # the unpacked one does not shadow it for every program started here (torch's NCCL included).
  local cache
  cache=$(ldconfig -p 2>/dev/null)
  for so in libssl.so.3 libcrypto.so.3 libgfortran.so.5 libnuma.so.1 libbrotlicommon.so.1 \
            libbrotlidec.so.1 libbrotlienc.so.1 libibverbs.so.1 librdmacm.so.1 libnl-3.so.200 \
            libnl-route-3.so.200; do
    grep -q "^[[:space:]]*$so " <<<"$cache" || continue
    for f in "$mlib/$so" "$d/lib/x86_64-linux-gnu/$so"; do
      [ -e "$f" ] && lib=$(readlink -f "$f") && rm -f "$f" "$lib" && echo "using the machine's $so" >>"$log"
    done
  done
  export PATH="$d/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$mlib/openmpi/lib:$mlib/pmix2/lib:$mlib:$d/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CMAKE_PREFIX_PATH="$d/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export PKG_CONFIG_PATH="$mlib/pkgconfig:$d/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  # Multiarch headers (OpenSSL's configuration.h) sit where the compiler looks by default,
  # /usr/include/x86_64-linux-gnu: the unpacked folder is added as a system include folder.
  export CPLUS_INCLUDE_PATH="$d/usr/include/x86_64-linux-gnu${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  export C_INCLUDE_PATH="$d/usr/include/x86_64-linux-gnu${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}"
  # Open MPI finds its components, help files and wrapper data under OPAL_PREFIX; PMIx (which
  # ignores it) is told where its components are.
  export OPAL_PREFIX="$d/usr"
  export PMIX_MCA_mca_base_component_path="$mlib/pmix2/lib/pmix"
  # Components for hardware the machine may lack (InfiniBand, OFI, netlink) fail to load, which
  # Open MPI reports on every rank's stderr (and tests read stderr): they are optional.
  export OMPI_MCA_mca_base_component_show_load_errors="${OMPI_MCA_mca_base_component_show_load_errors:-0}"
  {
    echo "--- unpacked environment"
    env | grep -E '^(PATH|LD_LIBRARY_PATH|CMAKE_PREFIX_PATH|PKG_CONFIG_PATH|C_INCLUDE_PATH|CPLUS_INCLUDE_PATH|OPAL_PREFIX|PMIX_|OMPI_)' | sort
  } >>"$log"
  return 0
}
if [ $have_debs = 1 ]; then
  logln "--- deps: unpacking ${#debs[@]} .deb files into $deps_root"
  if setup_deps 2>"$tmp/deps.err"; then
    need=$(sed -n 's/^# needs: GLIBC_\([0-9.]*\).*/\1/p' "$root/.gpu_deps/debs/manifest.txt" 2>/dev/null)
    have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
    if ! v=$(timeout 30 mpirun --version 2>&1 | head -1); then
      record "deps" "unpacked, mpirun does not start" "" fail "$v"
    elif [ -n "$need" ] && [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
      record "deps" "unpacked" "glibc >= $need" fail "this machine has glibc $have"
    else
      record "deps" "unpacked ${#debs[@]} .deb" "" pass "$v at $(command -v mpirun)"
    fi
  else
    record "deps" "unpacking failed" "" fail "$(tail -1 "$tmp/deps.err")"
  fi
else
  record "deps" "no .deb files: the machine's packages" "" info
fi

# --- build ---------------------------------------------------------------------------------

built_kvpipe=0 built_tests=0
if [ $skip_build = 1 ]; then
  record "build" "skipped (--skip-build)" "" info
elif [ $dry_run = 1 ]; then
  if [ ! -f "$build_dir/CMakeCache.txt" ]; then
    record "build" "not configured" "configured build dir" fail "$build_dir has no CMakeCache.txt (the dry run never configures)"
  elif run 300 cmake --build "$build_dir" --target kvpipe kvpipe_gpu_tests -j "$jobs"; then
    record "build" "up to date" "" pass "cmake --build $build_dir --target kvpipe kvpipe_gpu_tests"
  else
    record "build" "failed" "" fail "$(why $? /dev/null) (see gpu_check.log)"
  fi
else
  cmake_args=(-S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DKVPIPE_PYTHON="$kvpython")
  [ ! -f "$build_dir/CMakeCache.txt" ] && command -v ninja >/dev/null && cmake_args+=(-G Ninja)
  if [ $have_debs = 1 ] && [ -d "$deps_root" ]; then
    # CMakeLists.txt looks for OpenBLAS in Debian's own folder only; MPI's wrapper and
    # launcher are named so that nothing else on the machine is picked.
    ob="$deps_root/usr/lib/x86_64-linux-gnu/openblas-pthread"
    cmake_args+=(-DOPENBLAS_LIBRARY="$ob/libopenblas.so"
                 -DOPENBLAS_INCLUDE_DIR="$deps_root/usr/include/x86_64-linux-gnu/openblas-pthread"
                 -DMPI_CXX_COMPILER="$deps_root/usr/bin/mpicxx" -DMPIEXEC_EXECUTABLE="$deps_root/usr/bin/mpirun")
  fi
  t0=$(date +%s)
  if run 180 cmake "${cmake_args[@]}"; then
    record "configure" "ok in $(($(date +%s) - t0)) s" "" pass
    t0=$(date +%s)
    # One build of both targets, so that the unit tests' objects compile while kvpipe links.
    if run 420 cmake --build "$build_dir" --target kvpipe kvpipe_gpu_tests -j "$jobs"; then
      record "build" "ok in $(($(date +%s) - t0)) s" "" pass "kvpipe and kvpipe_gpu_tests, -j $jobs"
      built_kvpipe=1 built_tests=1
    else
      rc=$?
      # What did link is still used: kvpipe alone makes every measurement.
      [ -x "$build_dir/launch/kvpipe" ] && [ "$build_dir/launch/kvpipe" -nt "$log" ] && built_kvpipe=1
      record "build" "failed" "" fail "$(why $rc /dev/null) (see gpu_check.log)$([ $built_kvpipe = 1 ] && echo '; kvpipe linked')"
    fi
  else
    record "configure" "failed" "" fail "$(why $? /dev/null): $(grep -E 'CMake Error|kvpipe:' "$log" | tail -2 | tr '\n' ' ')"
  fi
fi

# The kvpipe binary carries sm_90 code (what TORCH_CUDA_ARCH_LIST asked for) for its kernels.
check_sm90() {
  local name="sm_90 code in kvpipe (cuobjdump --list-elf)" bin="$build_dir/launch/kvpipe" tool elfs
  tool=$(command -v cuobjdump || true)
  [ -z "$tool" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump" ] && tool="${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump"
  if [ ! -x "$bin" ]; then record "$name" "no kvpipe binary" "sm_90" fail; return; fi
  if [ -z "$tool" ]; then
    if [ $dry_run = 1 ]; then
      local fatbin
      fatbin=$(readelf -SW "$bin" 2>/dev/null | grep -c '\.nv_fatbin')
      record "$name" "no cuobjdump here" "sm_90" info "dry run: $fatbin .nv_fatbin section(s) in the binary"
    else
      record "$name" "no cuobjdump" "sm_90" fail "the CUDA toolkit's cuobjdump is not on PATH or in \$CUDA_HOME/bin"
    fi
    return
  fi
  timeout 60 "$tool" --list-elf "$bin" >"$tmp/elf.txt" 2>&1
  cat "$tmp/elf.txt" >>"$log"
  elfs=$(grep -c 'sm_90' "$tmp/elf.txt")
  if [ "$elfs" -gt 0 ]; then record "$name" "$elfs sm_90 ELF(s)" "sm_90" pass "$(grep -oE 'sm_[0-9]+a?' "$tmp/elf.txt" | sort -u | tr '\n' ' ')"
  else record "$name" "none" "sm_90" fail "$(head -1 "$tmp/elf.txt")"; fi
}
check_sm90

# --- tests ---------------------------------------------------------------------------------

# ctest_start NAME CAP CTEST-ARGS...: starts ctest in the background, time-boxed; ctest_finish
# NAME waits for it and records its results (tests.csv, one summary row). ctest_label: both.
slug() { echo "$1" | tr -c 'A-Za-z0-9\n' '_'; }
ctest_start() {
  local name=$1 c s stop
  s=$(slug "$1")
  c=$(cap "$2"); shift 2
  rm -f "$tmp/$s.rc" "$tmp/$s.xml"
  if [ "$c" -lt 10 ]; then echo 125 >"$tmp/$s.rc"; logln "not started (no time left): ctest $*"; return; fi
  # Tests stop being started (and running ones time out) 5 s before the time box ends.
  stop=$(date -d "@$(($(date +%s) + c - 5))" +%H:%M:%S)
  # How many tests the selection holds: those the time box cuts off are not in ctest's report.
  ctest --test-dir "$build_dir" -N "$@" 2>/dev/null | sed -n 's/^Total Tests: *//p' >"$tmp/$s.total"
  logln "\$ ctest $* (time box ${c}s)"
  ( timeout -k 10 "$c" ctest --test-dir "$build_dir" --output-on-failure --timeout 300 --stop-time "$stop" \
      -j "$jobs" --output-junit "$tmp/$s.xml" "$@" >"$tmp/$s.out" 2>"$tmp/$s.err" &
    echo $! >"$tmp/$s.pid"
    wait $!
    echo $? >"$tmp/$s.rc" ) &
  ctest_pid[$s]=$!
}
ctest_finish() {
  local name=$1 s rc counts
  s=$(slug "$1")
  [ -n "${ctest_pid[$s]:-}" ] && wait "${ctest_pid[$s]}"
  unset "ctest_pid[$s]"
  rc=$(cat "$tmp/$s.rc" 2>/dev/null || echo 1)
  { cat "$tmp/$s.out" "$tmp/$s.err" 2>/dev/null | tail -c 100000; } >>"$log"
  logln "exit $rc ($name)"
  if [ "$rc" = 125 ]; then record "$name" "not run" "all pass" fail "out of time"; return; fi
  # JUnit from ctest >= 3.21; else its console lines.
  counts=$(python3 - "$tmp/$s.xml" "$tmp/$s.out" "$name" "$tests_csv" "$(cat "$tmp/$s.total" 2>/dev/null)" <<'PY'
import csv, os, re, sys, xml.etree.ElementTree as ET
junit, console, label, out, total = sys.argv[1:6]
text = ""
for path in (console, console[:-4] + ".err"):   # ctest's standard output and error
    if os.path.exists(path):
        text += open(path, errors="replace").read()
results = []   # (name, status, seconds)
if os.path.exists(junit) and os.path.getsize(junit) > 0:
    for tc in ET.parse(junit).getroot().iter("testcase"):
        st, sk = tc.get("status", ""), tc.find("skipped")
        if st == "run":
            s = "passed"
        elif st == "fail":
            s = "failed"
        elif sk is not None and "SKIP_REGULAR_EXPRESSION" in (sk.get("message") or ""):
            s = "skipped"
        else:
            s = "not run"
        results.append((tc.get("name"), s, tc.get("time", "")))
else:
    pat = re.compile(r"Test +#\d+: (\S+) \.*\s*(\**)(Passed|Failed|Skipped|Timeout|Not Run|Exception|SEGFAULT|Subprocess aborted|\w+)[^\d]*([\d.]+) sec")
    for line in text.splitlines():
        m = pat.search(line)
        if m:
            s = {"Passed": "passed", "Skipped": "skipped", "Not Run": "not run"}.get(m.group(3), "failed")
            results.append((m.group(1), s, m.group(4)))
# Past ctest's --stop-time the tests still running time out: cut off, not failed.
stopped = "stop time has been passed" in text
if stopped:
    cut = set(re.findall(r"Test +#\d+: (\S+) \.*\s*\**Timeout", text))
    results = [(r[0], "not run" if r[1] == "failed" and r[0] in cut else r[1], r[2]) for r in results]
n = {"passed": 0, "failed": 0, "skipped": 0, "not run": 0}
with open(out, "a", newline="") as f:
    w = csv.writer(f)
    for name, s, t in results:
        n[s] += 1
        w.writerow([label, name, s, t])
if total.isdigit() and int(total) > len(results):
    n["not run"] += int(total) - len(results)
    stopped = True
failed = [r[0] for r in results if r[1] == "failed"]
print(n["passed"], n["failed"], n["skipped"], n["not run"], int(stopped), " ".join(failed[:4]))
PY
)
  local passed failedn skipped notrun stopped names
  read -r passed failedn skipped notrun stopped names <<<"$counts"
  local total=$((${passed:-0} + ${failedn:-0} + ${skipped:-0} + ${notrun:-0}))
  local value="$passed passed, $failedn failed, $skipped skipped, $notrun not run"
  if [ "$total" = 0 ]; then
    record "$name" "no tests" "all pass" fail "$(why "$rc" "$tmp/$s.err")"
  elif [ "$failedn" -gt 0 ] || [ "$notrun" -gt 0 ]; then
    local why_not=""
    [ "$stopped" = 1 ] || [ "$rc" = 124 ] && why_not="out of time: $notrun not run"
    record "$name" "$value" "all pass" fail "${names:+failed: $names}${names:+${why_not:+; }}$why_not"
  elif [ "$name" = "ctest -L gpu" ] && [ $dry_run = 0 ] && [ "$skipped" -gt 0 ]; then
    record "$name" "$value" "all pass" fail "skipped on a GPU machine: the tests see no CUDA device"
  else
    record "$name" "$value" "all pass" pass
  fi
}
ctest_label() { ctest_start "$@"; ctest_finish "$1"; }

have_tests=0
[ -f "$build_dir/CTestTestfile.cmake" ] && { [ $built_tests = 1 ] || [ $dry_run = 1 ] || [ $skip_build = 1 ]; } && have_tests=1
if [ $have_tests = 1 ]; then
  ctest_label "ctest -L gpu" 120 -L gpu
else
  record "ctest -L gpu" "not run" "all pass" fail "no gpu-test build"
fi

# --- benchmarks ----------------------------------------------------------------------------

have_kvpipe=0
# A GPU run measures the kvpipe it built; the dry run (and --skip-build) the one that is there.
[ -x "$kvpipe" ] && { [ $built_kvpipe = 1 ] || [ $dry_run = 1 ] || [ $skip_build = 1 ]; } && have_kvpipe=1
[ $have_kvpipe = 0 ] && logln "no kvpipe executable at $kvpipe: the measurements fail"
cpu_threads=$(( $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) < 8 ? 1 : 8 ))
cat >"$tmp/job.yaml" <<YAML
model: $model
runtime: {device: $device}
cache: {memory: $cache_memory}
sampling: {ignore_eos: true}
YAML
cat >"$tmp/parity.yaml" <<YAML
model: $model
runtime: {device: $device, share_gpu: true}
parallel: {backend: mpi}
cache: {memory: $parity_cache}
sampling: {temperature: 0.0, ignore_eos: true}
YAML

# Fields of a bench report.json as KEY=VALUE lines (empty when absent).
report_fields() {
  python3 - "$1" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception:
    sys.exit(1)
def g(*path):
    v = r
    for p in path:
        v = v.get(p) if isinstance(v, dict) else None
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else v
print("decode_step_ms=%s" % g("latency_ms", "decode_step", "median"))
print("decode_steps=%s" % g("latency_ms", "decode_step", "count"))
print("full_batch_step_ms=%s" % g("latency_ms", "decode_step_full_batch", "median"))
print("full_batch_steps=%s" % g("latency_ms", "decode_step_full_batch", "count"))
print("full_batch=%s" % g("steps", "decode_full_batch"))
print("tpot_ms=%s" % g("latency_ms", "tpot", "mean"))
print("ttft_ms=%s" % g("latency_ms", "ttft", "median"))
print("output_tok_s=%s" % g("throughput", "output_tokens_per_s"))
print("completed=%s" % g("requests", "completed"))
print("weight_bytes=%s" % g("decode_weight_bytes"))
print("kv_bytes_per_token=%s" % g("kv_bytes_per_token"))
print("cached_layers=%s" % g("engine", "cached_layers"))
print("paged_calls=%s" % g("engine", "attention_calls", "paged"))
print("varlen_calls=%s" % g("engine", "attention_calls", "varlen"))
print("per_sequence_calls=%s" % g("engine", "attention_calls", "per_sequence"))
print("graphs_enabled=%s" % g("engine", "cuda_graphs", "enabled"))
print("graphs_captured=%s" % g("engine", "cuda_graphs", "captured"))
print("replayed_steps=%s" % g("engine", "cuda_graphs", "replayed_steps"))
print("output_digest=%s" % g("engine", "output_digest"))
PY
}
# Fields of a one-line JSON object (the peer script's output) as KEY=VALUE lines.
json_fields() {
  python3 - "$1" <<'PY'
import json, sys
try:
    lines = [l for l in open(sys.argv[1]) if l.strip().startswith("{")]
    r = json.loads(lines[-1])
except Exception:
    sys.exit(1)
for k, v in r.items():
    if not isinstance(v, (list, dict)):
        print("%s=%s" % (k, "" if v is None else v))
PY
}
# get KEY FILE-OF-KEY=VALUE-LINES
get() { sed -n "s/^$1=//p" "$2" | head -1; }
calc() { awk "BEGIN { v = $1; if (v != v) print \"\"; else printf \"%.${2:-1}f\", v }" 2>/dev/null; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a != "" && a + 0 >= b + 0) }'; }
# bytes/s as "N TB/s" (a GPU's) or "N GB/s" (a CPU's)
bw() { if ge "$1" 1e11; then echo "$(calc "$1 / 1e12" 2) TB/s"; else echo "$(calc "$1 / 1e9" 1) GB/s"; fi; }
# Status of a performance row: info on the CPU (targets are for the GPU), else pass/fail.
perf_status() {
  if [ $dry_run = 1 ]; then echo info; elif ge "$1" "$2"; then echo pass; else echo fail; fi
}
measured_bw=""   # device copy bandwidth (bytes/s), set by step_bandwidth
bench_env=()     # environment of the next bench_run's kvpipe

# The copy bandwidth every floor is stated against, beside the datasheet's.
step_bandwidth() {
  local name="copy bandwidth (at::copy_, read + write)" args=(--copy-bandwidth) rc
  [ $dry_run = 1 ] && args+=(--device cpu --tiny)
  if [ -z "$kvpython" ]; then record "$name" "no result" "" fail "no python with torch"; return; fi
  run_io 90 "$tmp/bw.out" "$tmp/bw.err" "$kvpython" "$root/benchmarks/peers/torch_decode.py" "${args[@]}"
  rc=$?
  if [ $rc != 0 ] || ! json_fields "$tmp/bw.out" >"$tmp/bw.fields"; then
    record "$name" "no result" "" fail "$(why $rc "$tmp/bw.err"); floors use the datasheet's 4.8 TB/s"
    return
  fi
  measured_bw=$(get bandwidth_bytes_per_s "$tmp/bw.fields")
  bench_row bandwidth "copy $(get copy_bytes "$tmp/bw.fields") B x $(get repeats "$tmp/bw.fields")" bytes_per_s "$measured_bw"
  record "$name" "$(bw "$measured_bw")" "" info \
    "$(calc "100 * $measured_bw / $datasheet_bytes_per_s" 0)% of the 4.8 TB/s datasheet figure; every floor below is stated against both"
}

# a. batch-1 decode against the floor: step_a CHECK KEY [SETTING ...] (a2: the decode step
# replayed from CUDA graphs). One measured request after a warm-up one (which captures the
# graph); tok/s = 1000 / the median decode step.
step_a() {
  local check=$1 key=$2 f step steps bytes tok floor_m floor_d ratio_m ratio_d ratio
  shift 2
  bench_env=("${attention_env[@]}")
  if ! bench_run "$key" "$step_cap" workload.requests=1 workload.warmup=1 workload.concurrency=1 \
       "workload.prompt_len=$decode_prompt" "workload.output_len=$decode_tokens" workload.shared_prefix=0.0 \
       scheduler.max_batch=1 "cache.memory=$cache_memory" "$@"; then
    bench_env=()
    record "$check" "no result" ">= $floor_ratio_target" fail "$(cat "$tmp/$key.why")"
    return 1
  fi
  bench_env=()
  f="$tmp/$key.fields"
  step=$(get decode_step_ms "$f") steps=$(get decode_steps "$f") bytes=$(get weight_bytes "$f")
  if [ -z "$step" ] || [ "${steps:-0}" = 0 ] || [ -z "$bytes" ]; then
    record "$check" "no result" ">= $floor_ratio_target" fail "no decode steps or weight bytes in report.json"
    return 1
  fi
  tok=$(calc "1000 / $step") floor_d=$(calc "$datasheet_bytes_per_s / $bytes") ratio_d=$(calc "(1000 / $step) / ($datasheet_bytes_per_s / $bytes)" 3)
  local note="$tok tok/s (median of $steps decode steps: $step ms)"
  if [ -n "$measured_bw" ]; then
    floor_m=$(calc "$measured_bw / $bytes") ratio_m=$(calc "(1000 / $step) / ($measured_bw / $bytes)" 3) ratio=$ratio_m
    note+="; floor $floor_m tok/s at the measured $(bw "$measured_bw"), ratio $ratio_m"
    bench_row a "$key" floor_ratio_measured_bw "$ratio_m"
  else
    ratio=$ratio_d
    note+="; no measured bandwidth"
  fi
  note+="; $floor_d tok/s at 4.8 TB/s, ratio $ratio_d ($bytes B/step)"
  bench_row a "$key, prompt $decode_prompt, $decode_tokens tokens" decode_step_median_ms "$step"
  bench_row a "$key" decode_tok_s "$tok"
  bench_row a "$key" weight_bytes_per_step "$bytes"
  bench_row a "$key" floor_ratio_datasheet "$ratio_d"
  echo "$tok" >"$tmp/$key.tok"
  record "$check" "$ratio" ">= $floor_ratio_target" "$(perf_status "$ratio" "$floor_ratio_target")" "$note"
}

# Which path a's and a2's measured decode steps took: every cached layer of every decode step
# on the paged kernel (a), every decode step replayed from a graph (a2, on a GPU).
check_paths() {
  local fa="$tmp/a.fields" fg="$tmp/a2.fields" name steps layers paged want
  name="a. decode steps on the paged kernel"
  if [ -s "$fa" ]; then
    steps=$(get decode_steps "$fa") layers=$(get cached_layers "$fa") paged=$(get paged_calls "$fa")
    want=$((${steps:-0} * ${layers:-0}))
    logln "a: attention layer calls paged $paged, varlen $(get varlen_calls "$fa"), per_sequence $(get per_sequence_calls "$fa"); $steps decode steps x $layers layers"
    # On the CPU (dry run) prompt steps take the paged path too: at least the decode steps' calls.
    if [ "$want" -gt 0 ] && { [ "$paged" = "$want" ] || { [ $dry_run = 1 ] && [ "${paged:-0}" -ge "$want" ]; }; }; then
      record "$name" "$paged of $want layer calls" "all" pass "$([ $dry_run = 1 ] && echo "the CPU's paged decode kernel (KVPIPE_ATTENTION=paged)")"
    else
      record "$name" "${paged:-?} of $want layer calls" "all" fail "varlen $(get varlen_calls "$fa"), per_sequence $(get per_sequence_calls "$fa")"
    fi
  else
    record "$name" "no result" "all" fail "a did not run"
  fi
  name="a2. decode steps replayed from CUDA graphs"
  if [ ! -s "$fg" ]; then record "$name" "no result" "all" fail "a2 did not run"; return; fi
  steps=$(get decode_steps "$fg")
  logln "a2: graphs enabled $(get graphs_enabled "$fg"), $(get graphs_captured "$fg") captured, $(get replayed_steps "$fg") of $steps decode steps replayed"
  if [ "$(get graphs_enabled "$fg")" = true ]; then
    if [ "${steps:-0}" -gt 0 ] && [ "$(get replayed_steps "$fg")" = "$steps" ]; then
      record "$name" "$steps of $steps" "all" pass "$(get graphs_captured "$fg") graph(s) captured (each holds the paged kernel)"
    else
      record "$name" "$(get replayed_steps "$fg") of ${steps:-?}" "all" fail "$(get graphs_captured "$fg") graph(s) captured"
    fi
  elif [ $dry_run = 1 ]; then
    # runtime.cuda_graphs makes no graphs on the CPU: there is nothing to replay, said as such.
    paged=$(get paged_calls "$fg") want=$((${steps:-0} * $(get cached_layers "$fg")))
    local st=info
    [ "${paged:-0}" -ge "$want" ] && [ "$want" -gt 0 ] || st=fail
    record "$name" "n/a on the CPU (no graphs)" "all" "$st" "eager steps instead: paged kernel $paged of $want layer calls"
  else
    record "$name" "none: no graphs made" "all" fail "runtime.cuda_graphs: true made no DecodeGraphs"
  fi
}

# a's and a2's greedy tokens (report.json's digest of every measured request's output): graphs
# must compute what eager launches compute.
check_outputs() {
  local name="a2. greedy tokens, graphs = eager (a)" da db
  da=$(get output_digest "$tmp/a.fields" 2>/dev/null) db=$(get output_digest "$tmp/a2.fields" 2>/dev/null)
  if [ -z "$da" ] || [ -z "$db" ]; then record "$name" "no result" "equal" fail "a or a2 has no output digest"
  elif [ "$da" = "$db" ]; then record "$name" "equal" "equal" pass "$decode_tokens tokens, digest $da"
  else record "$name" "differ" "equal" fail "digests $da (a) and $db (a2)"; fi
}

# a3. The same batch-1 decode in plain PyTorch, in the same run: kvpipe / PyTorch tokens/s.
step_peer() {
  local name="a3. kvpipe / PyTorch, batch-1 decode tok/s" f="$tmp/peer.fields" rc tok step bytes ta ta2 note
  if [ -z "$kvpython" ]; then record "$name" "no result" "" fail "no python with torch"; return; fi
  run_io "$step_cap" "$tmp/peer.out" "$tmp/peer.err" "$kvpython" "$root/benchmarks/peers/torch_decode.py" "${peer_args[@]}"
  rc=$?
  if [ $rc != 0 ] || ! json_fields "$tmp/peer.out" >"$f"; then record "$name" "no result" "" fail "PyTorch: $(why $rc "$tmp/peer.err")"; return; fi
  tok=$(get decode_tok_s "$f") step=$(get decode_step_ms_median "$f") bytes=$(get weight_bytes_per_step "$f")
  if [ -z "$tok" ]; then record "$name" "no result" "" fail "PyTorch timed no decode step"; return; fi
  bench_row peer "pytorch, graphs $(get cuda_graphs "$f")" decode_step_median_ms "$step"
  bench_row peer "pytorch" decode_tok_s "$tok"
  ta=$(cat "$tmp/a.tok" 2>/dev/null) ta2=$(cat "$tmp/a2.tok" 2>/dev/null)
  note="PyTorch $(calc "$tok") tok/s (median step $(calc "$step" 3) ms, CUDA graph $(get cuda_graphs "$f"))"
  if [ -n "$measured_bw" ] && [ -n "$bytes" ]; then note+=", $(calc "$tok / ($measured_bw / $bytes)" 3) of its floor at the measured bandwidth"; fi
  [ -n "$bytes" ] && note+=", $(calc "$tok / ($datasheet_bytes_per_s / $bytes)" 3) at 4.8 TB/s"
  local value=""
  [ -n "$ta2" ] && value="graphs $(calc "$ta2 / $tok" 2)" && bench_row peer "a2 / pytorch" ratio "$(calc "$ta2 / $tok" 3)"
  [ -n "$ta" ] && value+="${value:+, }eager $(calc "$ta / $tok" 2)" && bench_row peer "a / pytorch" ratio "$(calc "$ta / $tok" 3)"
  if [ -z "$value" ]; then record "$name" "no kvpipe figure" "" fail "$note"
  else record "$name" "$value" "" info "$note"; fi
}

# Compares two --logprobs-out files of one request, step by step while the tokens agree.
compare_logprobs() {
  python3 - "$1" "$2" <<'PY'
import json, math, sys
def load(path):
    steps = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                d = json.loads(line)
                steps[(d["id"], d["step"])] = (d["token"], d["logprobs"])
    return steps
a, b = load(sys.argv[1]), load(sys.argv[2])
keys = sorted(a)
agree, first_diff, max_all, max_chosen, gap = 0, -1, 0.0, 0.0, ""
for k in keys:
    if k not in b:
        first_diff = k[1]
        break
    (ta, la), (tb, lb) = a[k], b[k]
    if len(la) != len(lb):
        first_diff = k[1]
        break
    d = max((abs(x - y) for x, y in zip(la, lb) if math.isfinite(x) and math.isfinite(y)), default=0.0)
    max_all = max(max_all, d)
    max_chosen = max(max_chosen, abs(la[ta] - lb[ta]))
    if ta != tb:
        first_diff = k[1]
        gap = "%.3g" % (la[ta] - la[tb])   # how far apart the two choices were in the first file
        break
    agree += 1
print("steps=%d" % len(keys))
print("steps_b=%d" % len(b))
print("agree=%d" % agree)
print("first_diff=%d" % first_diff)
print("max_all=%.3g" % max_all)
print("max_chosen=%.3g" % max_chosen)
print("gap=%s" % gap)
PY
}

# e. bfloat16 on cuda (CPU float32 in the dry run) against float32 on the CPU.
step_e() {
  local m="$tmp/e-model" rc
  local name="e. bf16 $device vs f32 cpu: max abs dlogprob, chosen tokens"
  [ $dry_run = 1 ] && name="e. f32 cpu vs f32 cpu: max abs dlogprob, chosen tokens"
  if ! run "$step_cap" "$kvpipe" init-model --out "$m" --preset "$e2e_preset" --dtype bfloat16; then
    record "$name" "no result" "<= $e2e_tolerance" fail "init-model: $(why $? /dev/null)"
    return
  fi
  local prompt
  prompt=$(ids 32 "$(sed -n 's/.*"vocab_size": *\([0-9]*\).*/\1/p' "$m/config.json" | head -1)")
  run_io "$step_cap" "$tmp/e-cpu.out" "$tmp/e-cpu.err" "$kvpipe" generate --config "$tmp/job.yaml" \
    --set "model.path=$m" --set model.dtype=float32 --set runtime.device=cpu --set "runtime.threads=$cpu_threads" \
    --set "cache.memory=$e_cpu_cache" --prompt-ids "$prompt" --max-new-tokens "$e2e_tokens" --logprobs-out "$tmp/e-cpu.jsonl"
  rc=$?
  if [ $rc != 0 ]; then record "$name" "no result" "<= $e2e_tolerance" fail "cpu float32: $(why $rc "$tmp/e-cpu.err")"; return; fi
  local dev_dtype=bfloat16 dev_threads=1
  [ $dry_run = 1 ] && dev_dtype=float32 dev_threads=$cpu_threads
  run_io "$step_cap" "$tmp/e-dev.out" "$tmp/e-dev.err" "$kvpipe" generate --config "$tmp/job.yaml" \
    --set "model.path=$m" --set "model.dtype=$dev_dtype" --set "runtime.device=$device" --set "runtime.threads=$dev_threads" \
    --set "cache.memory=$e_dev_cache" --prompt-ids "$prompt" --max-new-tokens "$e2e_tokens" --logprobs-out "$tmp/e-dev.jsonl"
  rc=$?
  if [ $rc != 0 ]; then record "$name" "no result" "<= $e2e_tolerance" fail "$device $dev_dtype: $(why $rc "$tmp/e-dev.err")"; return; fi
  local c="$tmp/e.cmp"
  compare_logprobs "$tmp/e-cpu.jsonl" "$tmp/e-dev.jsonl" >"$c" || { record "$name" "no result" "" fail "logprobs not comparable"; return; }
  local steps agree first_diff max_chosen max_all gap
  steps=$(get steps "$c") agree=$(get agree "$c") first_diff=$(get first_diff "$c")
  max_chosen=$(get max_chosen "$c") max_all=$(get max_all "$c") gap=$(get gap "$c")
  if [ "${steps:-0}" = 0 ]; then record "$name" "no result" "<= $e2e_tolerance" fail "no logprobs written"; return; fi
  bench_row e "preset $e2e_preset, $e2e_tokens tokens" tokens_agree "$agree/$steps"
  bench_row e "preset $e2e_preset" max_abs_dlogprob_chosen "$max_chosen"
  bench_row e "preset $e2e_preset" max_abs_dlogprob_all "$max_all"
  local st=fail
  awk -v a="$max_chosen" -v t="$e2e_tolerance" 'BEGIN { exit !(a <= t) }' && st=pass
  record "$name" "$max_chosen" "<= $e2e_tolerance" "$st" "over the $((agree + (first_diff >= 0 ? 1 : 0))) step(s) with equal context; whole vocabulary: $max_all"
  if [ "$first_diff" = -1 ] && [ "$agree" = "$steps" ] && [ "$steps" -gt 0 ]; then
    record "e. greedy tokens agree" "$agree/$steps" "all" pass
  elif [ -n "$gap" ] && awk -v g="$gap" -v t="$e2e_tolerance" 'BEGIN { exit !(g <= 2 * t) }'; then
    record "e. greedy tokens agree" "$agree/$steps" "all" info "diverge at step $first_diff on a near-tie (float32 logprob gap $gap)"
  else
    record "e. greedy tokens agree" "$agree/$steps" "all" fail "diverge at step $first_diff${gap:+ (float32 logprob gap $gap)}"
  fi
}

# d. 2 ranks on one GPU against one rank: step_d NAME KEY TOLERANCE [SETTING ...] (d: two
# pipeline stages over MPI; d2: two tensor ranks of one stage, whose all-reduces stage through
# host memory, since NCCL refuses two ranks on one GPU).
step_d() {
  local name=$1 key=$2 tolerance=$3
  shift 3
  local prompt args rc s sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  prompt=$(ids 32 "$vocab")
  args=(generate --config "$tmp/parity.yaml" --prompt-ids "$prompt" --max-new-tokens "$parity_tokens")
  run_io "$step_cap" "$tmp/$key-1.out" "$tmp/$key-1.err" "$kvpipe" "${args[@]}" --logprobs-out "$tmp/$key-1.jsonl"
  rc=$?
  if [ $rc != 0 ]; then record "$name" "no result" "tokens equal, <= $tolerance" fail "1 rank: $(why $rc "$tmp/$key-1.err")"; return; fi
  if ! command -v mpirun >/dev/null; then record "$name" "no result" "" fail "no mpirun on PATH"; return; fi
  run_io "$step_cap" "$tmp/$key-2.out" "$tmp/$key-2.err" mpirun --oversubscribe -np 2 "$kvpipe" "${args[@]}" \
    "${sets[@]}" --logprobs-out "$tmp/$key-2.jsonl" --output "$tmp/$key-2.results"
  rc=$?
  if [ $rc != 0 ]; then record "$name" "no result" "tokens equal, <= $tolerance" fail "2 ranks: $(why $rc "$tmp/$key-2.err")"; return; fi
  local c="$tmp/$key.cmp"
  compare_logprobs "$tmp/$key-1.jsonl" "$tmp/$key-2.jsonl" >"$c" || { record "$name" "no result" "" fail "logprobs not comparable"; return; }
  local steps steps_b agree max_all
  steps=$(get steps "$c") steps_b=$(get steps_b "$c") agree=$(get agree "$c") max_all=$(get max_all "$c")
  bench_row "$key" "$parity_tokens tokens" tokens_agree "$agree/$steps"
  bench_row "$key" "$parity_tokens tokens" max_abs_dlogprob_all "$max_all"
  local st=fail
  [ "$steps" -gt 0 ] && [ "$agree" = "$steps" ] && [ "$steps_b" = "$steps" ] &&
    awk -v a="$max_all" -v t="$tolerance" 'BEGIN { exit !(a <= t) }' && st=pass
  record "$name" "tokens $agree/$steps equal, max abs dlogprob $max_all" "all equal, <= $tolerance" "$st" \
    "whole vocabulary, every step"
}

# One kvpipe bench run: bench_run NAME CAP SETTINGS... -> $tmp/NAME.fields (KEY=VALUE lines),
# with $bench_env in its environment.
bench_run() {
  local name=$1 c=$2 d="$tmp/bench-$1"
  shift 2
  local sets=() s
  for s in "$@"; do sets+=(--set "$s"); done
  run_io "$c" "$tmp/$name.out" "$tmp/$name.err" env "${bench_env[@]}" "$kvpipe" bench --config "$tmp/job.yaml" \
    --out "$d" "${sets[@]}"
  local rc=$?
  if [ $rc != 0 ]; then why $rc "$tmp/$name.err" >"$tmp/$name.why"; return 1; fi
  report_fields "$d/report.json" >"$tmp/$name.fields" || { echo "no report.json" >"$tmp/$name.why"; return 1; }
  rm -rf "$d"
}

# c. prefill tokens/s from TTFT (one measured request at a time, after a warm-up request).
step_c() {
  local p name ttft tok
  for p in "${prefills[@]}"; do
    name="c. prefill $p-token prompt"
    if ! bench_run "prefill$p" "$bench_cap" workload.requests=2 workload.warmup=1 workload.concurrency=1 \
         "workload.prompt_len=$p" workload.output_len=1 workload.shared_prefix=0.0 scheduler.max_batch=1 \
         "cache.memory=$cache_memory"; then
      record "$name" "no result" "" fail "$(cat "$tmp/prefill$p.why")"
      continue
    fi
    ttft=$(get ttft_ms "$tmp/prefill$p.fields")
    tok=$(calc "$p * 1000 / $ttft")
    bench_row c "prompt $p" ttft_ms "$ttft"
    bench_row c "prompt $p" prefill_tok_s "$tok"
    if [ -n "$tok" ]; then record "$name" "$tok tok/s" "" info "median TTFT $ttft ms"
    else record "$name" "no result" "" fail "no TTFT in report.json"; fi
  done
}

# The KV pool of one b point on the GPU: what its batch of contexts holds, 15% spare, 8 GiB at
# least (a pool of the whole GPU would be zero-filled in every run for nothing).
b_cache() {
  local b=$1 ctx=$2 per_token=$3
  [ $dry_run = 1 ] && { echo "$cache_memory"; return; }
  awk -v b="$b" -v c="$ctx" -v t="$per_token" 'BEGIN { g = int(b * (c + 32) * t * 1.15 / 2^30) + 2; if (g < 8) g = 8; printf "%dGiB", g }'
}

# b. decode throughput against the batch. Every request has a prompt of its own (distinct
# blocks: the KV reads come from HBM, not from a shared prefix in L2); all arrive together and
# prefill in steps of up to 16k tokens, then decode together. decode tok/s = batch x 1000 / the
# median decode-only step at the full batch (steps after the first requests finish are left
# out); each point's floor is (weight bytes + batch x context x KV bytes per token) / bandwidth.
step_b() {
  local ctx b name values tok1 tok ratio target label floors_m floors_d per_token
  per_token=$(get kv_bytes_per_token "$tmp/a.fields" 2>/dev/null)
  [ -z "$per_token" ] && per_token=131072   # Llama-3-8B in bfloat16: 2 x 32 layers x 8 heads x 128 x 2 B
  for ctx in "${contexts[@]}"; do
    values="" tok1="" tok="" floors_m="" floors_d=""
    label=$ctx
    [ "$ctx" -ge 1024 ] && label="$((ctx / 1024))k"
    for b in "${batches[@]}"; do
      name="b${b}_c${ctx}"
      # The largest point prefills half a million tokens before it decodes.
      local c=$bench_cap
      [ $dry_run = 0 ] && [ $((b * ctx)) -gt 131072 ] && c=$((bench_cap + 60))
      if ! bench_run "$name" "$c" "workload.requests=$b" "workload.concurrency=$b" workload.warmup=1 \
           "workload.prompt_len=$((ctx - bench_output))" "workload.output_len=$bench_output" \
           workload.shared_prefix=0.0 "scheduler.max_batch=$b" scheduler.max_tokens_per_step=16384 \
           "cache.memory=$(b_cache "$b" "$ctx" "$per_token")"; then
        values+="${values:+ / }fail" floors_m+="${floors_m:+ / }-" floors_d+="${floors_d:+ / }-"
        bench_row b "batch $b, context $ctx" error "$(cat "$tmp/$name.why")"
        [ -z "${b_error:-}" ] && b_error="batch $b: $(cat "$tmp/$name.why")"
        continue
      fi
      local f="$tmp/$name.fields" step steps full bytes kvt floor_bytes
      step=$(get full_batch_step_ms "$f") steps=$(get full_batch_steps "$f") full=$(get full_batch "$f")
      bytes=$(get weight_bytes "$f") kvt=$(get kv_bytes_per_token "$f")
      tok=""
      [ -n "$step" ] && [ "${steps:-0}" -gt 0 ] && tok=$(calc "$full * 1000 / $step")
      [ "$b" = "${batches[0]}" ] && tok1=$tok
      values+="${values:+ / }${tok:-?}"
      floor_bytes=$(calc "${bytes:-0} + $b * $ctx * ${kvt:-0}" 0)
      local fm="-" fd="-"
      if [ -n "$tok" ] && [ -n "$bytes" ]; then
        fd=$(calc "$tok / ($b * $datasheet_bytes_per_s / $floor_bytes)" 2)
        [ -n "$measured_bw" ] && fm=$(calc "$tok / ($b * $measured_bw / $floor_bytes)" 2)
      fi
      floors_m+="${floors_m:+ / }$fm" floors_d+="${floors_d:+ / }$fd"
      bench_row b "batch $b, context $ctx" decode_step_full_batch_median_ms "$step"
      bench_row b "batch $b, context $ctx" full_batch "$full"
      bench_row b "batch $b, context $ctx" full_batch_steps "$steps"
      bench_row b "batch $b, context $ctx" decode_step_median_ms "$(get decode_step_ms "$f")"
      bench_row b "batch $b, context $ctx" decode_tok_s "$tok"
      bench_row b "batch $b, context $ctx" floor_bytes_per_step "$floor_bytes"
      bench_row b "batch $b, context $ctx" floor_ratio_measured_bw "$fm"
      bench_row b "batch $b, context $ctx" floor_ratio_datasheet "$fd"
      [ "$full" != "$b" ] && b_note="${b_note:-}batch $b decoded at most $full together; "
    done
    local bl
    bl=$(IFS=/; echo "${batches[*]}")
    local note bw_text="?"
    [ -n "$measured_bw" ] && bw_text=$(bw "$measured_bw")
    note="${b_note:-}of the floor: $floors_m at the measured $bw_text, $floors_d at 4.8 TB/s"
    if [[ $values == *fail* ]] || [[ $values == *\?* ]]; then
      record "b. decode tok/s, $label context, batch $bl" "$values" "" fail "${b_error:-no decode step at the full batch}; $note"
    else
      record "b. decode tok/s, $label context, batch $bl" "$values" "" info "$note"
    fi
    b_error="" b_note=""
    target=$batch_ratio_target_1k
    [ "$ctx" -gt 4096 ] && target=$batch_ratio_target_8k
    local last=${batches[${#batches[@]} - 1]}
    name="b. batch $last / batch ${batches[0]}, $label context"
    if [ -n "$tok1" ] && [ -n "$tok" ] && [[ $values != *fail* ]] && [[ $values != *\?* ]]; then
      ratio=$(calc "$tok / $tok1" 2)
      bench_row b "context $ctx" "ratio_b${last}_b${batches[0]}" "$ratio"
      record "$name" "$ratio" ">= $target" "$(perf_status "$ratio" "$target")"
    else
      record "$name" "no result" ">= $target" fail
    fi
  done
}

# memcheck: the paged decode kernel and the graphs under compute-sanitizer.
step_memcheck() {
  local name="memcheck (compute-sanitizer): GpuPagedDecode*, GpuDecodeGraphs*" tool bin rc errors passed skipped
  local filter='GpuPagedDecode*:GpuDecodeGraphs*'
  bin="$build_dir/tests/kvpipe_gpu_tests"
  tool=$(command -v compute-sanitizer || true)
  [ -z "$tool" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ] && tool="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
  if [ ! -x "$bin" ]; then record "$name" "not run" "0 errors" fail "no kvpipe_gpu_tests executable"; return; fi
  if [ $dry_run = 1 ]; then
    # No GPU: the tests skip. They are run bare, to check that the filter names tests.
    run_io 60 "$tmp/memcheck.out" "$tmp/memcheck.err" "$bin" --gtest_filter="$filter"
    rc=$?
    skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}.*/\1/p' "$tmp/memcheck.out" | head -1)
    local st=info
    [ $rc = 0 ] && [ "${skipped:-0}" -gt 0 ] || st=fail
    record "$name" "n/a on the CPU" "0 errors" "$st" "${skipped:-0} tests skipped without a GPU; compute-sanitizer $([ -n "$tool" ] && echo "at $tool" || echo 'not installed here')"
    return
  fi
  if [ -z "$tool" ]; then record "$name" "not run" "0 errors" fail "no compute-sanitizer on PATH or in \$CUDA_HOME/bin"; return; fi
  run_io 150 "$tmp/memcheck.out" "$tmp/memcheck.err" "$tool" --tool memcheck --error-exitcode 3 "$bin" --gtest_filter="$filter"
  rc=$?
  errors=$(cat "$tmp/memcheck.out" "$tmp/memcheck.err" | sed -n 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p' | tail -1)
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\{0,1\}.*/\1/p' "$tmp/memcheck.out" | head -1)
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}.*/\1/p' "$tmp/memcheck.out" | head -1)
  if [ $rc = 0 ] && [ "${errors:-x}" = 0 ] && [ "${passed:-0}" -gt 0 ] && [ "${skipped:-0}" = 0 ]; then
    record "$name" "0 errors, $passed tests passed" "0 errors" pass
  else
    record "$name" "${errors:-?} errors, ${passed:-0} passed, ${skipped:-0} skipped" "0 errors" fail "$(why $rc "$tmp/memcheck.err")"
  fi
}

if [ $have_kvpipe = 1 ]; then
  say "--- bandwidth"; step_bandwidth
  say "--- a. batch-1 decode"; step_a "a. batch-1 decode / floor" a
  # CUDA graphs are off by default until this row says they pay (on the CPU the key is ignored).
  say "--- a2. batch-1 decode, CUDA graphs"
  step_a "a2. batch-1 decode with CUDA graphs / floor" a2 runtime.cuda_graphs=true
  check_paths
  check_outputs
  say "--- a3. PyTorch peer"; step_peer
  say "--- e. bf16 vs f32"; step_e
  say "--- b. decode vs batch"; step_b
  say "--- d. pipeline parity"; step_d "d. 2-rank pipeline parity (mpirun -np 2)" d "$parity_tolerance"
  say "--- d2. tensor parity"
  step_d "d2. 2 tensor ranks on one GPU (mpirun -np 2, parallel.tensor 2)" d2 "$tensor_parity_tolerance" parallel.tensor=2
  say "--- c. prefill"; step_c
else
  for n in "a. batch-1 decode / floor" "a2. batch-1 decode with CUDA graphs / floor" "a3. kvpipe / PyTorch" "e. bf16 vs f32" "b. decode vs batch" "d. 2-rank pipeline parity (mpirun -np 2)" "d2. 2 tensor ranks on one GPU (mpirun -np 2, parallel.tensor 2)" "c. prefill"; do
    record "$n" "not run" "" fail "no kvpipe executable"
  done
fi
say "--- memcheck"; step_memcheck

exit 0
