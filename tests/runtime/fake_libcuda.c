/*
 * A stand-in for the CUDA driver (libcuda.so.1) on machines without a GPU: just the entry
 * points the launch shim wraps or calls, each counting what it was asked.  Launches run
 * nothing; events "complete" when fake_gpu_catch_up() says so.  Built by the test that
 * uses it, never installed.
 */
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
