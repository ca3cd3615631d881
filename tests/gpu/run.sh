#!/usr/bin/env bash
# tests/gpu/run.sh - the whole GPU check in one call, from any directory:
# take the programs from build-gpu-pack/ (tests/gpu/pack.sh builds it on a
# machine with every build dependency; carry it along) when they load here,
# else build them (CMake when it can configure the project, otherwise nvcc +
# cc directly, so a machine without CMake, Check or ZeroMQ still works); run
# gpu_check (CUDA twins against the CPU reference), the nccl backend with one
# rank and a whole scaped on it with a host and a CUDA IPC trainer (run_nccl),
# the Python binding's CUDA path with torch (run_torch_scape), gpu_bench (GB/s
# against a device copy) and, when PyTorch with CUDA is importable, the
# torch.topk timing, then the CPU service benchmark (the daemon's overhead,
# on this machine's many cores); print a short summary table last.
#
#   tests/gpu/run.sh [--quick]     --quick: sizes up to 2^20+7 / 1e7 only
#
# NCCL comes from NCCL_HOME, the CUDA toolkit, /usr, or the pip wheel
# (nvidia/nccl in python3's site-packages), in that order.
#
# Exit 0 when gpu_check passes or when there is nothing to run on (no GPU or
# no nvcc: "SKIP: <reason>"); 1 when a check fails or a step breaks.
set -u -o pipefail

cd "$(dirname "$0")/../.." || exit 1
BUILD=build-gpu
LOGS=$BUILD/logs
CHECK_ARGS=()
BENCH_ARGS=(--sizes "1e6,1e7,1e8")
TORCH_SIZES=(1e6 1e7 1e8)
if [ "${1:-}" = "--quick" ]; then
    CHECK_ARGS=(--max-n 1048583)
    BENCH_ARGS=(--sizes "1e6,1e7")
    TORCH_SIZES=(1e6 1e7)
fi

skip() {
    echo "SKIP: $*"
    exit 0
}

die() {
    echo "run.sh: $*" >&2
    exit 1
}

find_tools() {
    command -v nvidia-smi >/dev/null 2>&1 || skip "nvidia-smi not found (no NVIDIA driver)"
    nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || skip "nvidia-smi lists no GPU"
    NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    [ -x "$NVCC" ] || skip "nvcc not found (set NVCC or put it on PATH)"
    CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
    CC=${CC:-$(command -v cc || command -v gcc || true)}
}

# NCCL_INC and NCCL_LIB (directories), and the library on LD_LIBRARY_PATH.
find_nccl() {
    NCCL_INC="" NCCL_LIB=""
    local py dir
    py=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
    for dir in "${NCCL_HOME:-}" "$CUDA_HOME" /usr "$py"; do
        [ -n "$dir" ] || continue
        for lib in "$dir/lib" "$dir/lib64" "$dir/lib/x86_64-linux-gnu"; do
            if [ -e "$lib/libnccl.so.2" ] && [ -z "$NCCL_LIB" ]; then
                NCCL_LIB=$lib
                [ -e "$dir/include/nccl.h" ] && NCCL_INC=$dir/include
            fi
        done
    done
    [ -n "$NCCL_LIB" ] && export LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "run.sh: NCCL library: ${NCCL_LIB:-not found}, header: ${NCCL_INC:-not found}"
}

# The programs pack.sh built elsewhere, if they load on this machine.
use_pack() {
    local pack=build-gpu-pack
    [ -x "$pack/bin/gpu_check" ] || return 1
    export LD_LIBRARY_PATH="$PWD/$pack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local b missing=""
    for b in "$pack"/bin/*; do
        missing+=$(LD_TRACE_LOADED_OBJECTS=1 "$b" 2>&1 | grep "not found" | sed "s|^|$b: |")
    done
    echo "$missing" >"$LOGS/pack.txt"
    if [ -n "$missing" ] || ! "$pack/bin/scaped" --help >/dev/null 2>>"$LOGS/pack.txt"; then
        echo "run.sh: the carried programs do not load here, building instead:"
        head -n 3 "$LOGS/pack.txt"
        return 1
    fi
    BIN=$pack/bin
    TI=$pack/bin
    DAEMON=$pack/bin/scaped
    LIBSCAPE=$pack/lib/libscape.so
    SERVICE_FROM=(--bin "$pack/bin")
    HOW="carried (tests/gpu/pack.sh)"
}

build_cmake() {
    command -v cmake >/dev/null 2>&1 || return 1
    local nccl=()
    [ -n "$NCCL_LIB" ] && nccl=(-DNCCL_LIBRARY="$NCCL_LIB/libnccl.so.2")
    [ -n "$NCCL_INC" ] && nccl+=(-DNCCL_INCLUDE_DIR="$NCCL_INC")
    if ! cmake -S . -B "$BUILD" -DSCAPE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_COMPILER="$NVCC" "${nccl[@]}" >"$LOGS/cmake.txt" 2>&1 ||
        ! cmake --build "$BUILD" -j "$(nproc)" --target gpu_check gpu_bench \
            >>"$LOGS/cmake.txt" 2>&1; then
        echo "run.sh: CMake build failed, falling back to nvcc + cc (see $LOGS/cmake.txt)"
        tail -n 5 "$LOGS/cmake.txt"
        return 1
    fi
    # The rest is best-effort: each missing piece is reported by run_nccl.
    cmake --build "$BUILD" -j "$(nproc)" --target gpu_nccl scaped trainer_c reference \
        gpu_trainer scape scapectl >>"$LOGS/cmake.txt" 2>&1 ||
        echo "run.sh: some nccl/daemon programs did not build"
    BIN=$BUILD/tests/gpu
    TI=$BUILD/tests/integration
    [ -x "$BUILD/daemon/scaped" ] && DAEMON=$BUILD/daemon/scaped
    [ -e "$BUILD/client/libscape.so" ] && LIBSCAPE=$BUILD/client/libscape.so
    [ -x "$BUILD/client/scapectl" ] && SERVICE_FROM=("$BUILD")
    HOW="cmake (Release)"
}

# Compile one C file into $OBJ; echo the object's path.
cc_one() {
    local obj
    obj="$OBJ/$(basename "${1%.c}").o"
    "$CC" -std=c11 -O2 -Wall -Wextra -ffp-contract=off -DSCAPE_HAVE_CUDA=1 \
        -Ikernels -Itests/gpu -I"$CUDA_HOME/include" "${@:2}" -c "$1" -o "$obj" || return 1
    echo "$obj"
}

build_direct() {
    [ -n "$CC" ] || die "no C compiler (cc or gcc) for the direct build"
    OBJ=$BUILD/direct
    mkdir -p "$OBJ"
    local lib=() check=() bench=() src
    for src in kernels/error.c kernels/cpu_*.c tests/gpu/gpu_common.c; do
        lib+=("$(cc_one "$src")") || die "compiling $src failed"
    done
    for src in tests/gpu/gpu_check.c tests/gpu/gpu_args.c; do
        check+=("$(cc_one "$src")") || die "compiling $src failed"
    done
    bench+=("$(cc_one tests/gpu/gpu_bench.c)") || die "compiling gpu_bench.c failed"
    "$NVCC" -std=c++17 -O3 --fmad=false -Xcompiler=-Wall -Ikernels \
        -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
        -c kernels/cuda_kernels.cu -o "$OBJ/cuda_kernels.o" || die "nvcc failed"
    lib+=("$OBJ/cuda_kernels.o")
    "$NVCC" -o "$OBJ/gpu_check" "${check[@]}" "${lib[@]}" -lm || die "linking gpu_check failed"
    "$NVCC" -o "$OBJ/gpu_bench" "${bench[@]}" "${lib[@]}" -lm || die "linking gpu_bench failed"
    BIN=$OBJ
    HOW="direct (nvcc + $(basename "$CC"))"
    # gpu_nccl: the engine and the local and nccl backends (no ZeroMQ needed);
    # skipped, and reported, without NCCL.
    [ -n "$NCCL_LIB" ] && [ -n "$NCCL_INC" ] || return 0
    local eng=() ok=1
    for src in daemon/engine.c daemon/engine_step.c daemon/engine_inspect.c \
               daemon/engine_ckpt.c daemon/plan.c daemon/comm.c daemon/comm_local.c \
               daemon/comm_nccl.c tests/gpu/gpu_nccl.c; do
        eng+=("$(cc_one "$src" -Idaemon -I"$NCCL_INC")") || ok=0
    done
    [ "$ok" = 1 ] && "$NVCC" -o "$OBJ/gpu_nccl" "${eng[@]}" "${lib[@]}" -L"$NCCL_LIB" \
        -Xlinker -rpath -Xlinker "$NCCL_LIB" -l:libnccl.so.2 -lpthread -lm ||
        echo "run.sh: gpu_nccl did not build"
}

run_check() {
    "$BIN/gpu_check" ${CHECK_ARGS[@]+"${CHECK_ARGS[@]}"} | tee "$LOGS/gpu_check.txt"
    CHECK_RC=$?
    # gpu_check has printed "SKIP: <reason>" (e.g. the driver is too old)
    [ "$CHECK_RC" -eq 77 ] && exit 0
}

run_bench() {
    "$BIN/gpu_bench" "${BENCH_ARGS[@]}" | tee "$LOGS/gpu_bench.txt"
    BENCH_RC=$?
    echo "# torch not run" >"$LOGS/torch.txt"
    if command -v python3 >/dev/null 2>&1; then
        python3 tests/gpu/torch_topk.py "${TORCH_SIZES[@]}" | tee "$LOGS/torch.txt"
    fi
}

# The nccl backend with one rank: its collectives and the engine on it
# (gpu_nccl), then a whole scaped on it with two trainer processes, one with
# host shared memory (trainer_c) and one with CUDA IPC buffers (gpu_trainer),
# whose parameters must equal the in-process reference's bit for bit.
run_nccl() {
    NCCL_STATUS="not run" NCCL_RC=0
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
    if [ -x "$BIN/gpu_nccl" ]; then
        timeout 240 "$BIN/gpu_nccl" | tee "$LOGS/gpu_nccl.txt"
        NCCL_RC=${PIPESTATUS[0]}
        [ "$NCCL_RC" -eq 77 ] && { NCCL_RC=0; NCCL_STATUS="skipped"; return; }
        NCCL_STATUS=$(tail -n 1 "$LOGS/gpu_nccl.txt")
        [ "$NCCL_RC" -eq 124 ] && NCCL_STATUS="gpu_nccl: timed out after 240 s"
    else
        NCCL_STATUS="gpu_nccl: not built (no NCCL?)"
    fi
    if [ -z "${DAEMON:-}" ] || [ ! -x "$BIN/gpu_trainer" ]; then
        NCCL_STATUS="$NCCL_STATUS; daemon: not built here (carry build-gpu-pack)"
        return
    fi
    local rt ti=${TI:-$BUILD/tests/integration}
    rt=$(mktemp -d /tmp/scape-gpu.XXXXXX)
    timeout 200 "$DAEMON" --runtime-dir "$rt/rt" --comm-backend nccl --trainers 2 --rho 0.01 \
        --warmup 3 --comm-timeout-ms 60000 >"$LOGS/scaped_nccl.txt" 2>&1 &
    local dpid=$!
    for _ in $(seq 150); do
        [ -S "$rt/rt/control" ] && break
        kill -0 "$dpid" 2>/dev/null || break
        sleep 0.1
    done
    local ok=1 tp=()
    if ! kill -0 "$dpid" 2>/dev/null; then
        ok=0
        tail -n 5 "$LOGS/scaped_nccl.txt"
    else
        timeout 180 "$ti/trainer_c" --endpoint "ipc://$rt/rt/control" --index 0 --n 1000000 \
            --steps 100 --out "$rt/t0" >"$LOGS/trainer_0.txt" 2>&1 &
        tp+=($!)
        timeout 180 "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 1 \
            --n 1000000 --steps 100 --out "$rt/t1" >"$LOGS/trainer_1.txt" 2>&1 &
        tp+=($!)
        for p in "${tp[@]}"; do wait "$p" || ok=0; done
    fi
    kill "$dpid" 2>/dev/null; wait "$dpid"
    timeout 120 "$ti/reference" --trainers 2 --n 1000000 --steps 100 --rho 0.01 --warmup 3 \
        --out "$rt/ref" >"$LOGS/reference.txt" 2>&1 || ok=0
    if [ "$ok" = 1 ] && cmp -s "$rt/t0" "$rt/ref" && cmp -s "$rt/t1" "$rt/ref"; then
        NCCL_STATUS="$NCCL_STATUS; scaped on nccl, a host and a CUDA IPC trainer, 100 steps == reference: ok"
    else
        NCCL_STATUS="$NCCL_STATUS; scaped on nccl vs reference: FAIL (see $LOGS)"
        NCCL_RC=1
    fi
    rm -rf "$rt"
}

# The Python binding's CUDA path: torch tensors over CUDA IPC buffers, and a
# CUDA and a CPU ScapeOptimizer agreeing bitwise (tests/gpu/torch_scape.py).
run_torch_scape() {
    TORCH_STATUS="not run" TORCH_RC=0
    if [ -z "${DAEMON:-}" ] || [ -z "${LIBSCAPE:-}" ]; then
        TORCH_STATUS="not run: scaped or libscape not built here (carry build-gpu-pack)"
        return
    fi
    command -v python3 >/dev/null 2>&1 || { TORCH_STATUS="not run: no python3"; return; }
    timeout 300 python3 tests/gpu/torch_scape.py --daemon "$DAEMON" --lib "$LIBSCAPE" \
        --log "$LOGS/scaped_torch.txt" | tee "$LOGS/torch_scape.txt"
    TORCH_RC=${PIPESTATUS[0]}
    TORCH_STATUS=$(tail -n 1 "$LOGS/torch_scape.txt")
    case "$TORCH_RC" in
    0) ;;
    77) TORCH_RC=0 ;;
    124) TORCH_STATUS="torch_scape: timed out after 300 s"; TORCH_RC=1 ;;
    *) TORCH_RC=1 ;;
    esac
}

# Issue 3's service benchmark on this machine's CPUs (many more than the
# 2-vCPU development machine): the daemon's overhead against the in-process
# engine, handover bytes, memory (tests/bench/bench_service.py).
run_service_bench() {
    SERVICE_STATUS="not run"
    if [ -z "${SERVICE_FROM+x}" ] || [ -z "${DAEMON:-}" ]; then
        SERVICE_STATUS="not run: the daemon programs are not built here"
        return
    fi
    command -v python3 >/dev/null 2>&1 || { SERVICE_STATUS="not run: no python3"; return; }
    if timeout 300 python3 tests/bench/bench_service.py "${SERVICE_FROM[@]}" --quick \
        --markdown "$LOGS/service.md" >"$LOGS/service.txt" 2>&1; then
        local dflt nodefer
        dflt=$(grep -m1 "^| step, through scaped (last poster" "$LOGS/service.md" | awk -F'|' '{print $5}')
        nodefer=$(grep -m1 "^| step, through scaped with defer_select false" "$LOGS/service.md" |
            awk -F'|' '{print $5}')
        SERVICE_STATUS="through scaped vs in-process:${dflt}; defer_select false:${nodefer} (table: $LOGS/service.md)"
    else
        SERVICE_STATUS="bench_service failed or timed out (see $LOGS/service.txt)"
    fi
}

print_summary() {
    local gpu status
    gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)
    status=$(grep -E '^gpu_check: (PASS|FAIL)' "$LOGS/gpu_check.txt" | tail -n 1)
    echo
    echo "==================== scaped GPU check summary ===================="
    echo "date      : $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "host      : $(uname -n)"
    echo "gpu       : $gpu (nvcc $("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
    echo "build     : $HOW"
    echo "check     : ${status:-gpu_check exited with status $CHECK_RC}"
    echo "nccl      : ${NCCL_STATUS:-not run}"
    echo "python    : ${TORCH_STATUS:-not run}"
    echo "service   : ${SERVICE_STATUS:-not run}"
    awk '$1 != "BENCH" { next }
         !($2 in seen) { seen[$2] = 1; order[++nops] = $2 }
         { gbs[$3, $2] = $5; pct[$3, $2] = $6; if ($3 > max) max = $3 }
         END {
             if (!max) { print "bench     : no results"; exit }
             printf "bench     : n = %d, GB/s and %% of a device-to-device copy\n", max
             printf "    %-16s %9s %7s\n", "op", "GB/s", "%copy"
             for (i = 1; i <= nops; i++)
                 if (order[i] !~ /^topk/ && (max, order[i]) in gbs)
                     printf "    %-16s %9.1f %7.1f\n", order[i], gbs[max, order[i]],
                            pct[max, order[i]]
         }' "$LOGS/gpu_bench.txt"
    echo "top-k     : k = 1% of n; torch.topk on the same GPU, same timing rules"
    awk 'FNR == NR { if ($1 == "TORCH") t[$2, $3] = $4; next }
         FNR == 1 { printf "    %10s %10s %14s %8s %12s %8s\n", "n", "scaped ms",
                           "torch unsorted", "speedup", "torch sorted", "speedup" }
         $1 == "BENCH" && $2 ~ /^topk/ {
             u = t["topk_unsorted", $3]; s = t["topk_sorted", $3]
             printf "    %10d %10.4f %14s %8s %12s %8s\n", $3, $4,
                    u == "" ? "-" : u, u == "" ? "-" : sprintf("%.2fx", u / $4),
                    s == "" ? "-" : s, s == "" ? "-" : sprintf("%.2fx", s / $4)
         }' "$LOGS/torch.txt" "$LOGS/gpu_bench.txt"
    [ "$BENCH_RC" -eq 0 ] || echo "bench     : gpu_bench exited with status $BENCH_RC"
}

find_tools
mkdir -p "$LOGS"
find_nccl
use_pack || build_cmake || build_direct
run_check
run_nccl
run_torch_scape
run_bench
run_service_bench
print_summary
[ "$CHECK_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$NCCL_RC" -eq 0 ] && [ "$TORCH_RC" -eq 0 ]
