/* trace.h: the rows of a collectives trace (ddpc_group_trace_* in ddpc.h) and their CUDA events.
 * comm_nccl.c owns the trace of a group and decides when each point is recorded; this file keeps
 * the rows, records the events and turns them into milliseconds. CUDA builds only.
 *
 * Threads: rows are taken under the group's lock (every post holds it). A taken row's events may
 * be recorded later by the nccl backend's posting thread, which is why a trace is only detached
 * (and then collected and freed) once that thread has issued everything posted before. */
#ifndef DDPC_TRACE_H
#define DDPC_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "ddpc.h"

#ifdef DDPC_WITH_CUDA

typedef struct DdpcTrace DdpcTrace;
typedef struct DdpcTraceRec DdpcTraceRec;

/* Room for `capacity` rows, with their events made up front (on the current device), so that
 * recording adds no allocation to a traced step. */
ddpc_status ddpc_trace_create(size_t capacity, DdpcTrace **out);
void ddpc_trace_free(DdpcTrace *t);

/* The next row, or NULL when the trace is full (the row is counted as dropped). */
DdpcTraceRec *ddpc_trace_take(DdpcTrace *t, uint64_t seq, int op, int dtype, size_t count,
                              int path, int deferred);
void ddpc_trace_set_path(DdpcTraceRec *r, int path);
/* Records point `point` (DDPC_TRACE_*) of the row on `stream`. r may be NULL (not traced). */
ddpc_status ddpc_trace_record(DdpcTraceRec *r, int point, uintptr_t stream);

/* Waits for every recorded event, in slices until `deadline_ms` (ddpc_now_ms clock), giving up
 * early when check() fails (the group's abort, Ctrl-C), then fills the rows: milliseconds after
 * the first mark (or the first event recorded). Does not free t. */
ddpc_status ddpc_trace_collect(DdpcTrace *t, int64_t deadline_ms, ddpc_status (*check)(void *),
                               void *check_ctx, DdpcTraceRow **rows, size_t *n,
                               uint64_t *dropped);

#endif /* DDPC_WITH_CUDA */

#endif /* DDPC_TRACE_H */
