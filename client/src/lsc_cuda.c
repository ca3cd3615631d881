/* lsc_cuda.c - libscape's device buffers (lsc_cuda.h). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "scape_cuda_err.h"

#include "lsc_cuda.h"

_Static_assert(sizeof(cudaIpcMemHandle_t) == LSC_IPC_HANDLE_BYTES, "IPC handle size");

typedef int (*get_range_fn)(unsigned long long *base, size_t *size, unsigned long long ptr);
typedef int (*ctx_get_fn)(void **ctx);
typedef int (*ctx_set_fn)(void *ctx);

/* A function of the driver, from the libcuda the runtime loaded (the CPU
 * emulator's own in its build: tests/gpu/emu). */
static void *driver(const char *name)
{
#ifdef SCAPE_CUDA_EMU
    return emu_driver_symbol(name);
#endif
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL)
        h = dlopen("libcuda.so.1", RTLD_NOW);
    return h ? dlsym(h, name) : NULL;
}

static get_range_fn address_range(void)
{
    static get_range_fn fn;
    if (fn == NULL)
        fn = (get_range_fn)driver("cuMemGetAddressRange_v2");
    return fn;
}

/* The caller's current device, set to `device` for the calls between
 * guard_on and guard_off and given back after them.  What is given back is
 * the thread's current context as it was (the driver's cuCtxGetCurrent /
 * cuCtxSetCurrent), not a device number: a thread that had no context yet
 * (cudaGetDevice says 0 then) is left without one, instead of getting a
 * context on GPU 0 that cudaSetDevice(0) would create there. */
typedef struct guard {
    int prev, changed;
    void *prev_ctx;
    int have_ctx;
} guard;

static cudaError_t guard_on(guard *g, int device)
{
    static ctx_get_fn get;
    if (get == NULL)
        get = (ctx_get_fn)driver("cuCtxGetCurrent");
    g->changed = 0;
    g->have_ctx = get && get(&g->prev_ctx) == 0;
    cudaError_t e = cudaGetDevice(&g->prev);
    if (e == cudaSuccess && g->prev != device) {
        e = cudaSetDevice(device);
        g->changed = e == cudaSuccess;
    }
    if (e != cudaSuccess)
        (void)cudaGetLastError();
    return e;
}

static void guard_off(const guard *g)
{
    static ctx_set_fn set;
    if (!g->changed)
        return;
    if (set == NULL)
        set = (ctx_set_fn)driver("cuCtxSetCurrent");
    if (g->have_ctx && set && set(g->prev_ctx) == 0)
        return;
    scape_cuda_quietly(cudaSetDevice(g->prev));
}

#define LSC_GUARDED(g, call)                                                   \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess) {                                               \
            guard_off(g);                                                      \
            return scape_set_error(SCAPE_CUDA, "libscape: %s: %s", #call,      \
                                   scape_cuda_failed(e_));               \
        }                                                                      \
    } while (0)

/* A MIG instance: CUDA_VISIBLE_DEVICES names it by its MIG-... UUID, or
 * (a container runtime that sets only NVIDIA_VISIBLE_DEVICES, a GPU in MIG
 * mode) the device's name carries "MIG" ("NVIDIA H100 80GB HBM3 MIG
 * 1g.10gb"). */
static int on_mig(int device)
{
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    if (v && strstr(v, "MIG-") != NULL)
        return 1;
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    prop.name[sizeof prop.name - 1] = '\0';
    return strstr(prop.name, " MIG ") != NULL;
}

scape_rc lsc_cuda_check_ipc(int device)
{
    int ua = 0, ipc_ev = 0;
    cudaError_t e = cudaDeviceGetAttribute(&ua, cudaDevAttrUnifiedAddressing, device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&ipc_ev, cudaDevAttrIpcEventSupport, device);
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "scape_attach: CUDA device %d: %s", device,
                               scape_cuda_failed(e));
    if (on_mig(device))
        return scape_set_error(SCAPE_UNSUPPORTED, "scape_attach: CUDA device %d is a MIG "
                               "instance (CUDA_VISIBLE_DEVICES names MIG-..., or its name says "
                               "MIG), and MIG has no "
                               "CUDA IPC, so scaped cannot open this trainer's buffers: attach "
                               "with host memory (SCAPE_MEMORY_HOST, device='cpu'), or run on "
                               "a whole GPU", device);
    if (!ua || !ipc_ev)
        return scape_set_error(SCAPE_UNSUPPORTED, "scape_attach: CUDA device %d has no %s, "
                               "which handing CUDA buffers to scaped needs: attach with host "
                               "memory (SCAPE_MEMORY_HOST, device='cpu')", device,
                               !ua ? "unified addressing" : "interprocess events");
    return SCAPE_OK;
}

scape_rc lsc_cuda_alloc(lsc_dev_buf *b, int device, size_t bytes)
{
    memset(b, 0, sizeof *b);
    guard g;
    LSC_GUARDED(&g, guard_on(&g, device));
    struct cudaDeviceProp prop;
    LSC_GUARDED(&g, cudaGetDeviceProperties(&prop, device));
    _Static_assert(sizeof prop.uuid.bytes == sizeof b->uuid, "a GPU UUID has 16 bytes");
    memcpy(b->uuid, prop.uuid.bytes, sizeof b->uuid);
    size_t whole = (bytes + LSC_ALLOC_GRANULE - 1) / LSC_ALLOC_GRANULE * LSC_ALLOC_GRANULE;
    LSC_GUARDED(&g, cudaMalloc(&b->ptr, whole ? whole : LSC_ALLOC_GRANULE));
    b->bytes = bytes;
    b->device = device;
    cudaIpcMemHandle_t h;
    /* The daemon reads the buffers from another process: the zeros must be
     * there before anyone can be told about them (a stream of our own,
     * waited for alone). */
    cudaStream_t z = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&z, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(b->ptr, 0, bytes, z);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(z);
    if (z)
        scape_cuda_quietly(cudaStreamDestroy(z));
    int ipc_failed = 0;
    if (e == cudaSuccess && (e = cudaIpcGetMemHandle(&h, b->ptr)) != cudaSuccess)
        ipc_failed = 1;
    get_range_fn range = address_range();
    unsigned long long base = 0;
    size_t size = 0;
    if (e == cudaSuccess && (range == NULL ||
                             range(&base, &size, (unsigned long long)(uintptr_t)b->ptr) != 0))
        e = cudaErrorUnknown; /* the offset cannot be told: do not hand out the buffer */
    const char *why = e == cudaSuccess ? "" : scape_cuda_failed(e);
    if (e != cudaSuccess) {
        scape_cuda_quietly(cudaFree(b->ptr));
        memset(b, 0, sizeof *b);
        guard_off(&g);
        if (ipc_failed)
            return scape_set_error(SCAPE_UNSUPPORTED, "scape_attach: CUDA IPC is not available "
                                   "on device %d (cudaIpcGetMemHandle: %s%s): attach with host "
                                   "memory (SCAPE_MEMORY_HOST, device='cpu')", device,
                                   why, on_mig(device) ? "; a MIG instance" : "");
        return scape_set_error(SCAPE_CUDA, "libscape: exporting a device buffer: %s",
                               e == cudaErrorUnknown ? "cannot measure its allocation "
                                                      "(cuMemGetAddressRange)"
                                                    : why);
    }
    memcpy(b->handle, &h, sizeof h);
    b->offset = (size_t)((unsigned long long)(uintptr_t)b->ptr - base);
    guard_off(&g);
    return SCAPE_OK;
}

void lsc_cuda_free(lsc_dev_buf *b, void *stream)
{
    guard g;
    if (b->ptr && guard_on(&g, b->device) == cudaSuccess) {
        scape_cuda_quietly(cudaStreamSynchronize((cudaStream_t)stream)); /* the caller's last use */
        scape_cuda_quietly(cudaFree(b->ptr));
        guard_off(&g);
    }
    memset(b, 0, sizeof *b);
}

scape_rc lsc_cuda_events_create(lsc_dev_events *ev, int device)
{
    memset(ev, 0, sizeof *ev);
    ev->device = device;
    ev->blocking = 1;
    guard g;
    LSC_GUARDED(&g, guard_on(&g, device));
    cudaEvent_t e = NULL;
    LSC_GUARDED(&g, cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess));
    cudaIpcEventHandle_t h;
    cudaError_t r = cudaIpcGetEventHandle(&h, e);
    if (r != cudaSuccess) {
        const char *why = scape_cuda_failed(r);
        scape_cuda_quietly(cudaEventDestroy(e));
        guard_off(&g);
        return scape_set_error(SCAPE_UNSUPPORTED, "scape_attach: cannot export an "
                               "interprocess event on CUDA device %d (cudaIpcGetEventHandle: "
                               "%s): attach with host memory (SCAPE_MEMORY_HOST)", device, why);
    }
    _Static_assert(sizeof h == LSC_IPC_HANDLE_BYTES, "IPC event handle size");
    memcpy(ev->grad_handle, &h, sizeof h);
    ev->grad = e;
    guard_off(&g);
    return SCAPE_OK;
}

scape_rc lsc_cuda_events_open_params(lsc_dev_events *ev, const void *handle, size_t len)
{
    if (len != LSC_IPC_HANDLE_BYTES)
        return scape_set_error(SCAPE_PROTO, "scape_attach: scaped's params_event has %zu "
                               "bytes, not %d", len, LSC_IPC_HANDLE_BYTES);
    cudaIpcEventHandle_t h;
    memcpy(&h, handle, sizeof h);
    guard g;
    cudaEvent_t e = NULL;
    LSC_GUARDED(&g, guard_on(&g, ev->device));
    LSC_GUARDED(&g, cudaIpcOpenEventHandle(&e, h));
    ev->params = e;
    guard_off(&g);
    return SCAPE_OK;
}

void lsc_cuda_events_free(lsc_dev_events *ev)
{
    guard g;
    if ((ev->grad || ev->params) && guard_on(&g, ev->device) == cudaSuccess) {
        if (ev->grad)
            scape_cuda_quietly(cudaEventDestroy((cudaEvent_t)ev->grad));
        if (ev->params)
            scape_cuda_quietly(cudaEventDestroy((cudaEvent_t)ev->params));
        guard_off(&g);
    }
    memset(ev, 0, sizeof *ev);
}

scape_rc lsc_cuda_grads_ready(lsc_dev_events *ev, int initial)
{
    guard g;
    LSC_GUARDED(&g, guard_on(&g, ev->device));
    /* scape_sync's answer does not wait for events: the initial parameters
     * must be there when it is asked; so must everything for a daemon that
     * knows no events */
    if (initial || ev->params == NULL)
        LSC_GUARDED(&g, cudaStreamSynchronize((cudaStream_t)ev->stream));
    else
        LSC_GUARDED(&g, cudaEventRecord((cudaEvent_t)ev->grad, (cudaStream_t)ev->stream));
    guard_off(&g);
    return SCAPE_OK;
}

scape_rc lsc_cuda_params_ready(lsc_dev_events *ev)
{
    if (ev->params == NULL)
        return SCAPE_OK; /* such a daemon answers once the parameters are there */
    guard g;
    LSC_GUARDED(&g, guard_on(&g, ev->device));
    if (ev->blocking)
        LSC_GUARDED(&g, cudaEventSynchronize((cudaEvent_t)ev->params));
    else
        LSC_GUARDED(&g, cudaStreamWaitEvent((cudaStream_t)ev->stream,
                                            (cudaEvent_t)ev->params, 0));
    guard_off(&g);
    return SCAPE_OK;
}
