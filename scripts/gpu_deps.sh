#!/usr/bin/env bash
# Downloads, on Debian 12 (apt-get download: nothing is installed), the .deb files of the
# packages kvpipe's build and tests need that a GPU machine image may lack: an Ubuntu-like
# image with the compiler, CMake, ninja, the CUDA toolkit and a Python holding torch, but no
# Open MPI, yaml-cpp, GoogleTest or kvpipe's other -dev packages, and no network there.
# scripts/gpu_check.sh unpacks them (dpkg -x, no root, nothing written outside the checkout).
#
#   scripts/gpu_deps.sh [--dir .gpu_deps] [--max-mib 48]
#
# The packages are those of scripts/setup.sh that the build and the unit tests use, with their
# dependencies resolved recursively, less what any such image has (the C library, the
# compiler's runtime libraries, zlib, the toolchain, dpkg and perl) and less what is not needed
# to build and run kvpipe on one node (Open MPI's static-link -dev dependencies, ssh, the
# optional hwloc plugins with their X11/XML/OpenCL libraries, GoogleTest's sources). The .deb
# files go into DIR/debs (replacing any there); the total size is printed, and the script
# fails above --max-mib, since the files travel with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.gpu_deps max_mib=48
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --max-mib) max_mib=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_deps: unknown argument $1" >&2; exit 2 ;;
  esac
done
for t in apt-get apt-cache dpkg-deb objdump; do
  command -v "$t" >/dev/null || { echo "gpu_deps: needs $t (Debian 12: apt, dpkg, binutils)" >&2; exit 2; }
done

# What CMakeLists.txt and tests/CMakeLists.txt find: MPI (and mpirun for the tests and the
# pipeline check), yaml-cpp, nlohmann/json, CLI11, GoogleTest, PCRE2, utf8proc, cpp-httplib,
# OpenBLAS (pthread) and pkg-config for the pkg_check_modules() of the last four.
roots=(
  openmpi-bin libopenmpi-dev
  libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libgtest-dev
  libpcre2-dev libutf8proc-dev libcpp-httplib-dev libopenblas-pthread-dev
  pkgconf
)
# Never downloaded (Debian names; a dependency on one of them is taken as satisfied there).
skip_re='^('
# the C library, the compiler's runtime libraries and the rest of any Ubuntu base image
skip_re+='libc6|libc-bin|libgcc-s1|libstdc\+\+6|libatomic1|libgomp1|libitm1|libquadmath0|zlib1g|libzstd1|liblzma5|libbz2-1\.0'
skip_re+='|libcrypt1|libudev1|libsystemd0|libselinux1|libtinfo6|libcap2|libcap-ng0|libaudit1|libaudit-common|libpam.*'
skip_re+='|libacl1|libattr1|libgmp10|libffi8|libmd0|libbsd0|libuuid1|libblkid1|libmount1|libdb5\.3|libgdbm.*|libsemanage.*|libsepol2'
skip_re+='|debconf|debconf-2\.0|cdebconf|dpkg|perl|perl-base|perl-modules-.*|libperl.*|adduser|passwd|tar|debianutils|install-info|readline-common|libreadline8'
# the toolchain (the image has a compiler; kvpipe builds with it)
skip_re+='|gcc|gcc-[0-9]+|gcc-[0-9]+-base|g\+\+.*|cpp|cpp-[0-9]+|gfortran.*|flang-.*|libflang.*|binutils.*|libbinutils|libctf.*|libgprofng0'
skip_re+='|libc6-dev|libc-dev|libc-dev-bin|linux-libc-dev|libcrypt-dev|libnsl-dev|libnsl2|libtirpc.*|rpcsvc-proto|libstdc\+\+-[0-9]+-dev'
skip_re+='|libgcc-[0-9]+-dev|libgfortran-[0-9]+-dev|libasan.*|liblsan.*|libtsan.*|libubsan.*|libhwasan.*|libcc1-0|libisl.*|libmpc3|libmpfr6'
# Open MPI's -dev dependencies (static linking, Fortran, its HTML docs) and remote launch
skip_re+='|libibverbs-dev|libhwloc-dev|libevent-dev|libpmix-dev|libnl-3-dev|libnl-route-3-dev|libnuma-dev|libltdl-dev|libjs-.*'
skip_re+='|openssh-client|ssh-client|autoconf|automake|autotools-dev|m4|libtool'
# optional at run time: hwloc's plugins (X11, libxml2, OpenCL); GoogleTest's sources
skip_re+='|libhwloc-plugins|googletest'
skip_re+=')$'

# Direct dependencies of one package (Depends and Pre-Depends, first alternative of each),
# as apt-cache reports them for the candidate version.
deps_of() {
  apt-cache show --no-all-versions "$1" 2>/dev/null |
    awk '/^(Pre-)?Depends:/ { sub(/^[^:]*: */, ""); n = split($0, a, /, */);
           for (i = 1; i <= n; i++) { split(a[i], alt, / *\| */); p = alt[1];
             sub(/ *\(.*/, "", p); sub(/:any$/, "", p); print p } }' | sort -u
}

declare -A seen=()
queue=("${roots[@]}") packages=() skipped=()
while [ ${#queue[@]} -gt 0 ]; do
  p=${queue[0]} queue=("${queue[@]:1}")
  [ -n "${seen[$p]:-}" ] && continue
  seen[$p]=1
  if [[ $p =~ $skip_re ]]; then skipped+=("$p"); continue; fi
  if ! apt-cache show --no-all-versions "$p" >/dev/null 2>&1; then
    echo "gpu_deps: no package $p in the apt lists (virtual, or run apt-get update); skipped" >&2
    skipped+=("$p"); continue
  fi
  packages+=("$p")
  while read -r d; do [ -n "$d" ] && queue+=("$d"); done < <(deps_of "$p")
done

debs="$dir/debs"
mkdir -p "$debs"
rm -f "$debs"/*.deb "$debs"/manifest.txt
echo "gpu_deps: downloading ${#packages[@]} package(s) into $debs"
# As root, apt's download sandbox user cannot write into the checkout; download as root.
( cd "$debs" && apt-get -q -o APT::Sandbox::User=root download "${packages[@]}" ) ||
  { echo "gpu_deps: apt-get download failed (try 'apt-get update')" >&2; exit 1; }

# The newest glibc and libstdc++ symbol versions the downloaded binaries need: the machine
# that unpacks them needs at least those (Debian 12 builds: glibc 2.36, GCC 12's libstdc++).
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for f in "$debs"/*.deb; do dpkg-deb -x "$f" "$tmp/root"; done
glibc=$(find "$tmp/root" -type f \( -name '*.so*' -o -path '*/bin/*' \) -exec objdump -T {} + 2>/dev/null |
        grep -oE 'GLIBC_2\.[0-9]+' | sort -uV | tail -1 || true)
glibcxx=$(find "$tmp/root" -type f \( -name '*.so*' -o -path '*/bin/*' \) -exec objdump -T {} + 2>/dev/null |
          grep -oE 'GLIBCXX_3\.4\.[0-9]+' | sort -uV | tail -1 || true)

{
  echo "# kvpipe GPU-check dependencies (scripts/gpu_deps.sh): Debian $(cat /etc/debian_version 2>/dev/null || echo '?') packages"
  echo "# needs: ${glibc:-GLIBC_?} ${glibcxx:-GLIBCXX_?}"
  for f in "$debs"/*.deb; do
    printf '%s %s %s\n' "$(dpkg-deb -f "$f" Package)" "$(dpkg-deb -f "$f" Version)" "$(stat -c %s "$f")"
  done
} >"$debs/manifest.txt"

files=("$debs"/*.deb)
bytes=$(cat "${files[@]}" | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu_deps: packages: ${packages[*]}"
echo "gpu_deps: taken as present there: ${skipped[*]}"
echo "gpu_deps: the binaries need ${glibc:-GLIBC_?} and ${glibcxx:-GLIBCXX_?} or newer on the machine that unpacks them"
echo "gpu_deps: ${#files[@]} .deb files, $mib MiB in $debs"
if awk -v b="$bytes" -v m="$max_mib" 'BEGIN { exit !(b > m * 1048576) }'; then
  echo "gpu_deps: $mib MiB is over the limit of $max_mib MiB" >&2
  exit 1
fi
