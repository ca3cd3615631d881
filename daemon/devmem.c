/* devmem.c - trainers' CUDA IPC buffers, and shared memory registered for
 * the cuda executor (shm.h).
 *
 * The daemon opens the trainer's allocation on its own device.  The cuda
 * executor reads and writes it there; for the host executor the daemon
 * keeps a pinned host copy of it, which is what that engine reads and
 * writes: the gradients are pulled into it before a step and the new
 * parameters pushed back after.  Before opening, the handle's allocation is
 * measured with the driver's cuMemGetAddressRange (looked up in the already
 * loaded libcuda), so a trainer that declares more than it allocated is
 * refused instead of making a copy fault, which would poison the daemon's
 * CUDA context for every trainer.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime.h>

#include "scape_cuda_err.h"

#include "shm.h"

_Static_assert(sizeof(cudaIpcMemHandle_t) == SHM_IPC_HANDLE_BYTES, "IPC handle size");

typedef int (*get_range_fn)(unsigned long long *base, size_t *size, unsigned long long ptr);

static get_range_fn address_range(void)
{
    static get_range_fn fn;
#ifdef SCAPE_CUDA_EMU /* the CPU emulator's driver (tests/gpu/emu) */
    fn = (get_range_fn)emu_driver_symbol("cuMemGetAddressRange_v2");
#endif
    if (fn == NULL) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (h == NULL)
            h = dlopen("libcuda.so.1", RTLD_NOW);
        if (h)
            fn = (get_range_fn)dlsym(h, "cuMemGetAddressRange_v2");
    }
    return fn;
}

scape_rc shm_map_open_cuda(shm_map *m, const void *handle, size_t handle_len, size_t offset,
                           size_t declared, size_t need, int device, int from, int mirror,
                           const char *what)
{
    memset(m, 0, sizeof *m);
    if (handle == NULL || handle_len != SHM_IPC_HANDLE_BYTES)
        return scape_set_error(SCAPE_INVALID, "%s: a CUDA IPC handle has %d bytes, not %zu",
                               what, SHM_IPC_HANDLE_BYTES, handle_len);
    if (declared < need)
        return scape_set_error(SCAPE_INVALID,
                               "%s: buffer of %zu bytes is too small, the layout needs %zu",
                               what, declared, need);
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "%s: cudaSetDevice(%d): %s", what, device,
                               scape_cuda_failed(e));
    if (from < 0)
        from = device;
    int peer = from == device;
    if (!peer && (e = cudaDeviceCanAccessPeer(&peer, device, from)) != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "%s: cudaDeviceCanAccessPeer(%d, %d): %s", what,
                               device, from, scape_cuda_failed(e));
    if (!peer)
        return scape_set_error(SCAPE_UNSUPPORTED,
                               "%s: the trainer's buffers are on CUDA device %d, and this "
                               "daemon's device %d has no peer access to it: run one daemon "
                               "per GPU (cuda_device: %d, its own runtime_dir) and attach each "
                               "trainer to the daemon of its GPU", what, from, device, from);
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    void *dev = NULL;
    e = cudaIpcOpenMemHandle(&dev, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_INVALID, "%s: cudaIpcOpenMemHandle: %s (a handle of "
                               "another process on this node?)", what, scape_cuda_failed(e));
    get_range_fn range = address_range();
    unsigned long long base = 0;
    size_t size = 0;
    scape_rc rc = SCAPE_OK;
    if (range == NULL || range(&base, &size, (unsigned long long)(uintptr_t)dev) != 0)
        rc = scape_set_error(SCAPE_CUDA, "%s: cannot measure the CUDA IPC buffer "
                             "(cuMemGetAddressRange)", what);
    else {
        size_t held = (size_t)(size - ((unsigned long long)(uintptr_t)dev - base));
        if (offset > held || held - offset < declared)
            rc = scape_set_error(SCAPE_INVALID, "%s: %zu bytes at offset %zu pass the end of "
                                 "the CUDA allocation the handle names (%zu bytes)", what,
                                 declared, offset, held);
    }
    void *host = NULL;
    if (rc == SCAPE_OK && mirror &&
        (e = cudaMallocHost(&host, declared ? declared : 1)) != cudaSuccess)
        rc = scape_set_error(SCAPE_NOMEM, "%s: cudaMallocHost(%zu): %s", what, declared,
                             scape_cuda_failed(e));
    if (rc != SCAPE_OK) {
        scape_cuda_quietly(cudaIpcCloseMemHandle(dev));
        return rc;
    }
    *m = (shm_map){ .addr = host, .bytes = declared, .dev = (char *)dev + offset,
                    .mapped = dev, .offset = offset, .device = from };
    memcpy(m->ipc, handle, sizeof m->ipc);
    snprintf(m->name, sizeof m->name, "cuda-ipc:%d", from);
    return SCAPE_OK;
}

static scape_rc copy(shm_map *m, size_t bytes, uint64_t *copied, int to_host)
{
    if (m->dev == NULL || m->addr == NULL || bytes == 0)
        return SCAPE_OK;
    if (bytes > m->bytes)
        return scape_set_error(SCAPE_INVALID, "devmem: copy of %zu bytes past a %zu-byte "
                               "buffer", bytes, m->bytes);
    cudaError_t e = to_host ? cudaMemcpy(m->addr, m->dev, bytes, cudaMemcpyDeviceToHost)
                            : cudaMemcpy(m->dev, m->addr, bytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "devmem: %s copy of %zu bytes: %s",
                               to_host ? "device-to-host" : "host-to-device", bytes,
                               scape_cuda_failed(e));
    if (copied)
        *copied += bytes;
    return SCAPE_OK;
}

scape_rc shm_map_pull(shm_map *m, size_t bytes, uint64_t *copied)
{
    return copy(m, bytes, copied, 1);
}

scape_rc shm_map_push(shm_map *m, size_t bytes, uint64_t *copied)
{
    return copy(m, bytes, copied, 0);
}

scape_rc shm_map_pin(shm_map *m, const char *what)
{
    if (m->addr == NULL || m->dev || m->pinned)
        return SCAPE_OK;
    cudaError_t e = cudaHostRegister(m->addr, m->bytes ? m->bytes : 1, cudaHostRegisterDefault);
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "%s: cudaHostRegister of the trainer's shared memory "
                               "(%zu bytes): %s; the cuda executor reads such buffers through "
                               "it (executor host does not need it)", what, m->bytes,
                               scape_cuda_failed(e));
    m->pinned = 1;
    return SCAPE_OK;
}

void shm_map_unpin(shm_map *m)
{
    if (m->pinned)
        scape_cuda_quietly(cudaHostUnregister(m->addr));
    m->pinned = 0;
}

/* Between host memory and a buffer; the device buffer only without a copy.
 * From pageable host memory cudaMemcpy may return once the bytes are staged,
 * before they have landed (the runtime's "API synchronization behavior"):
 * the default stream it used is synchronised, so that a trainer told its
 * parameters are in place (Synced, a step's reply) finds them there. */
static scape_rc move(void *dst, const void *src, size_t bytes, const char *what)
{
    cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(0); /* the default stream cudaMemcpy used */
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "devmem: %s of %zu bytes: %s", what, bytes,
                               scape_cuda_failed(e));
    return SCAPE_OK;
}

scape_rc shm_map_read(const shm_map *m, void *dst, size_t bytes)
{
    if (bytes > m->bytes)
        return scape_set_error(SCAPE_INVALID, "devmem: read of %zu bytes past a %zu-byte "
                               "buffer", bytes, m->bytes);
    if (m->addr) {
        memcpy(dst, m->addr, bytes);
        return SCAPE_OK;
    }
    return move(dst, m->dev, bytes, "read from the trainer's device buffer");
}

scape_rc shm_map_write(shm_map *m, const void *src, size_t bytes)
{
    if (bytes > m->bytes)
        return scape_set_error(SCAPE_INVALID, "devmem: write of %zu bytes past a %zu-byte "
                               "buffer", bytes, m->bytes);
    if (m->addr) {
        memcpy(m->addr, src, bytes);
        return shm_map_push(m, bytes, NULL);
    }
    return move(m->dev, src, bytes, "write into the trainer's device buffer");
}

scape_rc shm_map_cuda_device(const unsigned char *uuid, int *ordinal, const char *what)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "%s: cudaGetDeviceCount: %s", what,
                               scape_cuda_failed(e));
    for (int d = 0; d < n; d++) {
        struct cudaDeviceProp p;
        if ((e = cudaGetDeviceProperties(&p, d)) != cudaSuccess)
            return scape_set_error(SCAPE_CUDA, "%s: cudaGetDeviceProperties(%d): %s", what, d,
                                   scape_cuda_failed(e));
        _Static_assert(sizeof p.uuid.bytes == SHM_GPU_UUID_BYTES, "a GPU UUID has 16 bytes");
        if (memcmp(p.uuid.bytes, uuid, SHM_GPU_UUID_BYTES) == 0) {
            *ordinal = d;
            return SCAPE_OK;
        }
    }
    char text[64]; /* as nvidia-smi -L writes it */
    const unsigned char *u = uuid;
    snprintf(text, sizeof text, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
             "%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8],
             u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    return scape_set_error(SCAPE_UNSUPPORTED, "%s: the trainer's buffers are on GPU %s, which "
                           "is not one of the %d this daemon sees (its CUDA_VISIBLE_DEVICES): "
                           "run the node's daemon with every trainer's GPU visible, or one "
                           "daemon per GPU (cuda_device, its own runtime_dir)", what, text, n);
}

/* ---- events --------------------------------------------------------------- */

_Static_assert(sizeof(cudaIpcEventHandle_t) == SHM_IPC_HANDLE_BYTES, "IPC event handle size");

scape_rc shm_map_open_event(shm_map *m, const void *handle, size_t handle_len,
                            const char *what)
{
    if (handle == NULL || handle_len != SHM_IPC_HANDLE_BYTES)
        return scape_set_error(SCAPE_INVALID, "%s: an interprocess event handle has %d bytes, "
                               "not %zu", what, SHM_IPC_HANDLE_BYTES, handle_len);
    cudaIpcEventHandle_t h;
    memcpy(&h, handle, sizeof h);
    cudaEvent_t ev = NULL;
    cudaError_t e = cudaIpcOpenEventHandle(&ev, h);
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_INVALID, "%s: cudaIpcOpenEventHandle: %s (an event of "
                               "another process on this node, made with cudaEventInterprocess "
                               "and cudaEventDisableTiming?)", what, scape_cuda_failed(e));
    if (m->event)
        scape_cuda_quietly(cudaEventDestroy((cudaEvent_t)m->event));
    m->event = ev;
    return SCAPE_OK;
}

scape_rc shm_map_export_event(shm_map *m, unsigned char *handle, const char *what)
{
    cudaEvent_t ev = NULL;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess);
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "%s: cudaEventCreateWithFlags: %s", what,
                               scape_cuda_failed(e));
    cudaIpcEventHandle_t h;
    if ((e = cudaIpcGetEventHandle(&h, ev)) != cudaSuccess) {
        const char *why = scape_cuda_failed(e);
        scape_cuda_quietly(cudaEventDestroy(ev));
        return scape_set_error(SCAPE_CUDA, "%s: cudaIpcGetEventHandle: %s", what, why);
    }
    memcpy(handle, &h, sizeof h);
    if (m->event)
        scape_cuda_quietly(cudaEventDestroy((cudaEvent_t)m->event));
    m->event = ev;
    return SCAPE_OK;
}

scape_rc shm_map_event_done(const shm_map *m, int *done, const char *what)
{
    *done = 1;
    if (m->event == NULL)
        return SCAPE_OK;
    cudaError_t e = scape_cuda_query(cudaEventQuery((cudaEvent_t)m->event));
    if (e == cudaErrorNotReady) {
        *done = 0;
        return SCAPE_OK;
    }
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "%s: cudaEventQuery: %s", what, scape_cuda_failed(e));
    return SCAPE_OK;
}

scape_rc shm_map_record_event(shm_map *m, const char *what)
{
    static cudaStream_t quiet; /* a stream of the daemon's own, with nothing on it */
    if (m->event == NULL)
        return SCAPE_OK;
    cudaError_t e = cudaSuccess;
    if (quiet == NULL)
        e = cudaStreamCreateWithFlags(&quiet, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        e = cudaEventRecord((cudaEvent_t)m->event, quiet);
    if (e != cudaSuccess)
        return scape_set_error(SCAPE_CUDA, "%s: recording the parameters-ready event: %s", what,
                               scape_cuda_failed(e));
    return SCAPE_OK;
}

void shm_map_close_cuda(shm_map *m)
{
    if (m->event)
        scape_cuda_quietly(cudaEventDestroy((cudaEvent_t)m->event));
    if (m->mapped)
        scape_cuda_quietly(cudaIpcCloseMemHandle(m->mapped));
    if (m->addr)
        scape_cuda_quietly(cudaFreeHost(m->addr));
    memset(m, 0, sizeof *m);
}
