/* emu.cpp - scaped's CUDA emulator: the runtime (memory, streams, events,
 * launches) and a one-rank NCCL, on the CPU, for the emulator build of the
 * GPU checks (tests/gpu/emu/CMakeLists.txt).  See include/cuda_runtime.h for
 * what it checks and what it cannot.
 *
 * Execution.  Everything runs on the calling host thread under one lock.  A
 * kernel runs block after block; a block's threads are fibers with stacks of
 * their own, switched only where CUDA makes threads meet (__syncthreads, the
 * warp intrinsics), so the work between two barriers of one thread runs
 * without interruption.  A barrier that can never complete (a thread waiting
 * at __syncthreads while others wait at a warp op, a warp op naming a lane
 * that has exited, lanes of one warp at different intrinsics) stops the
 * process with the kernel's name and what each thread waits at.
 *
 * Order.  EMU_SEED=N (N != 0) runs the blocks of every launch, and the
 * fibers of every block in every round, in an order drawn from N: a kernel
 * whose result depends on that order (a float atomic, a race through shared
 * memory settled by a barrier in one order only) gives different bits under
 * different seeds.
 *
 * Streams.  Eager by default: work runs when it is queued.  EMU_LAZY=1 queues
 * it and runs a stream's work only when something waits for it (a stream or
 * event synchronisation, a query -- which answers cudaErrorNotReady first,
 * as a real one does while work is pending -- a stream waiting on an event,
 * a synchronous copy), in stream order; so host code that reads a result
 * before it waited reads stale memory, and a missing event between two
 * streams shows.  Copies follow the runtime's "API synchronization
 * behavior": from pageable memory to the device the stream's earlier work
 * runs and the source is staged at the call, the write queued; to pageable
 * memory, and synchronous copies other than device to device, complete at
 * return.
 *
 * Errors follow the runtime: a failing call returns its error and leaves it
 * as the thread's last error (cudaErrorNotReady from a query too), which
 * cudaGetLastError returns and clears; a launch with a bad configuration
 * leaves cudaErrorInvalidConfiguration.  New device and pinned memory is
 * filled with 0xff bytes (a NaN as a float), since real memory is not
 * zeroed either. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "cuda_runtime.h"
#include "nccl.h"

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

/* Fibers switch by a few instructions on x86-64, by ucontext elsewhere (or
 * with -DEMU_UCONTEXT, which is how that path is tried on x86-64). */
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
#define EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace {

[[noreturn]] void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cuda emulator: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(NULL);
    abort();
}

double now_ms()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

std::recursive_mutex g_mu;
typedef std::lock_guard<std::recursive_mutex> guard;
thread_local cudaError_t t_last = cudaSuccess;
thread_local int t_device = 0;
thread_local void *t_ctx = nullptr; /* the driver's current context: none until bound */
char g_primary[8];                  /* each device's primary context */

/* The runtime binds the current device's primary context at a thread's
 * first call that needs one, as cudaSetDevice does. */
void bind_ctx()
{
    if (t_ctx == nullptr)
        t_ctx = &g_primary[t_device];
}
unsigned long long g_kernels = 0;

struct settings {
    bool lazy = false;
    uint64_t seed = 0;
    int devices = 1; /* EMU_DEVICES, 1 to 8 */
    bool peer = true; /* EMU_PEER=0: no device reaches another's memory */
    char text[160];
    settings()
    {
        const char *l = getenv("EMU_LAZY"), *s = getenv("EMU_SEED");
        const char *d = getenv("EMU_DEVICES"), *p = getenv("EMU_PEER");
        lazy = l && atoi(l) != 0;
        seed = s ? strtoull(s, NULL, 0) : 0;
        devices = d ? atoi(d) : 1;
        devices = devices < 1 ? 1 : devices > 8 ? 8 : devices;
        peer = !p || atoi(p) != 0;
        snprintf(text, sizeof text, "CUDA emulator on the CPU (%s streams, %s order)",
                 lazy ? "lazy" : "eager", seed ? "seeded" : "natural");
        if (seed)
            snprintf(text + strlen(text) - 1, sizeof text - strlen(text) + 1, " %llu)",
                     (unsigned long long)seed);
    }
};
settings &cfg()
{
    static settings s;
    return s;
}

cudaError_t fail(cudaError_t e)
{
    if (e != cudaSuccess)
        t_last = e;
    return e;
}

/* ---- memory ----------------------------------------------------------------------- */

enum kind { DEVICE, PINNED, REGISTERED };
struct block {
    size_t bytes;
    kind k;
    uintptr_t seg; /* the memfd segment it lies in (EMU_IPC=1), else 0 */
    int device;    /* device memory's device */
};
std::map<uintptr_t, block> g_mem;

/* A memfd segment: device memory another process can map (EMU_IPC=1). */
struct segment {
    size_t bytes;
    int fd;          /* -1 when imported */
    uint64_t id;     /* the owner's number for it */
    pid_t owner;
    unsigned users;  /* blocks carved out of it, or opens of an imported one */
    size_t used;     /* bytes carved so far */
};
std::map<uintptr_t, segment> g_segs;
uintptr_t g_small = 0; /* the segment small allocations are carved from now */
uint64_t g_seg_ids = 0;
/* Allocations under this size share segments of this size: 2 MiB as CUDA's
 * allocator, or EMU_IPC_SEGMENT_MIB to put several of a program's buffers
 * (libscape's, 2 MiB multiples) at offsets of one handle. */
size_t segment_bytes()
{
    static size_t b = 0;
    if (b == 0) {
        const char *v = getenv("EMU_IPC_SEGMENT_MIB");
        long mib = v ? atol(v) : 2;
        b = (size_t)(mib > 0 ? mib : 2) << 20;
    }
    return b;
}

bool ipc_mode()
{
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("EMU_IPC");
        on = v && atoi(v) != 0;
    }
    return on;
}

template <class M> typename M::value_type *containing(M &m, uintptr_t a, size_t (*len)(const typename M::mapped_type &))
{
    auto it = m.upper_bound(a);
    if (it == m.begin())
        return nullptr;
    --it;
    size_t n = len(it->second);
    if (a < it->first || a >= it->first + (n ? n : 1))
        return nullptr;
    return &*it;
}
size_t block_len(const block &b) { return b.bytes; }
size_t seg_len(const segment &s) { return s.bytes; }

const std::pair<const uintptr_t, block> *find_block(const void *p)
{
    return containing(g_mem, (uintptr_t)p, block_len);
}
std::pair<const uintptr_t, segment> *find_segment(const void *p)
{
    return containing(g_segs, (uintptr_t)p, seg_len);
}

uintptr_t new_segment(size_t bytes)
{
    int fd = memfd_create("scape-cuda-emu", MFD_CLOEXEC);
    if (fd < 0)
        return 0;
    void *m = MAP_FAILED;
    if (ftruncate(fd, (off_t)bytes) == 0)
        m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return 0;
    }
    g_segs[(uintptr_t)m] = segment{ bytes, fd, ++g_seg_ids, getpid(), 0, 0 };
    return (uintptr_t)m;
}

void drop_segment(uintptr_t base)
{
    auto it = g_segs.find(base);
    munmap((void *)base, it->second.bytes);
    if (it->second.fd >= 0)
        close(it->second.fd);
    if (g_small == base)
        g_small = 0;
    g_segs.erase(it);
}

/* Device memory in a segment: under 2 MiB carved out of the current small
 * segment (256-byte aligned), else a segment of its own. */
void *carve(size_t bytes, uintptr_t *seg)
{
    const size_t SEGMENT = segment_bytes();
    size_t need = (bytes + 255) / 256 * 256;
    if (bytes < SEGMENT) {
        if (g_small == 0 || g_segs[g_small].used + need > SEGMENT)
            g_small = new_segment(SEGMENT);
        *seg = g_small;
    } else {
        *seg = new_segment((bytes + SEGMENT - 1) / SEGMENT * SEGMENT);
    }
    if (*seg == 0)
        return nullptr;
    segment &s = g_segs[*seg];
    void *p = (char *)*seg + s.used;
    s.used += need;
    s.users++;
    return p;
}

cudaError_t alloc(void **p, size_t bytes, kind k)
{
    bind_ctx();
    if (p == nullptr)
        return fail(cudaErrorInvalidValue);
    *p = nullptr;
    if (bytes == 0)
        return cudaSuccess;
    void *m = nullptr;
    uintptr_t seg = 0;
    if (k == DEVICE && ipc_mode()) {
        if ((m = carve(bytes, &seg)) == nullptr)
            return fail(cudaErrorMemoryAllocation);
    } else if (posix_memalign(&m, 256, bytes) != 0) {
        return fail(cudaErrorMemoryAllocation);
    }
    memset(m, 0xff, bytes);
    g_mem[(uintptr_t)m] = block{ bytes, k, seg, t_device };
    *p = m;
    return cudaSuccess;
}

cudaError_t release(void *p, kind k)
{
    if (p == nullptr)
        return cudaSuccess;
    auto it = g_mem.find((uintptr_t)p);
    if (it == g_mem.end() || (it->second.k == DEVICE) != (k == DEVICE) || it->second.k == REGISTERED)
        return fail(k == DEVICE ? cudaErrorInvalidDevicePointer : cudaErrorInvalidValue);
    uintptr_t seg = it->second.seg;
    if (seg && g_segs[seg].fd < 0)
        return fail(cudaErrorInvalidDevicePointer); /* imported: cudaIpcCloseMemHandle's */
    g_mem.erase(it);
    if (seg) {
        if (--g_segs[seg].users == 0)
            drop_segment(seg);
    } else {
        free(p);
    }
    return cudaSuccess;
}

/* ---- streams and events ----------------------------------------------------------- */

struct stream;
struct op {
    enum { RUN, MARK, WAIT } what;
    std::function<void()> fn; /* RUN */
    cudaEvent_t ev;           /* MARK: the event whose time is taken */
    stream *on;               /* WAIT: until `on` has done `upto` */
    uint64_t upto;
};
struct stream {
    unsigned flags;
    int device;
    bool destroyed;
    std::deque<op> q;
    uint64_t queued, done; /* ops queued and run so far */
};
stream g_legacy = { 0, 0, false, {}, 0, 0 }; /* the NULL stream */
std::vector<std::unique_ptr<stream>> g_streams; /* kept after destroy: handles are checked */

stream *as_stream(cudaStream_t s) { return s ? reinterpret_cast<stream *>(s) : &g_legacy; }

bool valid(stream *s)
{
    if (s == &g_legacy)
        return true;
    for (auto &p : g_streams)
        if (p.get() == s)
            return !s->destroyed;
    return false;
}

} // namespace

struct emu_event {
    unsigned flags;
    bool destroyed;
    stream *on; /* the stream of its last record (null: never recorded) */
    uint64_t at; /* complete once `on` has done this many ops */
    double t_ms;
    bool imported; /* opened from another process's handle: always complete */
    int device;
    unsigned polls; /* an imported one answers "not yet" to every other query */
};

namespace {

std::vector<std::unique_ptr<emu_event>> g_events;

bool valid(emu_event *e)
{
    for (auto &p : g_events)
        if (p.get() == e)
            return !e->destroyed;
    return false;
}

void run_until(stream *s, uint64_t upto)
{
    while (s->done < upto && !s->q.empty()) {
        op o = std::move(s->q.front());
        s->q.pop_front();
        switch (o.what) {
        case op::RUN: o.fn(); break;
        case op::MARK: o.ev->t_ms = now_ms(); break; /* its event's position is reached */
        case op::WAIT: run_until(o.on, o.upto); break;
        }
        s->done++;
    }
}

void run_all(stream *s) { run_until(s, s->queued); }

void run_everything()
{
    run_all(&g_legacy);
    for (auto &p : g_streams)
        run_all(p.get());
}

/* Queue an op on s, after what the legacy default stream orders it behind:
 * work on the legacy stream waits for every blocking stream's earlier work,
 * and a blocking stream's work waits for the legacy stream's. */
void push(stream *s, op o)
{
    if (s == &g_legacy) {
        for (auto &p : g_streams)
            if (!p->destroyed && !(p->flags & cudaStreamNonBlocking) && p->done < p->queued) {
                s->q.push_back(op{ op::WAIT, {}, nullptr, p.get(), p->queued });
                s->queued++;
            }
    } else if (!(s->flags & cudaStreamNonBlocking) && g_legacy.done < g_legacy.queued) {
        s->q.push_back(op{ op::WAIT, {}, nullptr, &g_legacy, g_legacy.queued });
        s->queued++;
    }
    s->q.push_back(std::move(o));
    s->queued++;
    if (!cfg().lazy)
        run_all(s);
}

void push_fn(stream *s, std::function<void()> fn) { push(s, op{ op::RUN, std::move(fn), nullptr, nullptr, 0 }); }

bool event_done(const emu_event *e) { return e->on == nullptr || e->on->done >= e->at; }

/* ---- fibers ------------------------------------------------------------------------ */

#ifdef EMU_ASM_SWITCH
extern "C" void emu_switch(void **save_sp, void *to_sp);
extern "C" void emu_fiber_entry(void);
asm(R"(
    .pushsection .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
    .globl emu_fiber_entry
    .type emu_fiber_entry, @function
emu_fiber_entry:
    andq $-16, %rsp
    call emu_fiber_main
    ud2
    .size emu_fiber_entry, .-emu_fiber_entry
    .popsection
)");
#endif

const size_t STACK = 256 * 1024; /* ASan's redzones need the room */
const unsigned MAX_THREADS = 1024;

enum wait_kind { NONE, BAR, WARP, DONE };
struct fiber {
    unsigned tid;
    wait_kind wait;
    uint64_t gen; /* the barrier generation it waits to see pass */
    char *stack;
#ifdef EMU_ASM_SWITCH
    void *sp;
#else
    ucontext_t uc;
#endif
};
struct warp {
    unsigned lanes;   /* lanes that exist */
    unsigned alive;   /* bit per lane not yet exited */
    unsigned arrived; /* lanes at the current op */
    unsigned mask;
    const char *op;
    uint64_t gen;
    uint64_t slot[2][32];
};

struct runner {
    char *stacks = nullptr;
    fiber fib[MAX_THREADS];
    warp warps[MAX_THREADS / 32];
    unsigned nthreads = 0, live = 0, bar_count = 0;
    uint64_t bar_gen = 0;
    fiber *cur = nullptr;
    const char *kernel = "";
    const std::function<void()> *body = nullptr;
#ifdef EMU_ASM_SWITCH
    void *sched_sp = nullptr;
#else
    ucontext_t sched_uc;
#endif
#ifdef EMU_ASAN
    void *fake = nullptr;
    const void *sched_bottom = nullptr;
    size_t sched_size = 0;
#endif
};
runner g_run;

void ensure_stacks()
{
    if (g_run.stacks)
        return;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void *m = mmap(nullptr, STACK * MAX_THREADS, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
        die("mmap of %zu bytes of fiber stacks: %s", STACK * MAX_THREADS, strerror(errno));
    g_run.stacks = (char *)m;
    for (unsigned i = 0; i < MAX_THREADS; i++) /* a guard page under each stack */
        if (mprotect(g_run.stacks + (size_t)i * STACK, page, PROT_NONE) != 0)
            die("mprotect of a guard page: %s", strerror(errno));
}

/* Into fiber f from the scheduler, and back. */
void enter(fiber *f)
{
    g_run.cur = f;
    threadIdx.x = f->tid % blockDim.x;
    threadIdx.y = f->tid / blockDim.x % blockDim.y;
    threadIdx.z = f->tid / (blockDim.x * blockDim.y);
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(&g_run.fake, f->stack, STACK);
#endif
#ifdef EMU_ASM_SWITCH
    emu_switch(&g_run.sched_sp, f->sp);
#else
    if (swapcontext(&g_run.sched_uc, &f->uc) != 0)
        die("swapcontext: %s", strerror(errno));
#endif
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(g_run.fake, nullptr, nullptr);
#endif
}

void leave(bool finished)
{
    fiber *f = g_run.cur;
#ifdef EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(finished ? nullptr : &fake, g_run.sched_bottom, g_run.sched_size);
#endif
#ifdef EMU_ASM_SWITCH
    emu_switch(&f->sp, g_run.sched_sp);
#else
    if (swapcontext(&f->uc, &g_run.sched_uc) != 0)
        die("swapcontext: %s", strerror(errno));
#endif
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, &g_run.sched_bottom, &g_run.sched_size);
#endif
    (void)finished;
}

void release_barriers()
{
    if (g_run.bar_count && g_run.bar_count == g_run.live) {
        g_run.bar_count = 0;
        g_run.bar_gen++;
    }
}

} // namespace

extern "C" void emu_fiber_main(void)
{
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &g_run.sched_bottom, &g_run.sched_size);
#endif
    (*g_run.body)();
    fiber *f = g_run.cur;
    f->wait = DONE;
    g_run.live--;
    warp &w = g_run.warps[f->tid / 32];
    w.alive &= ~(1u << (f->tid % 32));
    if (w.arrived && w.arrived == (w.mask & w.alive)) { /* the rest of a warp op's lanes */
        w.arrived = 0;
        w.gen++;
    }
    release_barriers();
    leave(true);
    die("a finished fiber was resumed");
}

#ifndef EMU_ASM_SWITCH
static void fiber_trampoline(void) { emu_fiber_main(); }
#endif

namespace {

void start_fiber(fiber *f, unsigned tid)
{
    f->tid = tid;
    f->wait = NONE;
    f->gen = 0;
    f->stack = g_run.stacks + (size_t)tid * STACK;
#ifdef EMU_ASM_SWITCH
    uintptr_t top = ((uintptr_t)(f->stack + STACK)) & ~(uintptr_t)15;
    uint64_t *sp = (uint64_t *)top - 8; /* csr word, six registers, return address */
    uint32_t mxcsr;
    uint16_t fpcw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpcw));
    memset(sp, 0, 8 * sizeof *sp);
    memcpy(sp, &mxcsr, 4);
    memcpy((char *)sp + 4, &fpcw, 2);
    sp[7] = (uint64_t)(uintptr_t)emu_fiber_entry;
    f->sp = sp;
#else
    if (getcontext(&f->uc) != 0)
        die("getcontext: %s", strerror(errno));
    f->uc.uc_stack.ss_sp = f->stack + sysconf(_SC_PAGESIZE);
    f->uc.uc_stack.ss_size = STACK - sysconf(_SC_PAGESIZE);
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, fiber_trampoline, 0);
#endif
}

[[noreturn]] void deadlock()
{
    unsigned bar = 0, wrp = 0, done = 0;
    for (unsigned i = 0; i < g_run.nthreads; i++)
        (g_run.fib[i].wait == BAR ? bar : g_run.fib[i].wait == WARP ? wrp : done)++;
    die("kernel %s, block (%u,%u,%u): no thread can go on: %u wait at __syncthreads, %u at a "
        "warp intrinsic, %u have exited (a barrier not reached by every thread)",
        g_run.kernel, blockIdx.x, blockIdx.y, blockIdx.z, bar, wrp, done);
}

void run_block(std::mt19937_64 *rng)
{
    const unsigned n = g_run.nthreads;
    g_run.live = n;
    g_run.bar_count = 0;
    for (unsigned w = 0; w < (n + 31) / 32; w++) {
        warp &x = g_run.warps[w];
        x.lanes = n - w * 32 >= 32 ? 32 : n - w * 32;
        x.alive = x.lanes == 32 ? 0xffffffffu : (1u << x.lanes) - 1u;
        x.arrived = 0;
        x.op = nullptr;
    }
    std::vector<unsigned> order(n);
    for (unsigned i = 0; i < n; i++) {
        order[i] = i;
        start_fiber(&g_run.fib[i], i);
    }
    while (g_run.live) {
        if (rng)
            std::shuffle(order.begin(), order.end(), *rng);
        bool moved = false;
        for (unsigned i : order) {
            fiber *f = &g_run.fib[i];
            if (f->wait == DONE)
                continue;
            if (f->wait == BAR && f->gen == g_run.bar_gen)
                continue;
            if (f->wait == WARP && f->gen == g_run.warps[i / 32].gen)
                continue;
            f->wait = NONE;
            enter(f);
            moved = true;
        }
        if (!moved)
            deadlock();
    }
}

void run_kernel(const char *name, const emu_cfg &c, const std::function<void()> &body)
{
    ensure_stacks();
    g_kernels++;
    g_run.kernel = name;
    g_run.body = &body;
    gridDim = c.grid;
    blockDim = c.block;
    g_run.nthreads = c.block.x * c.block.y * c.block.z;
    const uint64_t nblocks = (uint64_t)c.grid.x * c.grid.y * c.grid.z;
    std::unique_ptr<std::mt19937_64> rng;
    std::vector<uint64_t> border;
    if (cfg().seed) {
        rng.reset(new std::mt19937_64(cfg().seed ^ (g_kernels * 0x9e3779b97f4a7c15ull)));
        border.resize(nblocks);
        for (uint64_t b = 0; b < nblocks; b++)
            border[b] = b;
        std::shuffle(border.begin(), border.end(), *rng);
    }
    for (uint64_t i = 0; i < nblocks; i++) {
        uint64_t b = rng ? border[i] : i;
        blockIdx.x = (unsigned)(b % c.grid.x);
        blockIdx.y = (unsigned)(b / c.grid.x % c.grid.y);
        blockIdx.z = (unsigned)(b / ((uint64_t)c.grid.x * c.grid.y));
        run_block(rng.get());
    }
    g_run.cur = nullptr;
}

} // namespace

/* ---- device side ------------------------------------------------------------------ */

void __syncthreads(void)
{
    fiber *f = g_run.cur;
    if (f == nullptr)
        die("__syncthreads outside a kernel");
    if (++g_run.bar_count == g_run.live) {
        g_run.bar_count = 0;
        g_run.bar_gen++;
        return;
    }
    f->wait = BAR;
    f->gen = g_run.bar_gen;
    leave(false);
}

void emu_warp_exchange(const char *opname, unsigned mask, uint64_t mine, uint64_t out[32])
{
    fiber *f = g_run.cur;
    if (f == nullptr)
        die("%s outside a kernel", opname);
    warp &w = g_run.warps[f->tid / 32];
    const unsigned lane = f->tid % 32;
    if (!(mask >> lane & 1u))
        die("kernel %s: lane %u of warp %u calls %s with mask %#x, which does not name it",
            g_run.kernel, lane, f->tid / 32, opname, mask);
    /* lanes named in mask that have exited (or do not exist) take no part,
     * as in CUDA; what they would have given reads as garbage there */
    if (w.arrived == 0) {
        w.op = opname;
        w.mask = mask;
    } else if (strcmp(w.op, opname) != 0 || w.mask != mask) {
        die("kernel %s: warp %u diverges: lane %u calls %s (mask %#x) while others wait in %s "
            "(mask %#x)",
            g_run.kernel, f->tid / 32, lane, opname, mask, w.op, w.mask);
    }
    const unsigned buf = (unsigned)(w.gen & 1);
    w.slot[buf][lane] = mine;
    w.arrived |= 1u << lane;
    if (w.arrived == (mask & w.alive)) {
        w.arrived = 0;
        w.gen++;
    } else {
        f->wait = WARP;
        f->gen = w.gen;
        leave(false);
    }
    for (unsigned l = 0; l < 32; l++)
        out[l] = mask >> l & 1u ? w.slot[buf][l] : 0;
}

void emu_enqueue_kernel(const char *name, const emu_cfg &c, std::function<void()> body)
{
    guard g(g_mu);
    bind_ctx();
    const uint64_t threads = (uint64_t)c.block.x * c.block.y * c.block.z;
    if (c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 || c.grid.x > 0x7fffffffu ||
        c.grid.y > 65535 || c.grid.z > 65535 || threads == 0 || threads > MAX_THREADS ||
        c.block.z > 64 || c.shmem > 48 * 1024) {
        fail(cudaErrorInvalidConfiguration);
        return;
    }
    stream *s = as_stream(c.stream);
    if (!valid(s) || (s != &g_legacy && s->device != t_device)) { /* a stream of another device */
        fail(cudaErrorInvalidResourceHandle);
        return;
    }
    if (g_run.cur)
        die("kernel %s launched from inside kernel %s", name, g_run.kernel);
    emu_cfg copy = c;
    push_fn(s, [name, copy, body]() { run_kernel(name, copy, body); });
}

/* ---- the runtime API -------------------------------------------------------------- */

extern "C" {

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
#define N(x) \
    case x:  \
        return #x;
        N(cudaSuccess) N(cudaErrorInvalidValue) N(cudaErrorMemoryAllocation)
        N(cudaErrorInitializationError) N(cudaErrorInvalidConfiguration)
        N(cudaErrorInvalidDevicePointer) N(cudaErrorInvalidMemcpyDirection)
        N(cudaErrorInsufficientDriver) N(cudaErrorNoDevice) N(cudaErrorInvalidDevice)
        N(cudaErrorInvalidResourceHandle) N(cudaErrorNotReady) N(cudaErrorPeerAccessUnsupported)
        N(cudaErrorLaunchFailure) N(cudaErrorNotSupported) N(cudaErrorUnknown)
#undef N
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorPeerAccessUnsupported: return "peer access is not supported between these two devices";
    case cudaErrorNotSupported: return "operation not supported";
    default: return cudaGetErrorName(e);
    }
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = t_last;
    t_last = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return t_last; }

static bool bad_device(int dev) { return dev < 0 || dev >= cfg().devices; }

cudaError_t cudaGetDeviceCount(int *n)
{
    if (!n)
        return fail(cudaErrorInvalidValue);
    *n = cfg().devices;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *dev)
{
    if (!dev)
        return fail(cudaErrorInvalidValue);
    *dev = t_device;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int dev)
{
    if (bad_device(dev))
        return fail(cudaErrorInvalidDevice);
    t_device = dev;
    t_ctx = &g_primary[dev];
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev)
{
    if (!p)
        return fail(cudaErrorInvalidValue);
    if (bad_device(dev))
        return fail(cudaErrorInvalidDevice);
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", cfg().text);
    memcpy(p->uuid.bytes, "scape-cuda-emu-0", 16); /* the same in every process */
    p->uuid.bytes[15] = (char)('0' + dev);
    p->totalGlobalMem = (size_t)16 << 30;
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 4;
    p->maxThreadsPerBlock = 1024;
    p->warpSize = 32;
    p->unifiedAddressing = 1;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int dev)
{
    if (!v)
        return fail(cudaErrorInvalidValue);
    if (bad_device(dev))
        return fail(cudaErrorInvalidDevice);
    switch (a) {
    case cudaDevAttrMaxThreadsPerBlock: *v = 1024; break;
    case cudaDevAttrMultiProcessorCount: *v = 4; break;
    case cudaDevAttrUnifiedAddressing: *v = 1; break;
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
    case cudaDevAttrIpcEventSupport: *v = 1; break;
    default: return fail(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int *can, int dev, int peer)
{
    if (!can)
        return fail(cudaErrorInvalidValue);
    if (bad_device(dev) || bad_device(peer))
        return fail(cudaErrorInvalidDevice);
    *can = dev != peer && cfg().peer;
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void)
{
    guard g(g_mu);
    run_everything();
    return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int *v)
{
    if (!v)
        return fail(cudaErrorInvalidValue);
    *v = CUDART_VERSION;
    return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v) { return cudaDriverGetVersion(v); }

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    guard g(g_mu);
    return alloc(p, bytes, DEVICE);
}
cudaError_t cudaFree(void *p)
{
    guard g(g_mu);
    run_everything(); /* cudaFree synchronises the device */
    return release(p, DEVICE);
}
cudaError_t cudaMallocHost(void **p, size_t bytes)
{
    guard g(g_mu);
    return alloc(p, bytes, PINNED);
}
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags)
{
    (void)flags;
    return cudaMallocHost(p, bytes);
}
cudaError_t cudaFreeHost(void *p)
{
    guard g(g_mu);
    run_everything();
    return release(p, PINNED);
}
cudaError_t cudaHostRegister(void *p, size_t bytes, unsigned flags)
{
    guard g(g_mu);
    (void)flags;
    if (!p || !bytes)
        return fail(cudaErrorInvalidValue);
    if (find_block(p))
        return fail(cudaErrorInvalidValue); /* cudaErrorHostMemoryAlreadyRegistered */
    g_mem[(uintptr_t)p] = block{ bytes, REGISTERED, 0, 0 };
    return cudaSuccess;
}
cudaError_t cudaHostUnregister(void *p)
{
    guard g(g_mu);
    auto it = g_mem.find((uintptr_t)p);
    if (it == g_mem.end() || it->second.k != REGISTERED)
        return fail(cudaErrorInvalidValue);
    run_everything();
    g_mem.erase(it);
    return cudaSuccess;
}
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s)
{
    guard g(g_mu);
    if (!valid(as_stream(s)))
        return fail(cudaErrorInvalidResourceHandle);
    return alloc(p, bytes, DEVICE);
}
cudaError_t cudaFreeAsync(void *p, cudaStream_t s)
{
    guard g(g_mu);
    stream *st = as_stream(s);
    if (!valid(st))
        return fail(cudaErrorInvalidResourceHandle);
    if (p && g_mem.find((uintptr_t)p) == g_mem.end())
        return fail(cudaErrorInvalidDevicePointer);
    push_fn(st, [p]() {
        if (release(p, DEVICE) != cudaSuccess)
            die("cudaFreeAsync(%p): not device memory, or freed twice", p);
    });
    return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p)
{
    guard g(g_mu);
    if (!a)
        return fail(cudaErrorInvalidValue);
    memset(a, 0, sizeof *a);
    auto b = find_block(p);
    if (!b) {
        a->type = cudaMemoryTypeUnregistered;
        a->device = -2;
        return cudaSuccess;
    }
    a->type = b->second.k == DEVICE ? cudaMemoryTypeDevice : cudaMemoryTypeHost;
    a->device = b->second.k == DEVICE ? b->second.device : 0;
    a->devicePointer = (void *)p;
    a->hostPointer = b->second.k == DEVICE ? nullptr : (void *)p;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total)
{
    if (!free_bytes || !total)
        return fail(cudaErrorInvalidValue);
    *total = (size_t)16 << 30;
    *free_bytes = *total / 2;
    return cudaSuccess;
}

static cudaError_t copy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind k,
                        cudaStream_t s, bool sync)
{
    guard g(g_mu);
    bind_ctx();
    if ((unsigned)k > (unsigned)cudaMemcpyDefault)
        return fail(cudaErrorInvalidMemcpyDirection);
    if (bytes && (!dst || !src))
        return fail(cudaErrorInvalidValue);
    stream *st = as_stream(s);
    if (!valid(st))
        return fail(cudaErrorInvalidResourceHandle);
    if (bytes == 0)
        return cudaSuccess;
    auto db = find_block(dst), sb = find_block(src);
    if ((db && (uintptr_t)dst + bytes > db->first + db->second.bytes) ||
        (sb && (uintptr_t)src + bytes > sb->first + sb->second.bytes))
        return fail(cudaErrorInvalidValue); /* past the end of an allocation */
    const bool dst_dev = db && db->second.k == DEVICE, src_dev = sb && sb->second.k == DEVICE;
    /* The runtime's "API synchronization behavior": from pageable memory to
     * the device, the stream's earlier work completes and the source is
     * staged before the call returns, but the write to the device may land
     * later; to pageable memory the copy is complete at return; a
     * synchronous copy is complete at return unless it is device to device. */
    if (!sb && dst_dev) {
        run_all(st);
        auto staged = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + bytes);
        push_fn(st, [dst, staged]() { memcpy(dst, staged->data(), staged->size()); });
        return cudaSuccess;
    }
    push_fn(st, [dst, src, bytes]() { memmove(dst, src, bytes); });
    if (!db || (sync && !(src_dev && dst_dev)))
        run_all(st);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind k)
{
    return copy(dst, src, bytes, k, nullptr, true);
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind k,
                            cudaStream_t s)
{
    return copy(dst, src, bytes, k, s, false);
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t bytes, cudaStream_t s)
{
    guard g(g_mu);
    stream *st = as_stream(s);
    if (!valid(st))
        return fail(cudaErrorInvalidResourceHandle);
    if (bytes == 0)
        return cudaSuccess;
    auto b = find_block(p);
    if (!b || (uintptr_t)p + bytes > b->first + b->second.bytes)
        return fail(cudaErrorInvalidValue);
    push_fn(st, [p, v, bytes]() { memset(p, v, bytes); });
    return cudaSuccess;
}
cudaError_t cudaMemset(void *p, int v, size_t bytes)
{
    guard g(g_mu);
    cudaError_t e = cudaMemsetAsync(p, v, bytes, nullptr);
    auto b = find_block(p); /* asynchronous unless the target is pinned host memory */
    if (e == cudaSuccess && b && b->second.k != DEVICE)
        run_all(&g_legacy);
    return e;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    guard g(g_mu);
    if (!s)
        return fail(cudaErrorInvalidValue);
    bind_ctx();
    g_streams.emplace_back(new stream{ flags, t_device, false, {}, 0, 0 });
    *s = reinterpret_cast<cudaStream_t>(g_streams.back().get());
    return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    guard g(g_mu);
    stream *st = as_stream(s);
    if (!s || !valid(st))
        return fail(cudaErrorInvalidResourceHandle);
    st->destroyed = true; /* the handle is gone at once; its work still completes */
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    guard g(g_mu);
    stream *st = as_stream(s);
    if (!valid(st))
        return fail(cudaErrorInvalidResourceHandle);
    run_all(st);
    return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s)
{
    guard g(g_mu);
    stream *st = as_stream(s);
    if (!valid(st))
        return fail(cudaErrorInvalidResourceHandle);
    if (st->done == st->queued)
        return cudaSuccess;
    run_all(st); /* "not yet" once; done at the next query */
    return fail(cudaErrorNotReady);
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    guard g(g_mu);
    stream *st = as_stream(s);
    if (!valid(st) || !valid(e))
        return fail(cudaErrorInvalidResourceHandle);
    if (flags != 0)
        return fail(cudaErrorInvalidValue);
    if (!event_done(e))
        push(st, op{ op::WAIT, {}, nullptr, e->on, e->at });
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    guard g(g_mu);
    if (!e)
        return fail(cudaErrorInvalidValue);
    if (flags & ~(cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess))
        return fail(cudaErrorInvalidValue);
    if ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming))
        return fail(cudaErrorInvalidValue);
    bind_ctx();
    g_events.emplace_back(new emu_event{ flags, false, nullptr, 0, 0.0, false, t_device, 0 });
    *e = g_events.back().get();
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    guard g(g_mu);
    if (!valid(e))
        return fail(cudaErrorInvalidResourceHandle);
    e->destroyed = true;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    guard g(g_mu);
    stream *st = as_stream(s);
    if (!valid(e) || !valid(st) || (st != &g_legacy && !e->imported && st->device != e->device))
        return fail(cudaErrorInvalidResourceHandle); /* event and stream of one device */
    if (e->imported) { /* the other process sees nothing of it: the work is done now */
        run_all(st);
        return cudaSuccess;
    }
    e->on = st;
    push(st, op{ op::MARK, {}, e, nullptr, 0 });
    e->at = st->queued; /* its mark is the last op queued */
    if (e->flags & cudaEventInterprocess)
        run_until(st, e->at); /* complete when recorded: see cuda_runtime.h */
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e)
{
    guard g(g_mu);
    if (!valid(e))
        return fail(cudaErrorInvalidResourceHandle);
    if (e->imported) /* its waits are polled, as on a GPU where it may be pending */
        return e->polls++ & 1u ? cudaSuccess : fail(cudaErrorNotReady);
    if (event_done(e))
        return cudaSuccess;
    run_until(e->on, e->at);
    return fail(cudaErrorNotReady);
}
cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    guard g(g_mu);
    if (!valid(e))
        return fail(cudaErrorInvalidResourceHandle);
    if (e->on)
        run_until(e->on, e->at);
    return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    guard g(g_mu);
    if (!ms)
        return fail(cudaErrorInvalidValue);
    if (!valid(a) || !valid(b) || (a->flags & cudaEventDisableTiming) ||
        (b->flags & cudaEventDisableTiming) || !a->on || !b->on)
        return fail(cudaErrorInvalidResourceHandle);
    if (!event_done(a) || !event_done(b))
        return fail(cudaErrorNotReady);
    *ms = (float)(b->t_ms - a->t_ms);
    return cudaSuccess;
}

} // extern "C"

/* ---- interprocess memory and events, the driver's functions ---------------------- */

namespace {

const uint32_t IPC_MAGIC = 0x53454d55u; /* "SEMU" */
struct ipc_mem {
    uint32_t magic, kind; /* kind 1: memory, 2: an event */
    int32_t pid, fd;
    uint64_t bytes, id;
    int32_t device;
};
static_assert(sizeof(ipc_mem) <= CUDA_IPC_HANDLE_SIZE, "an IPC handle has 64 bytes");

int drv_range(unsigned long long *base, size_t *size, unsigned long long ptr)
{
    guard g(g_mu);
    const void *p = (const void *)(uintptr_t)ptr;
    if (auto s = find_segment(p)) {
        if (base) *base = s->first;
        if (size) *size = s->second.bytes;
        return 0;
    }
    auto b = find_block(p);
    if (!b || b->second.k != DEVICE)
        return 1; /* CUDA_ERROR_INVALID_VALUE */
    if (base) *base = b->first;
    if (size) *size = b->second.bytes;
    return 0;
}
int drv_ctx_get(void **ctx)
{
    if (!ctx)
        return 1;
    *ctx = t_ctx;
    return 0;
}
int drv_ctx_set(void *ctx)
{
    if (ctx == nullptr) {
        t_ctx = nullptr;
        return 0;
    }
    for (int d = 0; d < cfg().devices; d++)
        if (ctx == &g_primary[d]) {
            t_ctx = ctx;
            t_device = d; /* the runtime's current device follows the context */
            return 0;
        }
    return 201; /* CUDA_ERROR_INVALID_CONTEXT */
}

} // namespace

extern "C" {

void *emu_driver_symbol(const char *name)
{
    if (strcmp(name, "cuMemGetAddressRange_v2") == 0)
        return (void *)drv_range;
    if (strcmp(name, "cuCtxGetCurrent") == 0)
        return (void *)drv_ctx_get;
    if (strcmp(name, "cuCtxSetCurrent") == 0)
        return (void *)drv_ctx_set;
    return nullptr;
}

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p)
{
    guard g(g_mu);
    if (!h || !p)
        return fail(cudaErrorInvalidValue);
    auto s = find_segment(p);
    if (!s) {
        auto b = find_block(p);
        if (b && b->second.k == DEVICE && !ipc_mode())
            fprintf(stderr, "cuda emulator: cudaIpcGetMemHandle needs EMU_IPC=1 (device memory "
                            "in segments another process can map)\n");
        return fail(b && b->second.k == DEVICE ? cudaErrorNotSupported
                                               : cudaErrorInvalidDevicePointer);
    }
    if (s->second.fd < 0)
        return fail(cudaErrorInvalidValue); /* an imported segment is not exported again */
    auto b = find_block(p);
    ipc_mem m = { IPC_MAGIC, 1, (int32_t)getpid(), s->second.fd, s->second.bytes, s->second.id,
                  b ? b->second.device : 0 };
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, &m, sizeof m);
    return cudaSuccess;
}

cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags)
{
    guard g(g_mu);
    (void)flags;
    if (!p)
        return fail(cudaErrorInvalidValue);
    *p = nullptr;
    ipc_mem m;
    memcpy(&m, h.reserved, sizeof m);
    if (m.magic != IPC_MAGIC || m.kind != 1 || m.bytes == 0)
        return fail(cudaErrorInvalidValue);
    if (m.pid == (int32_t)getpid())
        return fail(cudaErrorInvalidValue); /* CUDA refuses a process's own handles too */
    for (auto &s : g_segs)
        if (s.second.fd < 0 && s.second.owner == m.pid && s.second.id == m.id) {
            s.second.users++;
            *p = (void *)s.first;
            return cudaSuccess;
        }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)m.pid, (int)m.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return fail(cudaErrorInvalidValue); /* its process is gone, or the handle is forged */
    struct stat st;
    void *base = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (uint64_t)st.st_size == m.bytes)
        base = mmap(nullptr, m.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED)
        return fail(cudaErrorInvalidValue);
    g_segs[(uintptr_t)base] = segment{ m.bytes, -1, m.id, (pid_t)m.pid, 1, m.bytes };
    g_mem[(uintptr_t)base] = block{ m.bytes, DEVICE, (uintptr_t)base, m.device };
    *p = base;
    return cudaSuccess;
}

cudaError_t cudaIpcCloseMemHandle(void *p)
{
    guard g(g_mu);
    auto it = g_segs.find((uintptr_t)p);
    if (it == g_segs.end() || it->second.fd >= 0)
        return fail(cudaErrorInvalidValue);
    if (--it->second.users == 0) { /* work still queued on it would fault, as on a GPU */
        g_mem.erase((uintptr_t)p);
        drop_segment((uintptr_t)p);
    }
    return cudaSuccess;
}

cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t *h, cudaEvent_t e)
{
    guard g(g_mu);
    if (!h || !valid(e))
        return fail(cudaErrorInvalidResourceHandle);
    if (!(e->flags & cudaEventInterprocess) || e->imported)
        return fail(cudaErrorInvalidResourceHandle);
    ipc_mem m = { IPC_MAGIC, 2, (int32_t)getpid(), -1, 0, (uint64_t)(uintptr_t)e, 0 };
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, &m, sizeof m);
    return cudaSuccess;
}

cudaError_t cudaIpcOpenEventHandle(cudaEvent_t *e, cudaIpcEventHandle_t h)
{
    guard g(g_mu);
    if (!e)
        return fail(cudaErrorInvalidValue);
    ipc_mem m;
    memcpy(&m, h.reserved, sizeof m);
    if (m.magic != IPC_MAGIC || m.kind != 2 || m.pid == (int32_t)getpid())
        return fail(cudaErrorInvalidResourceHandle);
    g_events.emplace_back(new emu_event{ cudaEventDisableTiming | cudaEventInterprocess, false,
                                         nullptr, 0, 0.0, true, t_device, 0 });
    *e = g_events.back().get();
    return cudaSuccess;
}

} // extern "C"

/* ---- NCCL, one rank ------------------------------------------------------------------ */

typedef std::function<void()> submit_fn; /* queues an operation's work on its streams */

struct emu_nccl_comm {
    bool blocking, aborted;
    int pending;                 /* polls of ncclCommGetAsyncError still answering ncclInProgress */
    unsigned calls;
    std::vector<submit_fn> held; /* an operation answered ncclInProgress: queued once settled */
};

namespace {

struct p2p {
    bool send;
    void *buf;
    size_t bytes;
    ncclComm_t comm;
    stream *s;
};
/* Groups are the calling thread's, as NCCL's are. */
thread_local int t_group = 0;
thread_local std::vector<p2p> t_p2p;
thread_local std::vector<std::pair<ncclComm_t, submit_fn>> t_group_ops;

size_t type_bytes(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}

/* A communicator's call may go on: not aborted (a use after ncclCommAbort,
 * which frees it in NCCL, stops the run), and, non-blocking, its last
 * ncclInProgress settled, as NCCL requires. */
ncclResult_t usable(ncclComm_t c)
{
    if (!c)
        return ncclInvalidArgument;
    if (c->aborted)
        die("NCCL: a communicator used after ncclCommAbort (NCCL has freed it)");
    if (c->pending) {
        fprintf(stderr, "cuda emulator: NCCL: communicator used before its last operation "
                        "returned ncclSuccess (poll ncclCommGetAsyncError first)\n");
        return ncclInvalidArgument;
    }
    return ncclSuccess;
}

/* The common checks of a collective or a send/receive. */
ncclResult_t nccl_op(ncclComm_t c, ncclDataType_t t, cudaStream_t s, size_t count, const void *a,
                     void *b, int root, size_t *bytes, stream **st)
{
    ncclResult_t r = usable(c);
    if (r != ncclSuccess)
        return r;
    *bytes = type_bytes(t) * count;
    if (!type_bytes(t) || root != 0)
        return ncclInvalidArgument;
    if (count && (!a || !b))
        return ncclInvalidArgument;
    *st = as_stream(s);
    if (!valid(*st))
        return ncclUnhandledCudaError;
    return ncclSuccess;
}

/* An operation's answer, its work queued now or held: a non-blocking
 * communicator answers ncclInProgress on every other call and queues the
 * work only when a poll settles it, as a real one may still be connecting. */
ncclResult_t finish(ncclComm_t c, std::vector<submit_fn> ops)
{
    if (!c->blocking && (c->calls++ & 1u)) {
        c->held = std::move(ops);
        c->pending = 1;
        return ncclInProgress;
    }
    for (auto &f : ops)
        f();
    return ncclSuccess;
}

ncclResult_t submit(ncclComm_t c, submit_fn f)
{
    if (t_group) { /* queued at the group's end, which answers for it */
        t_group_ops.emplace_back(c, std::move(f));
        return ncclSuccess;
    }
    std::vector<submit_fn> one;
    one.push_back(std::move(f));
    return finish(c, std::move(one));
}

ncclResult_t nccl_copy(const void *send, void *recv, size_t count, ncclDataType_t t, int root,
                       ncclComm_t comm, cudaStream_t s)
{
    guard g(g_mu);
    size_t bytes;
    stream *st;
    ncclResult_t r = nccl_op(comm, t, s, count, send, recv, root, &bytes, &st);
    if (r != ncclSuccess)
        return r;
    return submit(comm, [st, send, recv, bytes]() {
        if (bytes && send != recv)
            push_fn(st, [send, recv, bytes]() { memmove(recv, send, bytes); });
    });
}

} // namespace

extern "C" {

ncclResult_t ncclGetVersion(int *version)
{
    if (!version)
        return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}
ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    if (!id)
        return ncclInvalidArgument;
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "cuda emulator %ld", (long)getpid());
    return ncclSuccess;
}
const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}
const char *ncclGetLastError(ncclComm_t comm)
{
    (void)comm;
    return "";
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config)
{
    (void)id;
    if (!comm)
        return ncclInvalidArgument;
    *comm = nullptr;
    if (nranks != 1 || rank != 0) {
        fprintf(stderr, "cuda emulator: NCCL communicators of one rank only (asked: rank %d of "
                        "%d)\n", rank, nranks);
        return ncclInvalidUsage;
    }
    bool blocking = !config || config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;
    *comm = new emu_nccl_comm{ blocking, false, blocking ? 0 : 1, 0, {} };
    return blocking ? ncclSuccess : ncclInProgress;
}
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async_error)
{
    guard g(g_mu);
    if (!comm || !async_error)
        return ncclInvalidArgument;
    if (comm->aborted)
        die("NCCL: ncclCommGetAsyncError on a communicator after ncclCommAbort (freed in NCCL)");
    *async_error = ncclSuccess;
    if (comm->pending) {
        *async_error = ncclInProgress; /* this poll; the next one answers ncclSuccess */
        if (--comm->pending == 0) {
            std::vector<submit_fn> ops = std::move(comm->held);
            comm->held.clear();
            for (auto &f : ops)
                f();
        }
    }
    return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t comm)
{
    guard g(g_mu);
    ncclResult_t r = usable(comm);
    if (r != ncclSuccess)
        return r;
    if (comm->blocking)
        return ncclSuccess;
    comm->pending = 1;
    return ncclInProgress;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    guard g(g_mu);
    if (!comm)
        return ncclInvalidArgument;
    if (comm->aborted)
        die("NCCL: ncclCommDestroy after ncclCommAbort (freed in NCCL)");
    delete comm;
    return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    guard g(g_mu);
    if (comm) {
        if (comm->aborted)
            die("NCCL: ncclCommAbort twice on one communicator (freed in NCCL)");
        comm->aborted = true; /* kept, so that a later use stops the run instead of corrupting */
        comm->held.clear();
        comm->pending = 0;
    }
    return ncclSuccess;
}
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count)
{
    if (!comm || !count)
        return ncclInvalidArgument;
    *count = 1;
    return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank)
{
    if (!comm || !rank)
        return ncclInvalidArgument;
    *rank = 0;
    return ncclSuccess;
}

ncclResult_t ncclGroupStart(void)
{
    t_group++;
    return ncclSuccess;
}
ncclResult_t ncclGroupEnd(void)
{
    guard g(g_mu);
    if (t_group == 0)
        return ncclInvalidUsage;
    if (--t_group)
        return ncclSuccess;
    std::vector<p2p> sends, recvs;
    for (auto &x : t_p2p)
        (x.send ? sends : recvs).push_back(x);
    t_p2p.clear();
    auto ops = std::move(t_group_ops);
    t_group_ops.clear();
    /* each send to self meets the receive of the same position */
    if (sends.size() != recvs.size())
        return ncclInvalidUsage;
    for (size_t i = 0; i < sends.size(); i++) {
        if (sends[i].bytes != recvs[i].bytes)
            return ncclInvalidUsage;
        stream *rs = recvs[i].s, *ss = sends[i].s;
        const void *from = sends[i].buf;
        void *to = recvs[i].buf;
        size_t bytes = sends[i].bytes;
        ops.emplace_back(recvs[i].comm, [rs, ss, from, to, bytes]() {
            if (rs != ss) /* the receive after the send's earlier work */
                push(rs, op{ op::WAIT, {}, nullptr, ss, ss->queued });
            if (bytes && from != to)
                push_fn(rs, [from, to, bytes]() { memmove(to, from, bytes); });
            if (rs != ss) /* and the send done only with it */
                push(ss, op{ op::WAIT, {}, nullptr, rs, rs->queued });
        });
    }
    if (ops.empty())
        return ncclSuccess;
    /* one answer for the group: each communicator's work together */
    ncclResult_t r = ncclSuccess;
    std::vector<ncclComm_t> comms;
    for (auto &o : ops)
        if (std::find(comms.begin(), comms.end(), o.first) == comms.end())
            comms.push_back(o.first);
    for (ncclComm_t c : comms) {
        std::vector<submit_fn> mine;
        for (auto &o : ops)
            if (o.first == c)
                mine.push_back(std::move(o.second));
        ncclResult_t rc = finish(c, std::move(mine));
        if (r == ncclSuccess)
            r = rc;
    }
    return r;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t s)
{
    if ((unsigned)op > (unsigned)ncclAvg)
        return ncclInvalidArgument;
    return nccl_copy(send, recv, count, t, 0, comm, s);
}
ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t t,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t s)
{
    if ((unsigned)op > (unsigned)ncclAvg)
        return ncclInvalidArgument;
    return nccl_copy(send, recv, count, t, root, comm, s);
}
ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root,
                           ncclComm_t comm, cudaStream_t s)
{
    return nccl_copy(send, recv, count, t, root, comm, s);
}
ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t s)
{
    return nccl_copy(send, recv, count, t, 0, comm, s);
}
ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t s)
{
    if ((unsigned)op > (unsigned)ncclAvg)
        return ncclInvalidArgument;
    return nccl_copy(send, recv, count, t, 0, comm, s);
}
static ncclResult_t p2p_queue(bool is_send, void *buf, size_t count, ncclDataType_t t, int peer,
                              ncclComm_t comm, cudaStream_t s)
{
    guard g(g_mu);
    size_t bytes;
    stream *st;
    ncclResult_t r = nccl_op(comm, t, s, count, buf, buf, peer, &bytes, &st);
    if (r != ncclSuccess)
        return r;
    if (t_group == 0)
        return ncclInvalidUsage; /* a lone send to self would never complete */
    t_p2p.push_back(p2p{ is_send, buf, bytes, comm, st });
    return ncclSuccess;
}
ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t s)
{
    return p2p_queue(true, const_cast<void *>(send), count, t, peer, comm, s);
}
ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t s)
{
    return p2p_queue(false, recv, count, t, peer, comm, s);
}

} // extern "C"
