#!/usr/bin/env bash
# Makes the build toolchain of the committed wheels: Debian 11's glibc 2.31 and libstdc++ 10 (the system libraries
# of Ubuntu 20.04 / Debian 11) as a sysroot, and host-compiler wrappers (bin/g++: gcc 12, bin/g++-11: gcc 11 for
# CUDA 11.8) that compile and link against it, so the modules need nothing newer than glibc 2.31, GLIBCXX_3.4.28
# and CXXABI_1.3.12 (manylinux_2_31). Used by `tools/build_wheels.py --sysroot DIR`; docs/wheels.md explains.
#
#   bash tools/glibc231_sysroot.sh DIR      # needs apt-get (packages fetched from deb.debian.org, not installed)
set -euo pipefail

DIR=${1:?usage: glibc231_sysroot.sh DIR}
# Exact Debian 11 versions the committed wheels were linked against (apt downloads whatever bullseye has now;
# a different version still works but the wheels' bytes may differ: update the list when that happens).
PACKAGES="libc6=2.31-13+deb11u11 libc6-dev=2.31-13+deb11u11 linux-libc-dev=5.10.223-1 libcrypt1=1:4.4.18-4
libcrypt-dev=1:4.4.18-4 libstdc++6=10.2.1-6 libstdc++-10-dev=10.2.1-6 libgcc-s1=10.2.1-6 libgomp1=10.2.1-6"

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
ROOT=$DIR/root
APT=$DIR/apt
rm -rf "$ROOT" "$DIR/bin"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$DIR/debs" "$ROOT" "$DIR/bin"
echo 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bullseye main' \
    > "$APT/sources.list"
A=(-o "Dir::Etc::SourceList=$APT/sources.list" -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$APT/lists"
   -o "Dir::Cache=$APT/cache" -o Dir::State::status=/dev/null)
apt-get "${A[@]}" update -qq
# shellcheck disable=SC2086
(cd "$DIR/debs" && apt-get "${A[@]}" download $PACKAGES 2>&1 | grep -v "unsandboxed" || true)
for name in $PACKAGES; do
    ls "$DIR/debs/${name%%=*}_"*.deb > /dev/null || { echo "glibc231_sysroot: ${name} was not downloaded" >&2; exit 1; }
done
for deb in "$DIR"/debs/*.deb; do dpkg-deb -x "$deb" "$ROOT"; done

# Absolute symlinks (libpthread.so -> /lib/...) would point into the build machine's own glibc: make them relative.
find "$ROOT" -type l -lname '/*' | while read -r link; do
    ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$ROOT$(readlink "$link")")" "$link"
done
# libgomp alone in one folder: linked against by -fopenmp, and the copy auditwheel grafts (LD_LIBRARY_PATH points
# there during `auditwheel repair`, so the host's newer libgomp is not the one bundled).
mkdir -p "$ROOT/usr/lib/kb"
cp "$ROOT/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0" "$ROOT/usr/lib/kb/libgomp.so.1"
ln -sfn libgomp.so.1 "$ROOT/usr/lib/kb/libgomp.so"

wrapper() {  # wrapper NAME COMPILER: a host compiler that builds against the sysroot
    cat > "$DIR/bin/$1" <<EOF
#!/bin/sh
# $2 compiling and linking against Debian 11's glibc 2.31 and libstdc++ 10 (made by tools/glibc231_sysroot.sh)
exec $2 --sysroot=$ROOT -nostdinc++ -isystem $ROOT/usr/include/c++/10 \\
  -isystem $ROOT/usr/include/x86_64-linux-gnu/c++/10 -isystem $ROOT/usr/include/c++/10/backward "\$@" \\
  -L$ROOT/usr/lib/kb -L$ROOT/usr/lib/gcc/x86_64-linux-gnu/10 -L$ROOT/usr/lib/x86_64-linux-gnu \\
  -L$ROOT/lib/x86_64-linux-gnu -pthread
EOF
    chmod +x "$DIR/bin/$1"
}
wrapper g++ "$(command -v g++-12 || command -v g++)"
if command -v g++-11 > /dev/null; then wrapper g++-11 "$(command -v g++-11)"; fi
echo "Debian 11 sysroot: $(echo $PACKAGES | tr ' ' '\n' | grep -E '^(libc6|libstdc\+\+6|libgomp1)=' | tr '\n' ' ' \
    | sed 's/ $//')" > "$DIR/TOOLCHAIN"
echo "glibc231_sysroot: $DIR ready (bin/: $(ls "$DIR/bin" | tr '\n' ' '))"
