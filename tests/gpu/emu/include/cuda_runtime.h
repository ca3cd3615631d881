/* cuda_runtime.h - scaped's CUDA emulator: the part of the CUDA runtime API
 * that scaped uses, run on the CPU (tests/gpu/emu/emu.cpp).  It is found
 * before the toolkit's header only in the emulator build (tests/gpu/emu),
 * where the .cu files are compiled by the host C++ compiler after
 * cu2cpp.py has turned their launches into calls of emu_launch.
 *
 * What it checks: the kernels' logic (every block and thread runs, with
 * barriers and warp intrinsics honoured, in a seeded order), launch
 * configurations, and stream ordering: with EMU_LAZY=1 nothing queued on a
 * stream runs before something waits for it, so a missing synchronisation
 * reads stale data instead of getting lucky.  Memory is host memory (ASan
 * sees every kernel access in a sanitizer build; with EMU_IPC=1 other
 * processes map it, see below).  What it cannot check: timing, the memory
 * model, races between threads outside barriers, the device's own math
 * library, ordering between processes beyond what an event's record covers.
 * Names and values follow the CUDA runtime's, so the same source builds
 * against either (docs/design.md, "The CUDA code on the CPU"). */
#ifndef SCAPE_EMU_CUDA_RUNTIME_H
#define SCAPE_EMU_CUDA_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#define SCAPE_CUDA_EMU 1
#define CUDART_VERSION 13000

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorPeerAccessUnsupported = 217,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorUnknown = 999
} cudaError_t;

typedef struct emu_stream *cudaStream_t;
typedef struct emu_event *cudaEvent_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3
};

struct cudaPointerAttributes {
    enum cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
};

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrUnifiedAddressing = 41,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrIpcEventSupport = 117
};

typedef struct cudaUUID_st {
    char bytes[16];
} cudaUUID_t;

#define CUDA_IPC_HANDLE_SIZE 64
typedef struct cudaIpcMemHandle_st {
    char reserved[CUDA_IPC_HANDLE_SIZE];
} cudaIpcMemHandle_t;
typedef struct cudaIpcEventHandle_st {
    char reserved[CUDA_IPC_HANDLE_SIZE];
} cudaIpcEventHandle_t;

typedef struct cudaDeviceProp {
    char name[256];
    cudaUUID_t uuid;
    size_t totalGlobalMem;
    int major, minor;
    int multiProcessorCount;
    int maxThreadsPerBlock;
    int warpSize;
    int unifiedAddressing;
    int pciBusID, pciDeviceID, pciDomainID;
} cudaDeviceProp;

#define cudaStreamDefault 0x0u
#define cudaStreamNonBlocking 0x1u
#define cudaEventDefault 0x0u
#define cudaEventBlockingSync 0x1u
#define cudaEventDisableTiming 0x2u
#define cudaEventInterprocess 0x4u
#define cudaHostRegisterDefault 0x0u
#define cudaHostAllocDefault 0x0u
#define cudaIpcMemLazyEnablePeerAccess 0x1u

const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);

cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaGetDevice(int *dev);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev);
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int dev);
cudaError_t cudaDeviceCanAccessPeer(int *can, int dev, int peer);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaRuntimeGetVersion(int *v);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaHostRegister(void *p, size_t bytes, unsigned flags);
cudaError_t cudaHostUnregister(void *p);
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total);

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind k,
                            cudaStream_t s);
cudaError_t cudaMemset(void *p, int v, size_t bytes);
cudaError_t cudaMemsetAsync(void *p, int v, size_t bytes, cudaStream_t s);

cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);

cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b);

/* Interprocess memory and events.  Memory can be handed to another process
 * only when EMU_IPC=1: then device memory lives in memfd segments, as
 * CUDA's own allocator lays it out at its worst (allocations under 2 MiB
 * carved out of shared 2 MiB segments, so that a handle names the segment
 * and its base, and the buffer is at an offset in it), and another process
 * maps the segment through /proc/PID/fd.  An interprocess event completes
 * when it is recorded (the stream's earlier work runs then), so an opened
 * one is always complete: ordering across processes is not emulated. */
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p);
cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags);
cudaError_t cudaIpcCloseMemHandle(void *p);
cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t *h, cudaEvent_t e);
cudaError_t cudaIpcOpenEventHandle(cudaEvent_t *e, cudaIpcEventHandle_t h);

/* The emulator's driver functions (cuMemGetAddressRange_v2, cuCtxGetCurrent,
 * cuCtxSetCurrent) by name, where the real code takes them from libcuda
 * with dlsym; NULL for any other name. */
void *emu_driver_symbol(const char *name);

#ifdef __cplusplus
} /* extern "C" */
#include "emu_device.h"
#endif

#endif /* SCAPE_EMU_CUDA_RUNTIME_H */
