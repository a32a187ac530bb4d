/*
 * gpushare parkable memory: device allocations that can leave the GPU for host memory at
 * the host link's speed and come back at the same addresses.
 *
 * With GPUSHARE_PARKABLE_MEMORY=1 in a process the shim is preloaded into, the shim hands
 * out its own cuMemAlloc_v2 and cuMemFree_v2.  An allocation of at least
 * GPUSHARE_PARKABLE_MIN_KIB (default 2048: the GPU's mapping granularity) is backed
 * through the driver's virtual memory management API: an address range is reserved for
 * it and physical memory is created and mapped into it.  A park (gps_park_memory, which
 * the runtime calls for the broker) copies such allocations, least recently allocated or
 * restored first, into pinned host memory over several streams at once, then unmaps and
 * releases their physical memory and keeps the address range.  A restore creates
 * physical memory again, maps it at the same addresses and copies the bytes back.  The
 * program's pointers stay valid throughout, whichever allocator handed them out: CuPy's
 * and PyTorch's caching allocators and Numba all end in cuMemAlloc.
 *
 * A parked range is unmapped, and a kernel or a copy touching it would fault the whole
 * context.  So between a park and its restore, every launch and every copy or memset
 * that reaches the driver through the shim first restores all parked memory, and fails
 * with the restore's error (out of memory, say) rather than fault.
 *
 * Smaller allocations stay cuMemAlloc's: their rounding to the granularity would waste
 * more than they hold, and small buffers (the session's yield flag among them) may be
 * exported through CUDA IPC, which mapped memory cannot be.  So does an allocation the
 * API refuses for any reason but a full GPU (counted).  Nothing here decides what or
 * when to park: the runtime asks, for the broker.  Like the rest of the shim it needs no
 * CUDA header; tests run it on a stand-in driver (tests/runtime/fake_libcuda.c).
 */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shim.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long MemHandle; /* CUmemGenericAllocationHandle */

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NOT_FOUND 500

/* CUmemLocation, CUmemAllocationProp and CUmemAccessDesc (their ABI) */
typedef struct { int type; int id; } MemLocation;
typedef struct {
    int type;                   /* CU_MEM_ALLOCATION_TYPE_PINNED */
    int requested_handle_types; /* none */
    MemLocation location;
    void *win32_metadata;
    struct {
        unsigned char compression;
        unsigned char rdma_capable;
        unsigned short usage;
        unsigned char reserved[4];
    } flags;
} MemProp;
typedef struct { MemLocation location; int flags; } AccessDesc;
#define ALLOCATION_PINNED 1
#define LOCATION_DEVICE 1
#define ACCESS_READ_WRITE 3
#define GRANULARITY_RECOMMENDED 1
#define STREAM_NON_BLOCKING 1

/* ---- the driver calls made here, looked up once */

typedef struct {
    CUresult (*address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*address_free)(CUdeviceptr, size_t);
    CUresult (*create)(MemHandle *, size_t, const MemProp *, unsigned long long);
    CUresult (*release)(MemHandle);
    CUresult (*map)(CUdeviceptr, size_t, size_t, MemHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*set_access)(CUdeviceptr, size_t, const AccessDesc *, size_t);
    CUresult (*granularity)(size_t *, const MemProp *, int);
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*ctx_get_device)(CUdevice *);
    CUresult (*ctx_push)(CUcontext);
    CUresult (*ctx_pop)(CUcontext *);
    CUresult (*ctx_synchronize)(void);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_synchronize)(CUstream);
    CUresult (*copy_to_host)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*copy_to_device)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*host_alloc)(void **, size_t, unsigned);
    CUresult (*host_free)(void *);
} MemoryDriver;

typedef CUresult (*AllocFn)(CUdeviceptr *, size_t);
typedef CUresult (*FreeFn)(CUdeviceptr);

/* ---- state */

typedef struct {
    CUdeviceptr address; /* 0: an empty slot; TOMBSTONE: a freed one */
    size_t size;         /* as asked */
    size_t mapped;       /* rounded up to the granularity */
    MemHandle handle;    /* its physical memory while resident */
    CUcontext ctx;       /* current when it was allocated: its copies run there */
    CUdevice device;
    void *host;          /* its bytes while parked */
    uint64_t used;       /* when it was allocated or last restored (a sequence number) */
    int parked;
} Parkable;

typedef struct {
    uint64_t allocations;     /* parkable allocations made */
    uint64_t resident_bytes;  /* mapped bytes on the GPU now */
    uint64_t parked_bytes;    /* mapped bytes in host memory now */
    uint64_t parked_count;    /* allocations parked now */
    uint64_t fallbacks;       /* allocations the API refused, made by cuMemAlloc instead */
    uint64_t parks, restores; /* calls that moved something */
    uint64_t parked_total, restored_total; /* bytes moved, all parks and restores */
    uint64_t park_ns, restore_ns;          /* time they took */
    uint64_t guard_restores;  /* restores a launch or copy of a parked process made */
    uint64_t guard_failures;  /* such restores that failed (the call failed, not faulted) */
} MemoryStats;

typedef struct {
    uint64_t bytes;       /* mapped bytes moved */
    uint64_t allocations; /* allocations moved */
    uint64_t left_bytes;  /* what stayed where it was (resident for a park, parked for a restore) */
    uint64_t copy_ns;     /* the copies */
    uint64_t total_ns;    /* the whole call */
    int error;            /* the driver's answer that stopped it early (0: none) */
    char why[160];        /* why it stopped short of what was asked ("" when it did not) */
} MoveResult;

#define TOMBSTONE 1ull
#define CHUNK_BYTES (64ull << 20) /* copies this long keep every stream's queue busy */
#define MAX_STREAMS 8
#define MAX_CONTEXTS 8

static pthread_mutex_t g_mem_lock = PTHREAD_MUTEX_INITIALIZER;
static MemoryDriver g_mem;
static int g_mem_ready;                 /* 1 loaded, -1 not loadable */
static AllocFn real_alloc;
static FreeFn real_free;
static Parkable *g_table;
static size_t g_capacity, g_used_slots;  /* slots, and slots not empty (tombstones too) */
static uint64_t g_sequence;
static MemoryStats g_mstats;
static int g_enabled = -1;               /* GPUSHARE_PARKABLE_MEMORY, read once */
static size_t g_min_bytes = 2u << 20;
static size_t g_granularity[MAX_CONTEXTS];
static void publish_resident(void); /* the park service's word, when there is one */
static CUcontext g_stream_ctx[MAX_CONTEXTS];
static CUstream g_streams[MAX_CONTEXTS][MAX_STREAMS];

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int enabled(void) {
    if (g_enabled < 0) {
        const char *on = getenv("GPUSHARE_PARKABLE_MEMORY");
        const char *min_kib = getenv("GPUSHARE_PARKABLE_MIN_KIB");
        if (min_kib != NULL && *min_kib) {
            char *end = NULL;
            unsigned long long kib = strtoull(min_kib, &end, 10);
            if (end != NULL && *end == 0 && kib > 0) g_min_bytes = (size_t)kib << 10;
        }
        g_enabled = on != NULL && strcmp(on, "1") == 0;
    }
    return g_enabled;
}

static int load_memory_driver(void) {
    if (g_mem_ready) return g_mem_ready > 0;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda == NULL) cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (cuda == NULL) {
        g_mem_ready = -1;
        return 0;
    }
    MemoryDriver d;
#define FIND(field, symbol) *(void **)&d.field = gps_real_dlsym(cuda, symbol)
    FIND(address_reserve, "cuMemAddressReserve");
    FIND(address_free, "cuMemAddressFree");
    FIND(create, "cuMemCreate");
    FIND(release, "cuMemRelease");
    FIND(map, "cuMemMap");
    FIND(unmap, "cuMemUnmap");
    FIND(set_access, "cuMemSetAccess");
    FIND(granularity, "cuMemGetAllocationGranularity");
    FIND(ctx_get_current, "cuCtxGetCurrent");
    FIND(ctx_get_device, "cuCtxGetDevice");
    FIND(ctx_push, "cuCtxPushCurrent_v2");
    FIND(ctx_pop, "cuCtxPopCurrent_v2");
    FIND(ctx_synchronize, "cuCtxSynchronize");
    FIND(stream_create, "cuStreamCreate");
    FIND(stream_synchronize, "cuStreamSynchronize");
    FIND(copy_to_host, "cuMemcpyDtoHAsync_v2");
    FIND(copy_to_device, "cuMemcpyHtoDAsync_v2");
    FIND(host_alloc, "cuMemHostAlloc");
    FIND(host_free, "cuMemFreeHost");
#undef FIND
    void **each = (void **)&d;
    for (size_t i = 0; i < sizeof(d) / sizeof(void *); i++) {
        if (each[i] == NULL) {
            g_mem_ready = -1;
            return 0;
        }
    }
    g_mem = d;
    g_mem_ready = 1;
    return 1;
}

/* ---- the table of parkable allocations: open addressing by address */

static size_t slot_for(CUdeviceptr address, size_t capacity) {
    uint64_t h = address >> 12;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    return (size_t)(h >> 17) & (capacity - 1);
}

static Parkable *find_parkable(CUdeviceptr address) {
    if (g_capacity == 0) return NULL;
    for (size_t i = slot_for(address, g_capacity), n = 0; n < g_capacity;
         i = (i + 1) & (g_capacity - 1), n++) {
        if (g_table[i].address == 0) return NULL;
        if (g_table[i].address == address) return &g_table[i];
    }
    return NULL;
}

static int grow_table(void) {
    size_t capacity = g_capacity ? g_capacity * 2 : 256;
    Parkable *table = calloc(capacity, sizeof(Parkable));
    if (table == NULL) return -1;
    for (size_t i = 0; i < g_capacity; i++) {
        if (g_table[i].address <= TOMBSTONE) continue;
        size_t j = slot_for(g_table[i].address, capacity);
        while (table[j].address != 0) j = (j + 1) & (capacity - 1);
        table[j] = g_table[i];
    }
    free(g_table);
    g_table = table;
    g_capacity = capacity;
    g_used_slots = 0;
    for (size_t i = 0; i < capacity; i++) g_used_slots += table[i].address != 0;
    return 0;
}

static Parkable *add_parkable(const Parkable *entry) {
    if ((g_used_slots + 1) * 2 > g_capacity && grow_table() != 0) return NULL;
    size_t i = slot_for(entry->address, g_capacity);
    while (g_table[i].address > TOMBSTONE) i = (i + 1) & (g_capacity - 1);
    if (g_table[i].address == 0) g_used_slots++;
    g_table[i] = *entry;
    return &g_table[i];
}

/* ---- contexts: the granularity and the copy streams of each */

static int context_index(CUcontext ctx) {
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        if (g_stream_ctx[i] == ctx) return i;
        if (g_stream_ctx[i] == NULL) {
            g_stream_ctx[i] = ctx;
            return i;
        }
    }
    return -1;
}

static MemProp device_prop(CUdevice device) {
    MemProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = ALLOCATION_PINNED;
    prop.location.type = LOCATION_DEVICE;
    prop.location.id = device;
    return prop;
}

static size_t granularity_of(int index, CUdevice device) {
    if (index >= 0 && g_granularity[index]) return g_granularity[index];
    MemProp prop = device_prop(device);
    size_t granularity = 0;
    if (g_mem.granularity(&granularity, &prop, GRANULARITY_RECOMMENDED) != CUDA_SUCCESS
        || granularity == 0)
        return 0;
    if (index >= 0) g_granularity[index] = granularity;
    return granularity;
}

/* Physical memory for `p`, mapped at its address for its device. */
static CUresult map_physical(Parkable *p) {
    MemProp prop = device_prop(p->device);
    CUresult r = g_mem.create(&p->handle, p->mapped, &prop, 0);
    if (r != CUDA_SUCCESS) return r;
    r = g_mem.map(p->address, p->mapped, 0, p->handle, 0);
    if (r == CUDA_SUCCESS) {
        AccessDesc access = {{LOCATION_DEVICE, p->device}, ACCESS_READ_WRITE};
        r = g_mem.set_access(p->address, p->mapped, &access, 1);
        if (r != CUDA_SUCCESS) g_mem.unmap(p->address, p->mapped);
    }
    if (r != CUDA_SUCCESS) g_mem.release(p->handle);
    return r;
}

static void unmap_physical(Parkable *p) {
    g_mem.unmap(p->address, p->mapped);
    g_mem.release(p->handle);
    p->handle = 0;
}

/* ---- the allocation entry points handed out */

static CUresult parkable_alloc(CUdeviceptr *out, size_t size) {
    Parkable entry;
    memset(&entry, 0, sizeof(entry));
    if (g_mem.ctx_get_current(&entry.ctx) != CUDA_SUCCESS || entry.ctx == NULL
        || g_mem.ctx_get_device(&entry.device) != CUDA_SUCCESS)
        return CUDA_ERROR_NOT_INITIALIZED;
    size_t granularity = granularity_of(context_index(entry.ctx), entry.device);
    if (granularity == 0) return CUDA_ERROR_NOT_FOUND;
    entry.size = size;
    entry.mapped = (size + granularity - 1) / granularity * granularity;
    CUresult r = g_mem.address_reserve(&entry.address, entry.mapped, granularity, 0, 0);
    if (r != CUDA_SUCCESS) return r;
    r = map_physical(&entry);
    if (r != CUDA_SUCCESS) {
        g_mem.address_free(entry.address, entry.mapped);
        return r;
    }
    entry.used = ++g_sequence;
    if (add_parkable(&entry) == NULL) {
        unmap_physical(&entry);
        g_mem.address_free(entry.address, entry.mapped);
        return CUDA_ERROR_NOT_FOUND;
    }
    g_mstats.allocations++;
    g_mstats.resident_bytes += entry.mapped;
    publish_resident();
    *out = entry.address;
    return CUDA_SUCCESS;
}

static CUresult w_mem_alloc(CUdeviceptr *out, size_t size) {
    if (real_alloc == NULL) return CUDA_ERROR_NOT_INITIALIZED;
    if (out == NULL || size < g_min_bytes || !enabled()) return real_alloc(out, size);
    pthread_mutex_lock(&g_mem_lock);
    CUresult r = load_memory_driver() ? parkable_alloc(out, size) : CUDA_ERROR_NOT_FOUND;
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY) g_mstats.fallbacks++;
    pthread_mutex_unlock(&g_mem_lock);
    /* A full GPU is a full GPU: the caller (a caching allocator) frees its cache and asks
     * again, as it does when cuMemAlloc says so. */
    if (r == CUDA_SUCCESS || r == CUDA_ERROR_OUT_OF_MEMORY) return r;
    return real_alloc(out, size);
}

static CUresult w_mem_free(CUdeviceptr address) {
    if (real_free == NULL) return CUDA_ERROR_NOT_INITIALIZED;
    if (__atomic_load_n(&g_mstats.allocations, __ATOMIC_RELAXED) == 0) return real_free(address);
    pthread_mutex_lock(&g_mem_lock);
    Parkable *p = find_parkable(address);
    if (p == NULL) {
        pthread_mutex_unlock(&g_mem_lock);
        return real_free(address);
    }
    if (p->parked) {
        g_mem.host_free(p->host);
        g_mstats.parked_bytes -= p->mapped;
        g_mstats.parked_count--;
    } else {
        /* cuMemFree waits for the work that may still use the memory; unmapping does not. */
        g_mem.ctx_synchronize();
        unmap_physical(p);
        g_mstats.resident_bytes -= p->mapped;
    }
    g_mem.address_free(p->address, p->mapped);
    memset(p, 0, sizeof(*p));
    p->address = TOMBSTONE;
    publish_resident();
    pthread_mutex_unlock(&g_mem_lock);
    return CUDA_SUCCESS;
}

/* ---- park and restore */

static int by_use(const void *a, const void *b) {
    const Parkable *x = *(Parkable *const *)a, *y = *(Parkable *const *)b;
    return x->used < y->used ? -1 : x->used > y->used;
}

/* The allocations that are (parked or resident, as asked), least recently used first. */
static Parkable **collect(int parked, size_t *count) {
    *count = 0;
    Parkable **list = malloc((g_capacity ? g_capacity : 1) * sizeof(Parkable *));
    if (list == NULL) return NULL;
    for (size_t i = 0; i < g_capacity; i++) {
        if (g_table[i].address > TOMBSTONE && g_table[i].parked == parked) list[(*count)++] = &g_table[i];
    }
    qsort(list, *count, sizeof(Parkable *), by_use);
    return list;
}

/* Move the allocations of list[from]'s context to list[from..), keeping the rest
 * after them; returns where they end.  Copies run one context at a time. */
static size_t same_context_first(Parkable **list, size_t from, size_t count) {
    size_t end = from;
    CUcontext ctx = list[from]->ctx;
    for (size_t i = from; i < count; i++) {
        if (list[i]->ctx != ctx) continue;
        Parkable *swap = list[end];
        list[end++] = list[i];
        list[i] = swap;
    }
    return end;
}

static CUresult switch_context(CUcontext *pushed, CUcontext ctx) {
    if (*pushed == ctx) return CUDA_SUCCESS;
    CUcontext ignored;
    if (*pushed != NULL) g_mem.ctx_pop(&ignored);
    *pushed = NULL;
    CUresult r = g_mem.ctx_push(ctx);
    if (r == CUDA_SUCCESS) *pushed = ctx;
    return r;
}

/* The copy streams of `ctx` (current), up to `wanted`; how many there are. */
static unsigned streams_of(CUcontext ctx, unsigned wanted) {
    int index = context_index(ctx);
    if (index < 0) return 0;
    unsigned n = 0;
    for (; n < wanted && n < MAX_STREAMS; n++) {
        if (g_streams[index][n] == NULL
            && g_mem.stream_create(&g_streams[index][n], STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
            g_streams[index][n] = NULL;
            break;
        }
    }
    return n;
}

/* Copy each of `list` (one context's) to or from its host bytes in chunks spread over the
 * context's streams, and wait for all of it. */
static CUresult copy_all(Parkable **list, size_t count, unsigned wanted_streams, int to_host) {
    if (count == 0) return CUDA_SUCCESS;
    unsigned n = streams_of(list[0]->ctx, wanted_streams);
    CUstream *streams = g_streams[context_index(list[0]->ctx)];
    CUresult first_error = CUDA_SUCCESS;
    unsigned next = 0;
    for (size_t i = 0; i < count && first_error == CUDA_SUCCESS; i++) {
        Parkable *p = list[i];
        for (size_t offset = 0; offset < p->size; offset += CHUNK_BYTES) {
            size_t length = p->size - offset < CHUNK_BYTES ? p->size - offset : CHUNK_BYTES;
            CUstream stream = n ? streams[next++ % n] : NULL;
            char *host = (char *)p->host + offset;
            CUresult r = to_host ? g_mem.copy_to_host(host, p->address + offset, length, stream)
                                 : g_mem.copy_to_device(p->address + offset, host, length, stream);
            if (r != CUDA_SUCCESS) {
                first_error = r;
                break;
            }
        }
    }
    for (unsigned s = 0; s < n; s++) {
        CUresult r = g_mem.stream_synchronize(streams[s]);
        if (first_error == CUDA_SUCCESS) first_error = r;
    }
    if (n == 0) {
        CUresult r = g_mem.ctx_synchronize();
        if (first_error == CUDA_SUCCESS) first_error = r;
    }
    return first_error;
}

static void say(MoveResult *out, const char *text, unsigned long long mib, int error) {
    if (out->why[0] == 0) snprintf(out->why, sizeof(out->why), text, mib, error);
}

/* Park allocations until `want` bytes (0: all) have left the GPU, keeping this process's
 * host copies within `host_limit` bytes (0: no limit).  Copies go over `streams` streams
 * per context.  Returns 0 when it parked all that was asked, else the reason it did not
 * (also in out->why), having parked what it could. */
int gps_park_memory(uint64_t want, uint64_t host_limit, unsigned streams, MoveResult *out) {
    memset(out, 0, sizeof(*out));
    uint64_t started = now_ns();
    pthread_mutex_lock(&g_mem_lock);
    size_t count = 0;
    Parkable **list = g_mem_ready > 0 ? collect(0, &count) : NULL;
    size_t chosen = 0;
    uint64_t host = g_mstats.parked_bytes, bytes = 0;
    for (; list != NULL && chosen < count && (want == 0 || bytes < want); chosen++) {
        Parkable *p = list[chosen];
        if (host_limit && host + p->mapped > host_limit) {
            say(out, "the host budget for parked memory is spent (%llu MiB more needed)",
                (unsigned long long)(p->mapped >> 20), 0);
            break;
        }
        if (g_mem.host_alloc(&p->host, p->mapped, 0) != CUDA_SUCCESS) {
            p->host = NULL;
            say(out, "the host could not pin %llu MiB more for parked memory",
                (unsigned long long)(p->mapped >> 20), 0);
            break;
        }
        host += p->mapped;
        bytes += p->mapped;
    }
    /* One context at a time: its work drained, then its chosen allocations copied out. */
    CUcontext pushed = NULL;
    uint64_t copy_started = now_ns();
    CUresult r = CUDA_SUCCESS;
    size_t done = 0;
    while (done < chosen && r == CUDA_SUCCESS) {
        CUcontext ctx = list[done]->ctx;
        size_t end = same_context_first(list, done, chosen);
        r = switch_context(&pushed, ctx);
        if (r == CUDA_SUCCESS) r = g_mem.ctx_synchronize();
        if (r == CUDA_SUCCESS) r = copy_all(list + done, end - done, streams, 1);
        if (r != CUDA_SUCCESS) break;
        for (size_t i = done; i < end; i++) {
            Parkable *p = list[i];
            unmap_physical(p);
            p->parked = 1;
            g_mstats.resident_bytes -= p->mapped;
            g_mstats.parked_bytes += p->mapped;
            g_mstats.parked_count++;
            out->bytes += p->mapped;
            out->allocations++;
        }
        done = end;
    }
    out->copy_ns = now_ns() - copy_started;
    if (r != CUDA_SUCCESS) {
        out->error = r;
        say(out, "a copy to the host failed (%llu MiB stay on the GPU; CUDA error %d)",
            (unsigned long long)((bytes - out->bytes) >> 20), r);
    }
    for (size_t i = done; i < chosen; i++) {
        g_mem.host_free(list[i]->host);
        list[i]->host = NULL;
    }
    if (pushed != NULL) {
        CUcontext ignored;
        g_mem.ctx_pop(&ignored);
    }
    if (want && out->bytes < want && out->why[0] == 0 && list != NULL)
        say(out, "this process holds %llu MiB of parkable memory less than asked",
            (unsigned long long)((want - out->bytes) >> 20), 0);
    if (list == NULL && out->why[0] == 0) say(out, "no parkable memory here", 0, 0);
    out->left_bytes = g_mstats.resident_bytes;
    if (out->bytes) {
        g_mstats.parks++;
        g_mstats.parked_total += out->bytes;
    }
    out->total_ns = now_ns() - started;
    g_mstats.park_ns += out->total_ns;
    publish_resident();
    pthread_mutex_unlock(&g_mem_lock);
    free(list);
    return out->why[0] != 0;
}

/* Under g_mem_lock: bring every parked allocation back (mapped at its address, its bytes
 * copied in), all mapped before any copy so the copies keep the link busy. */
static int restore_locked(unsigned streams, MoveResult *out) {
    size_t count = 0;
    Parkable **list = collect(1, &count);
    if (list == NULL) {
        say(out, "out of host memory for the restore's list", 0, 0);
        return 1;
    }
    size_t mapped = 0;
    CUresult r = CUDA_SUCCESS;
    CUcontext pushed = NULL;
    for (; mapped < count; mapped++) {
        r = switch_context(&pushed, list[mapped]->ctx);
        if (r == CUDA_SUCCESS) r = map_physical(list[mapped]);
        if (r != CUDA_SUCCESS) break;
    }
    if (r != CUDA_SUCCESS) {
        uint64_t left = 0;
        for (size_t i = mapped; i < count; i++) left += list[i]->mapped;
        out->error = r;
        say(out, r == CUDA_ERROR_OUT_OF_MEMORY
                     ? "the GPU has no room yet for %llu MiB of it (CUDA error %d)"
                     : "mapping %llu MiB of it failed (CUDA error %d)",
            (unsigned long long)(left >> 20), r);
    }
    uint64_t copy_started = now_ns();
    size_t done = 0;
    CUresult copy_error = CUDA_SUCCESS;
    while (done < mapped) {
        CUcontext ctx = list[done]->ctx;
        size_t end = same_context_first(list, done, mapped);
        CUresult c = switch_context(&pushed, ctx);
        if (c == CUDA_SUCCESS) c = copy_all(list + done, end - done, streams, 0);
        if (c != CUDA_SUCCESS && copy_error == CUDA_SUCCESS) copy_error = c;
        for (size_t i = done; i < end; i++) {
            Parkable *p = list[i];
            if (c != CUDA_SUCCESS) { /* its bytes are not known to be there: keep it parked */
                unmap_physical(p);
                continue;
            }
            g_mem.host_free(p->host);
            p->host = NULL;
            p->parked = 0;
            p->used = ++g_sequence;
            g_mstats.parked_bytes -= p->mapped;
            g_mstats.parked_count--;
            g_mstats.resident_bytes += p->mapped;
            out->bytes += p->mapped;
            out->allocations++;
        }
        done = end;
    }
    out->copy_ns = now_ns() - copy_started;
    if (copy_error != CUDA_SUCCESS) {
        out->error = copy_error;
        say(out, "a copy back to the GPU failed (%llu MiB stay parked; CUDA error %d)",
            (unsigned long long)(g_mstats.parked_bytes >> 20), copy_error);
    }
    if (pushed != NULL) {
        CUcontext ignored;
        g_mem.ctx_pop(&ignored);
    }
    free(list);
    out->left_bytes = g_mstats.parked_bytes;
    if (out->left_bytes && out->why[0] == 0)
        say(out, "%llu MiB stay parked", (unsigned long long)(out->left_bytes >> 20), 0);
    if (out->bytes) {
        g_mstats.restores++;
        g_mstats.restored_total += out->bytes;
    }
    return out->why[0] != 0;
}

/* Bring every parked allocation back; 0 when all of it is resident again. */
int gps_restore_memory(unsigned streams, MoveResult *out) {
    memset(out, 0, sizeof(*out));
    uint64_t started = now_ns();
    pthread_mutex_lock(&g_mem_lock);
    int short_of_it = restore_locked(streams, out);
    out->total_ns = now_ns() - started;
    g_mstats.restore_ns += out->total_ns;
    publish_resident();
    pthread_mutex_unlock(&g_mem_lock);
    return short_of_it;
}

void gps_memory_stats(MemoryStats *out) {
    pthread_mutex_lock(&g_mem_lock);
    *out = g_mstats;
    pthread_mutex_unlock(&g_mem_lock);
}

/* Whether `address` lies in a parkable allocation, and then where it starts. */
unsigned long long gps_parkable_base(unsigned long long address) {
    pthread_mutex_lock(&g_mem_lock);
    unsigned long long base = 0;
    for (size_t i = 0; i < g_capacity && !base; i++) {
        const Parkable *p = &g_table[i];
        if (p->address > TOMBSTONE && address >= p->address && address < p->address + p->size)
            base = p->address;
    }
    pthread_mutex_unlock(&g_mem_lock);
    return base;
}

#define GUARD_STREAMS 4

int gps_memory_resident(void) {
    if (__atomic_load_n(&g_mstats.parked_count, __ATOMIC_ACQUIRE) == 0) return 0;
    pthread_mutex_lock(&g_mem_lock);
    int r = 0;
    if (g_mstats.parked_count > 0) {
        MoveResult out;
        memset(&out, 0, sizeof(out));
        uint64_t started = now_ns();
        g_mstats.guard_restores++;
        if (restore_locked(GUARD_STREAMS, &out) != 0) {
            g_mstats.guard_failures++;
            r = out.error ? out.error : CUDA_ERROR_OUT_OF_MEMORY;
        }
        g_mstats.restore_ns += now_ns() - started;
        publish_resident();
    }
    pthread_mutex_unlock(&g_mem_lock);
    return r;
}

/* ---- the copies and memsets handed out: each restores parked memory first
 *
 * Their arguments are passed on untouched, so one signature serves the entry point's
 * every version (the _v2 ones widened sizes and addresses; a register holds either). */
#define GUARDED(X)                                                                             \
    X(cuMemcpy, (CUdeviceptr a, CUdeviceptr b, size_t n), (a, b, n))                            \
    X(cuMemcpyAsync, (CUdeviceptr a, CUdeviceptr b, size_t n, CUstream s), (a, b, n, s))        \
    X(cuMemcpyHtoD, (CUdeviceptr d, const void *h, size_t n), (d, h, n))                        \
    X(cuMemcpyHtoDAsync, (CUdeviceptr d, const void *h, size_t n, CUstream s), (d, h, n, s))    \
    X(cuMemcpyDtoH, (void *h, CUdeviceptr d, size_t n), (h, d, n))                              \
    X(cuMemcpyDtoHAsync, (void *h, CUdeviceptr d, size_t n, CUstream s), (h, d, n, s))          \
    X(cuMemcpyDtoD, (CUdeviceptr a, CUdeviceptr b, size_t n), (a, b, n))                        \
    X(cuMemcpyDtoDAsync, (CUdeviceptr a, CUdeviceptr b, size_t n, CUstream s), (a, b, n, s))    \
    X(cuMemcpy2D, (const void *p), (p))                                                        \
    X(cuMemcpy2DUnaligned, (const void *p), (p))                                               \
    X(cuMemcpy2DAsync, (const void *p, CUstream s), (p, s))                                    \
    X(cuMemcpy3D, (const void *p), (p))                                                        \
    X(cuMemcpy3DAsync, (const void *p, CUstream s), (p, s))                                    \
    X(cuMemcpyPeer, (CUdeviceptr a, CUcontext x, CUdeviceptr b, CUcontext y, size_t n),         \
      (a, x, b, y, n))                                                                         \
    X(cuMemcpyPeerAsync,                                                                       \
      (CUdeviceptr a, CUcontext x, CUdeviceptr b, CUcontext y, size_t n, CUstream s),          \
      (a, x, b, y, n, s))                                                                      \
    X(cuMemsetD8, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))                        \
    X(cuMemsetD8Async, (CUdeviceptr d, unsigned char v, size_t n, CUstream s), (d, v, n, s))    \
    X(cuMemsetD16, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))                      \
    X(cuMemsetD16Async, (CUdeviceptr d, unsigned short v, size_t n, CUstream s), (d, v, n, s))  \
    X(cuMemsetD32, (CUdeviceptr d, unsigned v, size_t n), (d, v, n))                            \
    X(cuMemsetD32Async, (CUdeviceptr d, unsigned v, size_t n, CUstream s), (d, v, n, s))        \
    X(cuMemsetD2D8, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h),             \
      (d, p, v, w, h))                                                                         \
    X(cuMemsetD2D8Async,                                                                       \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream s),              \
      (d, p, v, w, h, s))                                                                      \
    X(cuMemsetD2D16, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h),           \
      (d, p, v, w, h))                                                                         \
    X(cuMemsetD2D16Async,                                                                      \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream s),             \
      (d, p, v, w, h, s))                                                                      \
    X(cuMemsetD2D32, (CUdeviceptr d, size_t p, unsigned v, size_t w, size_t h),                 \
      (d, p, v, w, h))                                                                         \
    X(cuMemsetD2D32Async, (CUdeviceptr d, size_t p, unsigned v, size_t w, size_t h, CUstream s), \
      (d, p, v, w, h, s))

/* Two of each: an entry point may come in a legacy and a per-thread default-stream
 * flavour, each with a real function of its own. */
#define DEFINE_GUARDED(name, params, args)                                                     \
    typedef CUresult(*name##_fn) params;                                                       \
    static name##_fn real_##name##_0, real_##name##_1;                                         \
    static CUresult w_##name##_0 params {                                                      \
        int r = gps_memory_resident();                                                         \
        return r ? r : real_##name##_0 args;                                                   \
    }                                                                                          \
    static CUresult w_##name##_1 params {                                                      \
        int r = gps_memory_resident();                                                         \
        return r ? r : real_##name##_1 args;                                                   \
    }
GUARDED(DEFINE_GUARDED)

/* `name` without a per-thread suffix (_ptds, _ptsz) and then without a _v2. */
static void base_name(const char *name, char *out, size_t size) {
    snprintf(out, size, "%s", name);
    size_t n = strlen(out);
    if (n > 5 && (strcmp(out + n - 5, "_ptds") == 0 || strcmp(out + n - 5, "_ptsz") == 0))
        out[n -= 5] = 0;
    if (n > 3 && strcmp(out + n - 3, "_v2") == 0) out[n - 3] = 0;
}

void *gps_wrap_memory_call(const char *name, void *real, int version) {
    if (name == NULL) {
        int ours = real == (void *)w_mem_alloc || real == (void *)w_mem_free;
#define OURS(symbol, params, args)                                                             \
    ours = ours || real == (void *)w_##symbol##_0 || real == (void *)w_##symbol##_1;
        GUARDED(OURS)
#undef OURS
        return ours ? real : NULL;
    }
    if (!enabled()) return NULL;
    char base[64];
    base_name(name, base, sizeof(base));
    /* cuMemAlloc and cuMemFree without _v2 are the 32-bit ones unless cuGetProcAddress
     * hands out a newer version under the plain name. */
    int wide = strstr(name, "_v2") != NULL || version >= 3020;
    if (strcmp(base, "cuMemAlloc") == 0 && wide) {
        if (real_alloc == NULL || real_alloc == (AllocFn)real) {
            real_alloc = (AllocFn)real;
            return (void *)w_mem_alloc;
        }
        return real;
    }
    if (strcmp(base, "cuMemFree") == 0 && wide) {
        if (real_free == NULL || real_free == (FreeFn)real) {
            real_free = (FreeFn)real;
            return (void *)w_mem_free;
        }
        return real;
    }
#define PICK_GUARDED(symbol, params, args)                                                     \
    if (strcmp(base, #symbol) == 0) {                                                          \
        if (real_##symbol##_0 == NULL || real_##symbol##_0 == (symbol##_fn)real) {             \
            real_##symbol##_0 = (symbol##_fn)real;                                             \
            return (void *)w_##symbol##_0;                                                     \
        }                                                                                      \
        if (real_##symbol##_1 == NULL || real_##symbol##_1 == (symbol##_fn)real) {             \
            real_##symbol##_1 = (symbol##_fn)real;                                             \
            return (void *)w_##symbol##_1;                                                     \
        }                                                                                      \
        return real;                                                                           \
    }
    GUARDED(PICK_GUARDED)
#undef PICK_GUARDED
    return NULL;
}

/* ---- the park service: requests the broker writes into the session's control block
 *
 * The broker cannot call into this process, and an idle notebook runs no Python that
 * could listen, so a thread of the shim's waits (a futex on the shared page, woken by the
 * broker, looking again every second) for a request: a park of so many MiB within a host
 * budget, or a restore.  It carries the request out here, where the memory's mappings
 * live, and answers in the same page.  Words (little-endian uint32, offsets in bytes;
 * control_block.py holds the same table):
 *
 *   32 request: bumped by the broker for each request    36 answered: the request done
 *   40 operation: 1 park, 2 restore                       44 MiB to park (0: all)
 *   48 host budget, MiB (0: none)                         52 MiB the request moved
 *   56 its answer: 0 all that was asked, else the driver's error or 1
 *   60 parkable MiB resident now (kept up to date by this file) */
enum { W_REQUEST = 0, W_ANSWERED = 1, W_OPERATION = 2, W_WANT_MIB = 3, W_HOST_MIB = 4,
       W_MOVED_MIB = 5, W_ANSWER = 6, W_RESIDENT_MIB = 7 };
enum { OP_PARK = 1, OP_RESTORE = 2 };
#define SERVICE_STREAMS 4

static volatile uint32_t *volatile g_park_words; /* the control block at offset 32 */
static pthread_t g_service;
static int g_service_started;

static void publish_resident(void) {
    volatile uint32_t *words = g_park_words;
    if (words == NULL) return;
    uint64_t mib = __atomic_load_n(&g_mstats.resident_bytes, __ATOMIC_RELAXED) >> 20;
    __atomic_store_n(&words[W_RESIDENT_MIB], mib > 0xffffffffu ? 0xffffffffu : (uint32_t)mib,
                     __ATOMIC_RELEASE);
}

static void futex_wait(volatile uint32_t *word, uint32_t seen, long ms) {
    struct timespec timeout = {ms / 1000, (ms % 1000) * 1000000L};
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &timeout, NULL, 0);
}

static void futex_wake(volatile uint32_t *word) {
    syscall(SYS_futex, word, FUTEX_WAKE, 64, NULL, NULL, 0);
}

static void *serve_parks(void *unused) {
    (void)unused;
    uint32_t answered = 0;
    for (;;) {
        volatile uint32_t *words = g_park_words;
        if (words == NULL) {
            struct timespec nap = {1, 0};
            nanosleep(&nap, NULL);
            continue;
        }
        publish_resident();
        uint32_t request = __atomic_load_n(&words[W_REQUEST], __ATOMIC_ACQUIRE);
        answered = __atomic_load_n(&words[W_ANSWERED], __ATOMIC_ACQUIRE);
        if (request == answered) {
            futex_wait(&words[W_REQUEST], request, 1000);
            continue;
        }
        MoveResult out;
        int short_of_it;
        if (words[W_OPERATION] == OP_PARK)
            short_of_it = gps_park_memory((uint64_t)words[W_WANT_MIB] << 20,
                                          (uint64_t)words[W_HOST_MIB] << 20, SERVICE_STREAMS, &out);
        else
            short_of_it = gps_restore_memory(SERVICE_STREAMS, &out);
        uint64_t mib = out.bytes >> 20;
        words[W_MOVED_MIB] = mib > 0xffffffffu ? 0xffffffffu : (uint32_t)mib;
        words[W_ANSWER] = short_of_it ? (out.error ? (uint32_t)out.error : 1u) : 0u;
        publish_resident();
        __atomic_store_n(&words[W_ANSWERED], request, __ATOMIC_RELEASE);
        futex_wake(&words[W_ANSWERED]);
    }
    return NULL;
}

/* Serve park requests written at `words` (the control block's word at offset 32; NULL:
 * serve none).  Starts the service thread once; 0 when it runs, -1 when it could not
 * start or parkable memory is off here. */
int gps_serve_parks(volatile uint32_t *words) {
    if (!enabled()) return -1;
    g_park_words = words;
    publish_resident();
    pthread_mutex_lock(&g_mem_lock);
    int started = g_service_started;
    if (!started) {
        sigset_t all, previous;
        sigfillset(&all);
        /* Signals (Ctrl-C above all) stay the program's: the thread blocks every one. */
        pthread_sigmask(SIG_SETMASK, &all, &previous);
        started = pthread_create(&g_service, NULL, serve_parks, NULL) == 0;
        pthread_sigmask(SIG_SETMASK, &previous, NULL);
        if (started) pthread_detach(g_service);
        g_service_started = started;
    }
    pthread_mutex_unlock(&g_mem_lock);
    return started ? 0 : -1;
}
