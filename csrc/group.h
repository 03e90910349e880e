/* group.h: what group.c shares with the backends (comm_cpu.c, comm_nccl.c): the group and work
 * structs and the backend table. Not part of the public C API (ddpc.h). */
#ifndef DDPC_GROUP_H
#define DDPC_GROUP_H

#include <pthread.h>
#include <stdatomic.h>

#include "common.h"

struct DdpcWork {
    atomic_int refs;
    DdpcGroup *g;
    DdpcCollArgs args;
    uint64_t seq;           /* 1-based, identical on every rank for the same collective */
    /* When the timeout runs out (ddpc_now_ms() clock), so deadline_ms - g->timeout_ms is when it
     * began counting: at post, or, for a backend with deadline_from_start, at ddpc_work_begin
     * (INT64_MAX until then). Atomic: the waiting thread reads what the backend's thread sets. */
    _Atomic int64_t deadline_ms;
    int64_t posted_ms;      /* ddpc_now_ms() at the post */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int stall_noted; /* ddpc_group_note_stall said it waits too long */
    atomic_int done;        /* 1 once status/msg are final */
    ddpc_status status;
    char *msg;              /* malloc'd copy of the failure message (set before done) */
    void *backend_data;     /* backend's per-work state (e.g. CUDA events); freed by backend */
    struct DdpcWork *next;  /* backend queue link */
};

typedef struct DdpcBackendOps {
    const char *name;
    /* 1 (cpu): a work's timeout counts from when the backend starts executing it, as gloo's does,
     * so a long queue of async works does not run out the clock of the last ones; the backend
     * calls ddpc_work_begin then. 0 (nccl): from the post, as torch's NCCL watchdog counts from
     * the enqueue (the GPU, not ddpc, decides when a queued kernel starts). */
    int deadline_from_start;
    /* Sets g->impl and g->transport; may use the store for rendezvous. */
    ddpc_status (*init)(DdpcGroup *g);
    /* Takes a reference to w (ddpc_work_retain) and queues it; the backend calls
     * ddpc_work_complete exactly once when it finishes (or fails). */
    ddpc_status (*post)(DdpcGroup *g, DdpcWork *w);
    /* Optional: device-side ordering of `stream` after w (nccl). NULL: host wait. */
    ddpc_status (*wait_stream)(DdpcWork *w, uintptr_t stream);
    /* Optional: a synchronous all-reduce queued on the caller's stream without a work (nccl's
     * one-shot path for small messages). *ran = 0: not taken, post it instead. */
    ddpc_status (*all_reduce_now)(DdpcGroup *g, const DdpcCollArgs *a, uint64_t seq, int *ran);
    /* Optional: called from ddpc_group_abort, e.g. to wake waiters or abort a communicator. */
    void (*abort)(DdpcGroup *g);
    /* Stops threads, frees g->impl. Outstanding works are completed with an error first. */
    void (*destroy)(DdpcGroup *g);
    /* Optional: frees w->backend_data when the last reference goes. */
    void (*work_free)(DdpcWork *w);
    /* Optional, all three or none (nccl): ddpc_group_trace_*, called with g->mu held. Stop
     * detaches the trace under it and returns it in *detached; trace_collect then waits for its
     * events and frees it without the lock. */
    ddpc_status (*trace_start)(DdpcGroup *g, size_t capacity);
    ddpc_status (*trace_mark)(DdpcGroup *g, uintptr_t stream);
    ddpc_status (*trace_stop)(DdpcGroup *g, void **detached);
    ddpc_status (*trace_collect)(DdpcGroup *g, void *detached, DdpcTraceRow **rows, size_t *n,
                                 uint64_t *dropped);
    /* Optional (nccl): ddpc_group_window_alloc. */
    ddpc_status (*window_alloc)(DdpcGroup *g, size_t bytes, void **out);
    /* Optional (nccl): ddpc_group_wait_posted. */
    ddpc_status (*wait_posted)(DdpcGroup *g);
    /* Optional (cpu): ddpc_group_wait_idle. */
    ddpc_status (*wait_idle)(DdpcGroup *g);
} DdpcBackendOps;

struct DdpcGroup {
    int rank, world, local_rank, local_world;
    int64_t timeout_ms;
    /* How long past a collective's timeout its waiter trusts the backend to report it (30 s):
     * past that, the backend has stopped answering and the wait fails on its own. */
    int64_t grace_ms;
    /* deadline_from_start backends: when a work last began or ended (ddpc_now_ms clock). Every
     * work ends by its own timeout, so with works queued this moves at least once per timeout
     * unless the backend's thread is stuck (ddpc_group_backend_stuck). */
    _Atomic int64_t progress_ms;
    int64_t stall_ms;       /* DDPC_STALL_WARN: note a collective waiting this long (0: never) */
    DdpcStore *store;
    char prefix[128];
    char host_id[256];
    char bind_addr[256];
    ddpc_transport want_transport;
    int cuda_device;
    char transport[16];     /* set by the backend's init: "shm", "tcp", "nccl" */
    size_t fast_max_bytes;  /* set by the backend's init: all_reduce_now's limit (0: none) */
    size_t staged_min_bytes;/* nccl: all-reduces from this size use the staged path (0: none) */
    atomic_ullong n_deferred; /* nccl: works the posting thread issued (ddpc_group_deferred_count) */
    const DdpcBackendOps *ops;
    void *impl;
    pthread_mutex_t mu;     /* guards next_seq */
    /* Held around ops->abort and while a backend's destroy takes impl away, so an abort coming
     * from another thread never runs on a freed impl. Nothing else is locked under it. */
    pthread_mutex_t impl_mu;
    uint64_t next_seq;
    atomic_int aborted;
    atomic_int refs;        /* 1 for the owner + 1 per live work: works may outlive destroy */
    ddpc_status abort_status;
    char abort_msg[2048];
};

extern const DdpcBackendOps ddpc_backend_cpu;
extern const DdpcBackendOps ddpc_backend_nccl;

/* For a backend with deadline_from_start: w starts executing now, and its timeout (and the stall
 * note's clock) with it. */
void ddpc_work_begin(DdpcWork *w);

/* For a wait on a deadline_from_start backend's queue: has it begun or ended no work since
 * `since_ms` (or its last progress, if later) for the timeout plus grace_ms? Then it has stopped
 * answering: the works before the ones waited for each end by their own timeout. */
int ddpc_group_backend_stuck(DdpcGroup *g, int64_t since_ms);

/* Records the outcome of w and wakes its waiters. st != DDPC_OK: the message is taken from
 * ddpc_last_error() of the calling thread. */
void ddpc_work_complete(DdpcWork *w, ddpc_status st);

/* Runs the backend's abort hook under impl_mu. */
void ddpc_group_call_abort_hook(DdpcGroup *g);
/* For a backend's destroy: sets g->impl to NULL under impl_mu, after which no abort hook can be
 * looking at the old impl (hooks read g->impl first and return when it is NULL). Call it before
 * freeing the impl, and not from inside an abort hook. */
void ddpc_group_take_impl(DdpcGroup *g);

/* This rank's host identity: the one given to init (host_id), else ddpc_default_host_id. */
void ddpc_group_host_id(const DdpcGroup *g, char *buf, size_t len);
/* Store key of this group: "<prefix>/<name>". */
void ddpc_group_key(const DdpcGroup *g, char *buf, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* For a collective that timed out: publishes how far this rank got, gives the other ranks a
 * moment to do the same, and writes into buf the ranks that never arrived at collective `seq`
 * (or died: the store's "ddpc/dead/<r>" keys), e.g. "rank 1 never arrived (it is at #6)". */
void ddpc_group_describe_missing(DdpcGroup *g, uint64_t seq, char *buf, size_t len);

/* For a wait loop's slow checks: once w has waited g->stall_ms for the other ranks, prints one
 * line to stderr saying so (where, for whom, when it gives up), so a stuck job says what it
 * waits for long before its timeout. `what` names the collective ("all_reduce #12"). */
void ddpc_group_note_stall(DdpcGroup *g, DdpcWork *w, const char *what);
/* Whether ddpc_group_note_stall would print now (so a caller formats `what` only then). */
int ddpc_group_stall_due(const DdpcGroup *g, DdpcWork *w);

/* What set this group's timeout, for a hint: "init_process_group" (the default group) or
 * "new_group". */
const char *ddpc_group_timeout_owner(const DdpcGroup *g);

/* DDPC_OK, or the abort status with the abort message (ours or published by a peer; the store is
 * polled at most every DDPC_SLICE_MS, so call this between wait slices). */
ddpc_status ddpc_group_check_abort(DdpcGroup *g);

/* Same as ddpc_group_check_abort, plus: is rank r known dead (its store connection dropped)? */
int ddpc_group_rank_dead(DdpcGroup *g, int r);

/* For a wait of group creation, between slices: 1 with the reason in buf when the group can no
 * longer be made because a rank of the job died (with the error it published, when it failed in
 * init_process_group) or the store refused a process claiming a rank another holds (a node
 * started with another --nproc-per-node); 0 otherwise. Two store checks when nothing failed. */
int ddpc_group_init_failure(DdpcGroup *g, char *buf, size_t len);

#endif /* DDPC_GROUP_H */
