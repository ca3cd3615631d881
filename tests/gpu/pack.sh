#!/usr/bin/env bash
# tests/gpu/pack.sh - build everything tests/gpu/run.sh runs, here (where the
# build dependencies are), and pack it with the shared libraries a CUDA-only
# machine lacks (ZeroMQ, protobuf-c, libyaml and theirs, the CUDA runtime;
# NCCL and the driver are the GPU machine's own) into build-gpu-pack/.
# Carry that folder to the GPU machine; run.sh uses it when it loads there.
#
#   tests/gpu/pack.sh         then, on the GPU machine: tests/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=build-gpu
PACK=build-gpu-pack
cmake -S . -B "$BUILD" -DSCAPE_CUDA=ON -DCMAKE_BUILD_TYPE=Release >"$BUILD.configure.log" 2>&1 ||
  { tail -n 20 "$BUILD.configure.log"; exit 1; }
targets=(gpu_check gpu_bench gpu_nccl gpu_exec gpu_step scaped scapectl trainer_c reference
         gpu_trainer scape)
cmake --build "$BUILD" -j"$(nproc)" --target "${targets[@]}" >"$BUILD.build.log" 2>&1 ||
  { tail -n 20 "$BUILD.build.log"; exit 1; }
rm -rf "$PACK"
mkdir -p "$PACK/bin" "$PACK/lib"
bins=("$BUILD"/tests/gpu/{gpu_check,gpu_bench,gpu_nccl,gpu_exec,gpu_step,gpu_trainer}
      "$BUILD"/daemon/scaped
      "$BUILD"/client/scapectl "$BUILD"/tests/integration/{trainer_c,reference})
cp "${bins[@]}" "$PACK/bin/"
cp -P "$BUILD"/client/libscape.so* "$PACK/lib/"
# The libraries they load, less the C runtime and what the GPU machine must
# bring itself (its driver's libcuda, its NCCL).
keep() {
  case "$(basename "$1")" in
  libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libresolv.so*|ld-linux*) return 1 ;;
  libgcc_s.so*|libstdc++.so*) return 1 ;;
  libcuda.so*|libnccl.so*|libscape.so*) return 1 ;;
  esac
}
for b in "${bins[@]}"; do
  ldd "$b" | awk '/=> \// { print $3 }' | while read -r lib; do
    if keep "$lib"; then cp -L -n "$lib" "$PACK/lib/"; fi
  done
done
# which sources these are: run.sh calls a pack of other sources stale
bash tests/gpu/run.sh --stamp >"$PACK/STAMP"
echo "pack: $(ls "$PACK/bin" | wc -l) programs, $(ls "$PACK/lib" | wc -l) libraries," \
     "$(du -sh "$PACK" | cut -f1) in $PACK"
