/* trace.c: the rows and CUDA events of a collectives trace (see trace.h). */
#include "trace.h"

#ifdef DDPC_WITH_CUDA

#include <math.h>
#include <stdlib.h>
#include <time.h>

#include "common.h"

struct DdpcTraceRec {
    DdpcTraceRow row;                  /* everything but ms, which collect fills */
    cudaEvent_t ev[DDPC_TRACE_POINTS]; /* with timing: made by create, destroyed by free */
    unsigned recorded;                 /* bit p: point p was recorded */
};

struct DdpcTrace {
    size_t cap, n;
    uint64_t dropped;
    DdpcTraceRec *recs;
};

void ddpc_trace_free(DdpcTrace *t) {
    if (!t) return;
    for (size_t i = 0; i < t->cap; i++)
        for (int p = 0; p < DDPC_TRACE_POINTS; p++)
            if (t->recs[i].ev[p]) (void)cudaEventDestroy(t->recs[i].ev[p]);
    free(t->recs);
    free(t);
}

ddpc_status ddpc_trace_create(size_t capacity, DdpcTrace **out) {
    *out = NULL;
    if (capacity > (size_t)1 << 20)
        return ddpc_error(DDPC_ERR_INVALID, "a trace of %zu rows is too large (each holds five "
                          "CUDA events): trace at most 1048576, a few steps need a few hundred",
                          capacity);
    DdpcTrace *t = calloc(1, sizeof *t);
    DdpcTraceRec *recs = calloc(capacity, sizeof *recs);
    if (!t || !recs) {
        free(t);
        free(recs);
        return ddpc_error(DDPC_ERR_NOMEM, "out of host memory for a trace of %zu rows", capacity);
    }
    t->recs = recs;
    t->cap = capacity;
    for (size_t i = 0; i < capacity; i++) {
        for (int p = 0; p < DDPC_TRACE_POINTS; p++) {
            cudaError_t e = cudaEventCreateWithFlags(&recs[i].ev[p], cudaEventDefault);
            if (e != cudaSuccess) {
                recs[i].ev[p] = NULL;
                ddpc_trace_free(t);
                return ddpc_error(DDPC_ERR_CUDA, "creating the trace's CUDA events failed: %s "
                                  "(%s)", cudaGetErrorName(e), cudaGetErrorString(e));
            }
        }
    }
    *out = t;
    return DDPC_OK;
}

DdpcTraceRec *ddpc_trace_take(DdpcTrace *t, uint64_t seq, int op, int dtype, size_t count,
                              int path, int deferred) {
    if (t->n == t->cap) {
        t->dropped++;
        return NULL;
    }
    DdpcTraceRec *r = &t->recs[t->n++];
    r->row.seq = seq;
    r->row.op = op;
    r->row.dtype = dtype;
    r->row.count = count;
    r->row.path = path;
    r->row.deferred = deferred;
    r->recorded = 0;
    return r;
}

void ddpc_trace_set_path(DdpcTraceRec *r, int path) {
    if (r) r->row.path = path;
}

ddpc_status ddpc_trace_record(DdpcTraceRec *r, int point, uintptr_t stream) {
    if (!r) return DDPC_OK;
    cudaError_t e = cudaEventRecord(r->ev[point], (cudaStream_t)stream);
    if (e != cudaSuccess)
        return ddpc_error(DDPC_ERR_CUDA, "recording a trace event failed: %s (%s)",
                          cudaGetErrorName(e), cudaGetErrorString(e));
    r->recorded |= 1u << point;
    return DDPC_OK;
}

/* Waits for ev in slices (200 us apart: a trace is read after a step, not inside one). */
static ddpc_status wait_event(cudaEvent_t ev, int64_t deadline_ms, ddpc_status (*check)(void *),
                              void *ctx) {
    for (;;) {
        cudaError_t e = cudaEventQuery(ev);
        if (e == cudaSuccess) return DDPC_OK;
        if (e != cudaErrorNotReady)
            return ddpc_error(DDPC_ERR_CUDA, "waiting for a trace event failed: %s (%s)",
                              cudaGetErrorName(e), cudaGetErrorString(e));
        if (ddpc_now_ms() >= deadline_ms)
            return ddpc_error(DDPC_ERR_TIMEOUT, "the traced collectives did not finish within "
                              "the group's timeout, so their times cannot be read");
        if (check) DDPC_CHECK(check(ctx));
        DDPC_CHECK(ddpc_check_interrupt());
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 200000L};
        nanosleep(&ts, NULL);
    }
}

ddpc_status ddpc_trace_collect(DdpcTrace *t, int64_t deadline_ms, ddpc_status (*check)(void *),
                               void *check_ctx, DdpcTraceRow **rows, size_t *n,
                               uint64_t *dropped) {
    *rows = NULL;
    *n = 0;
    *dropped = t->dropped;
    cudaEvent_t ref = NULL;
    for (size_t i = 0; i < t->n && !ref; i++)
        if (t->recs[i].row.path == DDPC_TRACE_MARK && (t->recs[i].recorded & 1u))
            ref = t->recs[i].ev[DDPC_TRACE_READY];
    for (size_t i = 0; i < t->n; i++) {
        for (int p = 0; p < DDPC_TRACE_POINTS; p++) {
            if (!(t->recs[i].recorded & (1u << p))) continue;
            DDPC_CHECK(wait_event(t->recs[i].ev[p], deadline_ms, check, check_ctx));
            if (!ref) ref = t->recs[i].ev[p];
        }
    }
    if (t->n == 0) return DDPC_OK;
    DdpcTraceRow *out = malloc(t->n * sizeof *out);
    if (!out) return ddpc_error(DDPC_ERR_NOMEM, "out of host memory reading a trace");
    for (size_t i = 0; i < t->n; i++) {
        out[i] = t->recs[i].row;
        for (int p = 0; p < DDPC_TRACE_POINTS; p++) {
            out[i].ms[p] = NAN;
            if (!(t->recs[i].recorded & (1u << p))) continue;
            float ms = 0.0f;
            cudaError_t e = cudaEventElapsedTime(&ms, ref, t->recs[i].ev[p]);
            if (e != cudaSuccess) {
                free(out);
                return ddpc_error(DDPC_ERR_CUDA, "reading a trace event's time failed: %s (%s)",
                                  cudaGetErrorName(e), cudaGetErrorString(e));
            }
            out[i].ms[p] = ms;
        }
    }
    *rows = out;
    *n = t->n;
    return DDPC_OK;
}

#endif /* DDPC_WITH_CUDA */
