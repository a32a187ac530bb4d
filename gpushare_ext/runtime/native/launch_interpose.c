/*
 * gpushare launch interposer: holds every framework's kernel launches on the host while
 * the session is paused, and bounds the work a session keeps in flight.
 *
 * It reaches every framework's launches in one of two ways:
 *
 * - preloaded (LD_PRELOAD, which the gpushare Jupyter server extension sets for the
 *   kernels it starts): it overrides dlsym and wraps the launch entry points that
 *   dlsym and cuGetProcAddress hand out (CUDA's runtime fetches every driver entry
 *   point through cuGetProcAddress), so CuPy, PyTorch, cuBLAS and Numba launches all
 *   pass through it.  This keeps the checkpoint lock and eviction working;
 * - as a CUPTI subscriber (the callback API of CUDA's profiling interface), which can
 *   be attached to a process already running.  But once CUPTI is in a process,
 *   cuCheckpointProcessLock answers CUDA_ERROR_NOT_SUPPORTED for it, even after
 *   unsubscribing (measured on an H200, driver 580), so this way is opt-in.
 *
 * Until the runtime points it at a control block it only counts launches.
 *
 * At entry: while the session's control block says paused (or its gate is closed), the
 * launching thread waits here, before the launch reaches the GPU, with the Python GIL
 * released if it held it; Ctrl-C lets the launch go.
 * At exit: every `record_every` launches an event is recorded on the launch's stream;
 * when `window` such events are outstanding, the next launch first waits for the
 * oldest.  So at most about window x record_every launches are queued on the GPU, and
 * a pause drains in about that much work instead of a whole queue.  With a target
 * (the default), both numbers follow the GPU time a launch takes, measured between
 * completed events that had work queued between them (no idle gap), so that about `target` microseconds of work stay queued: enough to
 * keep the GPU busy behind a host that launches small kernels, little enough that a
 * pause of long kernels drains in a few of them.
 *
 * Nothing here decides anything: the broker writes the control block, the runtime
 * attaches and sets the window.  It needs no CUDA or CUPTI header at build time (the
 * few types and numbers of those interfaces that it uses are declared below), and it
 * reaches CUPTI and the driver through dlopen/dlsym at attach time, so it builds on any
 * machine with a C compiler and is inert until attached.  The driver calls it makes go
 * through a table that tests replace with fakes.
 */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shim.h"

/* ---- the parts of the CUDA driver and CUPTI interfaces used here (their ABI) */

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef int CUptiResult;
typedef void *CUpti_SubscriberHandle;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define CU_EVENT_DISABLE_TIMING 2
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

enum { CUPTI_API_ENTER = 0, CUPTI_API_EXIT = 1 };
enum { CUPTI_CB_DOMAIN_DRIVER_API = 1 };
enum {
    CBID_cuLaunchKernel = 307,
    CBID_cuLaunchKernel_ptsz = 442,
    CBID_cuLaunchCooperativeKernel = 477,
    CBID_cuLaunchCooperativeKernel_ptsz = 478,
    CBID_cuGraphLaunch = 514,
    CBID_cuGraphLaunch_ptsz = 515,
    CBID_cuLaunchKernelEx = 652,
    CBID_cuLaunchKernelEx_ptsz = 653,
};
#define CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED 39

typedef struct {
    int callbackSite;
    const char *functionName;
    const void *functionParams;
    void *functionReturnValue;
    const char *symbolName;
    CUcontext context;
    uint32_t contextUid;
    uint64_t *correlationData;
    uint32_t correlationId;
} CUpti_CallbackData;

typedef struct { /* cuLaunchKernel, cuLaunchCooperativeKernel and their _ptsz forms */
    void *f;
    unsigned int grid[3], block[3], shared;
    CUstream hStream;
} LaunchParams;

typedef struct { /* CUlaunchConfig */
    unsigned int grid[3], block[3], shared;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} LaunchConfig;

typedef struct { /* cuLaunchKernelEx(_ptsz) */
    const LaunchConfig *config;
} LaunchExParams;

typedef struct { /* cuGraphLaunch(_ptsz) */
    void *graph;
    CUstream hStream;
} GraphLaunchParams;

typedef void (*CUpti_CallbackFunc)(void *, int, uint32_t, const void *);

/* ---- the driver calls made here, through a table tests can replace */

typedef struct {
    CUresult (*event_create)(CUevent *, unsigned int);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_query)(CUevent);
    CUresult (*event_synchronize)(CUevent);
    CUresult (*event_destroy)(CUevent);
    CUresult (*stream_is_capturing)(CUstream, int *);
    CUresult (*event_elapsed)(float *, CUevent, CUevent);
} gps_driver;

/* ---- state */

#define MAX_CONTEXTS 16
#define MAX_WINDOW 64 /* ring size; at most MAX_WINDOW - 2 outstanding keeps head - 1 intact */
#define MAX_OUTSTANDING (MAX_WINDOW - 2)

typedef struct {
    CUcontext ctx;
    CUevent events[MAX_WINDOW];
    uint64_t launches_at[MAX_WINDOW]; /* launches of this context when each was recorded */
    /* Whether the event before it was still pending when each was recorded: then the GPU
     * had work queued from that event to this one, and the time between them is GPU time
     * alone, with no idle gap (a training step's host sync, a notebook's think time). */
    unsigned char backlogged[MAX_WINDOW];
    int created;
    unsigned head, count;   /* ring of outstanding events; head - 1 is the last completed */
    int have_completed;
    unsigned since_record;  /* launches since the last event */
    unsigned every;         /* launches between events, as last worked out */
    uint64_t launches;      /* launches of this context so far */
    double per_launch_us;   /* GPU time a launch takes here (0: not known yet) */
} ContextWindow;

typedef struct {
    uint64_t launches;        /* launches seen */
    uint64_t held;            /* launches that waited for a resume */
    uint64_t held_ns;         /* time spent waiting for resumes */
    uint64_t window_waits;    /* launches that waited for the GPU to catch up */
    uint64_t window_wait_ns;
    uint64_t captured;        /* launches into a stream being captured (let through) */
    uint64_t driver_errors;   /* driver calls of ours that failed (the launch went on) */
    uint64_t interrupted;     /* holds ended by Ctrl-C */
    uint64_t per_launch_ns;   /* the latest estimate of a launch's GPU time (any context) */
    uint64_t window;          /* the window and spacing in force (the latest context's) */
    uint64_t record_every;
    uint64_t preemptible;     /* launches run by the runtime as preemptible kernels */
    uint64_t ptx_modules;     /* modules loaded from PTX text (candidates for that) */
    /* Launches only held and locked, never made preemptible, by the kind that keeps them
     * so (the runtime says so once in the cell that ran them): */
    uint64_t cooperative;     /* cuLaunchCooperativeKernel: its blocks wait on each other */
    uint64_t with_attributes; /* cuLaunchKernelEx with attributes (clusters, cooperative) */
    uint64_t graphs;          /* cuGraphLaunch: a graph's kernels are not the shim's to see */
    uint64_t long_waits;      /* launches of a long kernel run as it is that waited for the
                               * one before the last to finish (at most two on the GPU) */
    uint64_t dropped;         /* such launches a Ctrl-C dropped while they waited: never
                               * issued, so the next cell need not wait for them */
    /* What the shim believed was queued on the GPU when a hold began (the launches since
     * the oldest event still outstanding, at the GPU time a launch was learnt to take):
     * a pause's lock waits for that work, so a long first stop is told apart from a
     * queue the bound let grow. */
    uint64_t hold_queued_us_first;    /* at the first hold of this process (0: none yet) */
    uint64_t hold_queued_us_max;      /* the most at any hold */
    uint64_t hold_queued_launches_max;
} gps_stats;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static gps_driver g_driver;
static int g_driver_ready;
static volatile uint32_t *volatile g_gate;   /* control block: 0 open, else closed */
static volatile uint32_t *volatile g_state;  /* control block: session state */
/* control block: 1 while no session that could preempt this one exists (the broker
 * decides): the queue bound is then the looser one */
static volatile uint32_t *volatile g_unrivalled;
/* No bound until a session asks for one (gps_set_window): launches outside any lease can
 * be paused by nobody, so keeping their queue short would only slow them down. */
static unsigned g_window = 0, g_record_every = 4; /* fixed bound, or the start of an adaptive one */
static unsigned g_target_us = 0;                   /* 0: the fixed bound */
static unsigned g_rival_target_us = 0;             /* while rivalled (0: g_target_us) */
static ContextWindow g_windows[MAX_CONTEXTS];
static gps_stats g_stats;
static volatile sig_atomic_t g_interrupt;
static struct sigaction g_previous_sigint;
static void *g_cupti;
static CUpti_SubscriberHandle g_subscriber;
static __thread int t_inside; /* our own driver calls must not re-enter us */
/* Set by the runtime around the launches that finish a transaction Ctrl-C interrupted:
 * those are not held (the cell must get control back within a second). */
static __thread int t_exempt;

#define STATE_RUNNING 2
#define STATE_PAUSED 3
#define STATE_EVICTED 4

/* CPython's GIL, found in the process if it is a Python process: a launching thread
 * that holds it lets the session's other threads run while it waits. */
static int (*py_gil_check)(void);
static void *(*py_save_thread)(void);
static void (*py_restore_thread)(void *);

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void nap_us(long us) {
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

static int session_paused(void) {
    volatile uint32_t *gate = g_gate, *state = g_state;
    if (gate == NULL || state == NULL) return 0;
    uint32_t s = __atomic_load_n(state, __ATOMIC_ACQUIRE);
    return __atomic_load_n(gate, __ATOMIC_ACQUIRE) != 0 || s == STATE_PAUSED || s == STATE_EVICTED;
}

static void install_sigint(void);

/* Ctrl-C while a launch is held: the hold ends (the launch goes on, so no framework sees
 * a failed launch) and Python's own handler still runs, so the cell stops right after. */
static volatile uint64_t g_interrupts; /* every Ctrl-C the shim's handler saw */

static void on_sigint(int sig, siginfo_t *info, void *context) {
    g_interrupt = 1;
    __atomic_add_fetch(&g_interrupts, 1, __ATOMIC_RELAXED);
    if (g_previous_sigint.sa_flags & SA_SIGINFO) {
        if (g_previous_sigint.sa_sigaction) g_previous_sigint.sa_sigaction(sig, info, context);
    } else if (g_previous_sigint.sa_handler != SIG_IGN && g_previous_sigint.sa_handler != SIG_DFL) {
        g_previous_sigint.sa_handler(sig);
    } else if (g_previous_sigint.sa_handler == SIG_DFL) {
        signal(SIGINT, SIG_DFL);
        raise(SIGINT);
    }
}

/* ---- the two halves of a launch, callable without CUPTI (tests drive them directly) */

/* The work the windows say is queued, read without the lock (a thread may hold it
 * across a driver call the checkpoint lock blocks): a figure for the stats only. */
static void note_queue_at_hold(void) {
    double queued_us = 0;
    uint64_t launches = 0;
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        ContextWindow *w = &g_windows[i];
        if (!__atomic_load_n(&w->created, __ATOMIC_ACQUIRE)) continue;
        unsigned count = __atomic_load_n(&w->count, __ATOMIC_RELAXED);
        unsigned every = __atomic_load_n(&w->every, __ATOMIC_RELAXED);
        unsigned since = __atomic_load_n(&w->since_record, __ATOMIC_RELAXED);
        double per_launch_us;
        __atomic_load(&w->per_launch_us, &per_launch_us, __ATOMIC_RELAXED);
        uint64_t n = (uint64_t)count * (every ? every : 1) + since;
        launches += n;
        queued_us += (double)n * (per_launch_us > 0 ? per_launch_us : 0);
    }
    uint64_t us = (uint64_t)queued_us, zero = 0;
    __atomic_compare_exchange_n(&g_stats.hold_queued_us_first, &zero, us ? us : 1, 0,
                                __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    uint64_t seen = __atomic_load_n(&g_stats.hold_queued_us_max, __ATOMIC_RELAXED);
    while (us > seen && !__atomic_compare_exchange_n(&g_stats.hold_queued_us_max, &seen, us, 1,
                                                     __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    seen = __atomic_load_n(&g_stats.hold_queued_launches_max, __ATOMIC_RELAXED);
    while (launches > seen &&
           !__atomic_compare_exchange_n(&g_stats.hold_queued_launches_max, &seen, launches, 1,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* Entry: wait here while the session is paused.  Returns 1 if it waited. */
int gps_launch_enter(CUstream stream, int ptsz) {
    (void)stream;
    (void)ptsz;
    __atomic_add_fetch(&g_stats.launches, 1, __ATOMIC_RELAXED);
    if (!session_paused() || t_exempt) return 0;
    note_queue_at_hold();
    /* Python puts its own SIGINT handler back at every cell (ipykernel does): chain ours
     * in front of it again, or Ctrl-C could not end this hold. */
    install_sigint();
    void *saved = NULL;
    if (py_gil_check && py_save_thread && py_gil_check()) saved = py_save_thread();
    uint64_t started = now_ns();
    long nap = 5;
    g_interrupt = 0;
    while (session_paused()) {
        if (g_interrupt) {
            __atomic_add_fetch(&g_stats.interrupted, 1, __ATOMIC_RELAXED);
            break;
        }
        nap_us(nap);
        if (nap < 200) nap *= 2; /* answer a resume within a fifth of a millisecond */
    }
    __atomic_add_fetch(&g_stats.held, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_stats.held_ns, now_ns() - started, __ATOMIC_RELAXED);
    if (saved) py_restore_thread(saved);
    return 1;
}

/* The window of a context already seen, without the lock (a slot's context never
 * changes once it is created, until a test resets everything). */
static ContextWindow *known_window(CUcontext ctx) {
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        if (__atomic_load_n(&g_windows[i].created, __ATOMIC_ACQUIRE) && g_windows[i].ctx == ctx)
            return &g_windows[i];
    }
    return NULL;
}

/* Called with g_lock held. */
static ContextWindow *window_of(CUcontext ctx) {
    ContextWindow *known = known_window(ctx);
    if (known != NULL) return known;
    ContextWindow *free_slot = NULL;
    for (int i = 0; i < MAX_CONTEXTS && free_slot == NULL; i++) {
        if (!g_windows[i].created) free_slot = &g_windows[i];
    }
    if (free_slot == NULL) return NULL; /* more contexts than slots: no bound for this one */
    memset(free_slot, 0, sizeof(*free_slot));
    free_slot->ctx = ctx;
    for (unsigned i = 0; i < MAX_WINDOW; i++) {
        /* Timed events: the GPU time between two of them is what the bound learns from. */
        if (g_driver.event_create(&free_slot->events[i], 0) != CUDA_SUCCESS) {
            for (unsigned j = 0; j < i; j++) g_driver.event_destroy(free_slot->events[j]);
            g_stats.driver_errors++;
            return NULL;
        }
    }
    __atomic_store_n(&free_slot->created, 1, __ATOMIC_RELEASE);
    return free_slot;
}

static int capturing(CUstream stream) {
    int status = 0;
    if (g_driver.stream_is_capturing(stream, &status) != CUDA_SUCCESS) return 1; /* play safe */
    return status != 0;
}

/* Learn a launch's GPU time from the completed event at head, measured from the one
 * completed before it, when the GPU was busy all that time (an interval with an idle
 * gap in it would make launches look longer and the bound too tight).  Called with
 * g_lock held, after the head event completed. */
static void learn_from_completion(ContextWindow *w) {
    unsigned done = w->head;
    if (w->have_completed && w->backlogged[done] && g_driver.event_elapsed != NULL) {
        unsigned previous = (done + MAX_WINDOW - 1) % MAX_WINDOW;
        uint64_t launches = w->launches_at[done] - w->launches_at[previous];
        float ms = 0;
        if (launches > 0
            && g_driver.event_elapsed(&ms, w->events[previous], w->events[done]) == CUDA_SUCCESS
            && ms > 0) {
            double sample = (double)ms * 1000.0 / (double)launches;
            w->per_launch_us = w->per_launch_us == 0 ? sample : 0.8 * w->per_launch_us + 0.2 * sample;
            g_stats.per_launch_ns = (uint64_t)(w->per_launch_us * 1000.0);
        }
    }
    w->have_completed = 1;
}

static int lease_active(void);

/* A session with a lease that somebody could preempt (the broker's word). */
static int rivalled(void) {
    volatile uint32_t *unrivalled = g_unrivalled;
    return unrivalled != NULL && __atomic_load_n(unrivalled, __ATOMIC_ACQUIRE) == 0
           && lease_active();
}

/* The window and spacing for this context: fixed, or from its launches' GPU time.
 * While a rival may ask at any moment, the tighter target holds and at most one launch
 * waits behind the running one: a pause then drains about that much. */
static void bound_of(const ContextWindow *w, unsigned *window, unsigned *every) {
    *window = __atomic_load_n(&g_window, __ATOMIC_ACQUIRE);
    *every = __atomic_load_n(&g_record_every, __ATOMIC_ACQUIRE);
    unsigned target = __atomic_load_n(&g_target_us, __ATOMIC_ACQUIRE), least = 2;
    unsigned rival_target = __atomic_load_n(&g_rival_target_us, __ATOMIC_ACQUIRE);
    if (target == 0 || w->per_launch_us <= 0) return;
    if (rival_target != 0 && rival_target < target && rivalled()) {
        target = rival_target;
        least = 1;
    }
    double per = w->per_launch_us;
    double spacing = (double)target / (4.0 * per); /* about four events per target */
    *every = spacing < 1 ? 1 : spacing > 64 ? 64 : (unsigned)(spacing + 1e-6);
    double outstanding = (double)target / (per * (double)*every);
    *window = outstanding < least ? least
              : outstanding > MAX_OUTSTANDING ? MAX_OUTSTANDING : (unsigned)(outstanding + 0.999);
}

/* Exit of a successful launch: every record_every launches, record an event after it;
 * with window events outstanding, first wait for the oldest.  Returns 1 if it waited. */
int gps_launch_exit(CUcontext ctx, CUstream stream, int ptsz) {
    if (!g_driver_ready || __atomic_load_n(&g_window, __ATOMIC_ACQUIRE) == 0 || ctx == NULL) return 0;
    if (stream == NULL && ptsz) stream = CU_STREAM_PER_THREAD;
    /* Most launches only count: no lock, no driver call. */
    ContextWindow *w = known_window(ctx);
    if (w != NULL) {
        __atomic_add_fetch(&w->launches, 1, __ATOMIC_RELAXED);
        unsigned every = __atomic_load_n(&w->every, __ATOMIC_RELAXED);
        if (__atomic_add_fetch(&w->since_record, 1, __ATOMIC_RELAXED) < every) return 0;
    }
    int waited = 0;
    t_inside = 1;
    pthread_mutex_lock(&g_lock);
    if (w == NULL) {
        w = window_of(ctx);
        if (w == NULL) goto done;
        w->launches++;
        w->since_record++;
    }
    unsigned window, every;
    bound_of(w, &window, &every);
    w->every = every;
    g_stats.window = window;
    g_stats.record_every = every;
    if (w->since_record < every) goto done;
    w->since_record = 0;
    if (capturing(stream)) {
        g_stats.captured++; /* a graph being built: nothing runs now, nothing to bound */
        goto done;
    }
    /* Forget events the GPU has passed, learning from each; if the window is still
     * full, wait for the oldest. */
    while (w->count > 0 && g_driver.event_query(w->events[w->head]) == CUDA_SUCCESS) {
        learn_from_completion(w);
        w->head = (w->head + 1) % MAX_WINDOW;
        w->count--;
    }
    bound_of(w, &window, &every); /* with what the completions just taught */
    w->every = every;
    g_stats.window = window;
    g_stats.record_every = every;
    if (w->count >= window) {
        uint64_t started = now_ns();
        CUevent oldest = w->events[w->head];
        pthread_mutex_unlock(&g_lock); /* other threads' launches need not wait for ours */
        void *saved = NULL;
        if (py_gil_check && py_save_thread && py_gil_check()) saved = py_save_thread();
        CUresult r = g_driver.event_synchronize(oldest);
        if (saved) py_restore_thread(saved);
        pthread_mutex_lock(&g_lock);
        if (r != CUDA_SUCCESS) g_stats.driver_errors++;
        if (w->count > 0 && w->events[w->head] == oldest) {
            if (r == CUDA_SUCCESS) learn_from_completion(w);
            w->head = (w->head + 1) % MAX_WINDOW;
            w->count--;
        }
        g_stats.window_waits++;
        g_stats.window_wait_ns += now_ns() - started;
        waited = 1;
    }
    if (w->count < MAX_OUTSTANDING) {
        unsigned slot = (w->head + w->count) % MAX_WINDOW;
        if (g_driver.event_record(w->events[slot], stream) == CUDA_SUCCESS) {
            w->launches_at[slot] = w->launches;
            w->backlogged[slot] = w->count > 0; /* the latest event is not passed yet */
            w->count++;
        } else {
            g_stats.driver_errors++;
        }
    }
done:
    pthread_mutex_unlock(&g_lock);
    t_inside = 0;
    return waited;
}

/* ---- preload glue: dlsym and cuGetProcAddress hand out our wrappers */

typedef CUresult (*LaunchFn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void **, void **);
typedef CUresult (*CoopFn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, CUstream, void **);
typedef CUresult (*LaunchExFn)(const LaunchConfig *, void *, void **, void **);
typedef CUresult (*GraphFn)(void *, CUstream);
typedef CUresult (*GetProcV2Fn)(const char *, void **, int, uint64_t, void *);
typedef CUresult (*GetProcV1Fn)(const char *, void **, int, uint64_t);
typedef CUresult (*CtxFn)(CUcontext *);

static void *(*g_real_dlsym)(void *, const char *);
static uint64_t g_dlsym_overrides; /* calls of our dlsym: non-zero when preloaded */
static CtxFn g_ctx_current;

/* Hold (unless the launch only builds a graph) before a launch reaches the driver. */
static void before_launch(CUstream stream, int ptsz) {
    if (session_paused() && g_driver_ready && stream != NULL) {
        int status = 0;
        t_inside = 1;
        int being_captured = g_driver.stream_is_capturing(stream, &status) == CUDA_SUCCESS
                             && status != 0;
        t_inside = 0;
        if (being_captured) {
            __atomic_add_fetch(&g_stats.launches, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    gps_launch_enter(stream, ptsz);
}

static void after_launch(CUresult result, CUstream stream, int ptsz) {
    if (result != CUDA_SUCCESS || !g_driver_ready || g_ctx_current == NULL) return;
    CUcontext ctx = NULL;
    if (g_ctx_current(&ctx) == CUDA_SUCCESS) gps_launch_exit(ctx, stream, ptsz);
}

/* Two wrappers of each kind: an entry point may come in a legacy and a per-thread
 * default-stream flavour, each with a real function of its own. */
#define WRAPPED(kind, n) static kind real_##kind##_##n;
WRAPPED(LaunchFn, 0) WRAPPED(LaunchFn, 1) WRAPPED(CoopFn, 0) WRAPPED(CoopFn, 1)
WRAPPED(LaunchExFn, 0) WRAPPED(LaunchExFn, 1) WRAPPED(GraphFn, 0) WRAPPED(GraphFn, 1)

static int redirected(void *f, const unsigned *dims, unsigned shared, CUstream stream,
                      void **params, void **extra, CUresult *result);
static int sample_begin(void *f, CUstream stream);

/* Launches inside a wrapper now (held while paused, run by the runtime, or on their way
 * to the driver): a module is unloaded only once other threads' launches have gone on. */
static unsigned g_in_launch;
static __thread unsigned t_in_launch;
static void launch_begins(void) {
    t_in_launch++;
    __atomic_add_fetch(&g_in_launch, 1, __ATOMIC_ACQ_REL);
}
static void launch_ends(void) {
    __atomic_sub_fetch(&g_in_launch, 1, __ATOMIC_ACQ_REL);
    t_in_launch--;
}
static void sample_end(void *f, CUstream stream, int slot);
static int long_launch_dropped(void *f, CUstream stream);
static void long_launch_issued(void *f, CUstream stream, CUresult r);

#define LAUNCH_WRAPPER(n)                                                                      \
    static CUresult launch_##n(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,    \
                               unsigned by, unsigned bz, unsigned sh, CUstream st,            \
                               void **params, void **extra) {                                 \
        const unsigned dims[6] = {gx, gy, gz, bx, by, bz};                                     \
        CUresult r;                                                                            \
        if (redirected(f, dims, sh, st, params, extra, &r)) return r;                          \
        before_launch(st, 0);                                                                  \
        if ((r = gps_memory_resident()) != CUDA_SUCCESS) return r;                             \
        if (long_launch_dropped(f, st)) return CUDA_SUCCESS;                                   \
        int slot = sample_begin(f, st);                                                        \
        r = real_LaunchFn_##n(f, gx, gy, gz, bx, by, bz, sh, st, params, extra);               \
        if (slot >= 0) sample_end(f, st, r == CUDA_SUCCESS ? slot : -1);                       \
        long_launch_issued(f, st, r);                                                          \
        after_launch(r, st, 0);                                                                \
        return r;                                                                              \
    }                                                                                          \
    static CUresult w_launch_##n(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,  \
                                 unsigned by, unsigned bz, unsigned sh, CUstream st,          \
                                 void **params, void **extra) {                               \
        launch_begins();                                                                       \
        CUresult r = launch_##n(f, gx, gy, gz, bx, by, bz, sh, st, params, extra);             \
        launch_ends();                                                                         \
        return r;                                                                              \
    }
#define COOP_WRAPPER(n)                                                                        \
    static CUresult w_coop_##n(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,    \
                               unsigned by, unsigned bz, unsigned sh, CUstream st,            \
                               void **params) {                                               \
        __atomic_add_fetch(&g_stats.cooperative, 1, __ATOMIC_RELAXED);                         \
        launch_begins();                                                                       \
        before_launch(st, 0);                                                                  \
        CUresult r = gps_memory_resident();                                                    \
        if (r == CUDA_SUCCESS) r = real_CoopFn_##n(f, gx, gy, gz, bx, by, bz, sh, st, params); \
        after_launch(r, st, 0);                                                                \
        launch_ends();                                                                         \
        return r;                                                                              \
    }
/* A launch with attributes (clusters, cooperative ...) is never redirected. */
#define EX_WRAPPER(n)                                                                          \
    static CUresult ex_##n(const LaunchConfig *c, void *f, void **params, void **extra);      \
    static CUresult w_ex_##n(const LaunchConfig *c, void *f, void **params, void **extra) {    \
        launch_begins();                                                                       \
        CUresult r = ex_##n(c, f, params, extra);                                              \
        launch_ends();                                                                         \
        return r;                                                                              \
    }                                                                                          \
    static CUresult ex_##n(const LaunchConfig *c, void *f, void **params, void **extra) {      \
        CUstream st = c ? c->hStream : NULL;                                                   \
        CUresult r;                                                                            \
        if (c != NULL && c->numAttrs > 0)                                                      \
            __atomic_add_fetch(&g_stats.with_attributes, 1, __ATOMIC_RELAXED);                 \
        if (c != NULL && c->numAttrs == 0) {                                                   \
            const unsigned dims[6] = {c->grid[0], c->grid[1], c->grid[2],                      \
                                      c->block[0], c->block[1], c->block[2]};                  \
            if (redirected(f, dims, c->shared, st, params, extra, &r)) return r;               \
        }                                                                                      \
        before_launch(st, 0);                                                                  \
        if ((r = gps_memory_resident()) != CUDA_SUCCESS) return r;                             \
        if (long_launch_dropped(f, st)) return CUDA_SUCCESS;                                   \
        int slot = sample_begin(f, st);                                                        \
        r = real_LaunchExFn_##n(c, f, params, extra);                                          \
        if (slot >= 0) sample_end(f, st, r == CUDA_SUCCESS ? slot : -1);                       \
        long_launch_issued(f, st, r);                                                          \
        after_launch(r, st, 0);                                                                \
        return r;                                                                              \
    }
#define GRAPH_WRAPPER(n)                                                                       \
    static CUresult w_graph_##n(void *g, CUstream st) {                                        \
        __atomic_add_fetch(&g_stats.graphs, 1, __ATOMIC_RELAXED);                              \
        before_launch(st, 0);                                                                  \
        CUresult r = gps_memory_resident();                                                    \
        if (r == CUDA_SUCCESS) r = real_GraphFn_##n(g, st);                                    \
        after_launch(r, st, 0);                                                                \
        return r;                                                                              \
    }
LAUNCH_WRAPPER(0) LAUNCH_WRAPPER(1) COOP_WRAPPER(0) COOP_WRAPPER(1)
EX_WRAPPER(0) EX_WRAPPER(1) GRAPH_WRAPPER(0) GRAPH_WRAPPER(1)

/* The wrapper for `real` among two slots, or `real` itself when both hold others. */
#define PICK(kind, wrapper)                                                                    \
    do {                                                                                       \
        if (real_##kind##_0 == NULL || real_##kind##_0 == (kind)real) {                        \
            real_##kind##_0 = (kind)real;                                                      \
            return (void *)wrapper##_0;                                                        \
        }                                                                                      \
        if (real_##kind##_1 == NULL || real_##kind##_1 == (kind)real) {                        \
            real_##kind##_1 = (kind)real;                                                      \
            return (void *)wrapper##_1;                                                        \
        }                                                                                      \
        return real;                                                                           \
    } while (0)

static void *wrap_module_call(const char *name, void *real);

/* ---- memory imported from another process: its checkpoint cannot be restored
 *
 * On the H200 (driver 580), a process that opened another process's memory through CUDA
 * IPC is checkpointed without complaint and then fails to restore (INVALID_VALUE; the
 * process is left unusable).  The broker must not park such a process, so the shim
 * counts these imports and the session reports them. */
typedef struct { char reserved[64]; } IpcMemHandle; /* CUipcMemHandle, passed by value */
typedef CUresult (*IpcOpenFn)(void *, IpcMemHandle, unsigned);
typedef CUresult (*ImportFn)(void *, void *, int);
static IpcOpenFn real_ipc_open, real_ipc_open_v2;
static ImportFn real_import;
static uint64_t g_ipc_imports;
static volatile uint32_t *volatile g_import_word; /* control block: imports so far */

/* Count an import, and publish the count where the broker reads it before a park. */
static void count_import(void) {
    uint64_t n = __atomic_add_fetch(&g_ipc_imports, 1, __ATOMIC_RELAXED);
    volatile uint32_t *word = g_import_word;
    uint32_t shown = n > 0xffffffffu ? 0xffffffffu : (uint32_t)n;
    if (word != NULL) __atomic_store_n(word, shown, __ATOMIC_RELEASE);
}

/* The control block's word for the count (NULL: none), filled in at once. */
void gps_set_import_word(volatile uint32_t *word) {
    g_import_word = word;
    if (word != NULL) __atomic_store_n(word, (uint32_t)g_ipc_imports, __ATOMIC_RELEASE);
}

static CUresult w_ipc_open(void *pdptr, IpcMemHandle handle, unsigned flags) {
    count_import();
    return real_ipc_open ? real_ipc_open(pdptr, handle, flags) : 500;
}

static CUresult w_ipc_open_v2(void *pdptr, IpcMemHandle handle, unsigned flags) {
    count_import();
    return real_ipc_open_v2 ? real_ipc_open_v2(pdptr, handle, flags) : 500;
}

static CUresult w_import(void *allocation, void *os_handle, int kind) {
    count_import();
    return real_import ? real_import(allocation, os_handle, kind) : 500;
}

/* How many times this process opened memory of another process (0 when never). */
unsigned long long gps_ipc_imports(void) {
    return __atomic_load_n(&g_ipc_imports, __ATOMIC_RELAXED);
}

static void *wrap_import(const char *name, void *real) {
    if (strcmp(name, "cuIpcOpenMemHandle") == 0) {
        real_ipc_open = (IpcOpenFn)real;
        return (void *)w_ipc_open;
    }
    if (strcmp(name, "cuIpcOpenMemHandle_v2") == 0) {
        real_ipc_open_v2 = (IpcOpenFn)real;
        return (void *)w_ipc_open_v2;
    }
    if (strcmp(name, "cuMemImportFromShareableHandle") == 0) {
        real_import = (ImportFn)real;
        return (void *)w_import;
    }
    return NULL;
}

static int is_wrapper(void *fn) {
    return fn == (void *)w_launch_0 || fn == (void *)w_launch_1 || fn == (void *)w_coop_0
           || fn == (void *)w_coop_1 || fn == (void *)w_ex_0 || fn == (void *)w_ex_1
           || fn == (void *)w_graph_0 || fn == (void *)w_graph_1 || fn == (void *)w_ipc_open
           || fn == (void *)w_ipc_open_v2 || fn == (void *)w_import
           || wrap_module_call(NULL, fn) != NULL || gps_wrap_memory_call(NULL, fn, 0) != NULL;
}

static CUresult w_get_proc_v1(const char *symbol, void **pfn, int version, uint64_t flags);
static CUresult w_get_proc_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                              void *status);
static GetProcV1Fn real_get_proc_v1;
static GetProcV2Fn real_get_proc_v2;

/* Our stand-in for the entry point `name` whose real function is `real` (or `real`). */
static void *wrap(const char *name, void *real, int version) {
    if (real == NULL || is_wrapper(real) || strncmp(name, "cu", 2) != 0) return real;
    const char *base = name;
    size_t length = strlen(name);
    char trimmed[64];
    if (length > 5 && length < sizeof(trimmed) && strcmp(name + length - 5, "_ptsz") == 0) {
        memcpy(trimmed, name, length - 5);
        trimmed[length - 5] = 0;
        base = trimmed;
    }
    if (strcmp(base, "cuLaunchKernel") == 0) PICK(LaunchFn, w_launch);
    if (strcmp(base, "cuLaunchCooperativeKernel") == 0) PICK(CoopFn, w_coop);
    if (strcmp(base, "cuLaunchKernelEx") == 0) PICK(LaunchExFn, w_ex);
    if (strcmp(base, "cuGraphLaunch") == 0) PICK(GraphFn, w_graph);
    void *module_wrapper = wrap_module_call(name, real);
    if (module_wrapper != NULL) return module_wrapper;
    void *import_wrapper = wrap_import(name, real);
    if (import_wrapper != NULL) return import_wrapper;
    void *memory_wrapper = gps_wrap_memory_call(name, real, version);
    if (memory_wrapper != NULL) return memory_wrapper;
    if (strcmp(name, "cuGetProcAddress_v2") == 0
        || (strcmp(name, "cuGetProcAddress") == 0 && version >= 12000)) {
        if (real != (void *)w_get_proc_v2) real_get_proc_v2 = (GetProcV2Fn)real;
        return (void *)w_get_proc_v2;
    }
    if (strcmp(name, "cuGetProcAddress") == 0) {
        if (real != (void *)w_get_proc_v1) real_get_proc_v1 = (GetProcV1Fn)real;
        return (void *)w_get_proc_v1;
    }
    if (strcmp(name, "cuCtxGetCurrent") == 0 && g_ctx_current == NULL) g_ctx_current = (CtxFn)real;
    return real;
}

static CUresult w_get_proc_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                              void *status) {
    if (real_get_proc_v2 == NULL) return 500; /* CUDA_ERROR_NOT_FOUND */
    CUresult r = real_get_proc_v2(symbol, pfn, version, flags, status);
    if (r == CUDA_SUCCESS && pfn != NULL && symbol != NULL) {
        __atomic_add_fetch(&g_dlsym_overrides, 1, __ATOMIC_RELAXED);
        *pfn = wrap(symbol, *pfn, version);
    }
    return r;
}

static CUresult w_get_proc_v1(const char *symbol, void **pfn, int version, uint64_t flags) {
    if (real_get_proc_v1 == NULL) return 500;
    CUresult r = real_get_proc_v1(symbol, pfn, version, flags);
    if (r == CUDA_SUCCESS && pfn != NULL && symbol != NULL) *pfn = wrap(symbol, *pfn, version);
    return r;
}

static void *real_dlsym(void *handle, const char *name) {
    if (g_real_dlsym == NULL) {
        g_real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (g_real_dlsym == NULL)
            g_real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    }
    return g_real_dlsym ? g_real_dlsym(handle, name) : NULL;
}

void *gps_real_dlsym(void *handle, const char *name) { return real_dlsym(handle, name); }

/* Preloaded, this is every library's dlsym; loaded any other way it is only ours. */
__attribute__((visibility("default"))) void *dlsym(void *handle, const char *name) {
    void *found = real_dlsym(handle, name);
    if (found == NULL || name[0] != 'c' || name[1] != 'u') return found;
    __atomic_add_fetch(&g_dlsym_overrides, 1, __ATOMIC_RELAXED);
    return wrap(name, found, 0); /* an exported cuGetProcAddress has the first ABI */
}

static int g_preloaded;

/* At load: was this library named in LD_PRELOAD (then our dlsym is everyone's)? */
__attribute__((constructor)) static void note_how_loaded(void) {
    const char *list = getenv("LD_PRELOAD");
    Dl_info self;
    if (list == NULL || dladdr((void *)note_how_loaded, &self) == 0 || self.dli_fname == NULL)
        return;
    char mine[4096], theirs[4096], entry[4096];
    if (realpath(self.dli_fname, mine) == NULL) return;
    while (*list) {
        size_t n = strcspn(list, ": ");
        if (n > 0 && n < sizeof(entry)) {
            memcpy(entry, list, n);
            entry[n] = 0;
            if (realpath(entry, theirs) != NULL && strcmp(theirs, mine) == 0) g_preloaded = 1;
        }
        list += n;
        while (*list == ':' || *list == ' ') list++;
    }
}

/* Whether this library was preloaded, so that it wraps what every library looks up. */
int gps_preloaded(void) { return g_preloaded; }

/* ---- CUPTI glue */

static CUstream stream_of(uint32_t cbid, const void *params, int *ptsz) {
    *ptsz = 0;
    switch (cbid) {
    case CBID_cuLaunchKernel_ptsz:
    case CBID_cuLaunchCooperativeKernel_ptsz:
        *ptsz = 1; /* fall through */
    case CBID_cuLaunchKernel:
    case CBID_cuLaunchCooperativeKernel:
        return ((const LaunchParams *)params)->hStream;
    case CBID_cuLaunchKernelEx_ptsz:
        *ptsz = 1; /* fall through */
    case CBID_cuLaunchKernelEx: {
        const LaunchConfig *config = ((const LaunchExParams *)params)->config;
        return config ? config->hStream : NULL;
    }
    case CBID_cuGraphLaunch_ptsz:
        *ptsz = 1; /* fall through */
    case CBID_cuGraphLaunch:
        return ((const GraphLaunchParams *)params)->hStream;
    }
    return NULL;
}

static void on_api(void *userdata, int domain, uint32_t cbid, const void *data) {
    (void)userdata;
    const CUpti_CallbackData *info = (const CUpti_CallbackData *)data;
    if (domain != CUPTI_CB_DOMAIN_DRIVER_API || t_inside || info == NULL) return;
    int ptsz = 0;
    CUstream stream = stream_of(cbid, info->functionParams, &ptsz);
    if (info->callbackSite == CUPTI_API_ENTER) {
        before_launch(stream, ptsz);
    } else if (info->functionReturnValue == NULL
               || *(const CUresult *)info->functionReturnValue == CUDA_SUCCESS) {
        gps_launch_exit(info->context, stream, ptsz);
    }
}

static int load_driver(char *err, size_t errlen) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda == NULL) cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (cuda == NULL) {
        snprintf(err, errlen, "the CUDA driver (libcuda.so.1) is not loadable: %s", dlerror());
        return -1;
    }
    g_ctx_current = (CtxFn)real_dlsym(cuda, "cuCtxGetCurrent");
    gps_driver d;
    d.event_create = (CUresult(*)(CUevent *, unsigned int))real_dlsym(cuda, "cuEventCreate");
    d.event_record = (CUresult(*)(CUevent, CUstream))real_dlsym(cuda, "cuEventRecord");
    d.event_query = (CUresult(*)(CUevent))real_dlsym(cuda, "cuEventQuery");
    d.event_synchronize = (CUresult(*)(CUevent))real_dlsym(cuda, "cuEventSynchronize");
    d.event_destroy = (CUresult(*)(CUevent))real_dlsym(cuda, "cuEventDestroy_v2");
    d.stream_is_capturing = (CUresult(*)(CUstream, int *))real_dlsym(cuda, "cuStreamIsCapturing");
    d.event_elapsed = (CUresult(*)(float *, CUevent, CUevent))real_dlsym(cuda, "cuEventElapsedTime_v2");
    if (!d.event_elapsed) d.event_elapsed = (CUresult(*)(float *, CUevent, CUevent))real_dlsym(cuda, "cuEventElapsedTime");
    if (!g_ctx_current || !d.event_create || !d.event_record || !d.event_query
        || !d.event_synchronize || !d.event_destroy || !d.stream_is_capturing || !d.event_elapsed) {
        snprintf(err, errlen, "the CUDA driver lacks an event or capture entry point");
        return -1;
    }
    g_driver = d;
    g_driver_ready = 1;
    return 0;
}

static void find_python(void) {
    py_gil_check = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
    py_save_thread = (void *(*)(void))dlsym(RTLD_DEFAULT, "PyEval_SaveThread");
    py_restore_thread = (void (*)(void *))dlsym(RTLD_DEFAULT, "PyEval_RestoreThread");
}

/* Wrap whatever SIGINT handler is in place (Python's), once more if it was replaced. */
static void install_sigint(void) {
    struct sigaction current;
    if (sigaction(SIGINT, NULL, &current) != 0) return;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigint) return;
    struct sigaction ours;
    memset(&ours, 0, sizeof(ours));
    ours.sa_sigaction = on_sigint;
    ours.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&ours.sa_mask);
    g_previous_sigint = current;
    sigaction(SIGINT, &ours, NULL);
}

/* ---- kernels loaded from PTX: long ones are run preemptibly by the runtime
 *
 * A framework that loads a module from PTX text (CuPy compiling to PTX, a RawModule of
 * PTX) hands us the text the analysis and transform of gpushare need.  The runtime is
 * told of each such module and of each function taken from it, and may ask us to
 * *track* a function: its first launches are timed with a pair of events (and one in
 * RESAMPLE_EVERY after that), and once one took at least `g_long_us`, its later
 * launches (cuLaunchKernel, or cuLaunchKernelEx without attributes; not into a graph
 * being captured; parameters as an array) are handed to the runtime's launch hook,
 * which runs the preemptible twin and returns when it is done.  Short kernels stay
 * untouched: the queue bound already drains them within a few microseconds.  Numba,
 * which links to a cubin itself, tells the runtime of its kernels' PTX from Python.
 * A Ctrl-C during such a launch reaches the runtime, which ends the launch whole (rolled
 * back, or finished) and has it raised here once the hook has returned. */

typedef CUresult (*ModLoadFn)(void **, const void *);
typedef CUresult (*ModLoadExFn)(void **, const void *, unsigned, void *, void **);
typedef CUresult (*GetFunctionFn)(void **, void *, const char *);
typedef CUresult (*ModUnloadFn)(void *);
typedef void (*ModuleHook)(void *module, const char *ptx);
typedef void (*FunctionHook)(void *function, void *module, const char *name);
typedef void (*UnloadHook)(void *module);
typedef int (*LaunchHook)(void *function, const unsigned *dims, unsigned shared, CUstream stream,
                          void **params);

#define LAUNCH_NOT_HANDLED (-1) /* the launch hook's answer: launch the original */
#define MAX_TRACKED 4096        /* a power of two: open addressing by pointer hash */
#define SAMPLES_TO_DECIDE 3
#define RESAMPLE_EVERY 1024     /* a short kernel is timed again this often */
enum { TRACK_SAMPLING = 0, TRACK_LONG = 1, TRACK_SHORT = 2, TRACK_OFF = 3 };

typedef struct {
    void *f;               /* written last, with release: readers need no lock */
    int state;
    unsigned samples, launches;
    float longest_us;
    CUevent start, end;
    int pending;           /* an event pair was recorded and not read yet */
} Tracked;

static ModLoadFn real_mod_load;
static ModLoadExFn real_mod_load_ex;
static GetFunctionFn real_get_function;
static ModUnloadFn real_mod_unload;
static ModuleHook g_on_module;
static FunctionHook g_on_function;
static UnloadHook g_on_unload;
static LaunchHook g_on_launch;
static unsigned g_long_us = 2000;
static Tracked g_tracked[MAX_TRACKED];
static unsigned g_tracked_count;
static __thread int t_redirecting; /* the hook's own launches and loads are plain ones */
static __thread int t_answer;      /* what the hook did with the launch (gps_launch_answer) */
static __thread int t_reraise;     /* Ctrl-C came during the hook: raise it once it returns */

/* Only while a lease is held (the broker's state word: running, paused or evicted). */
static int lease_active(void) {
    volatile uint32_t *state = g_state;
    if (state == NULL) return 0;
    uint32_t s = __atomic_load_n(state, __ATOMIC_ACQUIRE);
    return s == STATE_RUNNING || s == STATE_PAUSED || s == STATE_EVICTED;
}

/* The runtime, inside the launch hook: the launch was run (0) or must run as it is (-1). */
void gps_launch_answer(int answer) { t_answer = answer; }

/* The runtime, inside the launch hook: a Ctrl-C came; deliver it when the hook returns. */
void gps_reraise_interrupt(void) { t_reraise = 1; }

/* The runtime: launches of this thread are (1) or are not (0) held while paused. */
void gps_set_exempt(int exempt) { t_exempt = exempt; }

static int looks_like_ptx(const void *image) {
    const unsigned char *c = (const unsigned char *)image;
    if (c == NULL) return 0;
    for (int i = 0; i < 256 && (c[i] == ' ' || c[i] == '\t' || c[i] == '\n' || c[i] == '\r'); i++)
        c++;
    return (c[0] == '/' && c[1] == '/') || c[0] == '.'; /* a comment or a directive */
}

static void seen_module(CUresult r, void **module, const void *image) {
    if (r != CUDA_SUCCESS || module == NULL || t_redirecting || !looks_like_ptx(image)) return;
    __atomic_add_fetch(&g_stats.ptx_modules, 1, __ATOMIC_RELAXED);
    if (g_on_module) g_on_module(*module, (const char *)image);
}

static CUresult w_mod_load(void **module, const void *image) {
    if (real_mod_load == NULL) return 500;
    CUresult r = real_mod_load(module, image);
    seen_module(r, module, image);
    return r;
}

static CUresult w_mod_load_ex(void **module, const void *image, unsigned n, void *options,
                              void **values) {
    if (real_mod_load_ex == NULL) return 500;
    CUresult r = real_mod_load_ex(module, image, n, options, values);
    seen_module(r, module, image);
    return r;
}

static CUresult w_get_function(void **function, void *module, const char *name) {
    if (real_get_function == NULL) return 500;
    CUresult r = real_get_function(function, module, name);
    if (r == CUDA_SUCCESS && function != NULL && !t_redirecting && g_on_function)
        g_on_function(*function, module, name);
    return r;
}

static CUresult w_mod_unload(void *module) {
    if (real_mod_unload == NULL) return 500;
    /* Another thread's launch in our hands (held while the session is paused, say) goes
     * to the driver before its module goes, as without the shim, where it was queued
     * long before: launching a function of an unloaded module is undefined.  That wait
     * ends when the launch does (a resume, a lease's end, a Ctrl-C); the GIL is let go
     * meanwhile, so the session can hear the broker. */
    if (__atomic_load_n(&g_in_launch, __ATOMIC_ACQUIRE) > t_in_launch) {
        void *saved = NULL;
        if (py_gil_check && py_save_thread && py_gil_check()) saved = py_save_thread();
        long nap = 5;
        while (__atomic_load_n(&g_in_launch, __ATOMIC_ACQUIRE) > t_in_launch) {
            nap_us(nap);
            if (nap < 200) nap *= 2;
        }
        if (saved) py_restore_thread(saved);
    }
    if (g_on_unload && !t_redirecting) g_on_unload(module); /* its functions go first */
    return real_mod_unload(module);
}

/* With name: our wrapper for that module entry point (remembering `real`), or NULL.
 * Without: whether `fn` is one of these wrappers (non-NULL if so). */
static void *wrap_module_call(const char *name, void *real) {
    if (name == NULL) {
        int ours = real == (void *)w_mod_load || real == (void *)w_mod_load_ex
                   || real == (void *)w_get_function || real == (void *)w_mod_unload;
        return ours ? real : NULL;
    }
#define SINGLE(symbol, type, slot, wrapper)                                                    \
    if (strcmp(name, symbol) == 0) {                                                           \
        if (slot == NULL || slot == (type)real) {                                              \
            slot = (type)real;                                                                 \
            return (void *)wrapper;                                                            \
        }                                                                                      \
        return real;                                                                           \
    }
    SINGLE("cuModuleLoadData", ModLoadFn, real_mod_load, w_mod_load)
    SINGLE("cuModuleLoadDataEx", ModLoadExFn, real_mod_load_ex, w_mod_load_ex)
    SINGLE("cuModuleGetFunction", GetFunctionFn, real_get_function, w_get_function)
    SINGLE("cuModuleUnload", ModUnloadFn, real_mod_unload, w_mod_unload)
#undef SINGLE
    return NULL;
}

static unsigned slot_of(void *f) {
    uintptr_t h = (uintptr_t)f;
    h ^= h >> 17;
    h *= 0x9E3779B97F4A7C15ull;
    return (unsigned)(h >> 40) & (MAX_TRACKED - 1);
}

static Tracked *find_tracked(void *f) {
    if (f == NULL || __atomic_load_n(&g_tracked_count, __ATOMIC_ACQUIRE) == 0) return NULL;
    for (unsigned i = 0, s = slot_of(f); i < MAX_TRACKED; i++, s = (s + 1) & (MAX_TRACKED - 1)) {
        void *here = __atomic_load_n(&g_tracked[s].f, __ATOMIC_ACQUIRE);
        if (here == f) return &g_tracked[s];
        if (here == NULL) return NULL;
    }
    return NULL;
}

/* Read a recorded event pair if the GPU has passed it; decide.  With g_lock held. */
static void read_sample(Tracked *t) {
    if (!t->pending || g_driver.event_query(t->end) != CUDA_SUCCESS) return;
    float ms = 0;
    t->pending = 0;
    if (g_driver.event_elapsed(&ms, t->start, t->end) != CUDA_SUCCESS) return;
    float us = ms * 1000.0f;
    if (us > t->longest_us) t->longest_us = us;
    t->samples++;
    /* One long launch makes it long; it takes a few short ones to call it short. */
    if ((t->state == TRACK_SHORT || t->state == TRACK_SAMPLING) && us >= (float)g_long_us)
        t->state = TRACK_LONG;
    if (t->state == TRACK_SAMPLING && t->samples >= SAMPLES_TO_DECIDE) t->state = TRACK_SHORT;
}

/* Before a plain launch of a tracked function that is being timed: record the start
 * event.  Returns a token for sample_end, or -1 when this launch is not timed. */
static int sample_begin(void *f, CUstream stream) {
    Tracked *t = find_tracked(f);
    if (t == NULL || !g_driver_ready || t_redirecting) return -1;
    /* Most launches of a tracked kernel are of a short one between two resamplings:
     * they only count, without the lock (this is every CuPy launch's path). */
    int state = __atomic_load_n(&t->state, __ATOMIC_ACQUIRE);
    if (state == TRACK_OFF || state == TRACK_LONG) return -1;
    int counted = 0;
    if (state == TRACK_SHORT && !__atomic_load_n(&t->pending, __ATOMIC_ACQUIRE)) {
        if (__atomic_add_fetch(&t->launches, 1, __ATOMIC_RELAXED) % RESAMPLE_EVERY != 0) return -1;
        counted = 1;
    }
    int token = -1;
    t_inside = 1;
    pthread_mutex_lock(&g_lock);
    read_sample(t);
    if (!counted) __atomic_add_fetch(&t->launches, 1, __ATOMIC_RELAXED);
    int due = t->state == TRACK_SAMPLING || (t->state == TRACK_SHORT && t->launches % RESAMPLE_EVERY == 0);
    if (due && !t->pending && !capturing(stream)) {
        if (t->start == NULL && g_driver.event_create(&t->start, 0) != CUDA_SUCCESS) t->start = NULL;
        if (t->end == NULL && g_driver.event_create(&t->end, 0) != CUDA_SUCCESS) t->end = NULL;
        if (t->start && t->end && g_driver.event_record(t->start, stream) == CUDA_SUCCESS)
            token = (int)(t - g_tracked);
    }
    pthread_mutex_unlock(&g_lock);
    t_inside = 0;
    return token;
}

static void sample_end(void *f, CUstream stream, int token) {
    (void)f;
    if (token < 0 || token >= MAX_TRACKED) return;
    Tracked *t = &g_tracked[token];
    t_inside = 1;
    pthread_mutex_lock(&g_lock);
    if (g_driver.event_record(t->end, stream) == CUDA_SUCCESS) t->pending = 1;
    pthread_mutex_unlock(&g_lock);
    t_inside = 0;
}

/* ---- long kernels run as they are: at most two on the GPU, the rest dropped by Ctrl-C
 *
 * A long kernel that is not made preemptible (outside a lease, or one the runtime
 * declines) would otherwise queue without bound: a loop of 1 s launches interrupted by
 * Ctrl-C left the next cell waiting ~50 s for the launches already queued.  So each
 * thread keeps at most two of them on the GPU (the one running and the next, so the GPU
 * never idles between them): a third waits on the host for the first to finish, and a
 * Ctrl-C during that wait drops it (it is never issued, so no buffer sees half of it)
 * and lets Python raise KeyboardInterrupt as soon as the launch returns. */
#define LONG_IN_FLIGHT 2
static __thread CUevent t_long_done[LONG_IN_FLIGHT]; /* after each of the last launches */
static __thread int t_long_pending[LONG_IN_FLIGHT];
static __thread unsigned t_long_next;

static int long_and_plain(void *f, CUstream stream) {
    if (!g_driver_ready || t_redirecting || t_exempt) return 0;
    Tracked *t = find_tracked(f);
    if (t == NULL || __atomic_load_n(&t->state, __ATOMIC_ACQUIRE) != TRACK_LONG) return 0;
    return !capturing(stream);
}

/* Before a plain launch of a long kernel: wait, on the host and interruptibly, until at
 * most one launch of a long kernel of this thread is still on the GPU.  Returns 1 if a
 * Ctrl-C came meanwhile: the caller drops the launch. */
static int long_launch_dropped(void *f, CUstream stream) {
    if (!long_and_plain(f, stream)) return 0;
    unsigned slot = t_long_next % LONG_IN_FLIGHT; /* the oldest of the last two */
    if (!t_long_pending[slot]) return 0;
    t_inside = 1;
    CUresult r = g_driver.event_query(t_long_done[slot]);
    t_inside = 0;
    if (r != CUDA_ERROR_NOT_READY) {
        t_long_pending[slot] = 0;
        return 0;
    }
    __atomic_add_fetch(&g_stats.long_waits, 1, __ATOMIC_RELAXED);
    install_sigint(); /* ipykernel puts Python's handler back at every cell */
    uint64_t interrupts = __atomic_load_n(&g_interrupts, __ATOMIC_RELAXED);
    void *saved = NULL;
    if (py_gil_check && py_save_thread && py_gil_check()) saved = py_save_thread();
    long nap = 20;
    int dropped = 0;
    for (;;) {
        if (__atomic_load_n(&g_interrupts, __ATOMIC_RELAXED) != interrupts) {
            dropped = 1;
            break;
        }
        t_inside = 1;
        r = g_driver.event_query(t_long_done[slot]);
        t_inside = 0;
        if (r != CUDA_ERROR_NOT_READY) break; /* done, or an error nobody can wait out */
        nap_us(nap);
        if (nap < 1000) nap *= 2; /* the next launch is queued: no hurry to the microsecond */
    }
    if (saved) py_restore_thread(saved);
    if (dropped) {
        __atomic_add_fetch(&g_stats.dropped, 1, __ATOMIC_RELAXED);
        return 1;
    }
    t_long_pending[slot] = 0;
    return 0;
}

/* After a plain launch of a long kernel: an event marks its end. */
static void long_launch_issued(void *f, CUstream stream, CUresult r) {
    if (r != CUDA_SUCCESS || !long_and_plain(f, stream)) return;
    unsigned slot = t_long_next % LONG_IN_FLIGHT;
    t_inside = 1;
    if (t_long_done[slot] == NULL &&
        g_driver.event_create(&t_long_done[slot], CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
        t_long_done[slot] = NULL;
    if (t_long_done[slot] != NULL && g_driver.event_record(t_long_done[slot], stream) == CUDA_SUCCESS) {
        t_long_pending[slot] = 1;
        t_long_next++;
    }
    t_inside = 0;
}

/* A plain launch of a function found long: the runtime runs its preemptible twin.
 * Returns 1 with *result set if the hook took the launch. */
static int redirected(void *f, const unsigned *dims, unsigned shared, CUstream stream,
                      void **params, void **extra, CUresult *result) {
    if (g_on_launch == NULL || t_redirecting || params == NULL || extra != NULL) return 0;
    /* Only a session that holds a lease can be asked to stop: outside one nobody would
     * ever end a yield, so the original runs (under the hold, like every launch). */
    if (!lease_active()) return 0;
    Tracked *t = find_tracked(f);
    if (t == NULL) return 0;
    if (t->pending) {
        pthread_mutex_lock(&g_lock);
        read_sample(t);
        pthread_mutex_unlock(&g_lock);
    }
    /* A kernel known to be long is launched ready to stop whether or not a rival exists
     * now: one launched as it is while nobody waited could not be stopped when somebody
     * came, and that newcomer's first cell would share the GPU with it to its end. */
    if (__atomic_load_n(&t->state, __ATOMIC_ACQUIRE) != TRACK_LONG) return 0;
    if (!g_driver_ready || capturing(stream)) return 0;
    t_redirecting = 1;
    t_answer = LAUNCH_NOT_HANDLED;
    t_reraise = 0;
    /* The hook's own return value is not trusted: a Python exception that escapes a ctypes
     * callback leaves it undefined.  The runtime says what happened through
     * gps_launch_answer, once the launch is whole. */
    g_on_launch(f, dims, shared, stream, params);
    int r = t_answer;
    t_redirecting = 0;
    t_exempt = 0;
    if (t_reraise) {
        t_reraise = 0;
        raise(SIGINT); /* Ctrl-C came during the launch: the caller's Python sees it now */
    }
    if (r == LAUNCH_NOT_HANDLED) return 0;
    __atomic_add_fetch(&g_stats.preemptible, 1, __ATOMIC_RELAXED);
    *result = r;
    return 1;
}

/* The runtime's hooks (NULL: none) and the GPU time that makes a kernel long. */
void gps_set_kernel_hooks(ModuleHook on_module, FunctionHook on_function, UnloadHook on_unload,
                          LaunchHook on_launch, unsigned long_us) {
    g_on_module = on_module;
    g_on_function = on_function;
    g_on_unload = on_unload;
    g_on_launch = on_launch;
    g_long_us = long_us;
    if (on_launch != NULL) install_sigint();
}

/* Time this function's launches (state: 0 timing them, 1 long, 2 short, 3 left alone).
 * Returns 0, or -1 if the table is full. */
int gps_track_function(void *f, int state) {
    if (f == NULL) return -1;
    pthread_mutex_lock(&g_lock);
    Tracked *t = find_tracked(f);
    if (t == NULL) {
        if (g_tracked_count >= MAX_TRACKED / 2) {
            pthread_mutex_unlock(&g_lock);
            return -1;
        }
        unsigned s = slot_of(f);
        while (g_tracked[s].f != NULL) s = (s + 1) & (MAX_TRACKED - 1);
        t = &g_tracked[s];
        __atomic_store_n(&t->f, f, __ATOMIC_RELEASE);
        __atomic_add_fetch(&g_tracked_count, 1, __ATOMIC_RELEASE);
    }
    if (state == TRACK_SAMPLING) { /* a new function, or one at a reused address */
        t->samples = t->launches = 0;
        t->longest_us = 0;
        t->pending = 0;
    }
    __atomic_store_n(&t->state, state, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* The tracked state of f (-1: not tracked) and the longest launch timed, in us. */
int gps_function_state(void *f, float *longest_us) {
    Tracked *t = find_tracked(f);
    if (t == NULL) return -1;
    pthread_mutex_lock(&g_lock);
    if (t->pending && g_driver_ready) read_sample(t);
    if (longest_us) *longest_us = t->longest_us;
    int state = t->state;
    pthread_mutex_unlock(&g_lock);
    return state;
}

/* ---- what the runtime calls (ctypes) */

/* The session, while the broker holds it paused: put the shim's SIGINT handler in front
 * of Python's (ipykernel puts Python's back at every cell), so that a Ctrl-C is counted
 * even while the main thread is blocked in a CUDA call of a locked process. */
void gps_chain_sigint(void) { install_sigint(); }

/* How many Ctrl-Cs the shim's handler has seen (the session compares two readings). */
unsigned long long gps_interrupts(void) { return __atomic_load_n(&g_interrupts, __ATOMIC_RELAXED); }

/* Point at the session's control block words (NULL, NULL: never hold). */
void gps_set_block(volatile uint32_t *gate, volatile uint32_t *state) {
    g_gate = gate;
    g_state = state;
    if (gate != NULL) install_sigint();
}

/* Point at the control block's word that says no rival exists (NULL: always ready). */
void gps_set_rival_word(volatile uint32_t *unrivalled) { g_unrivalled = unrivalled; }

/* At most `window` recorded events outstanding, one every `record_every` launches;
 * window 0 turns the bound off. */
void gps_set_window(unsigned window, unsigned record_every) {
    /* No lock: a launching thread holds g_lock across driver calls, and those block while
     * the broker holds the process with the checkpoint lock; the thread that lets a
     * Ctrl-C through then sets the window (a lease given up) and must not wait for it. */
    __atomic_store_n(&g_record_every, record_every == 0 ? 1 : record_every, __ATOMIC_RELEASE);
    __atomic_store_n(&g_window, window > MAX_OUTSTANDING ? MAX_OUTSTANDING : window, __ATOMIC_RELEASE);
}

/* Keep about `target_us` microseconds of GPU work queued (0: the fixed window above),
 * and `rivalled_us` while a session that could preempt this one exists (0: the same). */
void gps_set_target(unsigned target_us, unsigned rivalled_us) {
    /* No lock, for the same reason as gps_set_window. */
    __atomic_store_n(&g_rival_target_us, rivalled_us, __ATOMIC_RELEASE);
    __atomic_store_n(&g_target_us, target_us, __ATOMIC_RELEASE);
}

void gps_get_stats(gps_stats *out) {
    pthread_mutex_lock(&g_lock);
    *out = g_stats;
    pthread_mutex_unlock(&g_lock);
}

/* Tests: use these driver entry points instead of libcuda's (NULL: none). */
void gps_use_driver(const gps_driver *driver) {
    pthread_mutex_lock(&g_lock);
    memset(g_windows, 0, sizeof(g_windows));
    if (driver) {
        g_driver = *driver;
        g_driver_ready = 1;
    } else {
        g_driver_ready = 0;
    }
    memset(&g_stats, 0, sizeof(g_stats));
    pthread_mutex_unlock(&g_lock);
    find_python();
    install_sigint();
}

/* Subscribe to CUPTI's driver launch callbacks.  Returns 0, or a negative number with a
 * one-line reason in err: -1 driver, -2 CUPTI library, -3 another CUPTI subscriber (a
 * profiler), -4 CUPTI refused. */
int gps_attach(const char *cupti_path, char *err, size_t errlen) {
    if (g_subscriber != NULL) return 0;
    if (!g_driver_ready && load_driver(err, errlen) != 0) return -1;
    find_python();
    if (g_cupti == NULL) g_cupti = dlopen(cupti_path, RTLD_NOW | RTLD_LOCAL);
    if (g_cupti == NULL) {
        snprintf(err, errlen, "CUPTI could not be loaded from %s: %s", cupti_path, dlerror());
        return -2;
    }
    CUptiResult (*subscribe)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *) =
        (CUptiResult(*)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *))dlsym(g_cupti, "cuptiSubscribe");
    CUptiResult (*enable)(uint32_t, CUpti_SubscriberHandle, int, uint32_t) =
        (CUptiResult(*)(uint32_t, CUpti_SubscriberHandle, int, uint32_t))dlsym(g_cupti, "cuptiEnableCallback");
    if (!subscribe || !enable) {
        snprintf(err, errlen, "%s is not a CUPTI library (no cuptiSubscribe)", cupti_path);
        return -2;
    }
    CUpti_SubscriberHandle handle = NULL;
    CUptiResult r = subscribe(&handle, on_api, NULL);
    if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
        snprintf(err, errlen, "another CUPTI client (a profiler) is attached to this process");
        return -3;
    }
    if (r != 0) {
        snprintf(err, errlen, "cuptiSubscribe failed with CUPTI error %d", r);
        return -4;
    }
    static const uint32_t cbids[] = {
        CBID_cuLaunchKernel, CBID_cuLaunchKernel_ptsz, CBID_cuLaunchCooperativeKernel,
        CBID_cuLaunchCooperativeKernel_ptsz, CBID_cuGraphLaunch, CBID_cuGraphLaunch_ptsz,
        CBID_cuLaunchKernelEx, CBID_cuLaunchKernelEx_ptsz,
    };
    for (size_t i = 0; i < sizeof(cbids) / sizeof(cbids[0]); i++) {
        r = enable(1, handle, CUPTI_CB_DOMAIN_DRIVER_API, cbids[i]);
        if (r != 0) {
            snprintf(err, errlen, "cuptiEnableCallback(%u) failed with CUPTI error %d", cbids[i], r);
            CUptiResult (*unsubscribe)(CUpti_SubscriberHandle) =
                (CUptiResult(*)(CUpti_SubscriberHandle))dlsym(g_cupti, "cuptiUnsubscribe");
            if (unsubscribe) unsubscribe(handle);
            return -4;
        }
    }
    g_subscriber = handle;
    install_sigint();
    return 0;
}

/* Preloaded: bound the work in flight from now on (the driver must be loadable).
 * Returns 0, or -1 with a one-line reason. */
int gps_activate_preload(char *err, size_t errlen) {
    if (!gps_preloaded()) {
        snprintf(err, errlen, "the launch shim is not preloaded in this process");
        return -1;
    }
    if (!g_driver_ready && load_driver(err, errlen) != 0) return -1;
    find_python();
    return 0;
}

/* Unsubscribe (a profiler may then attach); the control block is forgotten too. */
void gps_detach(void) {
    gps_set_block(NULL, NULL);
    if (g_subscriber == NULL || g_cupti == NULL) return;
    CUptiResult (*unsubscribe)(CUpti_SubscriberHandle) =
        (CUptiResult(*)(CUpti_SubscriberHandle))dlsym(g_cupti, "cuptiUnsubscribe");
    if (unsubscribe) unsubscribe(g_subscriber);
    g_subscriber = NULL;
}

int gps_attached(void) { return g_subscriber != NULL; }
