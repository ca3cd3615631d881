#!/usr/bin/env bash
# tests/gpu/run.sh - the whole GPU check in one call, from any directory:
# take the programs from build-gpu-pack/ (tests/gpu/pack.sh builds it on a
# machine with every build dependency; carry it along) when they load here,
# else build them (CMake when it can configure the project, otherwise nvcc +
# cc directly, so a machine without CMake, Check or ZeroMQ still works); run
# gpu_check (the segmented CUDA kernels against their CPU versions), gpu_exec (the cuda
# executor against the host executor, bitwise), the nccl backend with one
# rank and a whole scaped on it with a host and a CUDA IPC trainer (run_nccl),
# CUDA IPC trainers handing over in place, by events, and one killed mid-job
# (run_handover),
# the Python binding's CUDA path with torch (run_torch_scape), gpu_bench (GB/s
# against a device copy) and, when PyTorch with CUDA is importable, the
# torch.topk timing; with --service also the CPU service benchmark (the
# daemon's overhead, on this machine's many cores).  Each step prints a
# "== step: result" line as it ends; a summary table comes last.
#
#   tests/gpu/run.sh [--quick] [--service] [--allow-partial] [--emu BUILD]
#     --quick          sizes up to 2^20+7 / 1e7 only
#     --service        also run tests/bench/bench_service.py (CPU only)
#     --allow-partial  exit 0 even when a step could not run here
#     --emu BUILD      no GPU: the same checks (check, exec, nccl, handover) on
#                      the CPU CUDA emulator's programs of the CMake build
#                      BUILD (tests/gpu/emu), at sizes it runs in minutes; the
#                      benchmarks and torch are not run.  ctest runs it, so
#                      that this script is tested before a GPU runs it.
#
# Time: every step has its own timeout, cut to what is left of a budget of
# SCAPE_GPU_BUDGET seconds (default 480: one device call, with room for the
# machine's start); a step that no longer fits is reported as not run.
# Output: besides stdout, when $OUT is set (the device tool's result folder)
# each step's result line goes to $OUT/progress.txt as the step ends, and at
# the end (on SIGTERM too, once the running step has ended) the summary to
# $OUT/summary.txt and every log to $OUT/gpu-logs.tgz.
#
# NCCL comes from NCCL_HOME, the CUDA toolkit, /usr, or the pip wheel
# (nvidia/nccl in python3's site-packages), in that order.
#
# Exit 0 when every step ran and passed, or when there is nothing to run on
# (no GPU or no nvcc: "SKIP: <reason>"); 1 when a check fails or a step
# breaks (a benchmark that fails included); 3 when nothing failed but some
# step could not run here (a stale or unusable pack, no NCCL, no torch, out of
# time), unless --allow-partial.
set -u -o pipefail

cd "$(dirname "$0")/../.." || exit 1
BUILD=build-gpu
CHECK_ARGS=()
EXEC_ARGS=()
BENCH_ARGS=(--sizes "1e6,1e7,1e8")
STEP_ARGS=(--sizes "1e8,1e9")
HANDOVER_SIZES=(100000000 1000000000)
TORCH_SIZES=(1e6 1e7 1e8)
NCCL_N=1000000 NCCL_STEPS=100 KILL_N=1000000
SERVICE=0 PARTIAL_OK=0 STAMP_ONLY=0 EMU=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    arg=${args[$i]}
    case "$arg" in
    --emu)
        i=$((i + 1))
        EMU=${args[$i]:-}
        [ -d "$EMU/tests/gpu/emu" ] || { echo "run.sh: --emu needs a CMake build directory with tests/gpu/emu" >&2; exit 2; }
        EMU=$(cd "$EMU" && pwd) ;;
    --quick)
        CHECK_ARGS=(--max-n 1048583)
        EXEC_ARGS=(--quick)
        STEP_ARGS=(--sizes 1e8)
        HANDOVER_SIZES=(100000000)
        BENCH_ARGS=(--sizes "1e6,1e7")
        TORCH_SIZES=(1e6 1e7) ;;
    --service) SERVICE=1 ;;
    --allow-partial) PARTIAL_OK=1 ;;
    --stamp) STAMP_ONLY=1 ;; # print the sources' stamp (pack.sh records it) and exit
    *) echo "usage: tests/gpu/run.sh [--quick] [--service] [--allow-partial] [--emu BUILD]" >&2; exit 2 ;;
    esac
done
if [ -n "$EMU" ]; then
    # The emulator runs a kernel's threads one after another: sizes it runs
    # in minutes, and its device memory where the trainers' handles can be
    # opened by the daemon (EMU_IPC), several buffers of one program at
    # offsets of one 64 MiB segment, so that an offset that is lost shows.
    BUILD=$EMU/tests/gpu/emu/run
    CHECK_ARGS=(--max-n 65537)
    EXEC_ARGS=(--quick --steps 20)
    HANDOVER_SIZES=(100000 3000000)
    NCCL_N=100000 NCCL_STEPS=60 KILL_N=100000
    export EMU_IPC=1 EMU_IPC_SEGMENT_MIB=${EMU_IPC_SEGMENT_MIB:-64}
fi
BUDGET=${SCAPE_GPU_BUDGET:-480}
LOGS=$BUILD/logs
T0=$SECONDS
NOT_RUN=()
CHECK_RC=0 EXEC_RC=0 BENCH_RC=0 NCCL_RC=0 TORCH_RC=0 OTHER_RC=0
DPID=

# Seconds a step may take: its own cap, cut to the budget left (less a
# margin for the summary); 0 when too little is left to start it.
tmo() {
    local left=$((BUDGET - (SECONDS - T0) - 15))
    if [ "$left" -lt 20 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

# One line per finished step, as it finishes (a kill loses nothing before it).
progress() {
    echo "== $*" | tee -a "$LOGS/progress.txt"
    if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then echo "== $*" >>"$OUT/progress.txt"; fi
}

# A step that could not run here: reported, and exit 3 unless --allow-partial.
not_run() {
    NOT_RUN+=("$1")
}

# The sources the programs come from: a pack built from other sources is stale.
source_stamp() {
    find daemon client kernels proto tests/gpu tests/integration -type f \
        \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.proto' \
           -o -name '*.py' \) \
        -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
}

# On any exit (a kill by the device tool's limit included): the summary and
# the logs into $OUT, which is what comes back from the device machine.
save_out() {
    [ -n "$DPID" ] && kill "$DPID" 2>/dev/null
    [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] || return 0
    [ -f "$LOGS/summary.txt" ] || cp "$LOGS/progress.txt" "$OUT/summary.txt" 2>/dev/null
    [ -f "$LOGS/summary.txt" ] && cp "$LOGS/summary.txt" "$OUT/summary.txt"
    tar czf "$OUT/gpu-logs.tgz" -C "$BUILD" logs 2>/dev/null
}

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
    local want have
    want=$(cat "$pack/STAMP" 2>/dev/null || echo none)
    have=$(source_stamp)
    BIN=$pack/bin
    TI=$pack/bin
    DAEMON=$pack/bin/scaped
    SCAPECTL=$pack/bin/scapectl
    LIBSCAPE=$pack/lib/libscape.so
    SERVICE_FROM=(--bin "$pack/bin")
    HOW="carried (tests/gpu/pack.sh, sources $want)"
    if [ "$want" != "$have" ]; then
        HOW="$HOW: STALE, the sources here are $have (rerun tests/gpu/pack.sh)"
        not_run "a pack of the current sources"
    fi
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
    cmake --build "$BUILD" -j "$(nproc)" --target gpu_nccl gpu_exec gpu_step scaped trainer_c \
        reference \
        gpu_trainer scape scapectl >>"$LOGS/cmake.txt" 2>&1 ||
        echo "run.sh: some nccl/daemon programs did not build"
    BIN=$BUILD/tests/gpu
    TI=$BUILD/tests/integration
    [ -x "$BUILD/daemon/scaped" ] && DAEMON=$BUILD/daemon/scaped
    [ -e "$BUILD/client/libscape.so" ] && LIBSCAPE=$BUILD/client/libscape.so
    [ -x "$BUILD/client/scapectl" ] && SERVICE_FROM=("$BUILD") SCAPECTL=$BUILD/client/scapectl
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
    for src in cuda_seg cuda_comm; do
        "$NVCC" -std=c++17 -O3 --fmad=false -Xcompiler=-Wall -Xcompiler=-ffp-contract=off \
            -Ikernels -gencode arch=compute_90,code=sm_90 \
            -gencode arch=compute_90,code=compute_90 \
            -c "kernels/$src.cu" -o "$OBJ/$src.o" || die "nvcc failed on $src.cu"
        lib+=("$OBJ/$src.o")
    done
    "$NVCC" -o "$OBJ/gpu_check" "${check[@]}" "${lib[@]}" -lm || die "linking gpu_check failed"
    "$NVCC" -o "$OBJ/gpu_bench" "${bench[@]}" "${lib[@]}" -lm || die "linking gpu_bench failed"
    BIN=$OBJ
    HOW="direct (nvcc + $(basename "$CC"))"
    # gpu_nccl and gpu_exec: the engine, its executors and the local and nccl
    # backends (no ZeroMQ needed); skipped, and reported, without NCCL.
    [ -n "$NCCL_LIB" ] && [ -n "$NCCL_INC" ] || return 0
    local eng=() ok=1 prog
    for src in daemon/engine.c daemon/engine_step.c daemon/engine_inspect.c \
               daemon/engine_ckpt.c daemon/engine_gnorm.c daemon/enums.c \
               daemon/plan.c daemon/pool.c daemon/maskcode.c \
               daemon/exec.c daemon/exec_host.c daemon/exec_dev.c daemon/dev_sim.c \
               daemon/dev_cuda.c daemon/comm.c daemon/comm_local.c daemon/comm_nccl.c; do
        eng+=("$(cc_one "$src" -Idaemon -I"$NCCL_INC")") || ok=0
    done
    for prog in gpu_nccl gpu_exec gpu_step; do
        [ "$ok" = 1 ] && "$NVCC" -o "$OBJ/$prog" \
            "$(cc_one "tests/gpu/$prog.c" -Idaemon -Itests/bench -I"$NCCL_INC")" "${eng[@]}" \
            "${lib[@]}" \
            -L"$NCCL_LIB" -Xlinker -rpath -Xlinker "$NCCL_LIB" -l:libnccl.so.2 -lpthread -lm ||
            echo "run.sh: $prog did not build"
    done
}

run_check() {
    local t
    t=$(tmo 240)
    if [ "$t" = 0 ]; then
        not_run gpu_check; progress "check: not run (out of time)"; CHECK_RC=0; return
    fi
    timeout "$t" "$BIN/gpu_check" ${CHECK_ARGS[@]+"${CHECK_ARGS[@]}"} | tee "$LOGS/gpu_check.txt"
    CHECK_RC=${PIPESTATUS[0]}
    case "$CHECK_RC" in
    77) not_run "gpu_check ($(grep -m1 '^SKIP' "$LOGS/gpu_check.txt"))"; CHECK_RC=0 ;;
    124) echo "gpu_check: FAIL: timed out after $t s" >>"$LOGS/gpu_check.txt" ;;
    esac
    progress "check: $(grep -E '^gpu_check: (PASS|FAIL)|^SKIP' "$LOGS/gpu_check.txt" | tail -n 1)" \
        "(exit $CHECK_RC)"
}

run_bench() {
    local t
    t=$(tmo 150)
    echo "# torch not run" >"$LOGS/torch.txt"
    : >"$LOGS/gpu_bench.txt"
    if [ "$t" = 0 ]; then
        not_run gpu_bench; progress "bench: not run (out of time)"; return
    fi
    timeout "$t" "$BIN/gpu_bench" "${BENCH_ARGS[@]}" | tee "$LOGS/gpu_bench.txt"
    BENCH_RC=${PIPESTATUS[0]}
    progress "bench: gpu_bench exit $BENCH_RC"
    [ "$BENCH_RC" -eq 77 ] && { not_run gpu_bench; BENCH_RC=0; }
    t=$(tmo 150)
    : >"$LOGS/gpu_step.txt"
    if [ "$t" != 0 ] && [ -x "$BIN/gpu_step" ]; then
        timeout "$t" "$BIN/gpu_step" "${STEP_ARGS[@]}" | tee "$LOGS/gpu_step.txt"
        local src=${PIPESTATUS[0]}
        progress "step bench: gpu_step exit $src"
        case "$src" in 0) ;; 77) not_run "gpu_step" ;; *) OTHER_RC=1 ;; esac
    else
        not_run "gpu_step (not built, or out of time)"
    fi
    t=$(tmo 120)
    if [ "$t" != 0 ] && command -v python3 >/dev/null 2>&1; then
        timeout "$t" python3 tests/gpu/torch_topk.py "${TORCH_SIZES[@]}" | tee "$LOGS/torch.txt"
        local rc=${PIPESTATUS[0]}
        progress "torch.topk: exit $rc"
        case "$rc" in 0) ;; 77) not_run "torch.topk timing" ;; *) OTHER_RC=1 ;; esac
    fi
}

# The cuda executor against the host executor, bitwise, over every optimizer,
# mode, dtype and trainer count, checkpoints across executors, and gradients
# handed over in buckets (gpu_exec).
run_exec() {
    EXEC_STATUS="not run" EXEC_RC=0
    local t
    t=$(tmo 240)
    if [ ! -x "$BIN/gpu_exec" ]; then
        EXEC_STATUS="gpu_exec: not built (no NCCL?)"
        not_run gpu_exec
    elif [ "$t" = 0 ]; then
        EXEC_STATUS="gpu_exec: not run (out of time)"
        not_run gpu_exec
    else
        timeout "$t" "$BIN/gpu_exec" ${EXEC_ARGS[@]+"${EXEC_ARGS[@]}"} | tee "$LOGS/gpu_exec.txt"
        EXEC_RC=${PIPESTATUS[0]}
        EXEC_STATUS=$(grep -E '^gpu_exec: (PASS|FAIL)|^SKIP' "$LOGS/gpu_exec.txt" | tail -n 1)
        case "$EXEC_RC" in
        0) ;;
        77) EXEC_RC=0; not_run "gpu_exec ($EXEC_STATUS)" ;;
        124) EXEC_STATUS="gpu_exec: FAIL: timed out after $t s" ;;
        *) EXEC_STATUS="${EXEC_STATUS:-gpu_exec: FAIL: exit $EXEC_RC}" ;;
        esac
    fi
    progress "exec: $EXEC_STATUS"
}

# Start scaped in the background, its output into log $1, runtime dir $2,
# the rest its options; sets DPID.  Fails when it exits or has no control
# socket after 15 s.
daemon_up() {
    local log=$1 rt=$2
    shift 2
    "$DAEMON" --runtime-dir "$rt" --comm-timeout-ms 60000 "$@" >>"$log" 2>&1 &
    DPID=$!
    for _ in $(seq 150); do
        [ -S "$rt/control" ] && return 0
        kill -0 "$DPID" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# The nccl backend with one rank: its collectives and the engine on it
# (gpu_nccl), then a whole scaped on it with two trainer processes, one with
# host shared memory (trainer_c) and one with CUDA IPC buffers (gpu_trainer),
# whose parameters must equal the in-process reference's bit for bit.
run_nccl() {
    NCCL_STATUS="not run" NCCL_RC=0
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
    local t
    t=$(tmo 180)
    if [ ! -x "$BIN/gpu_nccl" ]; then
        NCCL_STATUS="gpu_nccl: not built (no NCCL?)"
        not_run gpu_nccl
    elif [ "$t" = 0 ]; then
        NCCL_STATUS="gpu_nccl: not run (out of time)"
        not_run gpu_nccl
    else
        timeout "$t" "$BIN/gpu_nccl" | tee "$LOGS/gpu_nccl.txt"
        NCCL_RC=${PIPESTATUS[0]}
        NCCL_STATUS=$(grep -E '^gpu_nccl: (PASS|FAIL)|^SKIP' "$LOGS/gpu_nccl.txt" | tail -n 1)
        case "$NCCL_RC" in
        0) ;;
        77) NCCL_RC=0; not_run "gpu_nccl ($NCCL_STATUS)" ;;
        124) NCCL_STATUS="gpu_nccl: FAIL: timed out after $t s" ;;
        *) NCCL_STATUS="${NCCL_STATUS:-gpu_nccl: FAIL: exit $NCCL_RC}" ;;
        esac
    fi
    progress "nccl: $NCCL_STATUS"
    if [ -z "${DAEMON:-}" ] || [ ! -x "$BIN/gpu_trainer" ]; then
        NCCL_STATUS="$NCCL_STATUS; daemon: not built here (carry build-gpu-pack)"
        not_run "scaped on nccl with a CUDA IPC trainer"
        return
    fi
    t=$(tmo 200)
    if [ "$t" = 0 ]; then
        NCCL_STATUS="$NCCL_STATUS; scaped on nccl: not run (out of time)"
        not_run "scaped on nccl with a CUDA IPC trainer"
        return
    fi
    local rt ti=${TI:-$BUILD/tests/integration}
    rt=$(mktemp -d /tmp/scape-gpu.XXXXXX)
    local ok=1 tp=() why=""
    if ! daemon_up "$LOGS/scaped_nccl.txt" "$rt/rt" --comm-backend nccl --executor cuda \
        --trainers 2 --rho 0.01 --warmup 3; then
        ok=0 why="scaped did not start"
        tail -n 5 "$LOGS/scaped_nccl.txt"
    else
        timeout "$t" "$ti/trainer_c" --endpoint "ipc://$rt/rt/control" --index 0 --n "$NCCL_N" \
            --steps "$NCCL_STEPS" --out "$rt/t0" >"$LOGS/trainer_0.txt" 2>&1 &
        tp+=($!)
        timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 1 \
            --n "$NCCL_N" --steps "$NCCL_STEPS" --stream 1 --out "$rt/t1" >"$LOGS/trainer_1.txt" 2>&1 &
        tp+=($!)
        for p in "${tp[@]}"; do wait "$p" || { ok=0 why="a trainer failed"; }; done
    fi
    kill "$DPID" 2>/dev/null; wait "$DPID"
    DPID=""
    t=$(tmo 120)
    if [ "$t" = 0 ]; then
        ok=0 why="${why:-no time left for the reference}"
    else
        timeout "$t" "$ti/reference" --trainers 2 --n "$NCCL_N" --steps "$NCCL_STEPS" --rho 0.01 \
            --warmup 3 --out "$rt/ref" >"$LOGS/reference.txt" 2>&1 ||
            { ok=0 why="${why:-the reference failed}"; }
    fi
    if [ "$ok" = 1 ] && cmp -s "$rt/t0" "$rt/ref" && cmp -s "$rt/t1" "$rt/ref"; then
        NCCL_STATUS="$NCCL_STATUS; scaped (cuda executor) on nccl, a host and a CUDA IPC trainer (ordered by events on its own stream), $NCCL_STEPS steps == reference: ok"
    else
        NCCL_STATUS="$NCCL_STATUS; scaped on nccl vs reference: FAIL (${why:-parameters differ}; see $LOGS)"
        NCCL_RC=1
    fi
    progress "nccl: $NCCL_STATUS"
    rm -rf "$rt"
}

# Hand-over in place (issue 16): one scaped (cuda executor, host comm) with
# two CUDA IPC trainers, one blocking on the default stream and one ordered
# only by events on its own stream, against the in-process reference bit for
# bit, at N = 1e5 (400 KB buffers, under the 2 MiB the allocator may carve
# one block into) and N = 3e7 (120 MB), and at N = 1e5 again with each
# tensor's gradients posted as a bucket of its own (gpu_trainer --buckets 1:
# the daemon packs them early, each once the trainer's event has completed,
# which its status must show); then a trainer killed right after
# posting a step, its buffers and events open in the daemon, a replacement
# that joins, and the survivor and the replacement equal at the end.
run_handover() {
    HANDOVER_STATUS="" HANDOVER_RC=0
    if [ -z "${DAEMON:-}" ] || [ ! -x "$BIN/gpu_trainer" ]; then
        HANDOVER_STATUS="not run: scaped or gpu_trainer not built here (carry build-gpu-pack)"
        not_run "hand-over in place"
        return
    fi
    local ti=${TI:-$BUILD/tests/integration} rt n steps t ok why
    rt=$(mktemp -d /tmp/scape-hand.XXXXXX)
    local big=30000000
    [ -n "$EMU" ] && big=3000000
    local bk early
    for n in 100000 "$big" 100000:buckets; do
        bk="" early=""
        case $n in *:buckets) n=${n%:buckets} bk=1 ;; esac
        steps=$([ "$n" -gt 1000000 ] && echo 12 || echo 60)
        t=$(tmo 150)
        [ "$t" = 0 ] && { HANDOVER_STATUS="$HANDOVER_STATUS; N=$n: not run (out of time)"; not_run "hand-over at N=$n"; continue; }
        ok=1 why=""
        rm -rf "$rt/rt"
        if ! daemon_up "$LOGS/scaped_handover.txt" "$rt/rt" --executor cuda --trainers 2 --rho 0.01 --warmup 3; then
            ok=0 why="scaped did not start"
        else
            timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 0 \
                --n "$n" --steps "$steps" ${bk:+--buckets 1} --out "$rt/a" \
                >"$LOGS/hand_a_$n$bk.txt" 2>&1 &
            local pa=$!
            timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 1 \
                --n "$n" --steps "$steps" --stream 1 ${bk:+--buckets 1} --out "$rt/b" \
                >"$LOGS/hand_b_$n$bk.txt" 2>&1 || { ok=0 why="trainer 1 failed"; }
            wait "$pa" || { ok=0 why="trainer 0 failed"; }
            if [ -n "$bk" ]; then # the last step's tensors packed before its Steps came
                early=$("${SCAPECTL:-scapectl}" --runtime-dir "$rt/rt" status --json 2>/dev/null |
                        grep -o '"early_tensors":[0-9]*' | head -n 1 | cut -d: -f2) || early=""
                [ "${early:-0}" -gt 0 ] || { ok=0 why="${why:-nothing was packed early (status: ${early:-none})}"; }
            fi
            timeout "$t" "$ti/reference" --trainers 2 --n "$n" --steps "$steps" --rho 0.01 \
                --warmup 3 --out "$rt/ref" >"$LOGS/hand_ref_$n.txt" 2>&1 ||
                { ok=0 why="${why:-the reference failed}"; }
        fi
        kill "$DPID" 2>/dev/null; wait "$DPID" 2>/dev/null
        DPID=""
        if [ "$ok" = 1 ] && cmp -s "$rt/a" "$rt/ref" && cmp -s "$rt/b" "$rt/ref"; then
            HANDOVER_STATUS="$HANDOVER_STATUS; N=$n, two CUDA trainers (blocking, by events)${bk:+, a bucket per tensor ($early tensors packed early)} == reference: ok"
        else
            HANDOVER_STATUS="$HANDOVER_STATUS; N=$n${bk:+ in buckets} vs reference: FAIL (${why:-parameters differ}; see $LOGS)"
            HANDOVER_RC=1
        fi
    done
    t=$(tmo 150)
    if [ "$t" = 0 ]; then
        HANDOVER_STATUS="$HANDOVER_STATUS; killed trainer: not run (out of time)"
        not_run "hand-over with a killed trainer"
    else
        # The survivor holds before step 100 until the replacement has synced,
        # so the replacement really trains with it; the history (the step
        # the survivor went on alone, from the daemon's log, and the one the
        # replacement joined at, from its own) is replayed by the reference.
        ok=1 why="" alone="" joined=""
        rm -rf "$rt/rt" "$rt/a" "$rt/c" "$rt/ref" "$rt/joined"
        if ! daemon_up "$LOGS/scaped_kill.txt" "$rt/rt" --executor cuda --trainers 2 --rho 0.01 --warmup 3; then
            ok=0 why="scaped did not start"
        else
            timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 0 \
                --n "$KILL_N" --steps 200 --stream 1 --hold-at 100 --hold-file "$rt/joined" \
                --out "$rt/a" >"$LOGS/kill_a.txt" 2>&1 &
            local pa=$!
            timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 1 \
                --n "$KILL_N" --steps 200 --die-after-post 20 >"$LOGS/kill_b.txt" 2>&1
            grep -q "dying" "$LOGS/kill_b.txt" || { ok=0 why="the victim did not die after posting"; }
            timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 1 \
                --n "$KILL_N" --steps 200 --ready-file "$rt/joined" --out "$rt/c" \
                >"$LOGS/kill_c.txt" 2>&1 || { ok=0 why="${why:-the replacement failed}"; }
            wait "$pa" || { ok=0 why="${why:-the survivor failed}"; }
            kill -0 "$DPID" 2>/dev/null || { ok=0 why="${why:-scaped died}"; }
            alone=$(grep -o "step [0-9]*: now 1 trainer" "$LOGS/scaped_kill.txt" | head -1 | grep -o "[0-9]*" | head -1)
            joined=$(grep -o "steps [0-9]*\.\.200 done" "$LOGS/kill_c.txt" | grep -o "[0-9]*" | head -1)
            if [ "$ok" = 1 ] && [ -n "$alone" ] && [ -n "$joined" ] && [ "$joined" -gt "$alone" ] &&
                [ "$joined" -le 100 ]; then
                timeout "$t" "$ti/reference" --trainers 2 --n "$KILL_N" --steps 200 --rho 0.01 \
                    --warmup 3 --members "$alone:1,$joined:2" --out "$rt/ref" \
                    >"$LOGS/kill_ref.txt" 2>&1 || { ok=0 why="the reference failed"; }
            else
                [ -n "$why" ] || why="the history is not as planned: alone from step [$alone], the replacement from [$joined], where alone < joined <= 100"
                ok=0
            fi
        fi
        kill "$DPID" 2>/dev/null; wait "$DPID" 2>/dev/null
        DPID=""
        if [ "$ok" = 1 ] && cmp -s "$rt/a" "$rt/ref" && cmp -s "$rt/c" "$rt/ref"; then
            HANDOVER_STATUS="$HANDOVER_STATUS; a trainer killed after posting step 20, the survivor alone from step $alone, a replacement from step $joined, both == the reference with that history after 200 steps: ok"
        else
            HANDOVER_STATUS="$HANDOVER_STATUS; killed trainer: FAIL (${why:-the parameters differ from the reference}; see $LOGS)"
            HANDOVER_RC=1
        fi
    fi
    rm -rf "$rt"
    HANDOVER_STATUS=${HANDOVER_STATUS#; }
    progress "handover: $HANDOVER_STATUS"
}

# Trainers on two GPUs (issue 16): scaped on device 0 with a CUDA IPC
# trainer on device 0 and one on device 1 (by events on its own stream),
# against the reference bit for bit, the status naming each trainer's device
# while they train; where device 0 cannot reach device 1's memory, the
# trainer on device 1 must instead be refused with the reason (naming both
# devices), and scaped go on serving a trainer on its own device.  Needs two
# GPUs (the emulator makes them: EMU_DEVICES=2, both ways of EMU_PEER).
peer_case() { # $1: what is expected here: equal, refused or either
    local rt=$2 t ti=${TI:-$BUILD/tests/integration} expect=$1 st
    t=$(tmo 120)
    [ "$t" = 0 ] && { echo "not run (out of time)"; return 1; }
    rm -rf "$rt/rt" "$rt/a" "$rt/b" "$rt/ref"
    if ! daemon_up "$LOGS/scaped_peer_$expect.txt" "$rt/rt" --executor cuda --cuda-device 0 \
        --trainers 2 --rho 0.01 --warmup 3; then
        echo "FAIL (scaped did not start)"; return 1
    fi
    timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 1 --device 1 \
        --n 100000 --steps 30 --stream 1 --out "$rt/b" >"$LOGS/peer_b_$expect.txt" 2>&1 &
    local pb=$! refused=0 ok=1 why=""
    for _ in $(seq 100); do # until it has attached (it waits for its peer), or is refused
        grep -q "scaped refused\|no peer access" "$LOGS/peer_b_$expect.txt" && { refused=1; break; }
        kill -0 "$pb" 2>/dev/null || break
        "$SCAPECTL" --endpoint "ipc://$rt/rt/status" status >"$LOGS/peer_status_$expect.txt" 2>&1 &&
            grep -q "cuda:1" "$LOGS/peer_status_$expect.txt" && break
        sleep 0.2
    done
    if [ "$refused" = 0 ] && kill -0 "$pb" 2>/dev/null; then
        timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 0 --device 0 \
            --n 100000 --steps 30 --out "$rt/a" >"$LOGS/peer_a_$expect.txt" 2>&1 &
        local pa=$!
        grep -q "cuda:1" "$LOGS/peer_status_$expect.txt" || { ok=0 why="the status does not name cuda:1"; }
        wait "$pa" || { ok=0 why="${why:-the trainer on device 0 failed}"; }
        wait "$pb" || { ok=0 why="${why:-the trainer on device 1 failed}"; }
        timeout "$t" "$ti/reference" --trainers 2 --n 100000 --steps 30 --rho 0.01 --warmup 3 \
            --out "$rt/ref" >"$LOGS/peer_ref.txt" 2>&1 || { ok=0 why="${why:-the reference failed}"; }
        kill "$DPID" 2>/dev/null; wait "$DPID" 2>/dev/null; DPID=""
        if [ "$ok" = 1 ] && cmp -s "$rt/a" "$rt/ref" && cmp -s "$rt/b" "$rt/ref"; then
            [ "$expect" = refused ] && { echo "FAIL (device 0 reached device 1, which it has no peer access to)"; return 1; }
            echo "trainers on devices 0 and 1 (peer access) == reference, status cuda:1: ok"; return 0
        fi
        echo "FAIL (${why:-the parameters differ from the reference}; see $LOGS)"; return 1
    fi
    wait "$pb" 2>/dev/null
    # refused with the reason, and its buffers given back at once (libscape
    # frees them when scaped confirms it closed them: the slot is returned)
    if [ "$expect" = equal ] || ! grep -q "device 1" "$LOGS/peer_b_$expect.txt" ||
        ! grep -q "per GPU" "$LOGS/peer_b_$expect.txt" ||
        grep -q "did not confirm" "$LOGS/peer_b_$expect.txt"; then
        kill "$DPID" 2>/dev/null; wait "$DPID" 2>/dev/null; DPID=""
        echo "FAIL (the trainer on device 1 was not trained with: $(tail -n 1 "$LOGS/peer_b_$expect.txt"))"; return 1
    fi
    # refused as it should be: scaped serves a trainer on its own device
    timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 0 --device 0 \
        --n 100000 --steps 30 --out "$rt/a" >"$LOGS/peer_a_$expect.txt" 2>&1 &
    local pa=$!
    timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 1 --device 0 \
        --n 100000 --steps 30 --out "$rt/b" >"$LOGS/peer_c_$expect.txt" 2>&1 || ok=0
    wait "$pa" || ok=0
    kill "$DPID" 2>/dev/null; wait "$DPID" 2>/dev/null; DPID=""
    timeout "$t" "$ti/reference" --trainers 2 --n 100000 --steps 30 --rho 0.01 --warmup 3 \
        --out "$rt/ref" >"$LOGS/peer_ref.txt" 2>&1 || ok=0
    if [ "$ok" = 1 ] && cmp -s "$rt/a" "$rt/ref" && cmp -s "$rt/b" "$rt/ref"; then
        echo "no peer access: the trainer on device 1 refused (\"$(grep -o "the trainer's buffers are on CUDA device [0-9]*, and this daemon's device [0-9]* has no peer access to it" "$LOGS/peer_b_$expect.txt" | head -n 1)\") and its buffers freed, then two on device 0 == reference: ok"
        return 0
    fi
    echo "FAIL (refused as it should be, but then the trainers on device 0 did not match the reference; see $LOGS)"
    return 1
}

run_peer() {
    PEER_STATUS="" PEER_RC=0
    local ndev rt r
    if [ -n "$EMU" ]; then ndev=${EMU_DEVICES:-1}; else ndev=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); fi
    if [ "${ndev:-0}" -lt 2 ]; then
        PEER_STATUS="not run: one GPU here (two are needed)"
        progress "two GPUs: $PEER_STATUS"
        return
    fi
    if [ -z "${DAEMON:-}" ] || [ ! -x "$BIN/gpu_trainer" ] || [ -z "${SCAPECTL:-}" ]; then
        PEER_STATUS="not run: scaped, scapectl or gpu_trainer not built here"
        not_run "trainers on two GPUs"
        progress "two GPUs: $PEER_STATUS"
        return
    fi
    rt=$(mktemp -d /tmp/scape-peer.XXXXXX)
    if [ -n "$EMU" ]; then
        r=$(export EMU_PEER=1; peer_case equal "$rt") || PEER_RC=1
        PEER_STATUS="emulated with peer access: $r"
        r=$(export EMU_PEER=0; peer_case refused "$rt") || PEER_RC=1
        PEER_STATUS="$PEER_STATUS; emulated without: $r"
    else
        r=$(peer_case either "$rt") || PEER_RC=1
        PEER_STATUS=$r
    fi
    rm -rf "$rt"
    progress "two GPUs: $PEER_STATUS"
}

# The hand-over's cost per step (issue 16's benchmark): one CUDA IPC trainer
# (gpu_trainer --bench, by events on its own stream), the call from post to
# parameters ready against the daemon's engine step, in place (cuda
# executor) and staged through pinned host copies (host executor), at each
# of HANDOVER_SIZES; medians of the sparse steps.  Target: under 5% of the
# step in place.
run_handover_bench() {
    HANDBENCH_STATUS=""
    if [ -z "${DAEMON:-}" ] || [ ! -x "$BIN/gpu_trainer" ]; then
        HANDBENCH_STATUS="not run: scaped or gpu_trainer not built here"
        return
    fi
    local rt n ex t
    rt=$(mktemp -d /tmp/scape-handb.XXXXXX)
    for n in "${HANDOVER_SIZES[@]}"; do
        for ex in cuda host; do
            t=$(tmo 120)
            if [ "$t" = 0 ]; then
                HANDBENCH_STATUS="$HANDBENCH_STATUS; $ex N=$n: not run (out of time)"
                continue
            fi
            rm -rf "$rt/rt"
            if daemon_up "$LOGS/scaped_handover.txt" "$rt/rt" --executor "$ex" --trainers 1 --rho 0.01 --warmup 3 &&
                timeout "$t" "$BIN/gpu_trainer" --endpoint "ipc://$rt/rt/control" --index 0 \
                    --n "$n" --steps 13 --stream 1 --bench 1 --warmup 3 \
                    >"$LOGS/handbench_${ex}_$n.txt" 2>&1; then
                awk -v ex="$ex" '$1 == "BENCH" { print $0, ex }' \
                    "$LOGS/handbench_${ex}_$n.txt" >>"$LOGS/handbench.txt"
            else
                HANDBENCH_STATUS="$HANDBENCH_STATUS; $ex N=$n: failed (see $LOGS/handbench_${ex}_$n.txt)"
                OTHER_RC=1
            fi
            kill "$DPID" 2>/dev/null; wait "$DPID" 2>/dev/null
            DPID=""
        done
    done
    rm -rf "$rt"
    HANDBENCH_STATUS=${HANDBENCH_STATUS#; }
    progress "handover bench: ${HANDBENCH_STATUS:-done}"
}

# The Python binding's CUDA path: torch tensors over CUDA IPC buffers, and a
# CUDA and a CPU ScapeOptimizer agreeing bitwise (tests/gpu/torch_scape.py).
run_torch_scape() {
    TORCH_STATUS="not run" TORCH_RC=0
    local t
    t=$(tmo 240)
    if [ -z "${DAEMON:-}" ] || [ -z "${LIBSCAPE:-}" ]; then
        TORCH_STATUS="not run: scaped or libscape not built here (carry build-gpu-pack)"
    elif ! command -v python3 >/dev/null 2>&1; then
        TORCH_STATUS="not run: no python3"
    elif [ "$t" = 0 ]; then
        TORCH_STATUS="not run: out of time"
    else
        timeout "$t" python3 tests/gpu/torch_scape.py --daemon "$DAEMON" --lib "$LIBSCAPE" \
            --log "$LOGS/scaped_torch.txt" | tee "$LOGS/torch_scape.txt"
        TORCH_RC=${PIPESTATUS[0]}
        TORCH_STATUS=$(grep -E '^torch_scape: |^SKIP' "$LOGS/torch_scape.txt" | tail -n 1)
        case "$TORCH_RC" in
        0) ;;
        77) TORCH_RC=0 TORCH_STATUS="not run: $TORCH_STATUS" ;;
        124) TORCH_STATUS="torch_scape: FAIL: timed out after $t s"; TORCH_RC=1 ;;
        *) TORCH_STATUS="${TORCH_STATUS:-torch_scape: FAIL: exit $TORCH_RC}"; TORCH_RC=1 ;;
        esac
    fi
    case "$TORCH_STATUS" in "not run"*) not_run "torch over CUDA IPC" ;; esac
    progress "python: $TORCH_STATUS"
}

# Issue 3's service benchmark on this machine's CPUs (many more than the
# 2-vCPU development machine): the daemon's overhead against the in-process
# engine, handover bytes, memory (tests/bench/bench_service.py).
run_service_bench() {
    SERVICE_STATUS="not run (give --service)"
    [ "$SERVICE" = 1 ] || return 0
    local t
    t=$(tmo 300)
    if [ "$t" = 0 ]; then
        SERVICE_STATUS="not run: out of time"
        return
    fi
    if [ -z "${SERVICE_FROM+x}" ] || [ -z "${DAEMON:-}" ]; then
        SERVICE_STATUS="not run: the daemon programs are not built here"
        return
    fi
    command -v python3 >/dev/null 2>&1 || { SERVICE_STATUS="not run: no python3"; return; }
    if timeout "$t" python3 tests/bench/bench_service.py "${SERVICE_FROM[@]}" --quick \
        --markdown "$LOGS/service.md" >"$LOGS/service.txt" 2>&1; then
        local dflt nodefer
        dflt=$(grep -m1 "^| step, through scaped (last poster" "$LOGS/service.md" | awk -F'|' '{print $5}')
        nodefer=$(grep -m1 "^| step, through scaped with defer_select false" "$LOGS/service.md" |
            awk -F'|' '{print $5}')
        SERVICE_STATUS="through scaped vs in-process:${dflt}; defer_select false:${nodefer} (table: $LOGS/service.md)"
    else
        SERVICE_STATUS="bench_service failed or timed out (see $LOGS/service.txt)"
        OTHER_RC=1
    fi
    progress "service: $SERVICE_STATUS"
}

print_summary() {
    local gpu status
    if [ -n "$EMU" ]; then
        gpu="none: the CUDA emulator on the CPU (tests/gpu/emu); this is no GPU test"
    else
        gpu="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1) (nvcc $("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
    fi
    status=$(grep -E '^gpu_check: (PASS|FAIL)|^SKIP' "$LOGS/gpu_check.txt" 2>/dev/null | tail -n 1)
    echo
    echo "==================== scaped GPU check summary ===================="
    echo "date      : $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "host      : $(uname -n)"
    echo "gpu       : $gpu"
    echo "build     : $HOW"
    echo "time      : $((SECONDS - T0)) s of a budget of $BUDGET s"
    echo "check     : ${status:-gpu_check exited with status $CHECK_RC}"
    echo "exec      : ${EXEC_STATUS:-not run}"
    echo "nccl      : ${NCCL_STATUS:-not run}"
    echo "handover  : ${HANDOVER_STATUS:-not run}"
    echo "two GPUs  : ${PEER_STATUS:-not run}"
    echo "python    : ${TORCH_STATUS:-not run}"
    echo "service   : ${SERVICE_STATUS:-not run}"
    if [ -n "$EMU" ]; then
        echo "not run   : benchmarks and torch (timings and torch need a GPU)"
        local p
        for p in ${NOT_RUN[@]+"${NOT_RUN[@]}"}; do echo "NOT RUN   : $p"; done
        return
    fi
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
    awk '$1 == "BENCH" && $2 == "step" {
             if (!n++) printf "step      : the cuda executor, ms against the ideal at bandwidths measured here\n"
             printf "    %-11s N = %-11d %9.3f ms, ideal %9.3f ms, %5.2fx (target <= 1.5x)\n",
                    $3, $4, $5, $6, $7 }
         $1 == "BENCH" && $2 == "topk_seg" {
             printf "    segmented top-k, one tensor of %d, k = 1%%: %.3f ms\n", $3, $4 }' \
        "$LOGS/gpu_step.txt" 2>/dev/null
    awk '$1 == "BENCH" && $2 == "handover" {
             if (!n++) printf "handover  : call (post to parameters ready) against the engine step, medians\n"
             printf "    %-5s N = %-11d call %9.3f ms, engine %9.3f ms, hand-over %8.3f ms = %6.2f%% of the step\n",
                    $8, $3, $4, $5, $6, 100 * $7 }' "$LOGS/handbench.txt" 2>/dev/null
    [ -z "${HANDBENCH_STATUS:-}" ] || echo "handover  : $HANDBENCH_STATUS"
    [ "$BENCH_RC" -eq 0 ] || echo "bench     : gpu_bench exited with status $BENCH_RC"
    local part
    for part in ${NOT_RUN[@]+"${NOT_RUN[@]}"}; do echo "NOT RUN   : $part"; done
}

[ "$STAMP_ONLY" = 1 ] && { source_stamp; exit 0; }
[ -n "$EMU" ] || find_tools
rm -rf "$LOGS"
mkdir -p "$LOGS"
trap save_out EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
if [ -n "$EMU" ]; then
    BIN=$EMU/tests/gpu/emu TI=$EMU/tests/integration DAEMON=$EMU/tests/gpu/emu/scaped
    SCAPECTL=$EMU/client/scapectl
    export EMU_DEVICES=${EMU_DEVICES:-2} # the trainers-on-two-GPUs step
    HOW="the CUDA emulator's programs in $EMU (EMU_LAZY=${EMU_LAZY:-0}, EMU_SEED=${EMU_SEED:-0})"
else
    find_nccl
    use_pack || build_cmake || build_direct
fi
progress "build: $HOW"
run_check
run_exec
run_nccl
run_handover
run_peer
if [ -z "$EMU" ]; then # timings and torch: nothing an emulator can tell
    run_torch_scape
    run_bench
    run_handover_bench
    run_service_bench
fi
print_summary | tee "$LOGS/summary.txt"
[ "$CHECK_RC" -eq 0 ] && [ "$EXEC_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$NCCL_RC" -eq 0 ] &&
    [ "$TORCH_RC" -eq 0 ] && [ "${HANDOVER_RC:-0}" -eq 0 ] && [ "${PEER_RC:-0}" -eq 0 ] &&
    [ "$OTHER_RC" -eq 0 ] || exit 1
[ "${#NOT_RUN[@]}" -eq 0 ] || [ "$PARTIAL_OK" = 1 ] || exit 3
exit 0
