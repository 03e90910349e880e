/* ddpc.h: the C core's own API. Python-free: module.c is its only CPython client, and the
 * plain-C unit tests in tests/c are the others. Every function returns a ddpc_status; on failure
 * the thread-local message from ddpc_last_error() says what happened and what to do. */
#ifndef DDPC_H
#define DDPC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status and errors */

typedef enum ddpc_status {
    DDPC_OK = 0,
    DDPC_ERR_INVALID = 1,     /* bad argument from the caller */
    DDPC_ERR_SYSTEM = 2,      /* an OS call failed (errno text in the message) */
    DDPC_ERR_TIMEOUT = 3,     /* a deadline passed */
    DDPC_ERR_PEER = 4,        /* a peer died, closed its connection or aborted the group */
    DDPC_ERR_AUTH = 5,        /* the store refused our token, or we refused a client */
    DDPC_ERR_MISMATCH = 6,    /* ranks disagree about a collective's arguments or a model */
    DDPC_ERR_CUDA = 7,
    DDPC_ERR_NCCL = 8,
    DDPC_ERR_UNAVAILABLE = 9, /* not built in, or a run-time library is missing */
    DDPC_ERR_INTERRUPTED = 10,/* the interrupt hook reported a pending signal (Ctrl-C) */
    DDPC_ERR_NOMEM = 11,
    DDPC_ERR_NOTFOUND = 12,   /* a store key does not exist (non-blocking lookups) */
    DDPC_ERR_PROTOCOL = 13,   /* a malformed message on a socket */
} ddpc_status;

/* The message of the last failure on this thread. Never NULL. */
const char *ddpc_last_error(void);
/* Formats the message for status st on this thread and returns st (so: return ddpc_error(...)). */
ddpc_status ddpc_error(ddpc_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Prepends context to the current message ("all_reduce #7: " + old message); returns st. */
ddpc_status ddpc_error_prefix(ddpc_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
const char *ddpc_status_name(ddpc_status st);

/* Blocking loops run in slices of at most DDPC_SLICE_MS and call ddpc_check_interrupt() between
 * slices, so a Python caller that released the GIL still sees Ctrl-C. The hook returns non-zero
 * when the wait must stop; module.c installs one that runs PyErr_CheckSignals. The hook is only
 * called on threads flagged with ddpc_thread_set_interruptible(1) (Python caller threads). */
#define DDPC_SLICE_MS 100
typedef int (*ddpc_interrupt_hook)(void);
void ddpc_set_interrupt_hook(ddpc_interrupt_hook hook);
void ddpc_thread_set_interruptible(int on);
/* DDPC_OK, or DDPC_ERR_INTERRUPTED with the message set. */
ddpc_status ddpc_check_interrupt(void);

/* Monotonic clock in nanoseconds / milliseconds. */
uint64_t ddpc_now_ns(void);
int64_t ddpc_now_ms(void);
/* Deadline helpers: timeout_ms < 0 means "no deadline" (INT64_MAX). */
int64_t ddpc_deadline(int64_t timeout_ms);
/* Milliseconds until deadline, clamped to [0, slice_ms]. */
int64_t ddpc_slice(int64_t deadline_ms, int64_t slice_ms);

/* DDPC_DEBUG=INFO|TRACE (off by default) prints "host:pid:tid ddpc SUBSYS msg" to stderr. */
enum { DDPC_LOG_NONE = 0, DDPC_LOG_INFO = 1, DDPC_LOG_TRACE = 2 };
int ddpc_log_level(void);
void ddpc_log(int level, const char *subsys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define DDPC_INFO(subsys, ...) \
    do { if (ddpc_log_level() >= DDPC_LOG_INFO) ddpc_log(DDPC_LOG_INFO, subsys, __VA_ARGS__); } while (0)
#define DDPC_TRACE(subsys, ...) \
    do { if (ddpc_log_level() >= DDPC_LOG_TRACE) ddpc_log(DDPC_LOG_TRACE, subsys, __VA_ARGS__); } while (0)

/* ---------------------------------------------------------------- dtypes and reductions */

typedef enum ddpc_dtype {
    DDPC_FLOAT32 = 0,
    DDPC_FLOAT64 = 1,
    DDPC_FLOAT16 = 2,
    DDPC_BFLOAT16 = 3,
    DDPC_INT32 = 4,
    DDPC_INT64 = 5,
    DDPC_UINT8 = 6,
    DDPC_INT8 = 7,
    DDPC_NUM_DTYPES = 8
} ddpc_dtype;

typedef enum ddpc_redop {
    DDPC_SUM = 0,
    DDPC_AVG = 1,
    DDPC_MIN = 2,
    DDPC_MAX = 3,
    DDPC_PROD = 4,
    /* Bitwise, of the integer dtypes only (as gloo's; NCCL has none): */
    DDPC_BAND = 5,
    DDPC_BOR = 6,
    DDPC_BXOR = 7,
    DDPC_NUM_REDOPS = 8
} ddpc_redop;

/* Is op one of the bitwise reductions (DDPC_BAND, DDPC_BOR, DDPC_BXOR)? */
#define DDPC_REDOP_BITWISE(op) ((op) >= DDPC_BAND && (op) <= DDPC_BXOR)

size_t ddpc_dtype_size(ddpc_dtype dt);   /* 0 for an unknown dtype */
const char *ddpc_dtype_name(ddpc_dtype dt);
const char *ddpc_redop_name(ddpc_redop op);

/* Host reductions (reduce.c): acc[i] = acc[i] (op) in[i] for n elements. AVG accumulates like SUM;
 * the caller divides once with ddpc_reduce_scale. Half types accumulate through float. */
ddpc_status ddpc_reduce_host(void *acc, const void *in, size_t n, ddpc_dtype dt, ddpc_redop op);
/* out[i] = in[0][i] (op) in[1][i] (op) ... in[nin-1][i], in input order; AVG then divides by nin
 * (integers: truncating). Half types accumulate all inputs in float and round once. out must not
 * overlap any input. */
ddpc_status ddpc_reduce_host_n(void *out, const void *const *in, int nin, size_t n,
                               ddpc_dtype dt, ddpc_redop op);
/* out[i] = in[i] / divisor, in place allowed (integers: truncating division, like torch). */
ddpc_status ddpc_reduce_scale(void *buf, size_t n, ddpc_dtype dt, int64_t divisor);
/* Element conversion between dtypes on the host (float types only, plus identity). */
ddpc_status ddpc_convert_host(void *dst, ddpc_dtype dst_dt, const void *src, ddpc_dtype src_dt,
                              size_t n);

/* ---------------------------------------------------------------- rendezvous store */

typedef struct DdpcStoreServer DdpcStoreServer;
typedef struct DdpcStore DdpcStore;

/* Serves the store on host:port (port 0: the kernel picks one; read it back with
 * ddpc_store_server_port). host NULL or "" means 127.0.0.1; "0.0.0.0" binds every interface and
 * must be asked for explicitly. token: the job secret every client must prove it knows. */
ddpc_status ddpc_store_server_start(const char *host, int port, const char *token,
                                    DdpcStoreServer **out);
int ddpc_store_server_port(const DdpcStoreServer *s);
void ddpc_store_server_stop(DdpcStoreServer *s);

/* Keys the store's server sets itself: the first registered rank whose connection dropped
 * without a clean close (its number), and why it refused a process that claimed a rank another
 * live connection holds. A rank that fails in init_process_group (ddpc.distributed) sets
 * DDPC_STORE_FAILED_PREFIX followed by its rank to its error's text, and
 * DDPC_STORE_FIRST_FAILED_KEY to its rank unless another rank did first, before it leaves. */
#define DDPC_STORE_FIRST_DEAD_KEY "ddpc/first_dead"
#define DDPC_STORE_REFUSED_KEY "ddpc/refused"
#define DDPC_STORE_FAILED_PREFIX "ddpc/failed/"
#define DDPC_STORE_FIRST_FAILED_KEY "ddpc/first_failed"

/* Connects (retrying while the server is not up yet, until timeout_ms), then authenticates.
 * rank >= 0 registers the connection as that rank: when it drops without a clean close, the
 * server sets the key "ddpc/dead/<rank>" so waiters learn at once that the rank is gone. */
ddpc_status ddpc_store_connect(const char *host, int port, const char *token, int rank,
                               int64_t timeout_ms, DdpcStore **out);
void ddpc_store_close(DdpcStore *c);
ddpc_status ddpc_store_set(DdpcStore *c, const char *key, const void *val, size_t len);
/* A set that does not wait for its reply: the request is sent (one send, no round trip) and the
 * reply is read by the next call on this connection, which fails if the store refused it. For
 * values of at most 4 KiB; at most 32 replies are left unread (the 33rd waits for them). */
ddpc_status ddpc_store_set_posted(DdpcStore *c, const char *key, const void *val, size_t len);
/* Waits until the key exists (or timeout_ms passes), then returns a malloc'd copy (free()). */
ddpc_status ddpc_store_get(DdpcStore *c, const char *key, int64_t timeout_ms, void **val,
                           size_t *len);
/* Adds delta to the integer stored at key (missing: 0) and returns the new value. */
ddpc_status ddpc_store_add(DdpcStore *c, const char *key, int64_t delta, int64_t *out);
/* If the key's value equals expected (missing key: expected_len == 0 and expected NULL), sets it to
 * desired. Returns the value now stored (malloc'd) either way. */
ddpc_status ddpc_store_cas(DdpcStore *c, const char *key, const void *expected, size_t expected_len,
                           const void *desired, size_t desired_len, void **cur, size_t *cur_len);
ddpc_status ddpc_store_delete(DdpcStore *c, const char *key, int *deleted);
/* *present = 1 when every key exists, without waiting. */
ddpc_status ddpc_store_check(DdpcStore *c, const char *const *keys, int nkeys, int *present);
/* Waits until every key exists. On timeout the message lists the keys still missing. */
ddpc_status ddpc_store_wait(DdpcStore *c, const char *const *keys, int nkeys, int64_t timeout_ms);
/* Number of keys held by the server (diagnostics and tests). */
ddpc_status ddpc_store_num_keys(DdpcStore *c, int64_t *out);

/* ---------------------------------------------------------------- process groups */

typedef struct DdpcGroup DdpcGroup;
typedef struct DdpcWork DdpcWork;

typedef enum ddpc_transport {
    DDPC_TRANSPORT_AUTO = 0, /* shared memory when every rank shares this host, else TCP */
    DDPC_TRANSPORT_SHM = 1,
    DDPC_TRANSPORT_TCP = 2,
} ddpc_transport;

typedef struct DdpcGroupConfig {
    int rank;
    int world_size;
    int local_rank;
    int local_world_size;
    const char *backend;     /* "cpu" or "nccl" */
    int64_t timeout_ms;      /* deadline for every collective and rendezvous step */
    DdpcStore *store;        /* borrowed: must outlive the group */
    const char *prefix;      /* store key namespace of this group, e.g. "g0" */
    ddpc_transport transport;/* cpu backend only */
    const char *host_id;     /* identifies this host (hostname + boot id); shm needs all equal */
    const char *bind_addr;   /* address TCP transport listens on (the rank's reachable address) */
    int cuda_device;         /* nccl backend: the bound device ordinal */
} DdpcGroupConfig;

typedef enum ddpc_coll {
    DDPC_COLL_ALLREDUCE = 0,
    DDPC_COLL_BROADCAST = 1,
    DDPC_COLL_ALLGATHER = 2,
    DDPC_COLL_REDUCE_SCATTER = 3,
    DDPC_COLL_BARRIER = 4,
    DDPC_NUM_COLLS = 5
} ddpc_coll;

/* One collective. count is elements per rank: all_reduce and broadcast work in place on recv
 * (send must be NULL or equal to recv); all_gather reads count elements from send and writes
 * world_size*count to recv; reduce_scatter reads world_size*count from send and writes count to
 * recv. device -1 is host memory; >= 0 is a CUDA ordinal (nccl backend), and stream is the
 * caller's cudaStream_t as an integer: the collective starts after the work already queued on it. */
typedef struct DdpcCollArgs {
    ddpc_coll op;
    const void *send;
    void *recv;
    size_t count;
    ddpc_dtype dtype;
    ddpc_redop redop;
    int root;
    int device;
    uintptr_t stream;
    /* Device work only, optional, each called with hook_ctx and the backend's communication
     * stream, inside ddpc_group_post: `before` once that stream is ordered after the caller's,
     * to queue work there that prepares the collective's input; `after` once the collective is
     * queued there, to queue work that uses its result (there, or on a stream ordered after it)
     * before the collective counts as done (waiting for the work covers the queueing). A failure
     * fails the post and aborts the group. (nccl: `before` on an all-reduce that takes the staged
     * path makes it wait for the collectives before it, which it otherwise overlaps.) The posts
     * of a group call their hooks one at a time, in posting order. A deferred post (below) calls
     * `after` on the backend's posting thread, outside any lock of the caller's. */
    ddpc_status (*before)(void *ctx, uintptr_t comm_stream);
    ddpc_status (*after)(void *ctx, uintptr_t comm_stream);
    void *hook_ctx;
    /* Device work only, without before: the post only marks the caller's stream position
     * and queues the collective; the backend issues it from its own thread, in posting order
     * (nccl: the posting thread, unless DDPC_NCCL_POST_THREAD=0). For a caller on the host path
     * that feeds the GPU (the reducer's buckets during backward): the library call that launches
     * the collective (tens of microseconds, more on the staged path) leaves that path. The
     * buffers must stay valid until the work is done, as for any post. */
    int defer;
} DdpcCollArgs;

const char *ddpc_coll_name(ddpc_coll op);

ddpc_status ddpc_group_create(const DdpcGroupConfig *cfg, DdpcGroup **out);
/* Aborts outstanding work, tells peers this rank left cleanly, frees everything. */
void ddpc_group_destroy(DdpcGroup *g);
int ddpc_group_rank(const DdpcGroup *g);
int ddpc_group_size(const DdpcGroup *g);
const char *ddpc_group_backend(const DdpcGroup *g);
/* Which transport the cpu backend chose ("shm", "tcp"), or "nccl". */
const char *ddpc_group_transport(const DdpcGroup *g);
int64_t ddpc_group_timeout_ms(const DdpcGroup *g);
/* Marks the group failed with a message that every later call on any rank reports (it is
 * published in the store so peers blocked in a collective raise it too). */
void ddpc_group_abort(DdpcGroup *g, ddpc_status st, const char *why);

/* Validates args, assigns the next sequence number, and queues the collective. *out is a new
 * reference; release it with ddpc_work_release. Works complete in posting order. */
ddpc_status ddpc_group_post(DdpcGroup *g, const DdpcCollArgs *args, DdpcWork **out);
/* Waits until the thread that issues deferred posts (nccl) is done with every post queued so far:
 * issued it and ran its `before`/`after` work, or dropped it after an abort. A work can be
 * complete (an abort completes every work) while that thread still runs its `after` work, which
 * may use memory its poster is about to free. Interruptible; nothing to wait for elsewhere. */
ddpc_status ddpc_group_wait_posted(DdpcGroup *g);
/* Waits until every collective posted so far on this rank has finished or failed (each within
 * its deadline; interruptibly): destroy_process_group calls it first, so a collective posted
 * with async_op=True and never waited for still lands. Backends whose work runs on a device
 * stream (nccl) have nothing to wait for here. */
ddpc_status ddpc_group_wait_idle(DdpcGroup *g);
/* A synchronous all-reduce queued on args->stream without a work, when the backend has a path
 * for it (nccl: small messages between the GPUs of one host). *ran = 0: nothing was done, post
 * it instead. The next sequence number is used only when it ran. */
ddpc_status ddpc_group_all_reduce_now(DdpcGroup *g, const DdpcCollArgs *args, int *ran);
/* The largest message ddpc_group_all_reduce_now takes, in bytes (0: it takes none). */
size_t ddpc_group_fast_max_bytes(const DdpcGroup *g);
/* The smallest all-reduce that takes the nccl backend's staged copy-engine path (0: none). */
size_t ddpc_group_staged_min_bytes(const DdpcGroup *g);
/* How many collectives so far a backend thread issued for their caller (DdpcCollArgs.defer);
 * 0 on the cpu backend, which has no such thread. */
uint64_t ddpc_group_deferred_count(DdpcGroup *g);
/* Collective (every rank, in the same order, with the same size): `bytes` of device memory from
 * ncclMemAlloc on this rank's GPU, registered with the group's communicator as a symmetric
 * window (NCCL 2.27 or newer), where NCCL's all-reduce runs its symmetric kernels (sum only):
 * they read the peers' memory directly instead of staging through NCCL's buffers. The memory
 * lives until the group is destroyed. DDPC_ERR_UNAVAILABLE on every rank when any rank could
 * not allocate it (the cpu backend, an older NCCL, out of memory), with the reason. */
ddpc_status ddpc_group_window_alloc(DdpcGroup *g, size_t bytes, void **out);

/* The device timeline of a group's collectives (nccl backend): while a trace is on, each
 * collective records CUDA events at five points, and a mark records one on a given stream.
 *   READY    the caller's stream reached the post (its input is complete there)
 *   START    the communication stream began it (behind the collectives before it)
 *   WIRE     its input prepared there (the post's `before` work, e.g. a cast: else = START)
 *   REDUCED  the collective itself finished (NCCL's kernel, or the staged path's last step)
 *   DONE     the post's `after` work finished too (else = REDUCED)
 * One-shot all-reduces run on the caller's stream: READY = START = WIRE, REDUCED = DONE. */
enum {
    DDPC_TRACE_READY = 0,
    DDPC_TRACE_START = 1,
    DDPC_TRACE_WIRE = 2,
    DDPC_TRACE_REDUCED = 3,
    DDPC_TRACE_DONE = 4,
    DDPC_TRACE_POINTS = 5
};
typedef enum ddpc_trace_path {
    DDPC_TRACE_MARK = 0,    /* a mark, not a collective */
    DDPC_TRACE_NCCL = 1,
    DDPC_TRACE_STAGED = 2,  /* the copy-engine path through host memory */
    DDPC_TRACE_ONESHOT = 3, /* the one-shot kernel for small all-reduces */
} ddpc_trace_path;
typedef struct DdpcTraceRow {
    uint64_t seq;           /* the collective's sequence number (a mark's: the next one's) */
    int op;                 /* ddpc_coll, -1 for a mark */
    int dtype;              /* ddpc_dtype */
    size_t count;           /* elements per rank */
    int path;               /* ddpc_trace_path */
    int deferred;           /* issued by the posting thread */
    /* milliseconds after the trace's first mark (or its first event); a mark has only
     * ms[DDPC_TRACE_READY]; the other points of a mark, and points never recorded, are NaN */
    double ms[DDPC_TRACE_POINTS];
} DdpcTraceRow;
/* Starts a trace of room for `capacity` rows (collectives and marks; later ones are counted as
 * dropped), replacing one already on. Only the nccl backend traces: others fail, saying so. */
ddpc_status ddpc_group_trace_start(DdpcGroup *g, size_t capacity);
/* Records a mark on `stream` (a cudaStream_t of the group's device). Fails with no trace on. */
ddpc_status ddpc_group_trace_mark(DdpcGroup *g, uintptr_t stream);
/* Ends the trace: waits (in slices, interruptibly, at most the group's timeout) for every
 * recorded event, then returns the rows in recording order (*rows malloc'd, free() it; NULL
 * when *n is 0) and how many did not fit. */
ddpc_status ddpc_group_trace_stop(DdpcGroup *g, DdpcTraceRow **rows, size_t *n,
                                  uint64_t *dropped);

/* Blocks (interruptibly, in slices) until the work is done or its deadline passes. For device
 * work this waits for the host side only when host is set; otherwise see ddpc_work_wait_stream. */
ddpc_status ddpc_work_wait(DdpcWork *w);
/* Device work: makes `stream` wait for the collective (an event, no host sync). Host work: same
 * as ddpc_work_wait. */
ddpc_status ddpc_work_wait_stream(DdpcWork *w, uintptr_t stream);
/* 1 when finished (successfully or not), 0 while in flight. Never blocks. */
int ddpc_work_is_completed(DdpcWork *w);
/* 1 once the work has completed with an error (its wait raises it), else 0. */
int ddpc_work_failed(DdpcWork *w);
uint64_t ddpc_work_seq(const DdpcWork *w);
void ddpc_work_retain(DdpcWork *w);
void ddpc_work_release(DdpcWork *w);

/* ---------------------------------------------------------------- gradient reducer */

typedef struct DdpcReducer DdpcReducer;

/* Parameters 0..nparams-1 in registration order. Buckets group parameters by (dtype, device) in
 * `order` (a permutation; NULL: reverse registration order); the first bucket of each group holds
 * at most first_bucket_bytes, later ones bucket_cap_bytes (a parameter larger than the cap gets a
 * bucket of its own). Each slot starts on a 16-byte boundary; the padding stays zero. late[i] != 0
 * (late may be NULL) puts parameter i in buckets of their own, ordered after all others, that are
 * launched only by ddpc_reducer_finalize: for parameters whose gradient is accumulated more than
 * once per backward (a weight reused across reentrant checkpoint segments), or for every parameter
 * while their ready order is still unknown. comm_dtype < 0: reduce in each bucket's own dtype;
 * else cast to it (float16 or bfloat16) for the wire and back. */
ddpc_status ddpc_reducer_create(DdpcGroup *g, int nparams, const size_t *numels,
                                const ddpc_dtype *dtypes, const int *devices, const int *order,
                                const uint8_t *late, size_t first_bucket_bytes,
                                size_t bucket_cap_bytes, int comm_dtype, DdpcReducer **out);
/* Waits for collectives still in flight (their memory belongs to the caller), then frees. The
 * group must still exist. */
void ddpc_reducer_destroy(DdpcReducer *r);
int ddpc_reducer_num_buckets(const DdpcReducer *r);
/* Bucket b: its dtype, device and element count (the caller allocates memory of that size). */
ddpc_status ddpc_reducer_bucket_info(const DdpcReducer *r, int b, ddpc_dtype *dtype, int *device,
                                     size_t *count);
/* The dtype bucket b's comm_buf must have, or -1 when the bucket needs none (no comm_dtype, or
 * the bucket already has that dtype). */
int ddpc_reducer_bucket_comm_dtype(const DdpcReducer *r, int b);
/* Where parameter i's gradient lives: bucket and element offset. */
ddpc_status ddpc_reducer_param_slot(const DdpcReducer *r, int i, int *bucket, size_t *offset);
/* Gives bucket b its flat buffer (count elements; owned by the caller). Allowed between steps,
 * and within one while none of b's gradients was written into it (marked ready in its slot).
 * A bucket reduced in another dtype also needs its wire buffer: ddpc_reducer_set_bucket_wire. */
ddpc_status ddpc_reducer_set_bucket_memory(DdpcReducer *r, int b, void *buf);
/* The caller takes bucket b's memory back (same rules as set_bucket_memory), e.g. while its
 * gradients are set to None; it must give memory again before they are marked ready or the step
 * is finalized. */
ddpc_status ddpc_reducer_release_bucket(DdpcReducer *r, int b);
/* Starts a step: every parameter not ready, no bucket launched. Calling it again before any
 * parameter became ready is harmless. When the previous step was left unfinished (parameters were
 * marked ready but finalize never ran), waits for its collectives, resets, and fails once with a
 * message saying so: that step's gradients were not averaged. */
ddpc_status ddpc_reducer_prepare(DdpcReducer *r);
/* Parameter i's gradient is complete in its bucket slot. stream: the device stream that wrote it
 * (0 on host). Launches every bucket that is now complete and whose predecessors are launched.
 * Marking a parameter again is counted (ready_count) and harmless until its bucket is launched;
 * after that it fails, because the gradient changed while it was being reduced. */
ddpc_status ddpc_reducer_mark_ready(DdpcReducer *r, int i, uintptr_t stream);
/* ddpc_reducer_mark_ready after copying parameter i's gradient into its slot: src holds its
 * numel dense elements of its dtype, on the bucket's device (host memory for host buckets); the
 * copy is ordered on stream, before the bucket's collective. */
ddpc_status ddpc_reducer_mark_ready_copy(DdpcReducer *r, int i, const void *src,
                                         uintptr_t stream);
/* Marks parameter i ready given its gradient at src (dense, its dtype, the bucket's device),
 * which stays the parameter's gradient: when its bucket is reduced in another dtype and has a
 * wire buffer, src is cast straight into the wire and finalize writes the averaged values back
 * to src (*direct = 1; the bucket's own memory is not needed for it, and src must stay alive
 * and in place until finalize returns). Otherwise as mark_ready_copy (*direct = 0: the caller
 * points the gradient at the slot). */
ddpc_status ddpc_reducer_mark_ready_grad(DdpcReducer *r, int i, const void *src,
                                         uintptr_t stream, int *direct);
/* Gives bucket b its wire buffer (count elements of the comm dtype), or takes it back (NULL). A
 * bucket reduced in another dtype needs it from its first gradient of a step to the end of
 * finalize, and it may not change while the bucket is in use. */
ddpc_status ddpc_reducer_set_bucket_wire(DdpcReducer *r, int b, void *comm_buf);
/* Bucket b's wire is summed rather than averaged (summed 1; 0: averaged, the default), and the
 * cast back divides by the world size: for a wire in an NCCL symmetric window
 * (ddpc_group_window_alloc), whose kernels only sum. A device wire bucket only; not while the
 * bucket is in use. */
ddpc_status ddpc_reducer_set_bucket_summed(DdpcReducer *r, int b, int summed);
/* What parameter i's bucket has now, read in one go (0 for an index out of range). */
#define DDPC_PARAM_HAS_MEMORY 1 /* memory: given and not released since (or nothing to hold) */
#define DDPC_PARAM_WIRE_BUCKET 2 /* reduced in another dtype, through a wire buffer */
#define DDPC_PARAM_HAS_WIRE 4   /* that wire buffer is given: mark_ready_grad casts into it */
int ddpc_reducer_param_state(DdpcReducer *r, int i);
/* 1 when ddpc_reducer_mark_ready(r, i, ...) would launch a collective now (it then does work
 * that is worth releasing the GIL for), 0 when it only records. A hint: never fails. */
int ddpc_reducer_mark_would_launch(DdpcReducer *r, int i);
/* Writes the parameters not marked ready so far this step to out (room for nparams) and returns
 * how many there are. */
int ddpc_reducer_unready(DdpcReducer *r, int *out);
/* End of backward: zeroes the slots of parameters that were never marked ready, launches the
 * remaining buckets in order, and waits for all (device: makes `stream` wait, no host sync).
 * *unused receives the number of parameters that were unused this step. */
ddpc_status ddpc_reducer_finalize(DdpcReducer *r, uintptr_t stream, int *unused);
/* The order in which parameters became ready in the last finished step (nparams entries; -1 for
 * those never ready), and how many times each was marked ready. */
ddpc_status ddpc_reducer_observed_order(const DdpcReducer *r, int *order, int *ready_count);
/* The parameters whose gradient was copied into its slot (queued on the device) since the last
 * call, into out (room for every parameter); returns how many. A gradient to be copied waits for
 * the rest of its bucket's: until its parameter is listed here, the caller keeps the gradient
 * alive and .grad on it. */
int ddpc_reducer_take_flushed(DdpcReducer *r, int *out);
/* Host time (ns) since the last reset spent in: [0] marking gradients ready (their copies or
 * casts into the bucket or wire, queued on the device), [1] launching buckets (casts and posting
 * the collective). For the wrapper's host_times() diagnostic. */
void ddpc_reducer_host_times(DdpcReducer *r, uint64_t out[2], int reset);

/* ---------------------------------------------------------------- distributed sampler */

/* Fills out with the indices rank `rank` of `replicas` reads in one epoch, exactly like
 * torch.utils.data.DistributedSampler (shuffle: one permutation per (seed, epoch), identical on
 * every rank, process and machine, but not torch's own permutation; padding repeats from the
 * front; drop_last trims). pad=0 gives the exact split with no duplicated sample (rank lengths may
 * differ by one); drop_last=1 with pad=0 is DDPC_ERR_INVALID. *n_out receives the count; out must
 * hold ddpc_sampler_num_samples(...) entries. Large shuffles run on up to 8 threads
 * (DDPC_SAMPLER_THREADS overrides); the result never depends on the thread count.
 * ddpc_sampler_num_samples returns -1 for invalid arguments, with the message set. */
int64_t ddpc_sampler_num_samples(int64_t length, int replicas, int rank, int drop_last, int pad);
ddpc_status ddpc_sampler_indices(int64_t length, int replicas, int rank, int shuffle,
                                 uint64_t seed, uint64_t epoch, int drop_last, int pad,
                                 int64_t *out, int64_t *n_out);
/* A buffer for count indices; large ones are mapped with a transparent-huge-page hint, which
 * makes first touch several times cheaper. Free with ddpc_sampler_free(buf, the same count). */
ddpc_status ddpc_sampler_alloc(int64_t count, int64_t **out);
void ddpc_sampler_free(int64_t *buf, int64_t count);

/* ---------------------------------------------------------------- CUDA (kernels.cu, comm_nccl.c) */

/* 1 when this build has CUDA support compiled in. */
int ddpc_cuda_built(void);
/* Number of visible devices (0 without a driver or GPUs; never fails on a CPU-only machine). */
int ddpc_cuda_device_count(void);
/* Binds the calling thread (and the process's primary context) to device `dev`. */
ddpc_status ddpc_cuda_set_device(int dev);
/* Loads NCCL (dlopen) if not yet loaded; the message says where it looked when it fails. */
ddpc_status ddpc_nccl_load(char *version, size_t version_len);
/* Device helpers for the reducer (kernels.cu; DDPC_ERR_UNAVAILABLE in a CPU-only build). All are
 * queued on `stream` (a cudaStream_t as an integer) and checked with cudaGetLastError. */
ddpc_status ddpc_device_zero(void *ptr, size_t bytes, uintptr_t stream);
/* Work queued on `waiter` from now on runs after the work queued on `signaler` so far (an event,
 * never a host sync); nothing when they are the same stream. */
ddpc_status ddpc_device_stream_wait(uintptr_t waiter, uintptr_t signaler);
/* A stream of ddpc's own on the current device: non-blocking, at the greatest priority (its
 * work goes ahead of the caller's kernels when both are ready); *out is its cudaStream_t as an
 * integer. ddpc_device_stream_destroy lets it go (work queued there still completes). */
ddpc_status ddpc_device_stream_create(uintptr_t *out);
void ddpc_device_stream_destroy(uintptr_t stream);
/* Waits on the host until the work queued on `stream` is done, polling so that it stays
 * interruptible and gives up with an error after timeout_ms (< 0: never) rather than hang behind
 * a collective that never ends. */
ddpc_status ddpc_device_stream_finish(uintptr_t stream, int64_t timeout_ms);
/* dst[i] = (dst_dt)(src[i] * scale) for float32/float16/bfloat16/float64 pairs. */
ddpc_status ddpc_device_cast(void *dst, ddpc_dtype dst_dt, const void *src, ddpc_dtype src_dt,
                             size_t n, float scale, uintptr_t stream);
/* dsts[k][i] = (dst_dt)srcs[k][i] for i < counts[k], k < n: many casts between one pair of float
 * dtypes in a few launches (the reducer's wire slots back into separate gradients). Pairs must
 * not overlap; a zero count is skipped. */
ddpc_status ddpc_device_cast_many(int n, void *const *dsts, ddpc_dtype dst_dt,
                                  const void *const *srcs, ddpc_dtype src_dt,
                                  const size_t *counts, uintptr_t stream);
/* The same, each element multiplied by scale on the way (in the wider of the two dtypes): the
 * reducer's casts back from a wire that NCCL summed rather than averaged. */
ddpc_status ddpc_device_cast_many_scaled(int n, void *const *dsts, ddpc_dtype dst_dt,
                                         const void *const *srcs, ddpc_dtype src_dt,
                                         const size_t *counts, float scale, uintptr_t stream);
/* dst[i] = (dst[i] + srcs[0][i] + ... + srcs[nsrc-1][i]) / div for the float dtypes, summed in
 * float (double for float64) and rounded once; div 1 is a plain sum. At most
 * DDPC_DEVICE_REDUCE_MAX_SRCS sources, none overlapping dst. */
#define DDPC_DEVICE_REDUCE_MAX_SRCS 7
ddpc_status ddpc_device_reduce_into(void *dst, const void *const *srcs, int nsrc, ddpc_dtype dt,
                                    size_t n, int div, uintptr_t stream);
/* The embedding rows' end of backward (python/ddpc/_rows.py): for every run of equal ids in
 * sorted_ids[0..n) (ascending), grad[id, :] += scale * (the sum over the run, in order, of
 * rows[perm[k], :], or rows[k, :] when perm is NULL); grad is num_rows x width, rows is
 * (max perm + 1) x width. Ids < 0, == skip or >= num_rows are left out. One launch; the result
 * depends only on the inputs (no atomics). */
ddpc_status ddpc_device_rows_accumulate(void *grad, ddpc_dtype grad_dt, size_t num_rows,
                                        size_t width, const int64_t *sorted_ids,
                                        const int64_t *perm, size_t n, const void *rows,
                                        ddpc_dtype rows_dt, int64_t skip, double scale,
                                        uintptr_t stream);
/* A stable sort of one lookup's n indices (each in [0, num_rows): those outside sort
 * anywhere), in one launch of one block: sorted[k] is the k-th smallest, perm[k] its position in
 * ids (equal indices keep their order). For n <= DDPC_DEVICE_SORT_IDS_MAX; a larger lookup needs
 * another sort (torch.sort). */
#define DDPC_DEVICE_SORT_IDS_MAX 8192
ddpc_status ddpc_device_sort_ids(const int64_t *ids, size_t n, size_t num_rows, int64_t *sorted,
                                 int64_t *perm, uintptr_t stream);

/* One rank's part of the embedding rows' all-gather: for j < cap, ids_out[j] = sorted_ids[j]
 * (-1 for j >= n) and rows_out[j, :] = src[perm[j], :] (src[j, :] when perm is NULL; zeros when
 * src is NULL) in wire_dt; rows j >= n are left as they are. n <= cap; one launch. */
ddpc_status ddpc_device_rows_pack(void *ids_out, void *rows_out, ddpc_dtype wire_dt, size_t cap,
                                  size_t width, const int64_t *sorted_ids, const int64_t *perm,
                                  size_t n, const void *src, ddpc_dtype src_dt, uintptr_t stream);

/* ---------------------------------------------------------------- embedding rows (rows.c) */

/* The end of backward of one routed embedding lookup (python/ddpc/_rows.py), on the nccl
 * backend: every rank's sorted indices and lookup-gradient rows, all-gathered and added, divided
 * by the world size, into the table's averaged gradient. */
typedef struct DdpcRowsExchange {
    void *grad;                 /* the table's gradient: num_rows x width, contiguous */
    ddpc_dtype grad_dtype;
    size_t num_rows, width;
    const int64_t *sorted_ids;  /* this rank's n indices, ascending */
    const int64_t *perm;        /* the positions that sort them (NULL: already in order) */
    size_t n;
    const void *src;            /* the lookup output's gradient, n x width (NULL: none reached
                                 * the lookup on this rank, which then adds nothing) */
    ddpc_dtype src_dtype;
    ddpc_dtype wire_dtype;      /* the rows' dtype in the all-gather */
    size_t cap;                 /* the largest n of any rank: every rank's part has cap slots */
    void *buf;                  /* world * ddpc_rows_stride(...) bytes of device memory */
    size_t buf_bytes;
    int64_t skip;               /* the embedding's padding_idx (-1: none): never added */
    int device;
    uintptr_t stream;           /* the caller's stream: the exchange is queued on it */
} DdpcRowsExchange;

/* Bytes of one rank's part: cap int64 indices, then cap rows of wire_dt, rounded up to 8. */
size_t ddpc_rows_stride(size_t cap, size_t width, ddpc_dtype wire_dt);
/* Queues on x->stream: this rank's part packed into its place in buf, one in-place all-gather,
 * then one accumulation per rank in rank order (every rank adds the same values the same way).
 * The host does not wait. *out is the all-gather's work whenever it was posted (also when a later
 * step failed): buf must stay allocated until it is done. */
ddpc_status ddpc_rows_exchange(DdpcGroup *g, const DdpcRowsExchange *x, DdpcWork **out);

/* ---------------------------------------------------------------- settings */

/* The DDPC_* environment settings (csrc/settings.c): every one ddpc reads is in its table, and
 * every reader goes through these, so a value means the same everywhere and one that is not a
 * setting is refused (DDPC_ERR_INVALID, with what it takes) instead of meaning the default.
 * Unset or "" gives dflt. */
ddpc_status ddpc_setting_flag(const char *name, int dflt, int *out);   /* 1/0, true/false, ... */
ddpc_status ddpc_setting_uint(const char *name, uint64_t dflt, uint64_t *out); /* in its range */
ddpc_status ddpc_setting_number(const char *name, double dflt, double *out);   /* in its range */
ddpc_status ddpc_setting_choice(const char *name, int *out); /* index of its value; 0: default */
/* A setting's kind and, when it is set, its checked value. */
enum {
    DDPC_SETTING_FLAG,     /* index: 1 or 0 */
    DDPC_SETTING_UINT,     /* whole */
    DDPC_SETTING_NUMBER,   /* number */
    DDPC_SETTING_CHOICE,   /* index into its values, text: the value as the table spells it */
    DDPC_SETTING_LOGLEVEL, /* index: DDPC_LOG_NONE/INFO/TRACE */
    DDPC_SETTING_TEXT      /* text, checked where it is used */
};
typedef struct {
    int kind;
    int set;             /* 0: unset or "" (the rest is 0) */
    int index;
    unsigned long long whole;
    double number;
    const char *text;    /* the environment's string (a choice: the table's) */
} DdpcSettingValue;
ddpc_status ddpc_setting_get(const char *name, DdpcSettingValue *out);
/* Whether `value` (NULL or "": unset) is one for the setting `name`, whatever its kind. */
ddpc_status ddpc_setting_check_value(const char *name, const char *value);
/* Every setting's value in the environment: the first that is not one. */
ddpc_status ddpc_settings_check(void);
int ddpc_setting_count(void);
const char *ddpc_setting_name(int i); /* NULL past the end */
const char *ddpc_setting_about(int i);
/* Whether NCCL_P2P_DISABLE and NCCL_P2P_LEVEL, as NCCL reads them, turn P2P off between every
 * pair of GPUs: NCCL_P2P_DISABLE that reads as the number 1 ("true" leaves P2P on), or else
 * NCCL_P2P_LEVEL=LOC (or 0). why (NULL: not wanted) gets the setting that does it, as
 * "NAME=value". ddpc_nccl_p2p_off takes the values (NULL: unset); the other reads the
 * environment. */
int ddpc_nccl_p2p_off(const char *disable, const char *level, char *why, size_t len);
int ddpc_nccl_p2p_disabled(char *why, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* DDPC_H */
