#!/bin/sh
# pack.sh: put what the GPU machine lacks into .carry/ (git-ignored) so that
# the device tool can carry it: the mnemo binary, the unit-test binaries,
# libmnemo_torch.so (the PyTorch bridge, when `make python` built it), and
# the shared libraries it links that are not part of the base system
# (Lua, HDF5, OpenBLAS, readline, ...), compressed to stay under the 64 MiB
# carry limit. The CUDA libraries are not packed: the GPU machine has the
# toolkit's own in /usr/local/cuda/lib64. Run after `make` (CUDA=1).
# Usage: sh tests/gpu/pack.sh [BIN] [BUILD]     (defaults: ./mnemo build)
set -e
cd "$(dirname "$0")/../.."
bin=${1:-mnemo}
build=${2:-build}
[ -x "$bin" ] || { echo "pack.sh: no binary at $bin (run make first)" >&2; exit 2; }
rm -rf .carry && mkdir -p .carry/bin .carry/lib
cp "$bin" .carry/bin/mnemo
for t in "$build"/tests/test_*; do [ -x "$t" ] && [ ! -d "$t" ] && cp "$t" .carry/bin/; done
# the PyTorch bridge's native library (make python), when built
torch_lib=
if [ -f "$build/libmnemo_torch.so" ]; then torch_lib=$build/libmnemo_torch.so; cp "$torch_lib" .carry/bin/; fi
# symbols off the copies: the carry has a size limit (64 MiB), the binaries
# are most of it, and nothing on the GPU machine reads their symbols
if command -v strip >/dev/null 2>&1; then
    for f in .carry/bin/*; do strip "$f" 2>/dev/null || true; done
fi
for lib in $(ldd "$bin" "$build"/tests/test_* $torch_lib 2>/dev/null | awk '$3 ~ /^\// {print $3}' | sort -u); do
    case "$(basename "$lib")" in
        libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libgcc_s.so*|libresolv.so*|libstdc++.so*) continue ;;
        libcuda*|libcublas*|libnvrtc*) continue ;;
    esac
    cp -L "$lib" .carry/lib/
done
tar -C .carry -cJf .carry/lib.tar.xz lib && rm -rf .carry/lib
du -sh .carry
