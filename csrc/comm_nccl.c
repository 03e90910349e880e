/* comm_nccl.c: collectives on device memory through NCCL, which is loaded at run time (dlopen; no
 * nccl.h at build time: the few types and entry points used are declared here). Per group: one
 * blocking communicator (created on a helper thread so the caller's wait stays interruptible), one
 * high-priority communication stream, and one watchdog thread that completes works, enforces
 * deadlines and aborts the communicator when a peer fails. */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fastar.h"
#include "group.h"
#include "staged.h"
#include "trace.h"

/* ---------------------------------------------------------------- the part of NCCL's ABI we use */

/* Values as in NCCL 2.x's nccl.h. NCCL only ever appends to these enums, so they hold for every
 * 2.x release ddpc accepts (>= 2.14). */
typedef struct ncclComm *ncclComm_t;
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef int ncclResult_t;
enum { ncclSuccess = 0, ncclSystemError = 2, ncclRemoteError = 6, ncclInProgress = 7 };

typedef int ncclDataType_t;
enum {
    ncclInt8 = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclInt64 = 4,
    ncclFloat16 = 6,
    ncclFloat32 = 7,
    ncclFloat64 = 8,
    ncclBfloat16 = 9,
};

typedef int ncclRedOp_t;
enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };

/* The leading fields of ncclConfig_t. NCCL copies min(size, sizeof its own struct) bytes over its
 * defaults and resets every field newer than `version`, so this prefix, stamped with the version
 * that introduced it, is a complete configuration for every later NCCL. */
typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize; /* this and the three below: 2.17 */
    int minCTAs;
    int maxCTAs;
    const char *netName;
} NcclConfig;
#define NCCL_CONFIG_MAGIC 0xcafebeefu
#define NCCL_CONFIG_UNDEF_INT INT_MIN
/* 2.14 brought ncclCommInitRankConfig, which init uses. */
#define NCCL_MIN_VERSION 21400

typedef struct NcclApi {
    ncclResult_t (*GetVersion)(int *version);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *id);
    ncclResult_t (*CommInitRankConfig)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                       NcclConfig *config);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t *state);
    ncclResult_t (*CommAbort)(ncclComm_t comm);
    /* The last argument of the collectives is a cudaStream_t, an opaque pointer. */
    ncclResult_t (*AllReduce)(const void *send, void *recv, size_t count, ncclDataType_t dt,
                              ncclRedOp_t op, ncclComm_t comm, void *stream);
    ncclResult_t (*Broadcast)(const void *send, void *recv, size_t count, ncclDataType_t dt,
                              int root, ncclComm_t comm, void *stream);
    ncclResult_t (*AllGather)(const void *send, void *recv, size_t count, ncclDataType_t dt,
                              ncclComm_t comm, void *stream);
    ncclResult_t (*ReduceScatter)(const void *send, void *recv, size_t count, ncclDataType_t dt,
                                  ncclRedOp_t op, ncclComm_t comm, void *stream);
    const char *(*GetErrorString)(ncclResult_t result);
    const char *(*GetLastError)(ncclComm_t comm);
    /* Optional (NULL when this NCCL lacks them): symmetric windows, 2.27 and newer. */
    ncclResult_t (*MemAlloc)(void **ptr, size_t size);
    ncclResult_t (*MemFree)(void *ptr);
    ncclResult_t (*CommWindowRegister)(ncclComm_t comm, void *buff, size_t size, void **win,
                                       int flags);
} NcclApi;
#define NCCL_WIN_COLL_SYMMETRIC 0x01

/* The entry points ddpc loads; an optional one (a newer NCCL's) may be missing. */
static const struct {
    const char *name;
    size_t offset;
    int optional;
} k_nccl_syms[] = {
    {"ncclGetVersion", offsetof(NcclApi, GetVersion)},
    {"ncclGetUniqueId", offsetof(NcclApi, GetUniqueId)},
    {"ncclCommInitRankConfig", offsetof(NcclApi, CommInitRankConfig)},
    {"ncclCommGetAsyncError", offsetof(NcclApi, CommGetAsyncError)},
    {"ncclCommAbort", offsetof(NcclApi, CommAbort)},
    {"ncclAllReduce", offsetof(NcclApi, AllReduce)},
    {"ncclBroadcast", offsetof(NcclApi, Broadcast)},
    {"ncclAllGather", offsetof(NcclApi, AllGather)},
    {"ncclReduceScatter", offsetof(NcclApi, ReduceScatter)},
    {"ncclGetErrorString", offsetof(NcclApi, GetErrorString)},
    {"ncclGetLastError", offsetof(NcclApi, GetLastError)},
    {"ncclMemAlloc", offsetof(NcclApi, MemAlloc), 1},
    {"ncclMemFree", offsetof(NcclApi, MemFree), 1},
    {"ncclCommWindowRegister", offsetof(NcclApi, CommWindowRegister), 1},
};

static pthread_mutex_t g_load_mu = PTHREAD_MUTEX_INITIALIZER;
static NcclApi g_api;          /* complete once g_api_ready is set; never changes after */
static int g_api_ready;        /* guarded by g_load_mu */
static char g_version[32];     /* "2.28.3" */
static int g_code;             /* the same as NCCL_VERSION_CODE: 22803 */
static char g_path[PATH_MAX];  /* the file NCCL was loaded from */

/* ---------------------------------------------------------------- loading */

typedef struct {
    char text[3072];
    size_t used;
} Tried;

static void tried_add(Tried *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tried_add(Tried *t, const char *fmt, ...) {
    if (t->used >= sizeof t->text - 1) return;
    if (t->used) {
        int n = snprintf(t->text + t->used, sizeof t->text - t->used, "; ");
        if (n < 0) return;
        t->used = DDPC_MIN(t->used + (size_t)n, sizeof t->text - 1);
    }
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->text + t->used, sizeof t->text - t->used, fmt, ap);
    va_end(ap);
    if (n > 0) t->used = DDPC_MIN(t->used + (size_t)n, sizeof t->text - 1);
}

/* Opens dir/libnccl.so.2 when it exists; records the outcome either way. */
static void *try_dir(const char *dir, Tried *t) {
    char path[PATH_MAX];
    int n = snprintf(path, sizeof path, "%s/libnccl.so.2", dir);
    if (n < 0 || (size_t)n >= sizeof path) {
        tried_add(t, "%s (path too long)", dir);
        return NULL;
    }
    if (access(path, F_OK) != 0) {
        tried_add(t, "%s (no libnccl.so.2 there)", dir);
        return NULL;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) tried_add(t, "%s (%s)", path, dlerror());
    return h;
}

/* Finds libnccl.so.2: DDPC_NCCL_PATH, then the copy already in this process (torch's, so there is
 * one NCCL per process), then DDPC_NCCL_SEARCH_PATH (set by the Python layer from sys.path), the
 * nvidia-nccl wheel beside ddpc, the CUDA toolkit, and last the system loader. */
static ddpc_status nccl_open(void **out) {
    Tried t = {.used = 0};
    t.text[0] = '\0';
    void *h = NULL;
    *out = NULL;
    const char *env = getenv("DDPC_NCCL_PATH");
    if (env && env[0]) {
        char path[PATH_MAX];
        struct stat sb;
        int dir = stat(env, &sb) == 0 && S_ISDIR(sb.st_mode);
        int n = snprintf(path, sizeof path, dir ? "%s/libnccl.so.2" : "%s", env);
        if (n < 0 || (size_t)n >= sizeof path)
            return ddpc_error(DDPC_ERR_INVALID, "DDPC_NCCL_PATH is too long (%zu characters)",
                              strlen(env));
        h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h)
            return ddpc_error(DDPC_ERR_UNAVAILABLE,
                              "DDPC_NCCL_PATH=%s: cannot load %s: %s. Point it at libnccl.so.2 "
                              "(or the folder holding it), or unset it to search the usual places",
                              env, path, dlerror());
        *out = h;
        return DDPC_OK;
    }
    tried_add(&t, "DDPC_NCCL_PATH (unset)");
    h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (h) goto found;
    tried_add(&t, "this process (no NCCL loaded yet)");

    const char *search = getenv("DDPC_NCCL_SEARCH_PATH");
    if (search && search[0]) {
        char *copy = strdup(search);
        if (!copy) return ddpc_error(DDPC_ERR_NOMEM, "out of host memory reading DDPC_NCCL_SEARCH_PATH");
        char *save = NULL;
        for (char *dir = strtok_r(copy, ":", &save); dir && !h; dir = strtok_r(NULL, ":", &save))
            h = try_dir(dir, &t);
        free(copy);
        if (h) goto found;
    } else {
        tried_add(&t, "DDPC_NCCL_SEARCH_PATH (unset)");
    }

    /* This extension is <site-packages>/ddpc/_C.so when installed; the wheels sit beside it. */
    Dl_info self;
    if (dladdr((void *)&ddpc_nccl_load, &self) && self.dli_fname) {
        char site[PATH_MAX];
        snprintf(site, sizeof site, "%s", self.dli_fname);
        for (int up = 0; up < 2; up++) {
            char *slash = strrchr(site, '/');
            if (slash) *slash = '\0';
        }
        static const char *const k_wheel_dirs[] = {"nvidia/nccl/lib", "nvidia/cu13/lib",
                                                   "nvidia/cu12/lib"};
        for (size_t i = 0; i < sizeof k_wheel_dirs / sizeof *k_wheel_dirs && !h; i++) {
            char dir[PATH_MAX];
            int n = snprintf(dir, sizeof dir, "%s/%s", site[0] ? site : ".", k_wheel_dirs[i]);
            if (n > 0 && (size_t)n < sizeof dir) h = try_dir(dir, &t);
        }
        if (h) goto found;
    }

    const char *roots[] = {getenv("CUDA_HOME"), getenv("CUDA_PATH"), "/usr/local/cuda"};
    for (size_t i = 0; i < sizeof roots / sizeof *roots && !h; i++) {
        if (!roots[i] || !roots[i][0]) continue;
        char dir[PATH_MAX];
        int n = snprintf(dir, sizeof dir, "%s/lib64", roots[i]);
        if (n > 0 && (size_t)n < sizeof dir) h = try_dir(dir, &t);
    }
    if (h) goto found;

    h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (h) goto found;
    tried_add(&t, "the system loader (%s)", dlerror());
    return ddpc_error(DDPC_ERR_UNAVAILABLE,
                      "NCCL (libnccl.so.2) was not found. Looked in: %s. Install it with `pip "
                      "install nvidia-nccl-cu13` (or -cu12, matching your CUDA), or set "
                      "DDPC_NCCL_PATH to the file; the cpu backend needs no NCCL",
                      t.text);
found:
    *out = h;
    return DDPC_OK;
}

ddpc_status ddpc_nccl_load(char *version, size_t version_len) {
    ddpc_status st = DDPC_OK;
    void *h = NULL;
    pthread_mutex_lock(&g_load_mu);
    if (g_api_ready) goto done;
    NcclApi api;
    memset(&api, 0, sizeof api);
    DDPC_CHECK_GOTO(nccl_open(&h), st, done);
    char where[PATH_MAX] = "libnccl.so.2";
    char missing[512] = "";
    size_t used = 0;
    for (size_t i = 0; i < sizeof k_nccl_syms / sizeof *k_nccl_syms; i++) {
        void *sym = dlsym(h, k_nccl_syms[i].name);
        if (!sym && k_nccl_syms[i].optional) continue;
        if (!sym) {
            int n = snprintf(missing + used, sizeof missing - used, "%s%s", used ? ", " : "",
                             k_nccl_syms[i].name);
            if (n > 0) used = DDPC_MIN(used + (size_t)n, sizeof missing - 1);
            continue;
        }
        /* dlsym hands out a data pointer; POSIX guarantees it converts to the function. */
        memcpy((char *)&api + k_nccl_syms[i].offset, &sym, sizeof sym);
    }
    Dl_info info;
    if (api.GetVersion && dladdr((void *)api.GetVersion, &info) && info.dli_fname)
        snprintf(where, sizeof where, "%s", info.dli_fname);
    if (used) {
        st = ddpc_error(DDPC_ERR_UNAVAILABLE,
                        "the NCCL at %s lacks %s: it is older than 2.14, which ddpc needs. "
                        "Install a newer one (`pip install nvidia-nccl-cu13`) or set "
                        "DDPC_NCCL_PATH to it",
                        where, missing);
        goto fail;
    }
    int code = 0;
    ncclResult_t r = api.GetVersion(&code);
    if (r != ncclSuccess) {
        st = ddpc_error(DDPC_ERR_NCCL, "ncclGetVersion of %s failed with code %d", where, r);
        goto fail;
    }
    /* NCCL_VERSION_CODE: major*1000+minor*100+patch up to 2.8, major*10000+minor*100+patch after. */
    int major = code >= 10000 ? code / 10000 : code / 1000;
    int minor = code >= 10000 ? code % 10000 / 100 : code % 1000 / 100;
    int patch = code % 100;
    if (code < NCCL_MIN_VERSION) {
        st = ddpc_error(DDPC_ERR_UNAVAILABLE,
                        "the NCCL at %s is version %d.%d.%d; ddpc needs 2.14 or newer. Install "
                        "one (`pip install nvidia-nccl-cu13`) and set DDPC_NCCL_PATH to it",
                        where, major, minor, patch);
        goto fail;
    }
    snprintf(g_version, sizeof g_version, "%d.%d.%d", major, minor, patch);
    g_code = code;
    snprintf(g_path, sizeof g_path, "%s", where);
    g_api = api;
    g_api_ready = 1;
    DDPC_INFO("NCCL", "loaded NCCL %s from %s", g_version, g_path);
    goto done;
fail:
    dlclose(h);
done:
    if (st == DDPC_OK && version && version_len) snprintf(version, version_len, "%s", g_version);
    pthread_mutex_unlock(&g_load_mu);
    return st;
}

#ifdef DDPC_WITH_CUDA

/* ---------------------------------------------------------------- error reporting */

/* Describes a failed NCCL call once, with NCCL's own explanation of the last error. */
static ddpc_status nccl_fail(ncclResult_t r, const char *call, const char *file, int line) {
    const char *last = g_api.GetLastError(NULL);
    return ddpc_error(DDPC_ERR_NCCL, "%s failed: %s (NCCL code %d)%s%s; run with NCCL_DEBUG=INFO "
                      "for NCCL's own log (%s:%d)",
                      call, g_api.GetErrorString(r), r, last && last[0] ? "; NCCL says: " : "",
                      last ? last : "", file, line);
}

#define NCCLCHECK(name, call)                                                    \
    do {                                                                         \
        ncclResult_t nr_ = (call);                                               \
        if (nr_ != ncclSuccess && nr_ != ncclInProgress)                         \
            return nccl_fail(nr_, (name), __FILE__, __LINE__);                   \
    } while (0)

/* ncclInProgress is not a failure: the nonblocking communicator finishes the call later. */
#define NCCLCHECK_GOTO(name, call, res, st, label)                               \
    do {                                                                         \
        (res) = (call);                                                          \
        if ((res) != ncclSuccess && (res) != ncclInProgress) {                   \
            (st) = nccl_fail((res), (name), __FILE__, __LINE__);                 \
            goto label;                                                          \
        }                                                                        \
    } while (0)

/* Teardown cannot report to a caller: a failure there is logged (DDPC_DEBUG=INFO). */
#define CUDA_LOG(call)                                                                         \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess)                                                                 \
            DDPC_INFO("NCCL", "%s failed: %s (%s:%d)", #call, cudaGetErrorString(e_), __FILE__, \
                      __LINE__);                                                               \
    } while (0)

/* ---------------------------------------------------------------- backend state */

#define POLL_MIN_US 20
#define POLL_MAX_US 1000
/* How often the watchdog (or an initializing rank) asks the store whether a peer died or aborted:
 * each question is a round trip to rank 0, so not on every poll. */
#define STORE_CHECK_MS 500
/* How often the watchdog looks at the fast path's control block when no work is queued. */
#define FAST_WATCH_MS 100
/* A clean shutdown waits this long at most for NCCL to finalize before aborting instead. */

typedef struct NcclWorkData {
    cudaEvent_t done;   /* recorded on the communication stream after the collective */
    atomic_int enqueued;/* 1 once `done` is recorded: only then may the watchdog query it */
    int staged;         /* it took the staged path: check the peers' aborted words when done */
    int deferred;       /* posted with DdpcCollArgs.defer: the posting thread issues it */
    /* A deferred post (DdpcCollArgs.defer): the caller's stream position when it was posted,
     * until the posting thread has made the communication stream wait for it; the link in the
     * posting queue; and whether the posting thread is done with it (posted or failed). */
    cudaEvent_t ready;
    struct DdpcWork *post_next;
    int posted; /* guarded by NcclImpl.mu */
    DdpcTraceRec *trace; /* its row of the group's trace, or NULL when not traced */
} NcclWorkData;

typedef struct NcclImpl {
    DdpcGroup *g;
    int device;
    pthread_mutex_t comm_mu; /* serializes calls on comm with its abort; never held with mu */
    ncclComm_t comm;         /* NULL once aborted */
    cudaStream_t stream;     /* the communication stream */
    cudaEvent_t ready;       /* marks the caller's stream position at each post (posts are
                              * serialized by g->mu, and a wait captures the event when issued) */
    int *scratch;            /* one int of device memory: what a barrier reduces */
    pthread_mutex_t mu;      /* guards the queue, the event pool, stop and abort_requested */
    pthread_cond_t cv;
    DdpcWork *head, *tail;   /* in flight, in posting order; only the watchdog removes */
    cudaEvent_t *pool;
    int npool, pool_cap;
    int stop;
    int abort_requested;
    pthread_t watchdog;
    int watchdog_started;
    struct FastAr *fast;     /* the one-shot path for small all-reduces, NULL when off */
    DdpcStaged *staged;      /* the copy-engine path for large all-reduces without P2P, or NULL */
    size_t staged_min_bytes; /* all-reduces of at least this many bytes take it */
    int staged_overlap;      /* calls on disjoint buffers overlap (DDPC_STAGED_OVERLAP=0: not) */
    /* The posting thread (deferred posts): it issues them in posting order, one after the
     * other, each from post_head; a post that is not deferred first waits until the queue is
     * empty (every post holds g->mu, so no new one arrives meanwhile). Guarded by mu. */
    pthread_t poster;
    int poster_started, poster_stop, poster_idle;
    pthread_cond_t post_cv;   /* the posting thread waits here for work */
    pthread_cond_t posted_cv; /* threads waiting for a post to be issued wait here */
    int posted_waiters;
    DdpcWork *post_head, *post_tail;
    /* The trace on (ddpc_group_trace_start), or NULL. Taken, started and stopped under g->mu;
     * stopped only after the posting thread has issued what was posted before. */
    DdpcTrace *trace;
    /* Symmetric windows (ddpc_group_window_alloc), guarded by mu: every rank makes them in the
     * same order, which numbers them. No window is deregistered: the communicator's abort at
     * destroy releases the registrations, then windows_free the memory. */
    struct NcclWindow *windows;
    int nwindows_made;
} NcclImpl;

typedef struct NcclWindow {
    void *ptr;   /* from ncclMemAlloc */
    size_t bytes;
    void *win;   /* ncclWindow_t */
    struct NcclWindow *next;
} NcclWindow;

/* What a fast call was, for the message when it fails (the kernel reports only its epoch). */
typedef struct FastCall {
    uint64_t seq;
    size_t count;
    int dtype, redop;
} FastCall;
#define FAST_HISTORY 256 /* divides 2^32: indexed by the epoch's low 32 bits too */

/* The one-shot all-reduce (fastar.h) of one group: this rank's region, the peers' regions as
 * mapped into this process, and the control block the kernels report to. */
typedef struct FastAr {
    char *region;                       /* this rank's, cudaMalloc'd */
    char *peer[DDPC_FAST_MAX_RANKS];    /* IPC mappings of the others (NULL for this rank) */
    DdpcFastCtl *ctl;                   /* pinned host memory, mapped; ctl_dev on the device */
    DdpcFastCtl *ctl_dev;
    size_t sub_bytes, max_bytes;
    uint64_t epoch;                     /* calls issued (under g->mu) */
    atomic_uint issued;                 /* its low 32 bits, for the watchdog */
    uintptr_t last_stream;              /* where the previous call ran */
    int have_last;
    cudaEvent_t chain;                  /* orders a call after the previous one on another stream */
    int64_t stalled_since_ms;           /* watchdog: when done_epoch stopped trailing issued */
    uint32_t stalled_epoch;
    atomic_int reported;                /* a kernel failure was turned into the group's abort */
    FastCall hist[FAST_HISTORY];
} FastAr;

static ddpc_status aborted_error(NcclImpl *im, const char *what);
static void fast_free(NcclImpl *im, int region_shared);
static void fast_watch(NcclImpl *im);
static void *poster_main(void *arg);
static ddpc_status wait_posted(NcclImpl *im, DdpcWork *w);
static ddpc_status drain_posted(NcclImpl *im, const DdpcWork *w, uint64_t seq);

static void sleep_us(unsigned us) {
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)us * 1000L};
    nanosleep(&ts, NULL);
}

/* Makes device `prev` current again after work on `device` (prev < 0: it was never read); a
 * failure there becomes the error only when st is DDPC_OK. Returns the status to report. */
static ddpc_status restore_device(int prev, int device, ddpc_status st) {
    if (prev < 0 || prev == device) return st;
    cudaError_t e = cudaSetDevice(prev);
    if (e != cudaSuccess && st == DDPC_OK)
        st = ddpc_error(DDPC_ERR_CUDA, "restoring the current device %d failed: %s", prev,
                        cudaGetErrorString(e));
    return st;
}

static const ncclDataType_t k_nccl_dtype[DDPC_NUM_DTYPES] = {
    [DDPC_FLOAT32] = ncclFloat32, [DDPC_FLOAT64] = ncclFloat64, [DDPC_FLOAT16] = ncclFloat16,
    [DDPC_BFLOAT16] = ncclBfloat16, [DDPC_INT32] = ncclInt32, [DDPC_INT64] = ncclInt64,
    [DDPC_UINT8] = ncclUint8, [DDPC_INT8] = ncclInt8,
};

static const ncclRedOp_t k_nccl_redop[DDPC_NUM_REDOPS] = {
    [DDPC_SUM] = ncclSum, [DDPC_AVG] = ncclAvg, [DDPC_MIN] = ncclMin, [DDPC_MAX] = ncclMax,
    [DDPC_PROD] = ncclProd,
};

/* "all_reduce #7 (1024 x float32, avg)": how every message names a collective. */
static void describe_work(const DdpcWork *w, char *buf, size_t len) {
    const DdpcCollArgs *a = &w->args;
    const char *name = ddpc_coll_name(a->op);
    unsigned long long seq = (unsigned long long)w->seq;
    switch (a->op) {
    case DDPC_COLL_BARRIER: snprintf(buf, len, "barrier #%llu", seq); break;
    case DDPC_COLL_BROADCAST:
        snprintf(buf, len, "broadcast #%llu (%zu x %s from rank %d)", seq, a->count,
                 ddpc_dtype_name(a->dtype), a->root);
        break;
    case DDPC_COLL_ALLGATHER:
        snprintf(buf, len, "all_gather #%llu (%zu x %s per rank)", seq, a->count,
                 ddpc_dtype_name(a->dtype));
        break;
    default:
        snprintf(buf, len, "%s #%llu (%zu x %s, %s)", name, seq, a->count,
                 ddpc_dtype_name(a->dtype), ddpc_redop_name(a->redop));
        break;
    }
}

/* The group's abort reason, once the aborting thread has finished writing it. */
static void settled_abort(DdpcGroup *g, ddpc_status *st, const char **msg) {
    while (atomic_load(&g->aborted) == 2) sched_yield();
    if (atomic_load(&g->aborted) == 1) {
        *st = g->abort_status;
        *msg = g->abort_msg;
    } else {
        *st = DDPC_ERR_PEER;
        *msg = "the NCCL communicator was aborted";
    }
}

/* Marks the group failed (peers learn it through the store) and has the watchdog abort the
 * communicator. The message is copied first: publishing it may overwrite this thread's. */
static void request_abort(NcclImpl *im, ddpc_status st, const char *why) {
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", why);
    ddpc_group_abort(im->g, st, msg);
    if (im->fast) im->fast->ctl->abort = 1; /* fast kernels waiting for a peer give up */
    pthread_mutex_lock(&im->mu);
    im->abort_requested = 1;
    pthread_cond_signal(&im->cv);
    pthread_mutex_unlock(&im->mu);
    ddpc_error(st, "%s", msg);
}

/* Completes every work of the list with st; a work whose own failure the message already
 * describes gets it unchanged, the others are told they were cancelled by it. */
static void complete_list(NcclImpl *im, DdpcWork *list, ddpc_status st, const char *msg) {
    while (list) {
        DdpcWork *w = list;
        list = w->next;
        w->next = NULL;
        char what[160];
        describe_work(w, what, sizeof what);
        if (!strncmp(msg, what, strlen(what)))
            ddpc_error(st, "%s", msg);
        else
            ddpc_error(st, "%s on rank %d was cancelled: %s", what, im->g->rank, msg);
        ddpc_work_complete(w, st);
        ddpc_work_release(w);
    }
}

/* ---------------------------------------------------------------- event pool */

static ddpc_status pool_get(NcclImpl *im, cudaEvent_t *ev) {
    pthread_mutex_lock(&im->mu);
    if (im->npool > 0) {
        *ev = im->pool[--im->npool];
        pthread_mutex_unlock(&im->mu);
        return DDPC_OK;
    }
    pthread_mutex_unlock(&im->mu);
    /* No timing: the event only orders streams and tells the watchdog when a collective ended. */
    DDPC_CUDACHECK(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
    return DDPC_OK;
}

static void pool_put(NcclImpl *im, cudaEvent_t ev) {
    pthread_mutex_lock(&im->mu);
    if (im->npool == im->pool_cap) {
        int cap = im->pool_cap ? 2 * im->pool_cap : 16;
        cudaEvent_t *p = realloc(im->pool, (size_t)cap * sizeof *p);
        if (!p) {
            pthread_mutex_unlock(&im->mu);
            CUDA_LOG(cudaEventDestroy(ev));
            return;
        }
        im->pool = p;
        im->pool_cap = cap;
    }
    im->pool[im->npool++] = ev;
    pthread_mutex_unlock(&im->mu);
}

/* ---------------------------------------------------------------- watchdog */

/* Takes the communicator away from every other thread and aborts it, then fails everything in
 * flight with the group's abort reason. Runs on the watchdog thread only. */
static void abort_all(NcclImpl *im) {
    ddpc_status st;
    const char *msg;
    settled_abort(im->g, &st, &msg);
    /* A post blocked inside NCCL (a connection to a peer that never comes) holds comm_mu, and
     * only ncclCommAbort can free it: after a second, abort without the lock. */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 1;
    int locked = pthread_mutex_timedlock(&im->comm_mu, &ts) == 0;
    ncclComm_t comm = im->comm;
    im->comm = NULL;
    if (comm) {
        /* Sets NCCL's abort flag, which also stops kernels spinning on a dead peer. */
        ncclResult_t r = g_api.CommAbort(comm);
        if (r != ncclSuccess && r != ncclInProgress)
            DDPC_INFO("NCCL", "ncclCommAbort failed: %s", g_api.GetErrorString(r));
        DDPC_INFO("NCCL", "rank %d aborted its communicator: %s", im->g->rank, msg);
    }
    if (locked) pthread_mutex_unlock(&im->comm_mu);
    pthread_mutex_lock(&im->mu);
    /* Staged all-reduces wait on the GPU for counters in host memory: release them. */
    if (im->staged) ddpc_staged_unblock(im->staged);
    DdpcWork *list = im->head;
    im->head = im->tail = NULL;
    im->abort_requested = 0;
    pthread_mutex_unlock(&im->mu);
    complete_list(im, list, st, msg);
}

/* Completes the works whose done event has been reached, in order. Returns how many, or -1
 * when the device failed (the abort is requested). */
static int reap(NcclImpl *im) {
    int n = 0;
    for (;;) {
        pthread_mutex_lock(&im->mu);
        DdpcWork *w = im->head;
        NcclWorkData *wd = w ? w->backend_data : NULL;
        int ready = wd && atomic_load(&wd->enqueued);
        pthread_mutex_unlock(&im->mu);
        if (!ready) break;
        cudaError_t e = cudaEventQuery(wd->done);
        if (e == cudaErrorNotReady) break;
        if (e != cudaSuccess) {
            char what[160], msg[1024];
            describe_work(w, what, sizeof what);
            snprintf(msg, sizeof msg,
                     "%s on rank %d (cuda:%d): the device reported %s (%s) while it ran; a "
                     "kernel on this device faulted and the CUDA context is unusable: restart "
                     "the process (CUDA_LAUNCH_BLOCKING=1 finds the kernel)",
                     what, im->g->rank, im->device, cudaGetErrorName(e), cudaGetErrorString(e));
            request_abort(im, DDPC_ERR_CUDA, msg);
            return -1;
        }
        int gone = wd->staged && im->staged ? ddpc_staged_peer_aborted(im->staged) : -1;
        if (gone >= 0) {
            /* That rank's released streams may have fed this one whatever they moved. */
            char what[160], msg[1024];
            describe_work(w, what, sizeof what);
            snprintf(msg, sizeof msg, "%s on rank %d: rank %d has aborted the group, and a "
                     "staged all-reduce that finished after that may hold data its released "
                     "copies moved: the result is not valid", what, im->g->rank, gone);
            request_abort(im, DDPC_ERR_PEER, msg);
            return -1;
        }
        pthread_mutex_lock(&im->mu);
        im->head = w->next;
        if (!im->head) im->tail = NULL;
        w->next = NULL;
        pthread_mutex_unlock(&im->mu);
        ddpc_work_complete(w, DDPC_OK);
        ddpc_work_release(w);
        n++;
    }
    return n;
}

/* Is the oldest work in flight still `seq`, after one more look at the device? Guards against
 * failing a collective that finished while we were deciding. */
static int still_waiting_on(NcclImpl *im, uint64_t seq) {
    if (reap(im) < 0) return 0;
    pthread_mutex_lock(&im->mu);
    int same = im->head && im->head->seq == seq;
    pthread_mutex_unlock(&im->mu);
    return same;
}

/* Appends to buf why peers are gone: ranks the store saw die, or the store itself (it lives in
 * rank 0's process). Returns how many reasons it found. */
static int describe_dead_peers(DdpcGroup *g, char *buf, size_t len) {
    char key[256];
    const char *keys[1] = {key};
    int present = 0, found = 0;
    size_t used = strlen(buf);
    ddpc_group_key(g, key, sizeof key, "abort");
    ddpc_status st = ddpc_store_check(g->store, keys, 1, &present);
    if (st != DDPC_OK && st != DDPC_ERR_TIMEOUT && st != DDPC_ERR_INTERRUPTED) {
        snprintf(buf + used, len - used, "; the rendezvous store on rank 0 stopped answering "
                 "(%.600s), so rank 0 has most likely exited", ddpc_last_error());
        return 1;
    }
    for (int r = 0; r < g->world && used < len; r++) {
        if (r == g->rank || !ddpc_group_rank_dead(g, r)) continue;
        int n = snprintf(buf + used, len - used, "; rank %d exited (its store connection "
                         "dropped)", r);
        if (n < 0) break;
        used = DDPC_MIN(used + (size_t)n, len - 1);
        found++;
    }
    return found;
}

/* NCCL's network transport (ranks on different hosts) sees a dead peer's sockets close at about
 * the moment rank 0's store sees its connection drop, and sometimes first: after such an error
 * (NCCL's remote or system error), the store is asked for up to this long which rank it was. */
#define DEAD_PEER_GRACE_MS 2000

/* describe_dead_peers, waiting up to DEAD_PEER_GRACE_MS for the store's answer after an NCCL
 * error r that a dead peer causes; at once for any other. */
static int describe_dead_peers_after(DdpcGroup *g, ncclResult_t r, char *buf, size_t len) {
    int grace = r == ncclRemoteError || r == ncclSystemError;
    int64_t until = ddpc_now_ms() + (grace ? DEAD_PEER_GRACE_MS : 0);
    size_t used = strlen(buf);
    for (;;) {
        int found = describe_dead_peers(g, buf, len);
        if (found || ddpc_now_ms() >= until) return found;
        buf[used] = '\0';
        sleep_us(50 * 1000);
    }
}

/* st with its message followed by the dead peers the store names, as DDPC_ERR_PEER when it names
 * any: for a collective that NCCL refused because a peer is gone. */
static ddpc_status name_dead_peers(DdpcGroup *g, ncclResult_t r, ddpc_status st) {
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", ddpc_last_error());
    if (!describe_dead_peers_after(g, r, msg, sizeof msg)) return st;
    return ddpc_error(DDPC_ERR_PEER, "%s", msg);
}

/* What the watchdog remembers between polls about the oldest work in flight. */
typedef struct {
    uint64_t seq;            /* the oldest work's sequence number */
    int64_t since_ms;        /* when it became the oldest */
    int64_t next_store_ms;   /* when the store may be asked again */
} HeadWatch;

/* Looks for reasons the oldest work will never finish: an NCCL error, its deadline, a peer that
 * died or aborted. On one, requests the abort. */
static void check_health(NcclImpl *im, HeadWatch *hw) {
    DdpcGroup *g = im->g;
    pthread_mutex_lock(&im->mu);
    /* Only this thread removes works, so the head stays valid after unlocking. */
    DdpcWork *w = im->head;
    pthread_mutex_unlock(&im->mu);
    if (!w) return;
    int64_t now = ddpc_now_ms();
    if (w->seq != hw->seq) {
        hw->seq = w->seq;
        hw->since_ms = now;
    }
    char what[160], msg[2048];
    describe_work(w, what, sizeof what);
    ddpc_group_note_stall(g, w, what);

    ncclResult_t state = ncclSuccess, r = ncclSuccess;
    /* A post holds comm_mu while it enqueues; rather than wait behind it, look next round. */
    if (pthread_mutex_trylock(&im->comm_mu) == 0) {
        if (im->comm) r = g_api.CommGetAsyncError(im->comm, &state);
        pthread_mutex_unlock(&im->comm_mu);
    }
    if (r != ncclSuccess) state = r;
    if (state != ncclSuccess && state != ncclInProgress) {
        const char *last = g_api.GetLastError(NULL);
        snprintf(msg, sizeof msg, "%s on rank %d (cuda:%d): NCCL reported an error: %s (NCCL "
                 "code %d)%s%.400s", what, g->rank, im->device, g_api.GetErrorString(state), state,
                 last && last[0] ? "; NCCL says: " : "", last ? last : "");
        /* NCCL often notices a dead peer first; the store says which rank it was. */
        int dead = describe_dead_peers_after(g, state, msg, sizeof msg);
        size_t used = strlen(msg);
        snprintf(msg + used, sizeof msg - used, ". The communicator was aborted and this process "
                 "group can no longer be used; run with NCCL_DEBUG=INFO for NCCL's own log");
        request_abort(im, dead ? DDPC_ERR_PEER : DDPC_ERR_NCCL, msg);
        return;
    }

    if (now >= w->deadline_ms) {
        if (!still_waiting_on(im, w->seq)) return;
        char missing[1024];
        ddpc_group_describe_missing(g, w->seq, missing, sizeof missing);
        snprintf(msg, sizeof msg,
                 "%s did not finish within %.1f s on rank %d (nccl, cuda:%d): %s. The NCCL "
                 "communicator was aborted and this process group can no longer be used; make "
                 "every rank call the same collectives in the same order, or raise the timeout",
                 what, (double)g->timeout_ms / 1000.0, g->rank, im->device, missing);
        request_abort(im, DDPC_ERR_TIMEOUT, msg);
        return;
    }

    /* Healthy collectives finish in milliseconds; only one that lingers makes the watchdog ask
     * the store (a round trip to rank 0) about the peers, and then at a modest rate. */
    if (now - hw->since_ms < STORE_CHECK_MS || now < hw->next_store_ms) return;
    hw->next_store_ms = now + STORE_CHECK_MS;
    /* A peer's published abort: check_abort calls our abort hook, the loop does the rest. */
    if (ddpc_group_check_abort(g) != DDPC_OK) return;
    char gone[1024] = "";
    if (!describe_dead_peers(g, gone, sizeof gone) || !still_waiting_on(im, w->seq)) return;
    snprintf(msg, sizeof msg,
             "%s cannot finish on rank %d (nccl, cuda:%d)%s. The NCCL communicator was aborted and "
             "this process group can no longer be used; look at that rank's output for why it "
             "stopped",
             what, g->rank, im->device, gone);
    request_abort(im, DDPC_ERR_PEER, msg);
}

static void *watchdog_main(void *arg) {
    NcclImpl *im = arg;
    cudaError_t e = cudaSetDevice(im->device);
    if (e != cudaSuccess) {
        char msg[512];
        snprintf(msg, sizeof msg, "the NCCL watchdog of rank %d could not bind cuda:%d: %s (%s)",
                 im->g->rank, im->device, cudaGetErrorName(e), cudaGetErrorString(e));
        request_abort(im, DDPC_ERR_CUDA, msg);
    }
    HeadWatch hw = {.seq = 0, .since_ms = 0, .next_store_ms = 0};
    unsigned us = POLL_MIN_US;
    for (;;) {
        pthread_mutex_lock(&im->mu);
        /* After an abort, a peer that still runs may lower a released staged counter again:
         * release them on every round until the group is destroyed. */
        int staged_aborted = im->staged && atomic_load(&im->g->aborted);
        if (staged_aborted) ddpc_staged_unblock(im->staged);
        if (im->fast || staged_aborted) {
            /* Fast calls have no works: look at them every FAST_WATCH_MS even when idle. */
            if (!im->stop && !im->abort_requested && !im->head) {
                struct timespec ts;
                clock_gettime(CLOCK_MONOTONIC, &ts);
                ts.tv_nsec += FAST_WATCH_MS * 1000000L;
                ts.tv_sec += ts.tv_nsec / 1000000000L;
                ts.tv_nsec %= 1000000000L;
                pthread_cond_timedwait(&im->cv, &im->mu, &ts);
            }
        } else {
            while (!im->stop && !im->abort_requested && !im->head)
                pthread_cond_wait(&im->cv, &im->mu);
        }
        int stop = im->stop, abort_req = im->abort_requested, busy = im->head != NULL;
        pthread_mutex_unlock(&im->mu);
        if (stop) break;
        fast_watch(im);
        if (abort_req) {
            abort_all(im);
            continue;
        }
        if (!busy) continue;
        if (reap(im)) {
            us = POLL_MIN_US;
            continue;
        }
        check_health(im, &hw);
        /* Back off while a long collective runs; restart fast after each completion, so a host
         * wait returns soon after the device finishes. */
        sleep_us(us);
        us = DDPC_MIN(us * 2, POLL_MAX_US);
    }
    return NULL;
}

/* ---------------------------------------------------------------- backend operations */

static void nccl_abort_hook(DdpcGroup *g) {
    NcclImpl *im = g->impl;
    if (!im) return; /* still initializing: nccl_init sees the abort itself */
    if (im->fast) im->fast->ctl->abort = 1;
    pthread_mutex_lock(&im->mu);
    if (im->staged) ddpc_staged_unblock(im->staged); /* destroy takes it away under mu */
    im->abort_requested = 1;
    pthread_cond_signal(&im->cv);
    pthread_mutex_unlock(&im->mu);
}

/* Lists the ranks that never reached NCCL initialization, or says that all did. */
static void describe_init_missing(DdpcGroup *g, char *buf, size_t len) {
    size_t used = 0;
    buf[0] = '\0';
    for (int r = 0; r < g->world; r++) {
        if (r == g->rank) continue;
        char key[256];
        const char *keys[1] = {key};
        int present = 0;
        const char *what = NULL;
        ddpc_group_key(g, key, sizeof key, "nccl/join/%d", r);
        if (ddpc_group_rank_dead(g, r))
            what = "exited (its store connection dropped)";
        else if (ddpc_store_check(g->store, keys, 1, &present) == DDPC_OK && !present)
            what = "never reached NCCL initialization";
        if (!what) continue;
        int n = snprintf(buf + used, len - used, "%srank %d %s", used ? "; " : "", r, what);
        if (n < 0 || (size_t)n >= len - used) break;
        used += (size_t)n;
    }
    if (!used)
        snprintf(buf, len, "every rank reached NCCL initialization, so NCCL's own setup stalled "
                 "(with several network interfaces, set NCCL_SOCKET_IFNAME; NCCL_DEBUG=INFO "
                 "shows where)");
}

/* Between slices of an initialization wait: Ctrl-C, a peer's abort, a dead peer, the deadline. */
static ddpc_status init_check(DdpcGroup *g, int64_t deadline, int64_t *next_store_check,
                              const char *step) {
    DDPC_CHECK(ddpc_check_interrupt());
    int64_t now = ddpc_now_ms();
    if (now >= deadline) {
        char missing[1024];
        describe_init_missing(g, missing, sizeof missing);
        return ddpc_error(DDPC_ERR_TIMEOUT,
                          "NCCL initialization of rank %d (cuda:%d) did not finish within %.1f s "
                          "while %s: %s",
                          g->rank, g->cuda_device, (double)g->timeout_ms / 1000.0, step, missing);
    }
    if (now < *next_store_check) return DDPC_OK;
    *next_store_check = now + STORE_CHECK_MS;
    DDPC_CHECK(ddpc_group_check_abort(g));
    char why[1600];
    if (ddpc_group_init_failure(g, why, sizeof why))
        return ddpc_error(DDPC_ERR_PEER, "%s (rank %d was %s)", why, g->rank, step);
    return DDPC_OK;
}

/* Waits in slices until a helper thread sets *done (read under mu): OK then, or the first
 * failure init_check finds (Ctrl-C, the deadline, a peer's abort or exit), the job still running
 * unless it finished meanwhile. */
static ddpc_status wait_helper(DdpcGroup *g, pthread_mutex_t *mu, const int *done,
                               int64_t deadline, const char *step) {
    int64_t next_store_check = 0;
    unsigned us = POLL_MIN_US;
    for (;;) {
        pthread_mutex_lock(mu);
        int d = *done;
        pthread_mutex_unlock(mu);
        if (d) return DDPC_OK;
        DDPC_CHECK(init_check(g, deadline, &next_store_check, step));
        sleep_us(us);
        us = DDPC_MIN(us * 2, POLL_MAX_US);
    }
}

/* Rank 0 makes the NCCL id and publishes it; the others wait for it. Then every rank says it
 * joined, so a timeout can name the ranks that never came. */
static ddpc_status exchange_id(DdpcGroup *g, int64_t deadline, ncclUniqueId *id) {
    char key[256];
    ddpc_group_key(g, key, sizeof key, "nccl/id");
    if (g->rank == 0) {
        NCCLCHECK("ncclGetUniqueId", g_api.GetUniqueId(id));
        DDPC_CHECK(ddpc_store_set(g->store, key, id, sizeof *id));
    } else {
        int64_t next_store_check = 0;
        for (;;) {
            void *val = NULL;
            size_t len = 0;
            /* At least 1 ms: a zero wait would make the store answer "not found". */
            int64_t slice = DDPC_MAX(ddpc_slice(deadline, DDPC_SLICE_MS), 1);
            ddpc_status st = ddpc_store_get(g->store, key, slice, &val, &len);
            if (st == DDPC_OK) {
                if (len != sizeof *id) {
                    free(val);
                    return ddpc_error(DDPC_ERR_PROTOCOL,
                                      "the NCCL id published by rank 0 under %s has %zu bytes, "
                                      "not %zu: another job shares this store prefix",
                                      key, len, sizeof *id);
                }
                memcpy(id, val, sizeof *id);
                free(val);
                break;
            }
            if (st != DDPC_ERR_TIMEOUT && st != DDPC_ERR_NOTFOUND) return st;
            DDPC_CHECK(init_check(g, deadline, &next_store_check, "waiting for rank 0's NCCL id"));
        }
    }
    ddpc_group_key(g, key, sizeof key, "nccl/join/%d", g->rank);
    DDPC_CHECK(ddpc_store_set(g->store, key, "1", 1));
    return DDPC_OK;
}

static void windows_free(NcclImpl *im);
static void windows_forget(NcclImpl *im);

static void impl_free(NcclImpl *im) {
    windows_free(im);
    ddpc_trace_free(im->trace); /* (a trace never stopped) */
    im->trace = NULL;
    fast_free(im, 1); /* a clean shutdown freed it already (fast_teardown) */
    if (im->staged) ddpc_staged_close(im->staged, (uintptr_t)im->stream, 1);
    im->staged = NULL;
    for (int i = 0; i < im->npool; i++) CUDA_LOG(cudaEventDestroy(im->pool[i]));
    free(im->pool);
    if (im->scratch) CUDA_LOG(cudaFree(im->scratch));
    if (im->ready) CUDA_LOG(cudaEventDestroy(im->ready));
    if (im->stream) CUDA_LOG(cudaStreamDestroy(im->stream));
    pthread_cond_destroy(&im->cv);
    pthread_cond_destroy(&im->post_cv);
    pthread_cond_destroy(&im->posted_cv);
    pthread_mutex_destroy(&im->mu);
    pthread_mutex_destroy(&im->comm_mu);
    free(im);
}

/* A blocking communicator: in nonblocking mode NCCL launches every collective from a thread it
 * creates per call and the caller must poll until the launch is done, which cost ~200 us per
 * collective on H200s. Blocking mode launches inline. Its one call that waits for peers,
 * ncclCommInitRankConfig, runs on this helper thread while the caller waits in slices (deadline,
 * Ctrl-C, dead peers). Connections are made during init (NCCL_RUNTIME_CONNECT=0 unless the user
 * set it), so no later collective blocks on a missing peer: its kernel waits on the GPU, where the
 * watchdog's deadline and ncclCommAbort reach it. */
typedef struct InitJob {
    pthread_mutex_t mu;
    int done, abandoned;
    ncclResult_t r;
    cudaError_t cuda;
    ncclComm_t comm;
    int nranks, rank, device;
    int nccl_code, min_ctas, max_ctas; /* NCCL's version code; CTA bounds or UNDEF */
    ncclUniqueId id;
} InitJob;

/* Aborts a communicator nobody will use; a failure only gets a log line (it is already lost). */
static void abort_unused(ncclComm_t comm) {
    ncclResult_t r = g_api.CommAbort(comm);
    if (r != ncclSuccess) DDPC_INFO("NCCL", "ncclCommAbort failed: %s", g_api.GetErrorString(r));
}

static void init_job_free(InitJob *j) {
    pthread_mutex_destroy(&j->mu);
    free(j);
}

static void *init_main(void *arg) {
    InitJob *j = arg;
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclSuccess;
    cudaError_t ce = cudaSetDevice(j->device);
    if (ce == cudaSuccess) {
        NcclConfig config = {
            .size = sizeof config, .magic = NCCL_CONFIG_MAGIC, .version = NCCL_MIN_VERSION,
            .blocking = 1, .cgaClusterSize = NCCL_CONFIG_UNDEF_INT,
            .minCTAs = NCCL_CONFIG_UNDEF_INT, .maxCTAs = NCCL_CONFIG_UNDEF_INT, .netName = NULL,
        };
        if (j->nccl_code >= 21700) {
            /* CTA bounds: fewer CTAs leave more SMs to the backward compute that the gradient
             * all-reduces overlap with. */
            config.version = 21700;
            config.minCTAs = j->min_ctas;
            config.maxCTAs = j->max_ctas;
        }
        r = g_api.CommInitRankConfig(&comm, j->nranks, j->id, j->rank, &config);
    }
    pthread_mutex_lock(&j->mu);
    j->r = r;
    j->cuda = ce;
    j->comm = comm;
    j->done = 1;
    int abandoned = j->abandoned;
    pthread_mutex_unlock(&j->mu);
    if (abandoned) {
        /* The caller gave up (timeout, Ctrl-C, a dead peer) and reported it; nobody else will
         * use this communicator. */
        if (comm) abort_unused(comm);
        init_job_free(j);
    }
    return NULL;
}

/* Reads a CTA bound for the communicator from the environment (1 to 64): unset leaves it to
 * NCCL. */
static ddpc_status env_ctas(const char *name, int *out) {
    uint64_t n;
    DDPC_CHECK(ddpc_setting_uint(name, 0, &n));
    if (n == 0) return DDPC_OK;
    if (g_code < 21700)
        return ddpc_error(DDPC_ERR_INVALID, "%s needs NCCL 2.17 or newer; this one is %s: unset "
                          "it or install a newer NCCL", name, g_version);
    *out = (int)n;
    return DDPC_OK;
}

static ddpc_status init_comm(DdpcGroup *g, const ncclUniqueId *id, int64_t deadline,
                             ncclComm_t *out) {
    *out = NULL;
    if (setenv("NCCL_RUNTIME_CONNECT", "0", 0) != 0)
        return ddpc_error(DDPC_ERR_SYSTEM, "setenv(NCCL_RUNTIME_CONNECT) failed: %s",
                          strerror(errno));
    int min_ctas = NCCL_CONFIG_UNDEF_INT, max_ctas = NCCL_CONFIG_UNDEF_INT;
    DDPC_CHECK(env_ctas("DDPC_NCCL_MIN_CTAS", &min_ctas));
    DDPC_CHECK(env_ctas("DDPC_NCCL_MAX_CTAS", &max_ctas));
    /* NCCL takes the bounds as a pair: the one left unset gets NCCL's own limit. */
    if (min_ctas != NCCL_CONFIG_UNDEF_INT && max_ctas == NCCL_CONFIG_UNDEF_INT) max_ctas = 64;
    if (max_ctas != NCCL_CONFIG_UNDEF_INT && min_ctas == NCCL_CONFIG_UNDEF_INT) min_ctas = 1;
    if (min_ctas > max_ctas)
        return ddpc_error(DDPC_ERR_INVALID, "DDPC_NCCL_MIN_CTAS=%d is above DDPC_NCCL_MAX_CTAS=%d: "
                          "make the minimum at most the maximum", min_ctas, max_ctas);
    InitJob *j = calloc(1, sizeof *j);
    if (!j) return ddpc_error(DDPC_ERR_NOMEM, "out of host memory creating an NCCL communicator");
    j->nccl_code = g_code;
    j->min_ctas = min_ctas;
    j->max_ctas = max_ctas;
    pthread_mutex_init(&j->mu, NULL);
    j->nranks = g->world;
    j->rank = g->rank;
    j->device = g->cuda_device;
    memcpy(&j->id, id, sizeof j->id);
    pthread_t th;
    int rc = ddpc_thread_start(&th, init_main, j, "ddpc-nccl-init", 1);
    if (rc != 0) {
        init_job_free(j);
        return ddpc_error(DDPC_ERR_SYSTEM, "starting the NCCL init thread failed: %s",
                          strerror(rc));
    }
    ddpc_status st = wait_helper(g, &j->mu, &j->done, deadline, "creating the NCCL communicator");
    if (st != DDPC_OK) {
        pthread_mutex_lock(&j->mu);
        if (!j->done) {
            j->abandoned = 1; /* the thread frees the job and aborts what it gets */
            pthread_mutex_unlock(&j->mu);
            return st;
        }
        pthread_mutex_unlock(&j->mu);
        if (j->comm) abort_unused(j->comm);
        init_job_free(j);
        return st;
    }
    ncclResult_t r = j->r;
    cudaError_t ce = j->cuda;
    *out = j->comm;
    init_job_free(j);
    if (ce != cudaSuccess)
        return ddpc_error(DDPC_ERR_CUDA, "cudaSetDevice(%d) on the NCCL init thread failed: %s",
                          g->cuda_device, cudaGetErrorString(ce));
    NCCLCHECK("ncclCommInitRankConfig", r);
    if (!*out)
        return ddpc_error(DDPC_ERR_NCCL, "ncclCommInitRankConfig returned no communicator");
    return DDPC_OK;
}

/* ---------------------------------------------------------------- the one-shot all-reduce */

/* Turns a failure the kernels reported into a message and status; 0 when there is none to
 * report (no failure, or only kernels that gave up because the group was already aborted). */
static int fast_failure(NcclImpl *im, char *msg, size_t len, ddpc_status *st) {
    FastAr *f = im->fast;
    DdpcGroup *g = im->g;
    uint32_t code = f->ctl->err_code;
    if (code == DDPC_FAST_OK || code == DDPC_FAST_ABORTED) return 0;
    __sync_synchronize(); /* the details were written before the code was */
    uint32_t epoch = f->ctl->err_epoch;
    int peer = f->ctl->err_peer;
    const FastCall *c = &f->hist[epoch % FAST_HISTORY];
    char what[160];
    snprintf(what, sizeof what, "all_reduce #%llu (%zu x %s, %s)", (unsigned long long)c->seq,
             c->count, ddpc_dtype_name((ddpc_dtype)c->dtype), ddpc_redop_name((ddpc_redop)c->redop));
    if (code == DDPC_FAST_MISMATCH) {
        *st = DDPC_ERR_MISMATCH;
        snprintf(msg, len, "%s on rank %d: rank %d passed %u elements (low 32 bits) to the same "
                 "collective. Every rank must pass tensors with the same number of elements; the "
                 "process group was aborted and can no longer be used",
                 what, g->rank, peer, (unsigned)f->ctl->err_peer_count);
        return 1;
    }
    char gone[1024] = "";
    describe_dead_peers(g, gone, sizeof gone);
    *st = gone[0] ? DDPC_ERR_PEER : DDPC_ERR_TIMEOUT;
    snprintf(msg, len, "%s did not finish within %.1f s on rank %d (nccl, cuda:%d): rank %d never "
             "arrived%s. The process group was aborted and can no longer be used; make every rank "
             "call the same collectives in the same order, or raise the timeout",
             what, (double)g->timeout_ms / 1000.0, g->rank, im->device, peer, gone);
    return 1;
}

/* Called by the watchdog and by each fast call: a kernel's failure aborts the group, once. */
static ddpc_status fast_check(NcclImpl *im) {
    char msg[2048];
    ddpc_status st = DDPC_OK;
    if (!fast_failure(im, msg, sizeof msg, &st)) return DDPC_OK;
    if (atomic_exchange(&im->fast->reported, 1) == 0) request_abort(im, st, msg);
    return ddpc_error(st, "%s", msg);
}

/* The watchdog's look at the fast path: a reported failure, or calls that have not finished for
 * a while, in which case the store says whether a peer died. */
static void fast_watch(NcclImpl *im) {
    FastAr *f = im->fast;
    if (!f || atomic_load(&im->g->aborted)) return;
    if (fast_check(im) != DDPC_OK) return;
    uint32_t issued = atomic_load(&f->issued), done = f->ctl->done_epoch;
    int64_t now = ddpc_now_ms();
    if (issued == done) {
        f->stalled_since_ms = 0;
        return;
    }
    if (f->stalled_since_ms == 0 || f->stalled_epoch != done) {
        f->stalled_since_ms = now;
        f->stalled_epoch = done;
        return;
    }
    if (now - f->stalled_since_ms < STORE_CHECK_MS) return;
    f->stalled_since_ms = now;
    if (ddpc_group_check_abort(im->g) != DDPC_OK) return; /* the abort hook stops the kernels */
    char gone[1024] = "";
    if (!describe_dead_peers(im->g, gone, sizeof gone)) return;
    const FastCall *c = &f->hist[(done + 1) % FAST_HISTORY];
    char msg[2048];
    snprintf(msg, sizeof msg,
             "all_reduce #%llu (%zu x %s, %s) cannot finish on rank %d (nccl, cuda:%d)%s. The "
             "process group was aborted and can no longer be used; look at that rank's output for "
             "why it stopped",
             (unsigned long long)c->seq, c->count, ddpc_dtype_name((ddpc_dtype)c->dtype),
             ddpc_redop_name((ddpc_redop)c->redop), im->g->rank, im->device, gone);
    atomic_store(&f->reported, 1);
    request_abort(im, DDPC_ERR_PEER, msg);
}

/* Frees the fast path's resources. region_shared: a peer may still have this rank's region mapped
 * (freeing it first is undefined behaviour in CUDA), so it is left allocated until the process
 * exits, 4 MiB of device memory, on failure paths only. */
static void fast_free(NcclImpl *im, int region_shared) {
    FastAr *f = im->fast;
    if (!f) return;
    im->g->fast_max_bytes = 0;
    for (int r = 0; r < DDPC_FAST_MAX_RANKS; r++)
        if (f->peer[r]) CUDA_LOG(cudaIpcCloseMemHandle(f->peer[r]));
    if (f->region && region_shared)
        DDPC_INFO("NCCL", "rank %d: the one-shot all-reduce region stays allocated (a peer may "
                  "still map it)", im->g->rank);
    else if (f->region)
        CUDA_LOG(cudaFree(f->region));
    if (f->ctl) CUDA_LOG(cudaFreeHost(f->ctl));
    if (f->chain) CUDA_LOG(cudaEventDestroy(f->chain));
    free(f);
    im->fast = NULL;
}

/* Waits for a store key every rank sets during initialization. */
static ddpc_status fast_get(DdpcGroup *g, const char *key, int64_t deadline, void **val,
                            size_t *len, const char *what) {
    int64_t next_store_check = 0;
    for (;;) {
        int64_t slice = DDPC_MAX(ddpc_slice(deadline, DDPC_SLICE_MS), 1);
        ddpc_status st = ddpc_store_get(g->store, key, slice, val, len);
        if (st == DDPC_OK) return DDPC_OK;
        if (st != DDPC_ERR_TIMEOUT && st != DDPC_ERR_NOTFOUND) return st;
        DDPC_CHECK(init_check(g, deadline, &next_store_check, what));
    }
}

/* One rank's first-round vote for a path shared by the ranks of one host: a "no", or a host other
 * than this rank's, turns the path off for all (*all_ok = 0, why says the first reason). */
static void vote_verdict(int ok, const char *host, const char *mine, int r, int *all_ok,
                         char *why, size_t why_len) {
    if (ok && !strcmp(host, mine)) return;
    if (*all_ok && !why[0])
        snprintf(why, why_len, ok ? "rank %d is on another host" : "rank %d cannot use it", r);
    *all_ok = 0;
}

/* The second round: every rank says whether it could set the path up (`name`/<rank> = '1', or
 * '0' followed by `reason` when there is one) and reads the others'; *enabled is 1 only when all
 * could, else why says the first rank that could not, and its reason, unless it held this
 * rank's own reason already (reason may be why: it is read before why is written). */
static ddpc_status yes_vote(DdpcGroup *g, int64_t deadline, const char *name, int yes,
                            const char *reason, int *enabled, char *why, size_t why_len,
                            const char *failed, const char *what) {
    char key[256], mine[512];
    int n = snprintf(mine, sizeof mine, "%c%s", yes ? '1' : '0', !yes && reason ? reason : "");
    ddpc_group_key(g, key, sizeof key, "%s/%d", name, g->rank);
    DDPC_CHECK(ddpc_store_set(g->store, key, mine, (size_t)DDPC_MIN(n, (int)sizeof mine - 1)));
    *enabled = 1;
    for (int r = 0; r < g->world; r++) {
        void *val = NULL;
        size_t len = 0;
        ddpc_group_key(g, key, sizeof key, "%s/%d", name, r);
        DDPC_CHECK(fast_get(g, key, deadline, &val, &len, what));
        const char *v = val;
        int ok = len == 1 && v[0] == '1';
        if (!ok && *enabled && !why[0]) {
            if (len > 1) /* its reason, not NUL-terminated */
                snprintf(why, why_len, "rank %d %s: %.*s", r, failed,
                         (int)DDPC_MIN(len - 1, 480), v + 1);
            else
                snprintf(why, why_len, "rank %d %s", r, failed);
        }
        if (!ok) *enabled = 0;
        free(val);
    }
    return DDPC_OK;
}

typedef struct {
    int32_t ok;
    char host[256];
    cudaIpcMemHandle_t handle;
} FastVote;

/* Every rank votes, so all take the same path: on only when all ranks share this host, may use
 * P2P (neither NCCL_P2P_DISABLE=1 nor NCCL_P2P_LEVEL=LOC) and could map each other's regions. A "no" is not an error: the
 * small all-reduces then go through NCCL like the rest. Store failures are errors. */
static ddpc_status fast_setup(NcclImpl *im, int64_t deadline) {
    DdpcGroup *g = im->g;
    char key[256], why[256] = "";
    int wanted;
    DDPC_CHECK(ddpc_setting_flag("DDPC_FAST_ALLREDUCE", 1, &wanted));
    FastVote mine;
    memset(&mine, 0, sizeof mine);
    ddpc_group_host_id(g, mine.host, sizeof mine.host);
    FastAr *f = calloc(1, sizeof *f);
    if (!f) return ddpc_error(DDPC_ERR_NOMEM, "out of host memory setting up the fast all-reduce");
    im->fast = f;
    if (!wanted)
        snprintf(why, sizeof why, "DDPC_FAST_ALLREDUCE=%s", getenv("DDPC_FAST_ALLREDUCE"));
    else if (!ddpc_nccl_p2p_disabled(why, sizeof why) && /* (else why names the setting) */
             (g->world < 2 || g->world > DDPC_FAST_MAX_RANKS))
        snprintf(why, sizeof why, "%d ranks (it takes 2 to %d)", g->world, DDPC_FAST_MAX_RANKS);
    if (!why[0]) {
        cudaError_t e = cudaMalloc((void **)&f->region, DDPC_FAST_REGION_BYTES);
        if (e == cudaSuccess) e = cudaMemset(f->region, 0, DDPC_FAST_REGION_BYTES);
        if (e == cudaSuccess) e = cudaIpcGetMemHandle(&mine.handle, f->region);
        if (e == cudaSuccess)
            e = cudaHostAlloc((void **)&f->ctl, sizeof *f->ctl, cudaHostAllocMapped);
        if (e == cudaSuccess) {
            memset((void *)f->ctl, 0, sizeof *f->ctl);
            e = cudaHostGetDevicePointer((void **)&f->ctl_dev, (void *)f->ctl, 0);
        }
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&f->chain, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaDeviceSynchronize(); /* the zeroed flags are in place */
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            snprintf(why, sizeof why, "setting up its memory failed: %s", cudaGetErrorString(e));
        }
    }
    mine.ok = !why[0];
    ddpc_group_key(g, key, sizeof key, "fast/vote/%d", g->rank);
    DDPC_CHECK(ddpc_store_set(g->store, key, &mine, sizeof mine));
    int all_ok = 1;
    FastVote *votes = calloc((size_t)g->world, sizeof *votes);
    if (!votes) return ddpc_error(DDPC_ERR_NOMEM, "out of host memory reading the fast votes");
    for (int r = 0; r < g->world; r++) {
        void *val = NULL;
        size_t len = 0;
        ddpc_group_key(g, key, sizeof key, "fast/vote/%d", r);
        ddpc_status st = fast_get(g, key, deadline, &val, &len,
                                  "setting up the fast all-reduce with its peers");
        if (st != DDPC_OK) {
            free(votes);
            return st;
        }
        if (len != sizeof votes[r]) {
            free(val);
            free(votes);
            return ddpc_error(DDPC_ERR_PROTOCOL, "%s holds %zu bytes, not %zu: another job "
                              "shares this store prefix, or the ranks run different ddpc builds",
                              key, len, sizeof(FastVote));
        }
        memcpy(&votes[r], val, sizeof votes[r]);
        free(val);
        FastVote *v = &votes[r];
        v->host[sizeof v->host - 1] = '\0';
        vote_verdict(v->ok, v->host, mine.host, r, &all_ok, why, sizeof why);
    }
    /* Only when every vote is yes does any rank map a peer's region. */
    const int votes_ok = all_ok;
    for (int r = 0; r < g->world && all_ok; r++) {
        if (r == g->rank) continue;
        cudaError_t e = cudaIpcOpenMemHandle((void **)&f->peer[r], votes[r].handle,
                                             cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            f->peer[r] = NULL;
            snprintf(why, sizeof why, "mapping rank %d's memory failed: %s", r,
                     cudaGetErrorString(e));
            all_ok = 0;
        }
    }
    free(votes);
    /* Second vote: did every rank map every other one? */
    int enabled = 0;
    DDPC_CHECK(yes_vote(g, deadline, "fast/mapped", all_ok, why, &enabled, why, sizeof why,
                        "could not map its peers",
                        "setting up the fast all-reduce with its peers"));
    if (!enabled) {
        DDPC_INFO("NCCL", "rank %d: small all-reduces go through NCCL (no one-shot path: %s)",
                  g->rank, why);
        /* Every vote was yes, so peers may have mapped this region before one of them failed. */
        fast_free(im, votes_ok);
        return DDPC_OK;
    }
    f->sub_bytes = DDPC_FAST_SLOT_BYTES / (size_t)g->world / 16 * 16;
    f->max_bytes = DDPC_MIN((size_t)DDPC_FAST_MAX_BYTES, f->sub_bytes);
    g->fast_max_bytes = f->max_bytes;
    DDPC_INFO("NCCL", "rank %d: one-shot all-reduce over CUDA IPC for messages up to %zu bytes",
              g->rank, f->max_bytes);
    return DDPC_OK;
}

/* ---------------------------------------------------------------- staged all-reduce setup */

typedef struct {
    int32_t ok;
    uint64_t chunk_bytes; /* rank 0's is used by all, like min_bytes */
    uint64_t min_bytes;
    char host[256];
    char shm[96]; /* rank 0's segment */
} StagedVote;

/* The copy-engine path (staged.h) for all-reduces of at least DDPC_STAGED_MIN_BYTES (1 MiB):
 * on when DDPC_STAGED_ALLREDUCE=1, or by default when NCCL_P2P_DISABLE=1 (or
 * NCCL_P2P_LEVEL=LOC), and every rank is
 * on this host. Like fast_setup, every rank votes so all take the same path, and a "no" only
 * leaves the large all-reduces to NCCL. */
static ddpc_status staged_setup(NcclImpl *im, int64_t deadline) {
    DdpcGroup *g = im->g;
    char key[256], why[256] = "";
    int wanted, overlap;
    DDPC_CHECK(ddpc_setting_flag("DDPC_STAGED_ALLREDUCE", ddpc_nccl_p2p_disabled(NULL, 0),
                                 &wanted));
    DDPC_CHECK(ddpc_setting_flag("DDPC_STAGED_OVERLAP", 1, &overlap));
    if (g->world < 2) return DDPC_OK;
    StagedVote mine;
    memset(&mine, 0, sizeof mine);
    ddpc_group_host_id(g, mine.host, sizeof mine.host);
    size_t chunk;
    DDPC_CHECK(ddpc_staged_chunk_bytes(g->world, &chunk));
    mine.chunk_bytes = chunk;
    uint64_t min_bytes;
    DDPC_CHECK(ddpc_setting_uint("DDPC_STAGED_MIN_BYTES", (uint64_t)1 << 20, &min_bytes));
    mine.min_bytes = DDPC_MAX(min_bytes, (uint64_t)1);
    DdpcStaged *s = NULL;
    /* Every rank votes, also when it does not want the path: a rank whose environment differs
     * must not leave the others waiting for its vote. */
    if (!wanted) {
        snprintf(why, sizeof why,
                 "not wanted (DDPC_STAGED_ALLREDUCE unset or 0, and NCCL keeps P2P on)");
    } else if (g->world > DDPC_STAGED_MAX_RANKS) {
        snprintf(why, sizeof why, "%d ranks (it takes 2 to %d)", g->world, DDPC_STAGED_MAX_RANKS);
    } else if (g->rank == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        snprintf(mine.shm, sizeof mine.shm, "/ddpc-stg-%d-%llx", (int)getpid(),
                 (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec);
        if (ddpc_staged_open(0, g->world, chunk, mine.shm, 1, &s) != DDPC_OK)
            snprintf(why, sizeof why, "%s", ddpc_last_error());
    }
    mine.ok = !why[0];
    ddpc_group_key(g, key, sizeof key, "staged/vote/%d", g->rank);
    ddpc_status st = ddpc_store_set(g->store, key, &mine, sizeof mine);
    StagedVote zero;
    memset(&zero, 0, sizeof zero);
    int all_ok = mine.ok;
    for (int r = 0; r < g->world && st == DDPC_OK; r++) {
        void *val = NULL;
        size_t len = 0;
        ddpc_group_key(g, key, sizeof key, "staged/vote/%d", r);
        if ((st = fast_get(g, key, deadline, &val, &len,
                           "setting up the staged all-reduce with its peers")) != DDPC_OK)
            break;
        if (len != sizeof(StagedVote)) {
            free(val);
            st = ddpc_error(DDPC_ERR_PROTOCOL, "%s holds %zu bytes, not %zu: another job shares "
                            "this store prefix, or the ranks run different ddpc builds", key, len,
                            sizeof(StagedVote));
            break;
        }
        StagedVote *v = val;
        v->host[sizeof v->host - 1] = '\0';
        v->shm[sizeof v->shm - 1] = '\0';
        vote_verdict(v->ok, v->host, mine.host, r, &all_ok, why, sizeof why);
        if (r == 0) zero = *v;
        free(val);
    }
    if (st != DDPC_OK || !all_ok) {
        /* Every rank read the same votes: all stop here, without the second vote. */
        if (s) ddpc_staged_close(s, 0, 0);
        if (st == DDPC_OK && wanted)
            DDPC_INFO("NCCL", "rank %d: large all-reduces go through NCCL (no staged path: %s)",
                      g->rank, why);
        return st;
    }
    chunk = (size_t)zero.chunk_bytes;
    if (chunk < 4096 || chunk % 4096) {
        if (s) ddpc_staged_close(s, 0, 0);
        return ddpc_error(DDPC_ERR_PROTOCOL, "rank 0 chose a staged chunk of %zu bytes: the ranks "
                          "run different ddpc builds", chunk);
    }
    if (g->rank != 0 &&
        ddpc_staged_open(g->rank, g->world, chunk, zero.shm, 0, &s) != DDPC_OK) {
        snprintf(why, sizeof why, "%s", ddpc_last_error());
        all_ok = 0;
    }
    /* Second vote: did every rank map the segment? Then rank 0 removes its name. */
    int enabled = 0;
    st = yes_vote(g, deadline, "staged/mapped", all_ok, why, &enabled, why, sizeof why,
                  "could not map it", "setting up the staged all-reduce with its peers");
    if (s) ddpc_staged_unlink(s);
    if (st != DDPC_OK || !enabled) {
        if (s) ddpc_staged_close(s, 0, 0);
        if (st == DDPC_OK)
            DDPC_INFO("NCCL", "rank %d: large all-reduces go through NCCL (no staged path: %s)",
                      g->rank, why);
        return st;
    }
    /* Rank 0's threshold: every rank must send a given all-reduce down the same path. */
    if ((size_t)zero.min_bytes != (size_t)mine.min_bytes)
        DDPC_INFO("NCCL", "rank %d: using rank 0's staged threshold of %llu bytes, not this "
                  "rank's %zu (DDPC_STAGED_MIN_BYTES differs)", g->rank,
                  (unsigned long long)zero.min_bytes, (size_t)mine.min_bytes);
    im->staged = s;
    im->staged_min_bytes = DDPC_MAX((size_t)zero.min_bytes, (size_t)1);
    /* Local: it changes which streams wait for what on this rank, not what any rank issues.
     * On unless DDPC_STAGED_OVERLAP=0. */
    im->staged_overlap = overlap;
    g->staged_min_bytes = im->staged_min_bytes;
    DDPC_INFO("NCCL", "rank %d: all-reduces of %zu bytes or more go through pinned host memory on "
              "the copy engines (%zu-byte chunks)", g->rank, im->staged_min_bytes, chunk);
    return DDPC_OK;
}

/* True while a fast call of this rank has not finished and nothing says it never will. */
static int fast_busy(NcclImpl *im) {
    FastAr *f = im->fast;
    return f && !atomic_load(&im->g->aborted) && f->ctl->err_code == DDPC_FAST_OK &&
           f->ctl->done_epoch != (uint32_t)f->epoch;
}

/* At destroy, after nccl_destroy waited for the calls (fast_busy) with the watchdog running.
 * Memory another process may still touch is never freed: kernels still running or queued are
 * told to give up, and if they do not drain, everything stays allocated; this rank's region is
 * freed only once every peer has closed its mapping of it. */
static void fast_teardown(NcclImpl *im) {
    FastAr *f = im->fast;
    if (!f) return;
    DdpcGroup *g = im->g;
    int quiet = f->ctl->done_epoch == (uint32_t)f->epoch;
    if (!quiet) {
        f->ctl->abort = 1; /* a call not yet begun touches no peer; a waiting one gives up */
        cudaError_t e;
        int64_t until = ddpc_now_ms() + 5000;
        while ((e = cudaEventQuery(f->chain)) == cudaErrorNotReady && ddpc_now_ms() < until)
            sleep_us(POLL_MAX_US);
        (void)cudaGetLastError();
        quiet = e == cudaSuccess;
    }
    if (!quiet) {
        DDPC_INFO("NCCL", "rank %d: one-shot all-reduce kernels did not drain at shutdown; their "
                  "memory stays allocated", g->rank);
        im->fast = NULL;
        g->fast_max_bytes = 0;
        return;
    }
    for (int r = 0; r < DDPC_FAST_MAX_RANKS; r++) {
        if (f->peer[r]) CUDA_LOG(cudaIpcCloseMemHandle(f->peer[r]));
        f->peer[r] = NULL;
    }
    /* After an abort a peer may never answer: do not wait for it, keep the region instead. */
    int all_closed = 0;
    if (!atomic_load(&g->aborted)) {
        char key[256];
        ddpc_group_key(g, key, sizeof key, "fast/closed");
        int64_t total = 0;
        if (ddpc_store_add(g->store, key, 1, &total) == DDPC_OK) {
            int64_t until = ddpc_now_ms() + DDPC_MIN(g->timeout_ms, 10000);
            while (total < g->world && ddpc_now_ms() < until && !atomic_load(&g->aborted)) {
                sleep_us(POLL_MAX_US);
                if (ddpc_store_add(g->store, key, 0, &total) != DDPC_OK) break;
            }
        }
        all_closed = total >= g->world;
    }
    fast_free(im, !all_closed);
}

/* The synchronous all-reduce of a small device buffer on the caller's stream, without a work:
 * *ran = 0 when it does not qualify (the caller posts it to NCCL instead). The choice depends on
 * what every rank passes alike (size, dtype, op, device), so all ranks take the same path. */
static ddpc_status nccl_all_reduce_now(DdpcGroup *g, const DdpcCollArgs *a, uint64_t seq,
                                       int *ran) {
    NcclImpl *im = g->impl;
    *ran = 0;
    FastAr *f = im ? im->fast : NULL;
    size_t esize = ddpc_dtype_size(a->dtype);
    if (!f || a->device != im->device || a->count == 0 || !ddpc_fast_supported(a->dtype, a->redop) ||
        a->count > f->max_bytes / (esize ? esize : 1))
        return DDPC_OK;
    *ran = 1;
    /* Inside CUDA graph capture neither path works (a replay would repeat this call's epoch, and
     * the NCCL path's watchdog cannot query captured events): refuse it before touching a peer. */
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaError_t qe = cudaStreamIsCapturing((cudaStream_t)a->stream, &capture);
    if (qe != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        return ddpc_error(DDPC_ERR_INVALID,
                          "all_reduce #%llu on rank %d: the stream is being captured into a CUDA "
                          "graph (%s), and ddpc's collectives cannot be captured: call them "
                          "outside the capture", (unsigned long long)seq, g->rank,
                          qe != cudaSuccess ? cudaGetErrorString(qe) : "capture in progress");
    }
    if (atomic_load(&g->aborted)) return aborted_error(im, "all_reduce");
    DDPC_CHECK(fast_check(im));
    ddpc_status st = DDPC_OK;
    /* The deferred posts before it are issued first: it orders itself after the newest. */
    DDPC_CHECK(drain_posted(im, NULL, seq));
    int prev = -1;
    DDPC_CUDACHECK_GOTO(cudaGetDevice(&prev), st, fail);
    if (prev != im->device) DDPC_CUDACHECK_GOTO(cudaSetDevice(im->device), st, fail);
    if (f->have_last && f->last_stream != a->stream) {
        /* The previous call ran on another stream: this one must not overtake it (the slots and
         * flags assume the calls of a rank run one after the other). f->chain marks its end. */
        DDPC_CUDACHECK_GOTO(cudaStreamWaitEvent((cudaStream_t)a->stream, f->chain, 0), st, fail);
    }
    /* Collectives posted earlier (async, on the communication stream) come first, as they would
     * through NCCL: the buffer may be one of theirs. The newest one's event covers them all. */
    pthread_mutex_lock(&im->mu);
    cudaError_t ce = cudaSuccess;
    if (im->tail) {
        NcclWorkData *wd = im->tail->backend_data;
        if (wd && atomic_load(&wd->enqueued))
            ce = cudaStreamWaitEvent((cudaStream_t)a->stream, wd->done, 0);
    }
    pthread_mutex_unlock(&im->mu);
    if (ce != cudaSuccess) {
        st = ddpc_error(DDPC_ERR_CUDA, "making the stream wait for the collectives posted before "
                        "it failed: %s (%s)", cudaGetErrorName(ce), cudaGetErrorString(ce));
        goto fail;
    }
    DdpcFastArgs fa;
    memset(&fa, 0, sizeof fa);
    for (int r = 0; r < g->world; r++) fa.base[r] = r == g->rank ? f->region : f->peer[r];
    fa.in = a->recv;
    fa.out = a->recv;
    fa.count = a->count;
    fa.sub_bytes = f->sub_bytes;
    fa.epoch = f->epoch + 1;
    fa.rank = g->rank;
    fa.world = g->world;
    fa.dtype = a->dtype;
    fa.redop = a->redop;
    fa.ctl = f->ctl_dev;
    fa.timeout_ns = g->timeout_ms >= (int64_t)(UINT64_MAX / 1000000ull)
                        ? UINT64_MAX : (uint64_t)g->timeout_ms * 1000000ull;
    FastCall *c = &f->hist[fa.epoch % FAST_HISTORY];
    c->seq = seq;
    c->count = a->count;
    c->dtype = a->dtype;
    c->redop = a->redop;
    DdpcTraceRec *tr = im->trace ? ddpc_trace_take(im->trace, seq, a->op, a->dtype, a->count,
                                                   DDPC_TRACE_ONESHOT, 0)
                                 : NULL;
    for (int p = DDPC_TRACE_READY; tr && p <= DDPC_TRACE_WIRE; p++)
        DDPC_CHECK_GOTO(ddpc_trace_record(tr, p, a->stream), st, fail);
    DDPC_CHECK_GOTO(ddpc_fast_launch(&fa, a->stream), st, fail);
    for (int p = DDPC_TRACE_REDUCED; tr && p <= DDPC_TRACE_DONE; p++)
        DDPC_CHECK_GOTO(ddpc_trace_record(tr, p, a->stream), st, fail);
    /* Marks this call's end, for the next call on another stream and for teardown, without ever
     * touching an older stream (its owner may have destroyed it since). */
    DDPC_CUDACHECK_GOTO(cudaEventRecord(f->chain, (cudaStream_t)a->stream), st, fail);
    f->epoch = fa.epoch;
    atomic_store(&f->issued, (uint32_t)fa.epoch);
    f->last_stream = a->stream;
    f->have_last = 1;
    goto out;
fail:
    /* The peers may already be waiting for this call: they must learn it will not come. */
    ddpc_error_prefix(st, "all_reduce #%llu (%zu x %s, %s) on rank %d: ", (unsigned long long)seq,
                      a->count, ddpc_dtype_name(a->dtype), ddpc_redop_name(a->redop), g->rank);
    request_abort(im, st, ddpc_last_error());
out:
    return restore_device(prev, im->device, st);
}

static ddpc_status nccl_init(DdpcGroup *g) {
    ddpc_status st = DDPC_OK;
    ncclResult_t r = ncclSuccess;
    int64_t deadline = ddpc_deadline(g->timeout_ms);
    char version[32];
    NcclImpl *im = NULL;
    DDPC_CHECK_GOTO(ddpc_nccl_load(version, sizeof version), st, fail);
    if (g->cuda_device < 0) {
        st = ddpc_error(DDPC_ERR_INVALID,
                        "the nccl backend needs the CUDA device this rank uses (device=, usually "
                        "LOCAL_RANK); got %d",
                        g->cuda_device);
        goto fail;
    }
    DDPC_CHECK_GOTO(ddpc_cuda_set_device(g->cuda_device), st, fail);
    im = calloc(1, sizeof *im);
    if (!im) {
        st = ddpc_error(DDPC_ERR_NOMEM, "out of host memory creating an NCCL group");
        goto fail;
    }
    im->g = g;
    im->device = g->cuda_device;
    pthread_mutex_init(&im->comm_mu, NULL);
    pthread_mutex_init(&im->mu, NULL);
    /* The watchdog's timed waits measure a monotonic clock: a wall-clock jump cannot stall it. */
    pthread_condattr_t cattr;
    pthread_condattr_init(&cattr);
    pthread_condattr_setclock(&cattr, CLOCK_MONOTONIC);
    pthread_cond_init(&im->cv, &cattr);
    pthread_cond_init(&im->post_cv, &cattr);
    pthread_cond_init(&im->posted_cv, &cattr);
    pthread_condattr_destroy(&cattr);

    int least = 0, greatest = 0;
    DDPC_CUDACHECK_GOTO(cudaDeviceGetStreamPriorityRange(&least, &greatest), st, fail);
    /* High priority so gradient buckets start as soon as they are ready, ahead of queued
     * compute; non-blocking so the legacy default stream does not serialize with it. */
    DDPC_CUDACHECK_GOTO(cudaStreamCreateWithPriority(&im->stream, cudaStreamNonBlocking, greatest),
                        st, fail);
    DDPC_CUDACHECK_GOTO(cudaEventCreateWithFlags(&im->ready, cudaEventDisableTiming), st, fail);
    DDPC_CUDACHECK_GOTO(cudaMalloc((void **)&im->scratch, sizeof(int)), st, fail);
    DDPC_CUDACHECK_GOTO(cudaMemset(im->scratch, 0, sizeof(int)), st, fail);

    ncclUniqueId id;
    DDPC_CHECK_GOTO(exchange_id(g, deadline, &id), st, fail);
    DDPC_CHECK_GOTO(init_comm(g, &id, deadline, &im->comm), st, fail);
    DDPC_CHECK_GOTO(fast_setup(im, deadline), st, fail);
    DDPC_CHECK_GOTO(staged_setup(im, deadline), st, fail);

    int rc = ddpc_thread_start(&im->watchdog, watchdog_main, im, "ddpc-watchdog", 0);
    if (rc != 0) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "starting the NCCL watchdog thread failed: %s",
                        strerror(rc));
        goto fail;
    }
    im->watchdog_started = 1;
    /* The reducer's bucket posts are issued from a thread of their own, off the host path that
     * launches the backward's kernels (DDPC_NCCL_POST_THREAD=0: on the caller's thread). */
    int post_thread;
    DDPC_CHECK_GOTO(ddpc_setting_flag("DDPC_NCCL_POST_THREAD", 1, &post_thread), st, fail);
    if (post_thread) {
        rc = ddpc_thread_start(&im->poster, poster_main, im, "ddpc-poster", 0);
        if (rc == 0)
            im->poster_started = 1;
        else
            DDPC_INFO("NCCL", "rank %d: no posting thread (%s): collectives are issued by their "
                      "callers", g->rank, strerror(rc));
    }
    g->impl = im;
    snprintf(g->transport, sizeof g->transport, "nccl");
    DDPC_INFO("NCCL", "rank %d/%d ready on cuda:%d with NCCL %s", g->rank, g->world, im->device,
              version);
    return DDPC_OK;

fail:
    if (im) {
        if (im->comm) {
            r = g_api.CommAbort(im->comm);
            if (r != ncclSuccess && r != ncclInProgress)
                DDPC_INFO("NCCL", "ncclCommAbort after a failed init failed: %s",
                          g_api.GetErrorString(r));
        }
        impl_free(im);
    }
    /* Tell the peers at once rather than let them wait out the timeout. The message is copied
     * first: publishing it may overwrite this thread's. */
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", ddpc_last_error());
    ddpc_group_abort(g, st, msg);
    ddpc_error(st, "%s", msg);
    return st;
}

/* Issues the NCCL call of a posted collective on the communication stream. */
static ncclResult_t issue(NcclImpl *im, const DdpcCollArgs *a, const char **name) {
    void *s = (void *)im->stream;
    if (a->op == DDPC_COLL_BARRIER) {
        *name = "ncclAllReduce (barrier)";
        return g_api.AllReduce(im->scratch, im->scratch, 1, ncclInt32, ncclSum, im->comm, s);
    }
    ncclDataType_t dt = k_nccl_dtype[a->dtype];
    switch (a->op) {
    case DDPC_COLL_ALLREDUCE:
        *name = "ncclAllReduce";
        return g_api.AllReduce(a->recv, a->recv, a->count, dt, k_nccl_redop[a->redop], im->comm, s);
    case DDPC_COLL_BROADCAST:
        *name = "ncclBroadcast";
        return g_api.Broadcast(a->recv, a->recv, a->count, dt, a->root, im->comm, s);
    case DDPC_COLL_ALLGATHER:
        *name = "ncclAllGather";
        return g_api.AllGather(a->send, a->recv, a->count, dt, im->comm, s);
    case DDPC_COLL_REDUCE_SCATTER:
        *name = "ncclReduceScatter";
        return g_api.ReduceScatter(a->send, a->recv, a->count, dt, k_nccl_redop[a->redop],
                                   im->comm, s);
    default: break;
    }
    *name = "an unknown collective";
    return ncclSuccess;
}

/* The error for a call that found the communicator already aborted. */
static ddpc_status aborted_error(NcclImpl *im, const char *what) {
    ddpc_status st;
    const char *msg;
    settled_abort(im->g, &st, &msg);
    return ddpc_error(st, "%s on rank %d: the process group was aborted: %s", what, im->g->rank,
                      msg);
}

/* The device memory a work reads or writes, as up to two byte ranges. */
static int work_ranges(const DdpcWork *w, uintptr_t lo[2], uintptr_t hi[2]) {
    const DdpcCollArgs *a = &w->args;
    size_t bytes = a->count * ddpc_dtype_size(a->dtype);
    size_t all = bytes * (size_t)w->g->world;
    int n = 0;
    switch (a->op) {
    case DDPC_COLL_ALLGATHER:
        lo[n] = (uintptr_t)a->send, hi[n++] = (uintptr_t)a->send + bytes;
        lo[n] = (uintptr_t)a->recv, hi[n++] = (uintptr_t)a->recv + all;
        break;
    case DDPC_COLL_REDUCE_SCATTER:
        lo[n] = (uintptr_t)a->send, hi[n++] = (uintptr_t)a->send + all;
        lo[n] = (uintptr_t)a->recv, hi[n++] = (uintptr_t)a->recv + bytes;
        break;
    case DDPC_COLL_BARRIER: break;
    default: /* all-reduce and broadcast work in place */
        lo[n] = (uintptr_t)a->recv, hi[n++] = (uintptr_t)a->recv + bytes;
        break;
    }
    return n;
}

/* True when no other work still in the queue touches the bytes w works on (queued works that
 * have finished on the device but are not reaped yet count too: the answer errs towards no). */
static int disjoint_from_queue(NcclImpl *im, const DdpcWork *w) {
    uintptr_t lo[2], hi[2], olo[2], ohi[2];
    int n = work_ranges(w, lo, hi);
    int ok = 1;
    pthread_mutex_lock(&im->mu);
    for (const DdpcWork *o = im->head; o && ok; o = o->next) {
        if (o == w) continue;
        int m = work_ranges(o, olo, ohi);
        for (int i = 0; i < n && ok; i++)
            for (int j = 0; j < m && ok; j++)
                if (lo[i] < ohi[j] && olo[j] < hi[i]) ok = 0;
    }
    pthread_mutex_unlock(&im->mu);
    return ok;
}

/* The NCCL part of a post, on the posting thread or the caller's. The work is already in the
 * queue, and the communication stream waits for the caller's position, which the event `pos`
 * marks; on any failure the group is aborted (a peer may already be inside this collective) and
 * the watchdog completes the work. */
static ddpc_status enqueue(NcclImpl *im, DdpcWork *w, cudaEvent_t pos) {
    NcclWorkData *wd = w->backend_data;
    char what[160]; /* described only on a failure: posts are on the training step's host path */
    const DdpcCollArgs *a = &w->args;
    ddpc_status st = DDPC_OK;
    ncclResult_t r = ncclSuccess;
    const char *name = "";
    /* Zero elements: nothing to move, and NCCL may reject the NULL buffers that come with it.
     * Every rank sees the same count, so every rank skips. */
    int call = a->op == DDPC_COLL_BARRIER || a->count > 0;
    /* Staged overlap: the staged all-reduce starts from the caller's stream position of this
     * post (pos) rather than behind the collectives before it on the communication stream.
     * Looked up before comm_mu, never held with mu. */
    void *ready = im->staged && im->staged_overlap && call && a->op == DDPC_COLL_ALLREDUCE &&
                          disjoint_from_queue(im, w)
                      ? (void *)pos
                      : NULL;
    /* The caller's work preparing the input, on this stream (ordered after the caller's by
     * nccl_post); a staged all-reduce then starts from here, not from the caller's position. */
    DDPC_CHECK_GOTO(ddpc_trace_record(wd->trace, DDPC_TRACE_START, (uintptr_t)im->stream), st,
                    fail);
    if (a->before) {
        DDPC_CHECK_GOTO(a->before(a->hook_ctx, (uintptr_t)im->stream), st, fail);
        if (ready) DDPC_CUDACHECK_GOTO(cudaEventRecord(pos, im->stream), st, fail);
    }
    DDPC_CHECK_GOTO(ddpc_trace_record(wd->trace, DDPC_TRACE_WIRE, (uintptr_t)im->stream), st,
                    fail);
    pthread_mutex_lock(&im->comm_mu);
    if (!im->comm) {
        pthread_mutex_unlock(&im->comm_mu);
        describe_work(w, what, sizeof what);
        return aborted_error(im, what);
    }
    if (call && im->staged && a->op == DDPC_COLL_ALLREDUCE &&
        a->count * ddpc_dtype_size(a->dtype) >= im->staged_min_bytes &&
        ddpc_staged_supported(a->dtype, a->redop)) {
        wd->staged = 1;
        ddpc_trace_set_path(wd->trace, DDPC_TRACE_STAGED);
        st = ddpc_staged_all_reduce(im->staged, a->recv, a->count, a->dtype, a->redop,
                                    (uintptr_t)im->stream, ready);
        pthread_mutex_unlock(&im->comm_mu);
        if (st != DDPC_OK) goto fail;
    } else {
        if (call) r = issue(im, a, &name);
        pthread_mutex_unlock(&im->comm_mu);
    }
    /* The communicator is blocking: the collective is on the stream when the call returns. */
    if (r != ncclSuccess) {
        st = name_dead_peers(im->g, r, nccl_fail(r, name, __FILE__, __LINE__));
        goto fail;
    }
    DDPC_CHECK_GOTO(ddpc_trace_record(wd->trace, DDPC_TRACE_REDUCED, (uintptr_t)im->stream), st,
                    fail);
    /* The caller's work on the result, behind the collective on this stream (the current device
     * is the communicator's: nccl_post set it). */
    if (a->after) DDPC_CHECK_GOTO(a->after(a->hook_ctx, (uintptr_t)im->stream), st, fail);
    DDPC_CHECK_GOTO(ddpc_trace_record(wd->trace, DDPC_TRACE_DONE, (uintptr_t)im->stream), st,
                    fail);
    DDPC_CUDACHECK_GOTO(cudaEventRecord(wd->done, im->stream), st, fail);
    atomic_store(&wd->enqueued, 1);
    return DDPC_OK;
fail:
    describe_work(w, what, sizeof what);
    ddpc_error_prefix(st, "%s on rank %d: ", what, im->g->rank);
    request_abort(im, st, ddpc_last_error());
    return st;
}

/* ---------------------------------------------------------------- the posting thread */

/* Waits until the posting thread is done with the deferred work w (issued it, or gave up on it
 * after an abort), or, with w NULL, with every deferred post queued so far. In slices, so Ctrl-C
 * reaches a Python caller; it ends because a post stuck inside NCCL is freed by the watchdog's
 * abort at the work's deadline. */
static ddpc_status wait_posted(NcclImpl *im, DdpcWork *w) {
    NcclWorkData *wd = w ? w->backend_data : NULL;
    pthread_mutex_lock(&im->mu);
    while (w ? !wd->posted : im->post_head != NULL) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += DDPC_SLICE_MS * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        im->posted_waiters++;
        pthread_cond_timedwait(&im->posted_cv, &im->mu, &ts);
        im->posted_waiters--;
        if (w ? wd->posted : im->post_head == NULL) break;
        pthread_mutex_unlock(&im->mu);
        DDPC_CHECK(ddpc_check_interrupt());
        pthread_mutex_lock(&im->mu);
    }
    pthread_mutex_unlock(&im->mu);
    return DDPC_OK;
}

/* For a collective issued on the caller's thread (the work w, or with w NULL the one-shot
 * all-reduce #seq), whose sequence number is taken: waits until the deferred posts before it are
 * issued. Interrupted (Ctrl-C), this rank will not issue it, so the group is aborted: the peers
 * must learn that it will not come. */
static ddpc_status drain_posted(NcclImpl *im, const DdpcWork *w, uint64_t seq) {
    if (!im->poster_started) return DDPC_OK;
    ddpc_status st = wait_posted(im, NULL);
    if (st != DDPC_OK) {
        char what[160]; /* described only on a failure: posts are on the training step's path */
        if (w)
            describe_work(w, what, sizeof what);
        else
            snprintf(what, sizeof what, "all_reduce #%llu", (unsigned long long)seq);
        ddpc_error_prefix(st, "%s on rank %d, waiting for the collectives posted before it: ", what,
                          im->g->rank);
        request_abort(im, st, ddpc_last_error());
    }
    return st;
}

/* Issues one deferred post: the communication stream waits for the caller's position, then the
 * collective goes there (enqueue). A work already failed (the group was aborted after it was
 * posted) is not issued. A failure requests the abort, which fails the work. */
static void post_deferred(NcclImpl *im, DdpcWork *w, int bound) {
    NcclWorkData *wd = w->backend_data;
    if (bound && !atomic_load(&w->done)) {
        cudaError_t e = cudaStreamWaitEvent(im->stream, wd->ready, 0);
        if (e == cudaSuccess) {
            if (enqueue(im, w, wd->ready) == DDPC_OK) atomic_fetch_add(&im->g->n_deferred, 1);
        } else {
            char what[160];
            describe_work(w, what, sizeof what);
            ddpc_error(DDPC_ERR_CUDA, "%s on rank %d: ordering the communication stream after "
                       "the caller's stream failed: %s (%s)", what, im->g->rank,
                       cudaGetErrorName(e), cudaGetErrorString(e));
            request_abort(im, DDPC_ERR_CUDA, ddpc_last_error());
        }
    }
    /* (the wait has captured the event: the next post may record it again) */
    pool_put(im, wd->ready);
    wd->ready = NULL;
}

/* ddpc_group_wait_posted: every post queued so far has left the posting thread. */
static ddpc_status nccl_wait_posted(DdpcGroup *g) {
    NcclImpl *im = g->impl;
    return im && im->poster_started ? wait_posted(im, NULL) : DDPC_OK;
}

static void *poster_main(void *arg) {
    NcclImpl *im = arg;
    cudaError_t e = cudaSetDevice(im->device);
    int bound = e == cudaSuccess;
    if (!bound) {
        char msg[512];
        snprintf(msg, sizeof msg, "the NCCL posting thread of rank %d could not bind cuda:%d: "
                 "%s (%s)", im->g->rank, im->device, cudaGetErrorName(e), cudaGetErrorString(e));
        request_abort(im, DDPC_ERR_CUDA, msg);
    }
    pthread_mutex_lock(&im->mu);
    for (;;) {
        while (!im->post_head && !im->poster_stop) {
            im->poster_idle = 1;
            pthread_cond_wait(&im->post_cv, &im->mu);
            im->poster_idle = 0;
        }
        DdpcWork *w = im->post_head;
        if (!w) break; /* stopping, and nothing is left to post */
        pthread_mutex_unlock(&im->mu);
        post_deferred(im, w, bound);
        pthread_mutex_lock(&im->mu);
        NcclWorkData *wd = w->backend_data;
        im->post_head = wd->post_next;
        if (!im->post_head) im->post_tail = NULL;
        wd->post_next = NULL;
        wd->posted = 1;
        if (im->posted_waiters) pthread_cond_broadcast(&im->posted_cv);
        pthread_mutex_unlock(&im->mu);
        ddpc_work_release(w); /* the queue's reference (may take mu: the event pool) */
        pthread_mutex_lock(&im->mu);
    }
    pthread_mutex_unlock(&im->mu);
    return NULL;
}

/* Stops the posting thread once it has issued (or, after an abort, dropped) what is queued. */
static void poster_stop(NcclImpl *im) {
    if (!im->poster_started) return;
    pthread_mutex_lock(&im->mu);
    im->poster_stop = 1;
    pthread_cond_signal(&im->post_cv);
    pthread_mutex_unlock(&im->mu);
    pthread_join(im->poster, NULL);
    im->poster_started = 0;
}

/* Puts w in the watchdog's queue and, when deferred, in the posting queue too, each holding a
 * reference; both appends under mu, so the two queues keep the same order. */
static void queue_work(NcclImpl *im, DdpcWork *w, int deferred) {
    ddpc_work_retain(w);
    if (deferred) ddpc_work_retain(w);
    pthread_mutex_lock(&im->mu);
    w->next = NULL;
    if (im->tail)
        im->tail->next = w;
    else
        im->head = w;
    im->tail = w;
    pthread_cond_signal(&im->cv);
    if (deferred) {
        if (im->post_tail)
            ((NcclWorkData *)im->post_tail->backend_data)->post_next = w;
        else
            im->post_head = w;
        im->post_tail = w;
        if (im->poster_idle) pthread_cond_signal(&im->post_cv);
    }
    pthread_mutex_unlock(&im->mu);
}

static ddpc_status nccl_post(DdpcGroup *g, DdpcWork *w) {
    NcclImpl *im = g->impl;
    const DdpcCollArgs *a = &w->args;
    ddpc_status st = DDPC_OK;
    char what[160]; /* described only on a failure */
    if (a->op != DDPC_COLL_BARRIER && a->count > 0 && a->device != im->device) {
        describe_work(w, what, sizeof what);
        char dev[32] = "host memory";
        if (a->device >= 0) snprintf(dev, sizeof dev, "cuda:%d", a->device);
        return ddpc_error(DDPC_ERR_INVALID,
                          "%s: the nccl backend of rank %d works on cuda:%d memory, but the array "
                          "is in %s: move it to cuda:%d (host arrays need the cpu backend)",
                          what, g->rank, im->device, dev, im->device);
    }
    /* Deferred: issued by the posting thread. Otherwise issued here, after the deferred posts
     * before it (the work in between may have filled this one's input). */
    int defer = a->defer && im->poster_started && !a->before && a->device >= 0;
    if (!defer) DDPC_CHECK(drain_posted(im, w, 0));
    int prev = -1;
    DDPC_CUDACHECK(cudaGetDevice(&prev));
    if (prev != im->device) DDPC_CUDACHECK(cudaSetDevice(im->device));
    NcclWorkData *wd = calloc(1, sizeof *wd);
    if (!wd) {
        describe_work(w, what, sizeof what);
        st = ddpc_error(DDPC_ERR_NOMEM, "%s: out of host memory", what);
        goto restore;
    }
    atomic_init(&wd->enqueued, 0);
    DDPC_CHECK_GOTO(pool_get(im, &wd->done), st, fail_wd);
    if (im->trace) {
        wd->trace = ddpc_trace_take(im->trace, w->seq, a->op, a->dtype, a->count,
                                    DDPC_TRACE_NCCL, defer);
        DDPC_CHECK_GOTO(ddpc_trace_record(wd->trace, DDPC_TRACE_READY, a->stream), st, fail_ev);
    }
    if (defer) {
        /* The caller's stream position, for the posting thread to make the communication stream
         * wait for; then the work joins the watchdog's queue and the posting queue, in the same
         * order (both appends under mu, and every post holds g->mu). */
        DDPC_CHECK_GOTO(pool_get(im, &wd->ready), st, fail_ev);
        cudaError_t e = cudaEventRecord(wd->ready, (cudaStream_t)a->stream);
        if (e != cudaSuccess) {
            pool_put(im, wd->ready);
            st = ddpc_error(DDPC_ERR_CUDA, "cudaEventRecord failed: %s (%s)", cudaGetErrorName(e),
                            cudaGetErrorString(e));
            goto fail_ev;
        }
        wd->deferred = 1;
        w->backend_data = wd;
        queue_work(im, w, 1);
        goto restore;
    }
    /* The communication stream waits for the caller's queued work (the event replaces a host
     * sync); the event may be re-recorded by the next post, the wait has already captured it. */
    DDPC_CUDACHECK_GOTO(cudaEventRecord(im->ready, (cudaStream_t)a->stream), st, fail_ev);
    DDPC_CUDACHECK_GOTO(cudaStreamWaitEvent(im->stream, im->ready, 0), st, fail_ev);
    w->backend_data = wd;
    queue_work(im, w, 0);
    st = enqueue(im, w, im->ready);
    goto restore;

fail_ev:
    describe_work(w, what, sizeof what);
    ddpc_error_prefix(st, "%s on rank %d (the stream must belong to cuda:%d): ", what, g->rank,
                      im->device);
    pool_put(im, wd->done);
fail_wd:
    free(wd);
restore:
    return restore_device(prev, im->device, st);
}

static ddpc_status nccl_wait_stream(DdpcWork *w, uintptr_t stream) {
    NcclWorkData *wd = w->backend_data;
    if (wd && wd->deferred && !atomic_load(&wd->enqueued)) {
        /* Not issued yet (the posting thread is behind), or it failed: then the abort it
         * requested fails the work, with the reason. */
        NcclImpl *im = w->g->impl;
        if (im) DDPC_CHECK(wait_posted(im, w));
        if (!atomic_load(&wd->enqueued)) DDPC_CHECK(ddpc_work_wait(w));
    }
    if (atomic_load(&w->done) && w->status != DDPC_OK)
        return ddpc_error(w->status, "%s", w->msg ? w->msg : "failed");
    if (!wd || !atomic_load(&wd->enqueued)) {
        char what[160];
        describe_work(w, what, sizeof what);
        return ddpc_error(DDPC_ERR_INVALID, "%s was never enqueued, so no stream can wait for it",
                          what);
    }
    /* The caller's stream resumes when the collective ends: no host sync. */
    DDPC_CUDACHECK(cudaStreamWaitEvent((cudaStream_t)stream, wd->done, 0));
    return DDPC_OK;
}

static void nccl_work_free(DdpcWork *w) {
    NcclWorkData *wd = w->backend_data;
    if (!wd) return;
    NcclImpl *im = w->g->impl;
    cudaEvent_t evs[2] = {wd->done, wd->ready}; /* (ready: only if never posted) */
    for (int k = 0; k < 2; k++) {
        if (!evs[k]) continue;
        if (im)
            pool_put(im, evs[k]);
        else
            CUDA_LOG(cudaEventDestroy(evs[k]));
    }
    free(wd);
    w->backend_data = NULL;
}

/* Frees the communicator. Every work of ours has finished by now (nccl_destroy waited), so an
 * abort loses nothing, and unlike ncclCommFinalize on a blocking communicator it never waits for a
 * peer that is still running or hung. */
static void close_comm(NcclImpl *im, ncclComm_t comm) {
    ncclResult_t r = g_api.CommAbort(comm);
    if (r != ncclSuccess)
        DDPC_INFO("NCCL", "rank %d: ncclCommAbort at shutdown failed: %s", im->g->rank,
                  g_api.GetErrorString(r));
}

static void nccl_destroy(DdpcGroup *g) {
    NcclImpl *im = g->impl;
    if (!im) return;
    if (im->watchdog_started) {
        /* Let the collectives already queued on the GPU finish: a script often reads the result
         * of its last all_reduce after leaving the group. The watchdog keeps enforcing their
         * deadlines and watching the peers meanwhile, so this wait ends; the extra 30 s only
         * guard against a watchdog stuck on an unresponsive store. */
        pthread_mutex_lock(&im->mu);
        int64_t hard = INT64_MAX;
        if (im->tail && im->tail->deadline_ms < INT64_MAX - 30000)
            hard = im->tail->deadline_ms + 30000;
        /* Fast calls end on their own (each kernel times out at the group's timeout) or when
         * the watchdog aborts the group. */
        int64_t fast_hard = ddpc_deadline(g->timeout_ms);
        if (fast_hard < INT64_MAX - 30000) fast_hard += 30000;
        while ((im->head && ddpc_now_ms() < hard) || (fast_busy(im) && ddpc_now_ms() < fast_hard)) {
            pthread_mutex_unlock(&im->mu);
            sleep_us(POLL_MAX_US);
            pthread_mutex_lock(&im->mu);
        }
        /* A fast call that failed just now: abort the group (and tell the peers) before the
         * watchdog, which would have done it, is gone. */
        pthread_mutex_unlock(&im->mu);
        if (im->fast) (void)fast_check(im);
        /* With the watchdog still running: a post stuck inside NCCL ends at its abort. */
        poster_stop(im);
        pthread_mutex_lock(&im->mu);
        im->stop = 1;
        pthread_cond_signal(&im->cv);
        pthread_mutex_unlock(&im->mu);
        pthread_join(im->watchdog, NULL);
    }
    int device = im->device, prev = -1;
    CUDA_LOG(cudaGetDevice(&prev));
    if (prev != device) CUDA_LOG(cudaSetDevice(device));
    pthread_mutex_lock(&im->mu);
    DdpcWork *list = im->head;
    im->head = im->tail = NULL;
    pthread_mutex_unlock(&im->mu);
    pthread_mutex_lock(&im->comm_mu);
    ncclComm_t comm = im->comm;
    im->comm = NULL;
    pthread_mutex_unlock(&im->comm_mu);
    if (comm) {
        if (list || atomic_load(&g->aborted)) {
            ncclResult_t r = g_api.CommAbort(comm);
            if (r != ncclSuccess && r != ncclInProgress)
                DDPC_INFO("NCCL", "ncclCommAbort failed: %s", g_api.GetErrorString(r));
        } else {
            close_comm(im, comm);
        }
    }
    /* After the communicator: fast calls queued behind a stuck NCCL work can drain now, and the
     * windows' memory (registered with it) can go once nothing reads it: the last step's casts
     * back out of a window are queued on the caller's stream with no wait (ncclMemFree does not
     * wait for them). After an abort some work may never finish, so the memory is left. */
    fast_teardown(im);
    if (im->windows && (list || atomic_load(&g->aborted))) {
        DDPC_INFO("NCCL", "rank %d: the aborted group's symmetric windows are left allocated",
                  g->rank);
        windows_forget(im);
    } else if (im->windows) {
        CUDA_LOG(cudaDeviceSynchronize());
        windows_free(im);
    }
    pthread_mutex_lock(&im->mu);
    DdpcStaged *staged = im->staged; /* the abort hook looks at it under mu */
    im->staged = NULL;
    pthread_mutex_unlock(&im->mu);
    if (staged) {
        ddpc_staged_close(staged, (uintptr_t)im->stream, list != NULL || atomic_load(&g->aborted));
        g->staged_min_bytes = 0;
    }
    complete_list(im, list, DDPC_ERR_PEER,
                  "the process group was destroyed while it was in flight");
    /* Works still referenced elsewhere give their events back to no pool from now on, and an
     * abort hook on another thread is done with im. */
    ddpc_group_take_impl(g);
    impl_free(im);
    if (prev >= 0 && prev != device) CUDA_LOG(cudaSetDevice(prev));
}

/* ---------------------------------------------------------------- the collectives trace */

static ddpc_status no_impl(DdpcGroup *g) {
    return ddpc_error(DDPC_ERR_INVALID, "the nccl process group of rank %d was destroyed",
                      g->rank);
}

/* Runs fn(im, arg) with the communicator's device current. */
static ddpc_status on_device(NcclImpl *im, ddpc_status (*fn)(NcclImpl *, void *), void *arg) {
    int prev = -1;
    DDPC_CUDACHECK(cudaGetDevice(&prev));
    if (prev != im->device) DDPC_CUDACHECK(cudaSetDevice(im->device));
    ddpc_status st = fn(im, arg);
    return restore_device(prev, im->device, st);
}

/* ---------------------------------------------------------------- symmetric windows */

/* Lets go of the list of windows, not of their memory. */
static void windows_forget(NcclImpl *im) {
    while (im->windows) {
        NcclWindow *w = im->windows;
        im->windows = w->next;
        free(w);
    }
}

/* Frees every window's memory. After the communicator is gone (its abort released the
 * registrations), or before it ever used them. */
static void windows_free(NcclImpl *im) {
    while (im->windows) {
        NcclWindow *w = im->windows;
        im->windows = w->next;
        ncclResult_t r = g_api.MemFree(w->ptr);
        if (r != ncclSuccess)
            DDPC_INFO("NCCL", "rank %d: ncclMemFree of a %zu-byte window failed: %s", im->g->rank,
                      w->bytes, g_api.GetErrorString(r));
        free(w);
    }
}

typedef struct {
    size_t bytes;
    void *ptr;
} WindowArgs;

/* The registration waits inside NCCL for every rank, so it runs on this helper thread while the
 * caller waits in slices (Ctrl-C, the deadline, a peer's abort or exit); a peer that never
 * registers its part would otherwise hold the caller inside NCCL for good, since the watchdog
 * looks only at collectives in flight. */
typedef struct WindowJob {
    pthread_mutex_t mu;
    int done, abandoned, gone;
    ncclResult_t r;
    cudaError_t cuda;
    NcclImpl *im;
    void *ptr;
    size_t bytes;
    void *win; /* ncclWindow_t */
} WindowJob;

static void window_job_free(WindowJob *j) {
    pthread_mutex_destroy(&j->mu);
    free(j);
}

static void *window_register_main(void *arg) {
    WindowJob *j = arg;
    NcclImpl *im = j->im;
    j->cuda = cudaSetDevice(im->device);
    if (j->cuda == cudaSuccess) {
        pthread_mutex_lock(&im->comm_mu);
        j->gone = im->comm == NULL;
        if (!j->gone)
            j->r = g_api.CommWindowRegister(im->comm, j->ptr, j->bytes, &j->win,
                                            NCCL_WIN_COLL_SYMMETRIC);
        pthread_mutex_unlock(&im->comm_mu);
    }
    pthread_mutex_lock(&j->mu);
    j->done = 1;
    int abandoned = j->abandoned;
    pthread_mutex_unlock(&j->mu);
    /* Abandoned: the caller gave up, its group aborted, and NCCL held this call for long after;
     * the window's memory is lost with the group (nothing here may touch im any more). */
    if (abandoned) window_job_free(j);
    return NULL;
}

/* How long a caller that gave up waits for the registration to come back from NCCL, which the
 * group's abort (ncclCommAbort) frees, before it leaves it to the helper thread. */
#define WINDOW_ABANDON_MS 30000

/* Waits for the registration job: OK once it is done, or the failure that stopped the wait, after
 * which the group is aborted and the job is either done too or (*abandoned) left to its thread,
 * which frees it. */
static ddpc_status window_job_wait(NcclImpl *im, WindowJob *j, int64_t deadline, int n,
                                   int *abandoned) {
    DdpcGroup *g = im->g;
    *abandoned = 0;
    char step[96];
    snprintf(step, sizeof step, "registering symmetric window #%d", n);
    ddpc_status st = wait_helper(g, &j->mu, &j->done, deadline, step);
    if (st == DDPC_OK) return DDPC_OK;
    char msg[1024];
    if (st == DDPC_ERR_TIMEOUT)
        snprintf(msg, sizeof msg, "rank %d (cuda:%d) did not finish %s within %.1f s: a peer never "
                 "registered its part (its output says why); DDPC_NCCL_WINDOW_MB=0 runs without "
                 "windows", g->rank, im->device, step, (double)g->timeout_ms / 1000.0);
    else
        snprintf(msg, sizeof msg, "%s", ddpc_last_error());
    request_abort(im, st, msg); /* its ncclCommAbort frees the registration */
    int64_t until = ddpc_now_ms() + WINDOW_ABANDON_MS;
    int done = 0;
    while (!done && ddpc_now_ms() < until) {
        sleep_us(POLL_MAX_US);
        pthread_mutex_lock(&j->mu);
        done = j->done;
        pthread_mutex_unlock(&j->mu);
    }
    pthread_mutex_lock(&j->mu);
    if (!j->done) {
        j->abandoned = *abandoned = 1;
        DDPC_INFO("NCCL", "rank %d: NCCL still holds symmetric window #%d's registration %d s "
                  "after the abort; its %zu bytes are lost", g->rank, n, WINDOW_ABANDON_MS / 1000,
                  j->bytes);
    }
    pthread_mutex_unlock(&j->mu);
    return ddpc_error(st, "%s", msg);
}

/* Every rank allocates with ncclMemAlloc, votes through the store whether it could (so that no
 * rank enters the registration, which waits for all, when another will not), then registers it
 * as a symmetric window (window_register_main). Posts queued by the posting thread go first, and
 * ddpc_group_window_alloc holds g->mu, so no other post comes in between: NCCL calls on one
 * communicator come from one thread at a time (comm_mu), in the same order on every rank. A
 * failure after this rank voted yes aborts the group: the peers may be registering already. */
static ddpc_status window_alloc_on(NcclImpl *im, void *arg) {
    WindowArgs *a = arg;
    DdpcGroup *g = im->g;
    int64_t deadline = ddpc_deadline(g->timeout_ms);
    char why[256] = "", name[64];
    pthread_mutex_lock(&im->mu);
    int n = im->nwindows_made++;
    pthread_mutex_unlock(&im->mu);
    void *ptr = NULL;
    int can = g_api.MemAlloc && g_api.MemFree && g_api.CommWindowRegister && g_code >= 22700;
    if (!can)
        snprintf(why, sizeof why, "NCCL %s has no symmetric windows: they need 2.27 or newer",
                 g_version);
    if (can) {
        ncclResult_t r = g_api.MemAlloc(&ptr, a->bytes);
        if (r != ncclSuccess) {
            (void)cudaGetLastError(); /* (a cudaMalloc fallback's error, not the caller's) */
            snprintf(why, sizeof why, "ncclMemAlloc of %zu bytes on cuda:%d failed: %s",
                     a->bytes, im->device, g_api.GetErrorString(r));
            ptr = NULL;
            can = 0;
        }
    }
    ddpc_status st = DDPC_OK;
    if (im->poster_started && (st = wait_posted(im, NULL)) != DDPC_OK) goto fail;
    snprintf(name, sizeof name, "nccl/window/%d", n);
    char others[512] = "";
    int all = 0;
    st = yes_vote(g, deadline, name, can, why, &all, others, sizeof others,
                  "could not allocate its part", "allocating a symmetric window with its peers");
    if (st != DDPC_OK) {
        /* The peers may have read every vote and gone on to register: they must learn that this
         * rank will not come. */
        char msg[1024];
        if (st == DDPC_ERR_TIMEOUT)
            snprintf(msg, sizeof msg, "rank %d timed out after %.1f s waiting for its peers to say "
                     "whether they could allocate symmetric window #%d (a peer stopped before, "
                     "its output says why); DDPC_NCCL_WINDOW_MB=0 runs without windows", g->rank,
                     (double)g->timeout_ms / 1000.0, n);
        else
            snprintf(msg, sizeof msg, "%s", ddpc_last_error());
        request_abort(im, st, msg);
        goto fail;
    }
    if (!all) {
        st = ddpc_error(DDPC_ERR_UNAVAILABLE, "symmetric window #%d (%zu bytes) on rank %d: %s",
                        n, a->bytes, g->rank, why[0] ? why : others);
        goto fail;
    }
    NcclWindow *w = calloc(1, sizeof *w);
    WindowJob *j = calloc(1, sizeof *j);
    int rc = ENOMEM;
    if (w && j) {
        pthread_mutex_init(&j->mu, NULL);
        j->im = im;
        j->ptr = ptr;
        j->bytes = a->bytes;
        pthread_t th;
        rc = ddpc_thread_start(&th, window_register_main, j, "ddpc-nccl-win", 1);
    }
    if (rc != 0) {
        if (j) window_job_free(j);
        free(w);
        st = ddpc_error(rc == ENOMEM ? DDPC_ERR_NOMEM : DDPC_ERR_SYSTEM, "registering symmetric "
                        "window #%d on rank %d: %s", n, g->rank,
                        rc == ENOMEM ? "out of host memory" : strerror(rc));
        request_abort(im, st, ddpc_last_error()); /* (the peers are about to register) */
        goto fail;
    }
    int abandoned = 0;
    st = window_job_wait(im, j, deadline, n, &abandoned);
    if (abandoned) { /* (its thread frees the job; the memory may still be NCCL's) */
        free(w);
        return st;
    }
    ncclResult_t r = j->r;
    int gone = j->gone, registered = !gone && j->cuda == cudaSuccess && r == ncclSuccess;
    cudaError_t ce = j->cuda;
    w->win = j->win;
    window_job_free(j);
    if (st == DDPC_OK && !registered) {
        if (gone)
            st = aborted_error(im, "registering a symmetric window");
        else if (ce != cudaSuccess)
            st = ddpc_error(DDPC_ERR_CUDA, "cudaSetDevice(%d) on the window thread failed: %s",
                            im->device, cudaGetErrorString(ce));
        else
            st = nccl_fail(r, "ncclCommWindowRegister", __FILE__, __LINE__);
        if (!gone) request_abort(im, st, ddpc_last_error()); /* the peers may wait inside it */
    }
    if (st != DDPC_OK && !registered) {
        free(w);
        goto fail;
    }
    /* Registered: kept with the group's windows even when the wait failed (the group is aborted
     * then), since NCCL may use the memory until the communicator is gone. */
    w->ptr = ptr;
    w->bytes = a->bytes;
    pthread_mutex_lock(&im->mu);
    w->next = im->windows;
    im->windows = w;
    pthread_mutex_unlock(&im->mu);
    if (st != DDPC_OK) return st;
    a->ptr = ptr;
    /* (NCCL registers nothing, and says so only by a NULL window, when the communicator has no
     * symmetric support: its ordinary kernels then reduce these buffers, with the same results) */
    DDPC_INFO("NCCL", "rank %d: symmetric window #%d, %zu bytes at %p%s", g->rank, n, a->bytes,
              ptr, w->win ? "" : ", but NCCL registered it without symmetric support");
    return DDPC_OK;
fail:
    if (ptr) {
        ncclResult_t fr = g_api.MemFree(ptr);
        if (fr != ncclSuccess)
            DDPC_INFO("NCCL", "ncclMemFree after a failed window failed: %s",
                      g_api.GetErrorString(fr));
    }
    return st;
}

static ddpc_status nccl_window_alloc(DdpcGroup *g, size_t bytes, void **out) {
    NcclImpl *im = g->impl;
    *out = NULL;
    if (!im) return no_impl(g);
    if (atomic_load(&g->aborted)) return aborted_error(im, "allocating a symmetric window");
    WindowArgs a = {.bytes = bytes};
    DDPC_CHECK(on_device(im, window_alloc_on, &a));
    *out = a.ptr;
    return DDPC_OK;
}

static ddpc_status trace_start_on(NcclImpl *im, void *arg) {
    DdpcTrace *t = NULL;
    DDPC_CHECK(ddpc_trace_create(*(size_t *)arg, &t));
    if (im->trace) {
        /* The posting thread may still record into the old one. */
        ddpc_status st = wait_posted(im, NULL);
        if (st != DDPC_OK) {
            ddpc_trace_free(t);
            return st;
        }
        ddpc_trace_free(im->trace);
    }
    im->trace = t;
    return DDPC_OK;
}

static ddpc_status nccl_trace_start(DdpcGroup *g, size_t capacity) {
    NcclImpl *im = g->impl;
    if (!im) return no_impl(g);
    return on_device(im, trace_start_on, &capacity);
}

static ddpc_status trace_mark_on(NcclImpl *im, void *arg) {
    uintptr_t stream = *(uintptr_t *)arg;
    DdpcTraceRec *r = ddpc_trace_take(im->trace, im->g->next_seq, -1, 0, 0, DDPC_TRACE_MARK, 0);
    ddpc_status st = ddpc_trace_record(r, DDPC_TRACE_READY, stream);
    if (st != DDPC_OK)
        ddpc_error_prefix(st, "a trace mark on rank %d (the stream must belong to cuda:%d): ",
                          im->g->rank, im->device);
    return st;
}

static ddpc_status nccl_trace_mark(DdpcGroup *g, uintptr_t stream) {
    NcclImpl *im = g->impl;
    if (!im) return no_impl(g);
    if (!im->trace)
        return ddpc_error(DDPC_ERR_INVALID, "no trace is on for this process group: start one "
                          "first (ddpc.comm_trace())");
    return on_device(im, trace_mark_on, &stream);
}

static ddpc_status nccl_trace_stop(DdpcGroup *g, void **detached) {
    NcclImpl *im = g->impl;
    if (!im) return no_impl(g);
    if (!im->trace)
        return ddpc_error(DDPC_ERR_INVALID, "no trace is on for this process group: start one "
                          "first (ddpc.comm_trace())");
    /* The posting thread records the points of the deferred posts: it must be done with them.
     * (Interrupted, the trace stays on, and a later stop or the group's end frees it.) */
    DDPC_CHECK(wait_posted(im, NULL));
    *detached = im->trace;
    im->trace = NULL;
    return DDPC_OK;
}

static ddpc_status trace_check(void *ctx) {
    DdpcGroup *g = ctx;
    ddpc_status st = ddpc_group_check_abort(g);
    if (st != DDPC_OK)
        ddpc_error_prefix(st, "the trace's collectives failed, so their times cannot be read: ");
    return st;
}

static ddpc_status nccl_trace_collect(DdpcGroup *g, void *detached, DdpcTraceRow **rows,
                                      size_t *n, uint64_t *dropped) {
    DdpcTrace *t = detached;
    ddpc_status st = ddpc_trace_collect(t, ddpc_deadline(g->timeout_ms), trace_check, g, rows, n,
                                        dropped);
    ddpc_trace_free(t);
    return st;
}

const DdpcBackendOps ddpc_backend_nccl = {
    .name = "nccl",
    .init = nccl_init,
    .post = nccl_post,
    .wait_stream = nccl_wait_stream,
    .all_reduce_now = nccl_all_reduce_now,
    .abort = nccl_abort_hook,
    .destroy = nccl_destroy,
    .work_free = nccl_work_free,
    .trace_start = nccl_trace_start,
    .trace_mark = nccl_trace_mark,
    .trace_stop = nccl_trace_stop,
    .trace_collect = nccl_trace_collect,
    .window_alloc = nccl_window_alloc,
    .wait_posted = nccl_wait_posted,
};

#else /* !DDPC_WITH_CUDA */

static ddpc_status nccl_init(DdpcGroup *g) {
    /* In this build this fails with the message that says how to get CUDA support. */
    ddpc_status st = ddpc_cuda_set_device(g->cuda_device);
    return st != DDPC_OK ? st : ddpc_error(DDPC_ERR_UNAVAILABLE, "this build has no CUDA support");
}

static ddpc_status nccl_post(DdpcGroup *g, DdpcWork *w) {
    (void)g;
    (void)w;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "this build of ddpc has no CUDA support");
}

static void nccl_destroy(DdpcGroup *g) { (void)g; }

const DdpcBackendOps ddpc_backend_nccl = {
    .name = "nccl",
    .init = nccl_init,
    .post = nccl_post,
    .destroy = nccl_destroy,
};

#endif
