/*
 * A stand-in for the CUDA driver (libcuda.so.1) on machines without a GPU: just the entry
 * points the launch shim wraps or calls, each counting what it was asked.  Launches run
 * nothing; events "complete" when fake_gpu_catch_up() says so.  Built by the test that
 * uses it, never installed.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
static unsigned long launches, records, syncs;
static int completed_up_to; /* events numbered 1.. complete up to this one */
static int next_event = 1;
static float elapsed_ms = 0.1f; /* what every event pair measures */

unsigned long fake_launches(void) { return launches; }
unsigned long fake_records(void) { return records; }
unsigned long fake_syncs(void) { return syncs; }
void fake_gpu_catch_up(void) { completed_up_to = next_event; }

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned sh, void *st, void **p, void **x) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)sh; (void)st;
    (void)p; (void)x;
    launches++;
    return 0;
}

CUresult cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, unsigned sh, void *st, void **p, void **x) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sh, st, p, x);
}

void *fake_real_launch(void) { return (void *)cuLaunchKernel; }

/* The launches the shim only holds: cooperative, with attributes, graphs. */
CUresult cuLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                   unsigned by, unsigned bz, unsigned sh, void *st, void **p) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sh, st, p, 0);
}
typedef struct { unsigned grid[3], block[3], shared; void *stream; void *attrs; unsigned n; } Config;
CUresult cuLaunchKernelEx(const Config *c, void *f, void **p, void **x) {
    (void)c; (void)f; (void)p; (void)x;
    launches++;
    return 0;
}
CUresult cuGraphLaunch(void *graph, void *stream) {
    (void)graph; (void)stream;
    launches++;
    return 0;
}

CUresult cuCtxGetCurrent(void **ctx) {
    *ctx = (void *)0x5EED;
    return 0;
}

CUresult cuEventCreate(void **event, unsigned flags) {
    (void)flags;
    *event = (void *)(intptr_t)next_event++;
    return 0;
}

CUresult cuEventRecord(void *event, void *stream) {
    (void)event; (void)stream;
    records++;
    return 0;
}

/* The checkpoint lock: while it holds, driver calls wait (as the real driver's do). */
static volatile int process_locked;
static volatile unsigned long calls_waiting;
void fake_lock_process(int on) { process_locked = on; }
unsigned long fake_calls_waiting(void) { return calls_waiting; }
static void wait_while_locked(void) {
    if (!process_locked) return;
    __atomic_add_fetch(&calls_waiting, 1, __ATOMIC_RELAXED);
    while (process_locked) {
        struct timespec nap = {0, 1000000};
        nanosleep(&nap, 0);
    }
    __atomic_sub_fetch(&calls_waiting, 1, __ATOMIC_RELAXED);
}

CUresult cuEventQuery(void *event) {
    wait_while_locked();
    return (intptr_t)event <= completed_up_to ? 0 : 600;
}

CUresult cuEventSynchronize(void *event) {
    syncs++;
    if ((intptr_t)event > completed_up_to) completed_up_to = (int)(intptr_t)event;
    return 0;
}

CUresult cuEventDestroy_v2(void *event) { (void)event; return 0; }

CUresult cuEventElapsedTime(float *ms, void *a, void *b) {
    (void)a; (void)b;
    *ms = elapsed_ms;
    return 0;
}

CUresult cuStreamIsCapturing(void *stream, int *status) {
    (void)stream;
    *status = 0;
    return 0;
}

CUresult cuModuleLoadData(void **module, const void *image);
CUresult cuModuleGetFunction(void **function, void *module, const char *name);
CUresult cuModuleUnload(void *module);

/* CUDA IPC: opening another process's memory hands out a made-up pointer. */
typedef struct { char reserved[64]; } IpcMemHandle;
static unsigned long ipc_opens;
unsigned long fake_ipc_opens(void) { return ipc_opens; }
CUresult cuIpcOpenMemHandle_v2(void **pdptr, IpcMemHandle handle, unsigned flags) {
    (void)flags;
    ipc_opens++;
    *pdptr = (void *)(intptr_t)(0x1000 + (unsigned char)handle.reserved[0]);
    return 0;
}

typedef unsigned long long CUdeviceptr;
CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t size);
CUresult cuMemFree_v2(CUdeviceptr p);
CUresult cuMemcpyDtoH_v2(void *host, CUdeviceptr device, size_t n);
CUresult cuMemcpyHtoD_v2(CUdeviceptr device, const void *host, size_t n);

/* The driver's lookup: cudart fetches every entry point this way. */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                             void *status) {
    (void)version; (void)status;
    if (strcmp(symbol, "cuLaunchKernel") == 0) {
        *pfn = (flags & 2) ? (void *)cuLaunchKernel_ptsz : (void *)cuLaunchKernel;
    } else if (strcmp(symbol, "cuGetProcAddress") == 0) {
        *pfn = (void *)cuGetProcAddress_v2;
    } else if (strcmp(symbol, "cuCtxGetCurrent") == 0) {
        *pfn = (void *)cuCtxGetCurrent;
    } else if (strcmp(symbol, "cuModuleLoadData") == 0) {
        *pfn = (void *)cuModuleLoadData;
    } else if (strcmp(symbol, "cuModuleGetFunction") == 0) {
        *pfn = (void *)cuModuleGetFunction;
    } else if (strcmp(symbol, "cuModuleUnload") == 0) {
        *pfn = (void *)cuModuleUnload;
    } else if (strcmp(symbol, "cuLaunchCooperativeKernel") == 0) {
        *pfn = (void *)cuLaunchCooperativeKernel;
    } else if (strcmp(symbol, "cuLaunchKernelEx") == 0) {
        *pfn = (void *)cuLaunchKernelEx;
    } else if (strcmp(symbol, "cuGraphLaunch") == 0) {
        *pfn = (void *)cuGraphLaunch;
    } else if (strcmp(symbol, "cuIpcOpenMemHandle") == 0) {
        *pfn = (void *)cuIpcOpenMemHandle_v2;
    } else if (strcmp(symbol, "cuMemAlloc") == 0) {
        *pfn = (void *)cuMemAlloc_v2;
    } else if (strcmp(symbol, "cuMemFree") == 0) {
        *pfn = (void *)cuMemFree_v2;
    } else if (strcmp(symbol, "cuMemcpyDtoH") == 0) {
        *pfn = (void *)cuMemcpyDtoH_v2;
    } else if (strcmp(symbol, "cuMemcpyHtoD") == 0) {
        *pfn = (void *)cuMemcpyHtoD_v2;
    } else {
        *pfn = 0;
        return 500;
    }
    return 0;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, 0);
}

/* Modules: a handle per load, a function per name. */
static unsigned long module_loads, unloads;
static char last_image[64];
void fake_set_elapsed_ms(float ms) { elapsed_ms = ms; }
unsigned long fake_module_loads(void) { return module_loads; }
unsigned long fake_unloads(void) { return unloads; }
const char *fake_last_image(void) { return last_image; }

CUresult cuModuleLoadData(void **module, const void *image) {
    module_loads++;
    strncpy(last_image, (const char *)image, sizeof(last_image) - 1);
    *module = (void *)(intptr_t)(0x1000 + module_loads);
    return 0;
}

CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
    *function = (void *)((intptr_t)module * 0x100 + (intptr_t)strlen(name));
    return 0;
}

static unsigned long launches_at_unload;
unsigned long fake_launches_at_unload(void) { return launches_at_unload; }
CUresult cuModuleUnload(void *module) {
    (void)module;
    unloads++;
    launches_at_unload = launches;
    return 0;
}

/* A process lock stand-in: once pointed at a control block's state word, cuCtxSynchronize
 * blocks while that word says paused (3) or evicted (4), as every CUDA call of a process
 * the broker locked with cuCheckpointProcessLock blocks until it is unlocked. */
#include <time.h>
static volatile uint32_t *lock_word;
void fake_lock_follows(volatile uint32_t *state_word) { lock_word = state_word; }
CUresult cuCtxSynchronize(void) {
    struct timespec nap = {0, 1000000};
    while (lock_word != 0 && (*lock_word == 3 || *lock_word == 4)) nanosleep(&nap, 0);
    return 0;
}

/* ---- device memory: host memory standing in for it
 *
 * cuMemAlloc is malloc.  The virtual memory management API is mmap: a reserved range is
 * mapped PROT_NONE, "physical memory" is a memfd, mapping it maps the file there, and
 * unmapping puts PROT_NONE back, so touching a parked range faults as it would on a
 * GPU (the test process would die).  fake_physical_limit caps the memfd bytes alive at
 * once, as a GPU's memory does. */
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
static unsigned long long physical_bytes, physical_limit = ~0ull, plain_allocs, plain_frees;
static unsigned long long handle_bytes[1024];
unsigned long long fake_physical_bytes(void) { return physical_bytes; }
void fake_physical_limit(unsigned long long bytes) { physical_limit = bytes; }
unsigned long long fake_plain_allocs(void) { return plain_allocs; }
unsigned long long fake_plain_frees(void) { return plain_frees; }

CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t size) {
    void *p = malloc(size);
    if (p == 0) return 2;
    plain_allocs++;
    *out = (CUdeviceptr)(uintptr_t)p;
    return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    plain_frees++;
    free((void *)(uintptr_t)p);
    return 0;
}
CUresult cuMemGetAllocationGranularity(size_t *out, const void *prop, int option) {
    (void)prop; (void)option;
    *out = 2u << 20;
    return 0;
}
CUresult cuMemAddressReserve(CUdeviceptr *out, size_t size, size_t align, CUdeviceptr at,
                             unsigned long long flags) {
    (void)at; (void)flags;
    size_t extra = align ? align : 4096;
    char *p = mmap(0, size + extra, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return 2;
    uintptr_t aligned = ((uintptr_t)p + extra - 1) / extra * extra;
    if (aligned > (uintptr_t)p) munmap(p, aligned - (uintptr_t)p);
    munmap((char *)aligned + size, (uintptr_t)p + size + extra - aligned - size);
    *out = (CUdeviceptr)aligned;
    return 0;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
    return munmap((void *)(uintptr_t)p, size) == 0 ? 0 : 1;
}
CUresult cuMemCreate(unsigned long long *handle, size_t size, const void *prop,
                     unsigned long long flags) {
    (void)prop; (void)flags;
    if (physical_bytes + size > physical_limit) return 2;
    int fd = memfd_create("fake-gpu-memory", 0);
    if (fd < 0 || fd >= 1024 || ftruncate(fd, (off_t)size) != 0) return 2;
    physical_bytes += size;
    handle_bytes[fd] = size;
    *handle = (unsigned long long)fd + 1;
    return 0;
}
CUresult cuMemRelease(unsigned long long handle) {
    int fd = (int)handle - 1;
    physical_bytes -= handle_bytes[fd];
    handle_bytes[fd] = 0;
    return close(fd) == 0 ? 0 : 1;
}
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, unsigned long long handle,
                  unsigned long long flags) {
    (void)flags;
    void *at = mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                    (int)handle - 1, (off_t)offset);
    return at == MAP_FAILED ? 1 : 0;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
    void *at = mmap((void *)(uintptr_t)p, size, PROT_NONE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return at == MAP_FAILED ? 1 : 0;
}
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const void *desc, size_t count) {
    (void)desc; (void)count;
    return mprotect((void *)(uintptr_t)p, size, PROT_READ | PROT_WRITE) == 0 ? 0 : 1;
}
CUresult cuCtxGetDevice(int *device) {
    *device = 0;
    return 0;
}
static void *pushed_context;
CUresult cuCtxPushCurrent_v2(void *ctx) {
    pushed_context = ctx;
    return 0;
}
CUresult cuCtxPopCurrent_v2(void **ctx) {
    if (ctx) *ctx = pushed_context;
    pushed_context = 0;
    return 0;
}
static unsigned long long streams_made;
unsigned long long fake_streams_made(void) { return streams_made; }
CUresult cuStreamCreate(void **stream, unsigned flags) {
    (void)flags;
    *stream = (void *)(uintptr_t)(0x5000 + ++streams_made);
    return 0;
}
CUresult cuStreamSynchronize(void *stream) { (void)stream; return 0; }
CUresult cuMemcpyDtoHAsync_v2(void *host, CUdeviceptr device, size_t n, void *stream) {
    (void)stream;
    memcpy(host, (void *)(uintptr_t)device, n);
    return 0;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr device, const void *host, size_t n, void *stream) {
    (void)stream;
    memcpy((void *)(uintptr_t)device, host, n);
    return 0;
}
CUresult cuMemcpyDtoH_v2(void *host, CUdeviceptr device, size_t n) {
    memcpy(host, (void *)(uintptr_t)device, n);
    return 0;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr device, const void *host, size_t n) {
    memcpy((void *)(uintptr_t)device, host, n);
    return 0;
}
static unsigned long long host_bytes, host_limit = ~0ull;
unsigned long long fake_pinned_bytes(void) { return host_bytes; }
void fake_pinned_limit(unsigned long long bytes) { host_limit = bytes; }
CUresult cuMemHostAlloc(void **out, size_t size, unsigned flags) {
    (void)flags;
    if (host_bytes + size > host_limit) return 2;
    size_t *p = malloc(size + 16);
    if (p == 0) return 2;
    p[0] = size;
    host_bytes += size;
    *out = (char *)p + 16;
    return 0;
}
CUresult cuMemFreeHost(void *p) {
    size_t *base = (size_t *)((char *)p - 16);
    host_bytes -= base[0];
    free(base);
    return 0;
}
