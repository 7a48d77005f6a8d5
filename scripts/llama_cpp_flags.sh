# Sourced by scripts/setup.sh and benchmarks/peers/build_llama_cpp.sh: how both builds of the
# llama.cpp reference (llama-cpp-python's library, and the benchmark tools from the same
# source) generate code, so that the parity tests and the benchmarks run the same llama.cpp.
#
# Native code for the processor it is built on (AVX2 on AMD Zen 3, AVX-512 with VNNI on
# Sapphire Rapids), but never AMX. Those Intel processors advertise AMX, and in the virtual
# machines this project runs on ggml's AMX matrix product has died of a general protection
# fault on `ldtilecfg`, even where the kernel grants the process its tile permission. A
# setup-time probe cannot settle it (a trial may pass on one machine of a model and fault on
# another, and a wheel cache outlives the machine it was probed on), so AMX is switched off
# always rather than detected. gcc's -mno-* options win over -march=native in any order.
# ggml uses AMX only for some quantised types' batched products; without it those take the
# AVX-512 VNNI path, as on a processor without AMX.
llama_cpp_isa_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

# What a wheel or binary built with these flags is bound to: the flags, the compiler and the
# processor (-march=native code may not run on another). A cache keyed by it never hands an
# older build (one with AMX) or another machine's build to this one.
llama_cpp_build_key() {
  {
    echo "$llama_cpp_isa_flags $*"
    "${CC:-cc}" --version 2>/dev/null | head -n 1
    grep -m 1 '^model name' /proc/cpuinfo 2>/dev/null
    grep -m 1 '^flags' /proc/cpuinfo 2>/dev/null
  } | sha256sum | cut -c1-16
}

# Fails naming the file when its machine code holds an AMX instruction (a tile register).
llama_cpp_check_no_amx() {
  local file="$1" n
  n="$(objdump -d --no-show-raw-insn "$file" | grep -c -E '%tmm[0-7]|ldtilecfg' || true)"
  if [ "$n" != 0 ]; then
    echo "llama.cpp: $file holds $n AMX instructions although it was built with $llama_cpp_isa_flags" >&2
    return 1
  fi
}
