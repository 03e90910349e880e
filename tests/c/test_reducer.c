/* test_reducer.c: unit test of the gradient reducer's logic (csrc/reducer.c) against a fake
 * process group that records every collective and, on wait, averages the bucket with a peer
 * whose gradient is 1.0 everywhere. Built and run by tests/test_wrap_model.py. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddpc.h"
#include "check.h"

/* ---------------------------------------------------------------- fake group */

struct DdpcGroup {
    int rank;
};

struct DdpcWork {
    uint64_t seq;
    DdpcCollArgs args;
    int refs;
    int done;
    int launches; /* device launches logged before it was posted */
};

#define MAX_LAUNCH 256
static uintptr_t g_launch_stream[MAX_LAUNCH];
static int g_nlaunch;

#define MAX_LOG 64
static DdpcWork *g_log[MAX_LOG];
static int g_nlog;
static uint64_t g_seq;

/* Device work (device >= 0, its "device" memory host memory here) is reduced at once, as the
 * collective runs in stream order, and then its `then` runs on the fake communication stream. */
enum { COMM_STREAM = 99 };

ddpc_status ddpc_work_wait(DdpcWork *w);

/* >= 0: the post that would be logged at this index fails, as a collective NCCL refused would. */
static int g_fail_post_at = -1;
/* How often the reducer waited for the posting thread to be done with its posts. */
static int g_wait_posted_calls;

ddpc_status ddpc_group_wait_posted(DdpcGroup *g) {
    (void)g;
    g_wait_posted_calls++;
    return DDPC_OK;
}

/* The aborts the reducer asked for: how many, and the last one's status and reason. */
static int g_aborts;
static ddpc_status g_abort_status;
static char g_abort_why[512];

void ddpc_group_abort(DdpcGroup *g, ddpc_status st, const char *why) {
    (void)g;
    g_aborts++;
    g_abort_status = st;
    snprintf(g_abort_why, sizeof g_abort_why, "%s", why);
    ddpc_error(DDPC_ERR_INVALID, "fake group: abort published"); /* as the store's may */
}

ddpc_status ddpc_group_post(DdpcGroup *g, const DdpcCollArgs *args, DdpcWork **out) {
    (void)g;
    if (g_nlog == MAX_LOG) return ddpc_error(DDPC_ERR_INVALID, "fake group: log full");
    if (g_nlog == g_fail_post_at)
        return ddpc_error(DDPC_ERR_NCCL, "fake group: post %d refused", g_nlog);
    DdpcWork *w = calloc(1, sizeof *w);
    if (!w) return ddpc_error(DDPC_ERR_NOMEM, "fake group: out of memory");
    w->seq = ++g_seq;
    w->args = *args;
    w->launches = g_nlaunch;
    w->refs = 2; /* the caller's and the log's */
    g_log[g_nlog++] = w;
    if (args->device >= 0) {
        ddpc_status st = args->before ? args->before(args->hook_ctx, COMM_STREAM) : DDPC_OK;
        if (st == DDPC_OK) ddpc_work_wait(w);
        if (st == DDPC_OK && args->after) st = args->after(args->hook_ctx, COMM_STREAM);
        if (st != DDPC_OK) {
            g_nlog--;
            free(w);
            return st;
        }
    }
    *out = w;
    return DDPC_OK;
}

/* All-reduces of at least this many bytes take the (pretended) staged path; 0: none do. */
static size_t g_staged_min;
size_t ddpc_group_staged_min_bytes(const DdpcGroup *g) {
    (void)g;
    return g_staged_min;
}

/* The pretended other rank contributes 1 to every element: an average gives (x + 1) / 2, a sum
 * (a summed wire bucket's) x + 1. */
ddpc_status ddpc_work_wait(DdpcWork *w) {
    if (!w->done) {
        w->done = 1;
        float div = w->args.redop == DDPC_SUM ? 1.0f : 2.0f;
        if (w->args.dtype == DDPC_FLOAT32) {
            float *p = w->args.recv;
            for (size_t i = 0; i < w->args.count; i++) p[i] = (p[i] + 1.0f) / div;
        } else if (w->args.dtype == DDPC_FLOAT64) {
            double *p = w->args.recv;
            for (size_t i = 0; i < w->args.count; i++) p[i] = (p[i] + 1.0) / 2.0;
        } else if (w->args.dtype == DDPC_BFLOAT16) {
            for (size_t i = 0; i < w->args.count; i++) {
                uint16_t *e = (uint16_t *)w->args.recv + i;
                float x;
                ddpc_convert_host(&x, DDPC_FLOAT32, e, DDPC_BFLOAT16, 1);
                x = (x + 1.0f) / div;
                ddpc_convert_host(e, DDPC_BFLOAT16, &x, DDPC_FLOAT32, 1);
            }
        }
    }
    return DDPC_OK;
}

ddpc_status ddpc_work_wait_stream(DdpcWork *w, uintptr_t stream) {
    (void)stream;
    return ddpc_work_wait(w);
}

void ddpc_work_release(DdpcWork *w) {
    if (w && --w->refs == 0) free(w);
}

uint64_t ddpc_work_seq(const DdpcWork *w) { return w->seq; }
int ddpc_group_rank(const DdpcGroup *g) { return g->rank; }
int64_t ddpc_group_timeout_ms(const DdpcGroup *g) {
    (void)g;
    return 1000;
}
int ddpc_group_size(const DdpcGroup *g) {
    (void)g;
    return 2; /* (this rank and the pretended other one) */
}

/* The device helpers, on host memory: each launch is logged with its stream (g_launch_stream,
 * above). */

static uintptr_t g_fail_stream; /* nonzero: launches on this stream fail, as a bad launch would */

static ddpc_status log_launch(uintptr_t s) {
    if (g_fail_stream && s == g_fail_stream)
        return ddpc_error(DDPC_ERR_CUDA, "fake: launch on stream %lu failed", (unsigned long)s);
    if (g_nlaunch == MAX_LAUNCH) return ddpc_error(DDPC_ERR_INVALID, "fake: launch log full");
    g_launch_stream[g_nlaunch++] = s;
    return DDPC_OK;
}

ddpc_status ddpc_device_zero(void *p, size_t b, uintptr_t s) {
    memset(p, 0, b);
    return log_launch(s);
}
/* A cast with a scale, into float32 only (the reducer's casts back from a summed wire). */
static ddpc_status scale_after(void *d, ddpc_dtype dd, size_t n, float sc) {
    if (sc == 1.0f) return DDPC_OK;
    if (dd != DDPC_FLOAT32)
        return ddpc_error(DDPC_ERR_INVALID, "fake: scaled casts into %s are not faked",
                          ddpc_dtype_name(dd));
    for (size_t i = 0; i < n; i++) ((float *)d)[i] *= sc;
    return DDPC_OK;
}

ddpc_status ddpc_device_cast(void *d, ddpc_dtype dd, const void *s, ddpc_dtype sd, size_t n,
                             float sc, uintptr_t st) {
    ddpc_status e = ddpc_convert_host(d, dd, s, sd, n);
    if (e == DDPC_OK) e = scale_after(d, dd, n, sc);
    return e != DDPC_OK ? e : log_launch(st);
}

ddpc_status ddpc_device_cast_many(int n, void *const *d, ddpc_dtype dd, const void *const *s,
                                  ddpc_dtype sd, const size_t *c, uintptr_t st) {
    for (int k = 0; k < n; k++) {
        ddpc_status e = ddpc_convert_host(d[k], dd, s[k], sd, c[k]);
        if (e != DDPC_OK) return e;
    }
    return n ? log_launch(st) : DDPC_OK;
}

ddpc_status ddpc_device_cast_many_scaled(int n, void *const *d, ddpc_dtype dd,
                                         const void *const *s, ddpc_dtype sd, const size_t *c,
                                         float sc, uintptr_t st) {
    for (int k = 0; k < n; k++) {
        ddpc_status e = ddpc_convert_host(d[k], dd, s[k], sd, c[k]);
        if (e == DDPC_OK) e = scale_after(d[k], dd, c[k], sc);
        if (e != DDPC_OK) return e;
    }
    return n ? log_launch(st) : DDPC_OK;
}

/* The stream waits asked for, in order (waiter, signaler). */
#define MAX_WAITS 64
static uintptr_t g_waits[MAX_WAITS][2];
static int g_nwaits;

ddpc_status ddpc_device_stream_wait(uintptr_t waiter, uintptr_t signaler) {
    if (g_nwaits < MAX_WAITS) {
        g_waits[g_nwaits][0] = waiter;
        g_waits[g_nwaits][1] = signaler;
        g_nwaits++;
    }
    return DDPC_OK;
}

/* The reducer's own streams: each made is BACK_STREAM; how many were made and let go. */
enum { BACK_STREAM = 77 };
static int g_streams_made, g_streams_destroyed;

ddpc_status ddpc_device_stream_create(uintptr_t *out) {
    g_streams_made++;
    *out = BACK_STREAM;
    return DDPC_OK;
}

void ddpc_device_stream_destroy(uintptr_t stream) {
    if (stream == BACK_STREAM) g_streams_destroyed++;
}

/* The streams whose work the host waited for, in order. */
static uintptr_t g_finished[MAX_WAITS];
static int g_nfinished;

ddpc_status ddpc_device_stream_finish(uintptr_t stream, int64_t timeout_ms) {
    (void)timeout_ms;
    if (g_nfinished < MAX_WAITS) g_finished[g_nfinished++] = stream;
    return DDPC_OK;
}

static void clear_log(void) {
    for (int i = 0; i < g_nlog; i++) ddpc_work_release(g_log[i]);
    g_nlog = 0;
}

static DdpcGroup g_group = {0};

/* 6 float32 parameters of 1000 elements (4000 bytes): first bucket 5000 bytes, cap 9000. */
static void test_assignment_and_launch_order(void) {
    size_t numels[6] = {1000, 1000, 1000, 1000, 1000, 1000};
    ddpc_dtype dts[6] = {0};
    int devs[6] = {-1, -1, -1, -1, -1, -1};
    DdpcReducer *r = NULL;
    OK(ddpc_reducer_create(&g_group, 6, numels, dts, devs, NULL, NULL, 5000, 9000, -1, &r));
    if (!r) return;
    /* reverse order: {5} (first bucket), {4,3}, {2,1}, {0} */
    EXPECT(ddpc_reducer_num_buckets(r) == 4, "got %d buckets", ddpc_reducer_num_buckets(r));
    int b;
    size_t off;
    OK(ddpc_reducer_param_slot(r, 5, &b, &off));
    EXPECT(b == 0 && off == 0, "param 5 in bucket %d at %zu", b, off);
    OK(ddpc_reducer_param_slot(r, 3, &b, &off));
    EXPECT(b == 1 && off == 1000, "param 3 in bucket %d at %zu", b, off);
    OK(ddpc_reducer_param_slot(r, 0, &b, &off));
    EXPECT(b == 3 && off == 0, "param 0 in bucket %d at %zu", b, off);
    float *mem[4];
    for (int k = 0; k < 4; k++) {
        ddpc_dtype dt;
        int dev;
        size_t count;
        OK(ddpc_reducer_bucket_info(r, k, &dt, &dev, &count));
        mem[k] = calloc(count, sizeof(float));
        for (size_t i = 0; i < count; i++) mem[k][i] = 3.0f;
        OK(ddpc_reducer_set_bucket_memory(r, k, mem[k]));
    }
    OK(ddpc_reducer_prepare(r));
    /* Bucket 1 completes first but must wait for bucket 0. */
    OK(ddpc_reducer_mark_ready(r, 4, 0));
    EXPECT(ddpc_reducer_mark_would_launch(r, 3) == 0, "bucket 1 launched before bucket 0");
    OK(ddpc_reducer_mark_ready(r, 3, 0));
    EXPECT(g_nlog == 0, "%d collectives posted before bucket 0 was complete", g_nlog);
    OK(ddpc_reducer_mark_ready(r, 4, 0)); /* again, before launch: only counted */
    EXPECT(ddpc_reducer_mark_would_launch(r, 5) == 1, "param 5 should launch buckets 0 and 1");
    OK(ddpc_reducer_mark_ready(r, 5, 0));
    EXPECT(g_nlog == 2, "expected buckets 0 and 1 launched, got %d collectives", g_nlog);
    if (g_nlog == 2) {
        EXPECT(g_log[0]->args.recv == mem[0] && g_log[1]->args.recv == mem[1],
               "buckets launched out of order");
        EXPECT(g_log[0]->args.op == DDPC_COLL_ALLREDUCE && g_log[0]->args.redop == DDPC_AVG,
               "not an averaging all_reduce");
    }
    g_aborts = 0;
    EXPECT(ddpc_reducer_mark_ready(r, 4, 0) == DDPC_ERR_INVALID,
           "a gradient arriving after its bucket was launched must fail");
    /* a mistake of the model's, which every rank may make alike: the caller's error, no abort */
    EXPECT(g_aborts == 0, "the late gradient aborted the group: %s", g_abort_why);
    int unready[6];
    int nu = ddpc_reducer_unready(r, unready);
    EXPECT(nu == 3 && unready[0] == 0 && unready[1] == 1 && unready[2] == 2, "unready %d", nu);
    OK(ddpc_reducer_mark_ready(r, 1, 0));
    /* params 0 and 2 unused: zeroed, then averaged with the peer's 1.0 */
    int unused = -1;
    OK(ddpc_reducer_finalize(r, 0, &unused));
    EXPECT(unused == 2, "unused = %d", unused);
    EXPECT(g_nlog == 4, "expected 4 collectives, got %d", g_nlog);
    EXPECT(mem[0][0] == 2.0f && mem[1][1999] == 2.0f, "used grads not averaged: %g %g",
           mem[0][0], mem[1][1999]);
    OK(ddpc_reducer_param_slot(r, 2, &b, &off));
    EXPECT(mem[b][off] == 0.5f && mem[b][off + 999] == 0.5f, "unused param 2: %g",
           mem[b][off]);
    OK(ddpc_reducer_param_slot(r, 1, &b, &off));
    EXPECT(mem[b][off] == 2.0f, "used param 1 (same bucket as 2): %g", mem[b][off]);
    EXPECT(mem[3][0] == 0.5f, "unused param 0: %g", mem[3][0]);
    int order[6], counts[6];
    OK(ddpc_reducer_observed_order(r, order, counts));
    EXPECT(order[0] == 4 && order[1] == 3 && order[2] == 5 && order[3] == 1 && order[4] == -1,
           "observed order %d %d %d %d %d", order[0], order[1], order[2], order[3], order[4]);
    EXPECT(counts[4] == 3 && counts[5] == 1 && counts[0] == 0, "counts %d %d %d", counts[4],
           counts[5], counts[0]);
    EXPECT(ddpc_reducer_finalize(r, 0, &unused) == DDPC_ERR_INVALID, "second finalize accepted");
    EXPECT(ddpc_reducer_mark_ready(r, 0, 0) == DDPC_ERR_INVALID, "mark_ready outside a step");
    clear_log();
    /* An unfinished step is reported once by the next prepare, which resets. */
    OK(ddpc_reducer_prepare(r));
    OK(ddpc_reducer_prepare(r)); /* nothing marked yet: harmless */
    OK(ddpc_reducer_mark_ready(r, 5, 0));
    EXPECT(ddpc_reducer_prepare(r) == DDPC_ERR_INVALID, "unfinished step not reported");
    EXPECT(strstr(ddpc_last_error(), "did not finish") != NULL, "message: %s", ddpc_last_error());
    EXPECT(g_nlog == 1 && g_log[0]->done, "the launched collective was not waited for");
    OK(ddpc_reducer_prepare(r));
    clear_log();
    ddpc_reducer_destroy(r);
    for (int k = 0; k < 4; k++) free(mem[k]);
}

/* A given order, late parameters, two dtypes, slot alignment, a parameter above the cap. */
static void test_order_late_dtypes(void) {
    size_t numels[5] = {3, 5, 10000, 7, 2};
    ddpc_dtype dts[5] = {DDPC_FLOAT32, DDPC_FLOAT64, DDPC_FLOAT32, DDPC_FLOAT32, DDPC_FLOAT64};
    int devs[5] = {-1, -1, -1, -1, -1};
    int order[5] = {0, 1, 2, 3, 4};
    uint8_t late[5] = {0, 0, 0, 1, 0};
    DdpcReducer *r = NULL;
    OK(ddpc_reducer_create(&g_group, 5, numels, dts, devs, order, late, 1000, 1000, -1, &r));
    if (!r) return;
    /* f32 {0}, f64 {1,4}, f32 {2} (too big for the open bucket: its own), late f32 {3} */
    EXPECT(ddpc_reducer_num_buckets(r) == 4, "got %d buckets", ddpc_reducer_num_buckets(r));
    int b;
    size_t off;
    OK(ddpc_reducer_param_slot(r, 4, &b, &off));
    EXPECT(b == 1 && off == 6, "param 4 (f64 after 5 f64, 16-byte aligned) in %d at %zu", b, off);
    OK(ddpc_reducer_param_slot(r, 2, &b, &off));
    EXPECT(b == 2 && off == 0, "param 2 in %d at %zu", b, off);
    OK(ddpc_reducer_param_slot(r, 3, &b, &off));
    EXPECT(b == 3, "late param 3 in bucket %d, expected the last", b);
    void *mem[4];
    for (int k = 0; k < 4; k++) {
        ddpc_dtype dt;
        int dev;
        size_t count;
        OK(ddpc_reducer_bucket_info(r, k, &dt, &dev, &count));
        EXPECT(ddpc_reducer_bucket_comm_dtype(r, k) == -1, "no comm dtype requested");
        mem[k] = calloc(count, ddpc_dtype_size(dt));
        OK(ddpc_reducer_set_bucket_memory(r, k, mem[k]));
    }
    OK(ddpc_reducer_prepare(r));
    for (int i = 0; i < 5; i++) OK(ddpc_reducer_mark_ready(r, i, 0));
    EXPECT(g_nlog == 3, "the late bucket launched during backward (%d collectives)", g_nlog);
    OK(ddpc_reducer_mark_ready(r, 3, 0)); /* late: a second gradient is fine */
    int unused = -1;
    OK(ddpc_reducer_finalize(r, 0, &unused));
    EXPECT(unused == 0 && g_nlog == 4, "unused %d, %d collectives", unused, g_nlog);
    if (g_nlog == 4) EXPECT(g_log[3]->args.recv == mem[3], "late bucket not launched last");
    clear_log();
    ddpc_reducer_destroy(r);
    for (int k = 0; k < 4; k++) free(mem[k]);
}

/* mark_ready_copy: the gradient lands in its slot (padding and neighbours untouched) before the
 * bucket launches; a second gradient after the launch is refused and copies nothing. */
static void test_mark_ready_copy(void) {
    size_t numels[2] = {3, 5};
    ddpc_dtype dts[2] = {DDPC_FLOAT32, DDPC_FLOAT32};
    int devs[2] = {-1, -1};
    int order[2] = {0, 1};
    DdpcReducer *r = NULL;
    OK(ddpc_reducer_create(&g_group, 2, numels, dts, devs, order, NULL, 1000, 1000, -1, &r));
    if (!r) return;
    ddpc_dtype dt;
    int dev, b0, b1;
    size_t count, off0, off1;
    OK(ddpc_reducer_bucket_info(r, 0, &dt, &dev, &count));
    OK(ddpc_reducer_param_slot(r, 0, &b0, &off0));
    OK(ddpc_reducer_param_slot(r, 1, &b1, &off1));
    EXPECT(ddpc_reducer_num_buckets(r) == 1 && b0 == 0 && b1 == 0, "one bucket expected");
    float *mem = malloc(count * sizeof(float));
    for (size_t k = 0; k < count; k++) mem[k] = -7.0f; /* uninitialized memory, made visible */
    EXPECT(ddpc_reducer_param_state(r, 0) == 0, "state %d before memory was given",
           ddpc_reducer_param_state(r, 0));
    OK(ddpc_reducer_set_bucket_memory(r, 0, mem));
    EXPECT(ddpc_reducer_param_state(r, 0) == DDPC_PARAM_HAS_MEMORY, "state %d of a float32 "
           "bucket with memory", ddpc_reducer_param_state(r, 0));
    OK(ddpc_reducer_prepare(r));
    float g0[3] = {1, 2, 3}, g1[5] = {4, 5, 6, 7, 8};
    EXPECT(ddpc_reducer_mark_ready_copy(r, 0, NULL, 0) == DDPC_ERR_INVALID, "NULL source");
    int flushed[2] = {-1, -1};
    float stale[3] = {-1, -1, -1};
    OK(ddpc_reducer_mark_ready_copy(r, 0, stale, 0));
    /* the same gradient again before the launch (accumulated out of place): the newest goes */
    OK(ddpc_reducer_mark_ready_copy(r, 0, g0, 0));
    EXPECT(g_nlog == 0, "launched before the bucket was complete");
    /* the copies wait for the bucket, to go in one batch; .grad stays on the source till then */
    EXPECT(mem[off0] == -7.0f, "slot 0 written before the bucket was complete");
    EXPECT(ddpc_reducer_take_flushed(r, flushed) == 0, "copied before the bucket was complete");
    OK(ddpc_reducer_mark_ready_copy(r, 1, g1, 0));
    EXPECT(g_nlog == 1, "%d collectives after the bucket was complete", g_nlog);
    int nf = ddpc_reducer_take_flushed(r, flushed);
    EXPECT(nf == 2 && ((flushed[0] == 0 && flushed[1] == 1) || (flushed[0] == 1 &&
                                                                flushed[1] == 0)),
           "%d parameters reported copied (%d %d)", nf, flushed[0], flushed[1]);
    EXPECT(ddpc_reducer_take_flushed(r, flushed) == 0, "reported copied twice");
    for (int k = 0; k < 3; k++)
        EXPECT(mem[off0 + k] == g0[k], "slot 0[%d] = %g", k, (double)mem[off0 + k]);
    for (int k = 0; k < 5; k++)
        EXPECT(mem[off1 + k] == g1[k], "slot 1[%d] = %g", k, (double)mem[off1 + k]);
    float again[3] = {9, 9, 9};
    EXPECT(ddpc_reducer_mark_ready_copy(r, 0, again, 0) == DDPC_ERR_INVALID &&
               strstr(ddpc_last_error(), "already being reduced"),
           "a gradient after the launch was accepted: %s", ddpc_last_error());
    EXPECT(mem[off0] == 1.0f, "the refused gradient was copied");
    int unused = -1;
    OK(ddpc_reducer_finalize(r, 0, &unused));
    EXPECT(unused == 0, "unused %d", unused);
    clear_log();

    /* a gradient queued for copying that then lies in its slot (the Python path copied a newer
     * one there) goes from the slot: the queued copy is dropped */
    OK(ddpc_reducer_prepare(r));
    OK(ddpc_reducer_mark_ready_copy(r, 0, stale, 0));
    for (int k = 0; k < 3; k++) mem[off0 + k] = 5.0f;
    OK(ddpc_reducer_mark_ready(r, 0, 0));
    OK(ddpc_reducer_mark_ready_copy(r, 1, g1, 0));
    nf = ddpc_reducer_take_flushed(r, flushed);
    EXPECT(nf == 1 && flushed[0] == 1, "%d reported copied (%d)", nf, flushed[0]);
    OK(ddpc_reducer_finalize(r, 0, &unused));
    EXPECT(mem[off0] == 3.0f && mem[off1] == 2.5f, "slot 0 %g (5 averaged: 3), slot 1 %g",
           (double)mem[off0], (double)mem[off1]);
    clear_log();
    ddpc_reducer_destroy(r);

    /* DDPC_GRAD_BATCH=0 (read when a reducer is made): each copy goes as its gradient arrives */
    setenv("DDPC_GRAD_BATCH", "0", 1);
    OK(ddpc_reducer_create(&g_group, 2, numels, dts, devs, order, NULL, 1000, 1000, -1, &r));
    unsetenv("DDPC_GRAD_BATCH");
    if (!r) return;
    OK(ddpc_reducer_set_bucket_memory(r, 0, mem));
    OK(ddpc_reducer_prepare(r));
    OK(ddpc_reducer_mark_ready_copy(r, 0, g0, 0));
    nf = ddpc_reducer_take_flushed(r, flushed);
    EXPECT(mem[off0] == g0[0] && nf == 1 && flushed[0] == 0, "unbatched: slot %g, %d reported",
           (double)mem[off0], nf);
    OK(ddpc_reducer_mark_ready_copy(r, 1, g1, 0));
    OK(ddpc_reducer_finalize(r, 0, &unused));
    clear_log();
    ddpc_reducer_destroy(r);
    free(mem);
}

/* Gradients to be copied wait for their bucket only while they hold under 1 MiB: a large one
 * goes at once, with the small ones waiting, so training holds little more than one GPU would. */
static void test_copy_batch_bound(void) {
    size_t numels[3] = {3, 300000, 5}; /* the middle one 1.2 MB of float32 */
    ddpc_dtype dts[3] = {DDPC_FLOAT32, DDPC_FLOAT32, DDPC_FLOAT32};
    int devs[3] = {-1, -1, -1};
    int order[3] = {0, 1, 2};
    DdpcReducer *r = NULL;
    OK(ddpc_reducer_create(&g_group, 3, numels, dts, devs, order, NULL, 1 << 24, 1 << 24, -1,
                           &r));
    if (!r) return;
    ddpc_dtype dt;
    int dev, b, flushed[3], nf;
    size_t count, off[3];
    OK(ddpc_reducer_bucket_info(r, 0, &dt, &dev, &count));
    EXPECT(ddpc_reducer_num_buckets(r) == 1, "one bucket expected");
    for (int i = 0; i < 3; i++) OK(ddpc_reducer_param_slot(r, i, &b, &off[i]));
    float *mem = calloc(count, sizeof(float)), *big = malloc(300000 * sizeof(float));
    float small0[3] = {1, 1, 1}, small2[5] = {2, 2, 2, 2, 2};
    for (int k = 0; k < 300000; k++) big[k] = 3.0f;
    OK(ddpc_reducer_set_bucket_memory(r, 0, mem));
    OK(ddpc_reducer_prepare(r));
    OK(ddpc_reducer_mark_ready_copy(r, 0, small0, 0));
    EXPECT(ddpc_reducer_take_flushed(r, flushed) == 0 && mem[off[0]] == 0.0f,
           "a 12-byte gradient was copied alone");
    OK(ddpc_reducer_mark_ready_copy(r, 1, big, 0));
    nf = ddpc_reducer_take_flushed(r, flushed);
    EXPECT(nf == 2 && mem[off[0]] == 1.0f && mem[off[1] + 299999] == 3.0f,
           "the 1.2 MB gradient waited (%d copied)", nf);
    EXPECT(g_nlog == 0, "launched before the bucket was complete");
    OK(ddpc_reducer_mark_ready_copy(r, 2, small2, 0));
    nf = ddpc_reducer_take_flushed(r, flushed);
    EXPECT(nf == 1 && flushed[0] == 2 && g_nlog == 1, "%d copied at the launch", nf);
    int unused = -1;
    OK(ddpc_reducer_finalize(r, 0, &unused));
    EXPECT(mem[off[2]] == 1.5f, "slot 2 = %g", (double)mem[off[2]]);
    clear_log();

    /* a gradient copied early (another came on another stream) and again (accumulated out of
     * place) is reported once until the caller reads the list, which has room for each
     * parameter once */
    float newer0[3] = {5, 5, 5};
    mem[off[0]] = 0.0f;
    OK(ddpc_reducer_prepare(r));
    OK(ddpc_reducer_mark_ready_copy(r, 0, small0, 0));
    OK(ddpc_reducer_mark_ready_copy(r, 2, small2, 1)); /* the copy on stream 0 goes now */
    EXPECT(mem[off[0]] == 1.0f, "slot 0 = %g: not copied at the stream change",
           (double)mem[off[0]]);
    /* listed already, so its newer gradient is copied at once: the caller lets the source go
     * as soon as it reads the list */
    OK(ddpc_reducer_mark_ready_copy(r, 0, newer0, 1));
    EXPECT(mem[off[0]] == 5.0f, "slot 0 = %g: a listed parameter's newer gradient waited",
           (double)mem[off[0]]);
    OK(ddpc_reducer_mark_ready_copy(r, 1, big, 1));
    nf = ddpc_reducer_take_flushed(r, flushed);
    EXPECT(nf == 3 && flushed[0] + flushed[1] + flushed[2] == 3, "%d reported (%d %d %d)", nf,
           flushed[0], flushed[1], flushed[2]);
    OK(ddpc_reducer_finalize(r, 0, &unused));
    EXPECT(mem[off[0]] == 3.0f, "slot 0 = %g: the newer gradient (5) averaged expected",
           (double)mem[off[0]]);
    clear_log();
    ddpc_reducer_destroy(r);
    free(mem);
    free(big);
}

static float bf16_value(const uint16_t *e) {
    float x;
    ddpc_convert_host(&x, DDPC_FLOAT32, e, DDPC_BFLOAT16, 1);
    return x;
}

/* A bucket reduced in bfloat16: fresh gradients go straight to the wire from where they lie and
 * get the averaged values back there, without the bucket's memory; a bucket with a gradient that
 * never arrived needs memory, which may still be given after others went to the wire. */
static void test_mark_ready_grad_to_wire(void) {
    size_t numels[3] = {3, 5, 2};
    ddpc_dtype dts[3] = {DDPC_FLOAT32, DDPC_FLOAT32, DDPC_FLOAT32};
    int devs[3] = {-1, -1, -1};
    int order[3] = {0, 1, 2};
    DdpcReducer *r = NULL;
    OK(ddpc_reducer_create(&g_group, 3, numels, dts, devs, order, NULL, 1000, 1000,
                           DDPC_BFLOAT16, &r));
    if (!r) return;
    ddpc_dtype dt;
    int dev, b, direct = -1;
    size_t count, off[3];
    OK(ddpc_reducer_bucket_info(r, 0, &dt, &dev, &count));
    EXPECT(ddpc_reducer_num_buckets(r) == 1, "one bucket expected");
    for (int i = 0; i < 3; i++) OK(ddpc_reducer_param_slot(r, i, &b, &off[i]));
    uint16_t *wire = calloc(count, sizeof *wire);
    float *mem = malloc(count * sizeof(float));
    for (size_t k = 0; k < count; k++) mem[k] = -7.0f;
    float g0[3] = {2, 2, 2}, g1[5] = {4, 4, 4, 4, 4}, g1b[5] = {6, 6, 6, 6, 6}, g2[2] = {8, 8};
    EXPECT(ddpc_reducer_param_state(r, 0) == DDPC_PARAM_WIRE_BUCKET, "state %d before memory and "
           "wire were given", ddpc_reducer_param_state(r, 0));
    /* without a wire buffer nothing can be marked, or finalized */
    OK(ddpc_reducer_set_bucket_memory(r, 0, mem));
    OK(ddpc_reducer_prepare(r));
    EXPECT(ddpc_reducer_mark_ready(r, 0, 0) == DDPC_ERR_INVALID &&
               strstr(ddpc_last_error(), "no wire buffer"),
           "marked without a wire: %s", ddpc_last_error());
    EXPECT(ddpc_reducer_mark_ready_grad(r, 0, g0, 0, &direct) == DDPC_ERR_INVALID,
           "marked to the wire without one");
    EXPECT(ddpc_reducer_finalize(r, 0, NULL) == DDPC_ERR_INVALID &&
               strstr(ddpc_last_error(), "no wire buffer"),
           "finalized without a wire: %s", ddpc_last_error());
    OK(ddpc_reducer_set_bucket_wire(r, 0, wire));
    EXPECT(ddpc_reducer_param_state(r, 0) ==
               (DDPC_PARAM_HAS_MEMORY | DDPC_PARAM_WIRE_BUCKET | DDPC_PARAM_HAS_WIRE),
           "state %d after memory and wire were given", ddpc_reducer_param_state(r, 0));
    OK(ddpc_reducer_finalize(r, 0, NULL));
    clear_log();

    /* step 1: the bucket has no memory (released, as the wrapper starts a bucket whose
     * gradients are None); two gradients go to the wire, the third never comes */
    OK(ddpc_reducer_release_bucket(r, 0));
    OK(ddpc_reducer_prepare(r));
    EXPECT(ddpc_reducer_mark_ready(r, 0, 0) == DDPC_ERR_INVALID, "in-slot mark without memory");
    EXPECT(ddpc_reducer_mark_ready_grad(r, 0, NULL, 0, &direct) == DDPC_ERR_INVALID,
           "NULL source");
    float before0 = bf16_value(&wire[off[0]]), before1 = bf16_value(&wire[off[1] + 4]);
    OK(ddpc_reducer_mark_ready_grad(r, 0, g0, 0, &direct));
    EXPECT(direct == 1, "direct %d", direct);
    /* the casts wait for the bucket's launch, to go in one batch */
    EXPECT(bf16_value(&wire[off[0]]) == before0, "wire slot 0 = %g before the launch",
           (double)bf16_value(&wire[off[0]]));
    OK(ddpc_reducer_mark_ready_grad(r, 1, g1, 0, &direct));
    /* the same gradient again (accumulated twice) before the launch: the newest is sent */
    OK(ddpc_reducer_mark_ready_grad(r, 1, g1b, 0, &direct));
    EXPECT(bf16_value(&wire[off[1] + 4]) == before1, "wire slot 1 written before the launch");
    EXPECT(g_nlog == 0, "launched before the bucket was complete");
    EXPECT(ddpc_reducer_set_bucket_wire(r, 0, wire + 1) == DDPC_ERR_INVALID,
           "the wire changed after gradients were cast into it");
    EXPECT(ddpc_reducer_finalize(r, 0, NULL) == DDPC_ERR_INVALID &&
               strstr(ddpc_last_error(), "has no memory"),
           "finalize without memory for the missing gradient: %s", ddpc_last_error());
    /* memory for the missing gradient's zeros (the wire stays), as the wrapper gives it */
    OK(ddpc_reducer_set_bucket_memory(r, 0, mem));
    int unused = -1;
    OK(ddpc_reducer_finalize(r, 0, &unused));
    EXPECT(unused == 1, "unused %d", unused);
    EXPECT(g_nlog == 1 && g_log[0]->args.recv == wire && g_log[0]->args.dtype == DDPC_BFLOAT16,
           "one bfloat16 all-reduce of the wire expected");
    for (int k = 0; k < 3; k++) EXPECT(g0[k] == 1.5f, "g0[%d] = %g", k, (double)g0[k]);
    for (int k = 0; k < 5; k++) EXPECT(g1b[k] == 3.5f, "g1b[%d] = %g", k, (double)g1b[k]);
    EXPECT(g1[0] == 4.0f, "the superseded gradient was written");
    for (int k = 0; k < 2; k++)
        EXPECT(mem[off[2] + k] == 0.5f, "unused slot [%d] = %g", k, (double)mem[off[2] + k]);
    clear_log();

    /* step 2: every gradient to the wire; the bucket released: no memory needed at all */
    OK(ddpc_reducer_release_bucket(r, 0));
    OK(ddpc_reducer_prepare(r));
    OK(ddpc_reducer_mark_ready_grad(r, 2, g2, 0, &direct));
    OK(ddpc_reducer_mark_ready_grad(r, 0, g0, 0, &direct));
    OK(ddpc_reducer_mark_ready_grad(r, 1, g1b, 0, &direct));
    EXPECT(g_nlog == 1, "%d collectives after the bucket was complete", g_nlog);
    OK(ddpc_reducer_finalize(r, 0, &unused));
    EXPECT(unused == 0, "unused %d", unused);
    EXPECT(g0[0] == 1.25f && g1b[0] == 2.25f && g2[0] == 4.5f, "averaged: %g %g %g",
           (double)g0[0], (double)g1b[0], (double)g2[0]);
    clear_log();

    /* step 3: a bucket with memory, one gradient in its slot and one to the wire */
    OK(ddpc_reducer_set_bucket_memory(r, 0, mem));
    OK(ddpc_reducer_prepare(r));
    for (int k = 0; k < 3; k++) mem[off[0] + k] = 10.0f;
    OK(ddpc_reducer_mark_ready(r, 0, 0));
    OK(ddpc_reducer_mark_ready_grad(r, 1, g1, 0, &direct));
    OK(ddpc_reducer_mark_ready_copy(r, 2, g2, 0));
    OK(ddpc_reducer_finalize(r, 0, &unused));
    EXPECT(mem[off[0]] == 5.5f && g1[0] == 2.5f && mem[off[2]] == 2.75f,
           "mixed: slot %g, wire %g, copied %g", (double)mem[off[0]], (double)g1[0],
           (double)mem[off[2]]);
    clear_log();

    /* step 4: queued casts go per stream: a gradient on another stream first sends those queued
     * on the old one; a gradient that went to the wire and then lies in its slot (accumulated
     * there) goes from the slot, and its queued cast is dropped */
    OK(ddpc_reducer_prepare(r));
    float h0[3] = {2, 2, 2}, h1[5] = {4, 4, 4, 4, 4};
    float wire0 = bf16_value(&wire[off[0]]), wire1 = bf16_value(&wire[off[1]]);
    OK(ddpc_reducer_mark_ready_grad(r, 0, h0, 0, &direct));
    EXPECT(bf16_value(&wire[off[0]]) == wire0, "cast before the launch or a stream change");
    OK(ddpc_reducer_mark_ready_grad(r, 1, h1, 1, &direct));
    EXPECT(bf16_value(&wire[off[0]]) == 2.0f, "the cast queued on stream 0 waited for stream 1: "
           "%g", (double)bf16_value(&wire[off[0]]));
    EXPECT(bf16_value(&wire[off[1]]) == wire1, "the cast on stream 1 went early");
    for (int k = 0; k < 5; k++) mem[off[1] + k] = 8.0f;
    OK(ddpc_reducer_mark_ready(r, 1, 1));
    for (int k = 0; k < 5; k++) h1[k] = 100.0f; /* read from here now would be wrong */
    OK(ddpc_reducer_mark_ready_copy(r, 2, g2, 1));
    EXPECT(g_nlog == 1, "%d collectives", g_nlog);
    OK(ddpc_reducer_finalize(r, 1, &unused));
    EXPECT(h0[0] == 1.5f && mem[off[1]] == 4.5f && h1[0] == 100.0f && mem[off[2]] == 2.75f,
           "per stream: wire %g, slot %g (the dropped source %g), copied %g", (double)h0[0],
           (double)mem[off[1]], (double)h1[0], (double)mem[off[2]]);
    clear_log();
    /* the wire goes back after the step, and memory given again does not bring one */
    OK(ddpc_reducer_set_bucket_wire(r, 0, NULL));
    OK(ddpc_reducer_set_bucket_memory(r, 0, mem));
    EXPECT(!(ddpc_reducer_param_state(r, 0) & DDPC_PARAM_HAS_WIRE), "the wire was not taken "
           "back");
    ddpc_reducer_destroy(r);
    free(mem);
    free(wire);
}

/* One device bucket of three float32 parameters (3, 5 and 2 elements, offsets off[]) reduced
 * in bfloat16, with its memory and wire buffer given: what the device-cast tests start from.
 * 0 when the reducer could not be made (the failure is counted already). */
typedef struct {
    DdpcReducer *r;
    size_t off[3];
    uint16_t *wire;
    float *mem;
} Bf16Bucket;

static int bf16_bucket(Bf16Bucket *w) {
    size_t numels[3] = {3, 5, 2};
    ddpc_dtype dts[3] = {DDPC_FLOAT32, DDPC_FLOAT32, DDPC_FLOAT32};
    int devs[3] = {0, 0, 0};
    int order[3] = {0, 1, 2};
    memset(w, 0, sizeof *w);
    OK(ddpc_reducer_create(&g_group, 3, numels, dts, devs, order, NULL, 1000, 1000,
                           DDPC_BFLOAT16, &w->r));
    if (!w->r) return 0;
    int b;
    size_t count;
    ddpc_dtype dt;
    int dev;
    OK(ddpc_reducer_bucket_info(w->r, 0, &dt, &dev, &count));
    for (int i = 0; i < 3; i++) OK(ddpc_reducer_param_slot(w->r, i, &b, &w->off[i]));
    w->wire = calloc(count, sizeof *w->wire);
    w->mem = calloc(count, sizeof(float));
    OK(ddpc_reducer_set_bucket_memory(w->r, 0, w->mem));
    OK(ddpc_reducer_set_bucket_wire(w->r, 0, w->wire));
    return 1;
}

static void bf16_bucket_free(Bf16Bucket *w) {
    ddpc_reducer_destroy(w->r);
    free(w->mem);
    free(w->wire);
}

/* A summed wire (ddpc_reducer_set_bucket_summed, for a wire in an NCCL symmetric window): the
 * collective sums, and the casts back, from the wire into the gradients cast from where they
 * lay and into the bucket's slots, divide by the world size: the same values as the average.
 * Not while the bucket is in use, and not for a bucket without a device wire. */
static void test_summed_wire(void) {
    Bf16Bucket w;
    if (!bf16_bucket(&w)) return;
    DdpcReducer *r = w.r;
    const size_t *off = w.off;
    float *mem = w.mem;
    int direct = -1, unused = -1;
    for (int summed = 1; summed >= 0; summed--) {
        OK(ddpc_reducer_set_bucket_summed(r, 0, summed));
        float g0[3] = {2, 2, 2}, g1[5] = {4, 4, 4, 4, 4};
        OK(ddpc_reducer_prepare(r));
        OK(ddpc_reducer_mark_ready_grad(r, 0, g0, 0, &direct));
        EXPECT(ddpc_reducer_set_bucket_summed(r, 0, 1) == DDPC_ERR_INVALID &&
                   strstr(ddpc_last_error(), "in use"),
               "changed while in use: %s", ddpc_last_error());
        OK(ddpc_reducer_mark_ready_grad(r, 1, g1, 0, &direct));
        for (int k = 0; k < 2; k++) mem[off[2] + k] = 8.0f;
        OK(ddpc_reducer_mark_ready(r, 2, 0));
        EXPECT(g_nlog == 1 && g_log[0]->args.redop == (summed ? DDPC_SUM : DDPC_AVG),
               "summed %d: %d collectives, redop %d", summed, g_nlog,
               g_nlog ? (int)g_log[0]->args.redop : -1);
        OK(ddpc_reducer_finalize(r, 0, &unused));
        EXPECT(g0[0] == 1.5f && g0[2] == 1.5f && g1[4] == 2.5f && mem[off[2] + 1] == 4.5f,
               "summed %d: after finalize %g %g %g %g", summed, (double)g0[0], (double)g0[2],
               (double)g1[4], (double)mem[off[2] + 1]);
        clear_log();
    }
    bf16_bucket_free(&w);
    /* a bucket reduced in its own dtype has no wire to sum */
    size_t numels[1] = {4};
    ddpc_dtype dts[1] = {DDPC_FLOAT32};
    int devs[1] = {0}, order[1] = {0};
    DdpcReducer *plain = NULL;
    OK(ddpc_reducer_create(&g_group, 1, numels, dts, devs, order, NULL, 1000, 1000, -1, &plain));
    if (plain) {
        EXPECT(ddpc_reducer_set_bucket_summed(plain, 0, 1) == DDPC_ERR_INVALID &&
                   strstr(ddpc_last_error(), "no device wire"),
               "a bucket without a wire: %s", ddpc_last_error());
        EXPECT(ddpc_reducer_set_bucket_summed(plain, 7, 1) == DDPC_ERR_INVALID,
               "bucket 7 of 1 accepted");
        ddpc_reducer_destroy(plain);
    }
}

/* name=value makes reducer creation fail with DDPC_ERR_INVALID, naming it and `takes` (the
 * values it takes); the variable is unset after. */
static void expect_setting_refused(const char *name, const char *value, const char *takes) {
    size_t numels[1] = {4};
    ddpc_dtype dts[1] = {DDPC_FLOAT32};
    int devs[1] = {0}, order[1] = {0};
    char both[64];
    snprintf(both, sizeof both, "%s=%s", name, value);
    setenv(name, value, 1);
    DdpcReducer *bad = NULL;
    ddpc_status st = ddpc_reducer_create(&g_group, 1, numels, dts, devs, order, NULL, 1000, 1000,
                                         DDPC_BFLOAT16, &bad);
    EXPECT(st == DDPC_ERR_INVALID && !bad && strstr(ddpc_last_error(), both) &&
               strstr(ddpc_last_error(), takes),
           "%s: %d %s", both, (int)st, ddpc_last_error());
    if (bad) ddpc_reducer_destroy(bad);
    unsetenv(name);
}

/* A device bucket reduced in bfloat16: its casts go on the communication stream, around its
 * collective: into the wire, and back into the gradients cast from where they lay and into its
 * slots, so finalize queues no cast. Around an all-reduce that takes the staged path, and with
 * without DDPC_COMM_CASTS=1 (the default), all go on the caller's stream, and back at
 * finalize. A value that is no setting fails the reducer's creation. */
static void test_device_casts_on_comm_stream(void) {
    enum { CALLER = 5 };
    /* mode 0: on the communication stream; 1: that, but a staged-size bucket; 2: the default
     * (DDPC_COMM_CASTS unset) */
    for (int mode = 0; mode < 3; mode++) {
        if (mode == 2)
            unsetenv("DDPC_COMM_CASTS");
        else
            setenv("DDPC_COMM_CASTS", "1", 1);
        g_staged_min = mode == 1 ? 16 : 0;
        Bf16Bucket w;
        if (!bf16_bucket(&w)) continue;
        DdpcReducer *r = w.r;
        const size_t *off = w.off;
        float *mem = w.mem;
        int direct = -1;
        float g0[3] = {2, 2, 2}, g1[5] = {4, 4, 4, 4, 4};
        OK(ddpc_reducer_prepare(r));
        g_nlaunch = 0;
        OK(ddpc_reducer_mark_ready_grad(r, 0, g0, CALLER, &direct));
        EXPECT(direct == 1, "direct %d", direct);
        OK(ddpc_reducer_mark_ready_grad(r, 1, g1, CALLER, &direct));
        EXPECT(g_nlaunch == 0, "mode %d: a cast went before the launch", mode);
        for (int k = 0; k < 2; k++) mem[off[2] + k] = 8.0f;
        OK(ddpc_reducer_mark_ready(r, 2, CALLER)); /* (in its slot) */
        EXPECT(g_nlog == 1 && (g_log[0]->args.after != NULL) == (mode == 0) &&
                   (g_log[0]->args.before != NULL) == (mode == 0),
               "mode %d: %d collectives, before %s, after %s", mode, g_nlog,
               g_nlog && g_log[0]->args.before ? "set" : "unset",
               g_nlog && g_log[0]->args.after ? "set" : "unset");
        int launches = g_nlaunch, to_wire_on_comm = 0, back_on_comm = 0;
        for (int k = 0; k < launches; k++) to_wire_on_comm += g_launch_stream[k] == COMM_STREAM;
        if (mode == 0) {
            EXPECT(g0[0] == 1.5f && g1[4] == 2.5f && mem[off[2] + 1] == 4.5f,
                   "mode %d: not cast back behind the collective: %g %g %g", mode,
                   (double)g0[0], (double)g1[4], (double)mem[off[2] + 1]);
            /* two casts in, two back (the direct gradients, the slot) */
            back_on_comm = launches >= 2 && g_launch_stream[launches - 1] == COMM_STREAM &&
                           g_launch_stream[launches - 2] == COMM_STREAM;
            EXPECT(launches == 4 && back_on_comm && to_wire_on_comm == 4,
                   "mode %d: %d launches, %d on the communication stream", mode, launches,
                   to_wire_on_comm);
        } else {
            EXPECT(g0[0] == 2.0f && g1[4] == 4.0f && mem[off[2] + 1] == 8.0f,
                   "mode %d: cast back before finalize", mode);
            EXPECT(launches == 2 && to_wire_on_comm == 0, "mode %d: %d launches, %d on the "
                   "communication stream", mode, launches, to_wire_on_comm);
        }
        int unused = -1;
        OK(ddpc_reducer_finalize(r, CALLER, &unused));
        EXPECT(unused == 0, "unused %d", unused);
        EXPECT(g0[0] == 1.5f && g1[4] == 2.5f && mem[off[2] + 1] == 4.5f,
               "mode %d: after finalize %g %g %g", mode, (double)g0[0], (double)g1[4],
               (double)mem[off[2] + 1]);
        int at_finalize = 0;
        for (int k = launches; k < g_nlaunch; k++) at_finalize += g_launch_stream[k] == CALLER;
        EXPECT(mode == 0 ? g_nlaunch == launches : at_finalize == 2,
               "mode %d: %d casts on the caller's stream at finalize", mode, at_finalize);
        clear_log();
        /* the next step starts afresh: with the bucket memory only, nothing is skipped */
        OK(ddpc_reducer_prepare(r));
        for (int k = 0; k < 3; k++) mem[off[0] + k] = 6.0f;
        OK(ddpc_reducer_mark_ready(r, 0, CALLER));
        OK(ddpc_reducer_mark_ready(r, 1, CALLER));
        OK(ddpc_reducer_mark_ready(r, 2, CALLER));
        OK(ddpc_reducer_finalize(r, CALLER, &unused));
        EXPECT(mem[off[0]] == 3.5f, "mode %d, step 2: slot %g", mode, (double)mem[off[0]]);
        clear_log();
        /* a cast that fails to launch (into the wire on the communication stream in mode 0, on
         * the caller's otherwise) fails the launch: the hook that completed the bucket says so,
         * naming the bucket, and no collective is left posted */
        g_fail_stream = mode == 0 ? COMM_STREAM : CALLER;
        OK(ddpc_reducer_prepare(r));
        OK(ddpc_reducer_mark_ready(r, 0, CALLER));
        OK(ddpc_reducer_mark_ready(r, 1, CALLER));
        g_aborts = 0;
        ddpc_status st = ddpc_reducer_mark_ready(r, 2, CALLER);
        EXPECT(st == DDPC_ERR_CUDA && strstr(ddpc_last_error(), "bucket 0") &&
                   strstr(ddpc_last_error(), "launch on stream"),
               "mode %d: a failed cast: %d %s", mode, (int)st, ddpc_last_error());
        EXPECT(g_nlog == 0, "mode %d: %d collectives posted after a failed cast", mode, g_nlog);
        EXPECT(g_aborts == 1 && g_abort_status == DDPC_ERR_CUDA &&
                   strstr(g_abort_why, "bucket 0") && strstr(g_abort_why, "launch on stream"),
               "mode %d: %d aborts: %s", mode, g_aborts, g_abort_why);
        g_fail_stream = 0;
        clear_log();
        bf16_bucket_free(&w);
    }
    expect_setting_refused("DDPC_COMM_CASTS", "maybe", "use 1 or 0");
    g_staged_min = 0;
}

/* DDPC_CAST_BACK=early: a device bucket reduced in bfloat16 is cast into the wire on the
 * caller's stream (as by default), and back as soon as its collective is queued, on the
 * reducer's own stream (made once, behind the communication stream), so finalize queues no
 * cast and orders the caller's stream after that one. A value that is no setting fails the
 * reducer's creation. */
static void test_device_cast_back_early(void) {
    size_t numels[3] = {3, 5, 2};
    ddpc_dtype dts[3] = {DDPC_FLOAT32, DDPC_FLOAT32, DDPC_FLOAT32};
    int order[3] = {0, 1, 2};
    enum { CALLER = 5 };
    setenv("DDPC_CAST_BACK", "early", 1);
    g_streams_made = g_streams_destroyed = 0;
    Bf16Bucket w;
    int made = bf16_bucket(&w);
    unsetenv("DDPC_CAST_BACK");
    if (!made) return;
    DdpcReducer *r = w.r;
    const size_t *off = w.off;
    float *mem = w.mem;
    int direct = -1;
    float g0[3] = {2, 2, 2}, g1[5] = {4, 4, 4, 4, 4};
    for (int step = 0; step < 2; step++) {
        OK(ddpc_reducer_prepare(r));
        g_nlaunch = 0;
        g_nwaits = 0;
        g0[0] = 2;
        g1[4] = 4;
        OK(ddpc_reducer_mark_ready_grad(r, 0, g0, CALLER, &direct));
        EXPECT(direct == 1, "direct %d", direct);
        OK(ddpc_reducer_mark_ready_grad(r, 1, g1, CALLER, &direct));
        for (int k = 0; k < 2; k++) mem[off[2] + k] = 8.0f;
        OK(ddpc_reducer_mark_ready(r, 2, CALLER)); /* (in its slot) */
        EXPECT(g_nlog == 1 && g_log[0]->args.after != NULL && g_log[0]->args.before == NULL &&
                   g_log[0]->args.defer,
               "step %d: %d collectives; a deferred post with only `after` expected", step,
               g_nlog);
        /* two casts into the wire on the caller's stream, two back on the reducer's */
        int launches = g_nlaunch;
        EXPECT(launches == 4 && g_launch_stream[0] == CALLER && g_launch_stream[1] == CALLER &&
                   g_launch_stream[2] == BACK_STREAM && g_launch_stream[3] == BACK_STREAM,
               "step %d: %d launches, on %lu %lu %lu %lu", step, launches,
               (unsigned long)g_launch_stream[0], (unsigned long)g_launch_stream[1],
               (unsigned long)g_launch_stream[2], (unsigned long)g_launch_stream[3]);
        EXPECT(g0[0] == 1.5f && g1[4] == 2.5f && mem[off[2] + 1] == 4.5f,
               "step %d: not cast back when the collective was queued: %g %g %g", step,
               (double)g0[0], (double)g1[4], (double)mem[off[2] + 1]);
        int back_after_comm = 0;
        for (int k = 0; k < g_nwaits; k++)
            back_after_comm += g_waits[k][0] == BACK_STREAM && g_waits[k][1] == COMM_STREAM;
        EXPECT(back_after_comm == 1, "step %d: the cast-back stream waited for the "
               "communication stream %d times", step, back_after_comm);
        int waits = g_nwaits, unused = -1;
        OK(ddpc_reducer_finalize(r, CALLER, &unused));
        EXPECT(g_nlaunch == launches, "step %d: %d casts queued by finalize", step,
               g_nlaunch - launches);
        EXPECT(g_nwaits > waits && g_waits[g_nwaits - 1][0] == CALLER &&
                   g_waits[g_nwaits - 1][1] == BACK_STREAM,
               "step %d: finalize did not order the caller's stream after the casts back", step);
        EXPECT(g0[0] == 1.5f && g1[4] == 2.5f && mem[off[2] + 1] == 4.5f,
               "step %d: after finalize %g %g %g", step, (double)g0[0], (double)g1[4],
               (double)mem[off[2] + 1]);
        clear_log();
    }
    EXPECT(g_streams_made == 1, "%d streams made for two steps", g_streams_made);
    bf16_bucket_free(&w);
    EXPECT(g_streams_destroyed == 1, "%d streams let go", g_streams_destroyed);
    /* a bucket on the host has no stream: cast back at finalize as before */
    int host[1] = {-1};
    setenv("DDPC_CAST_BACK", "early", 1);
    OK(ddpc_reducer_create(&g_group, 1, numels, dts, host, order, NULL, 1000, 1000,
                           DDPC_BFLOAT16, &r));
    unsetenv("DDPC_CAST_BACK");
    if (r) {
        ddpc_dtype dt;
        int dev;
        size_t count;
        OK(ddpc_reducer_bucket_info(r, 0, &dt, &dev, &count));
        uint16_t *wire = calloc(count, sizeof *wire);
        mem = calloc(count, sizeof(float));
        OK(ddpc_reducer_set_bucket_memory(r, 0, mem));
        OK(ddpc_reducer_set_bucket_wire(r, 0, wire));
        OK(ddpc_reducer_prepare(r));
        for (int k = 0; k < 3; k++) mem[k] = 6.0f;
        OK(ddpc_reducer_mark_ready(r, 0, 0));
        int unused = -1;
        OK(ddpc_reducer_finalize(r, 0, &unused));
        EXPECT(g_nlog == 1 && g_log[0]->args.after == NULL && mem[0] == 3.5f,
               "host bucket: %d collectives, after %s, slot %g", g_nlog,
               g_nlog && g_log[0]->args.after ? "set" : "unset", (double)mem[0]);
        clear_log();
        ddpc_reducer_destroy(r);
        free(mem);
        free(wire);
    }
    EXPECT(g_streams_made == 1, "a host bucket made a stream");
    expect_setting_refused("DDPC_CAST_BACK", "now", "use end or early or overlap");
}

/* A reducer made with DDPC_CAST_BACK=overlap over n <= 8 float32 parameters on device 0, ready
 * in index order, reduced in bf16; NULL (a failed check) when it cannot be made. */
static DdpcReducer *overlap_reducer(int n, const size_t *numels, size_t first_cap, size_t cap) {
    ddpc_dtype dts[8];
    int devs[8], order[8];
    for (int i = 0; i < n && i < 8; i++) {
        dts[i] = DDPC_FLOAT32;
        devs[i] = 0;
        order[i] = i;
    }
    setenv("DDPC_CAST_BACK", "overlap", 1);
    DdpcReducer *r = NULL;
    OK(ddpc_reducer_create(&g_group, n, numels, dts, devs, order, NULL, first_cap, cap,
                           DDPC_BFLOAT16, &r));
    unsetenv("DDPC_CAST_BACK");
    return r;
}

/* Gives buckets 0..n-1 of r zeroed float32 memory and bf16 wires of their sizes (count[b]; count
 * may be NULL); wire_buckets_free lets them go. */
static void wire_buckets(DdpcReducer *r, int n, float **mem, uint16_t **wire, size_t *count) {
    for (int b = 0; b < n; b++) {
        ddpc_dtype dt;
        int dev;
        size_t c = 0;
        OK(ddpc_reducer_bucket_info(r, b, &dt, &dev, &c));
        if (count) count[b] = c;
        wire[b] = calloc(c, sizeof *wire[b]);
        mem[b] = calloc(c, sizeof *mem[b]);
        OK(ddpc_reducer_set_bucket_memory(r, b, mem[b]));
        OK(ddpc_reducer_set_bucket_wire(r, b, wire[b]));
    }
}

static void wire_buckets_free(int n, float **mem, uint16_t **wire) {
    for (int b = 0; b < n; b++) {
        free(wire[b]);
        free(mem[b]);
    }
}

/* The collectives logged from g_log[first] on are the parts of one bucket's wire (count
 * elements at wire), in order, each cast back behind its own (`after`) and each posted right
 * after its part's casts into the wire on `caller` (launches there since the previous post, the
 * last of them right before the post). */
static void expect_chunks(const uint16_t *wire, size_t count, uintptr_t caller, int first) {
    size_t next = 0;
    for (int k = first; k < g_nlog; k++) {
        const DdpcCollArgs *a = &g_log[k]->args;
        EXPECT(a->recv == (void *)(wire + next) && a->after != NULL && a->count > 0,
               "chunk %d: at element %zu, %zu elements", k - first,
               (size_t)((const uint16_t *)a->recv - wire), a->count);
        next += a->count;
        /* since the previous post (or before the first): its casts into the wire, last */
        int at = g_log[k]->launches, on_caller = 0;
        int from = k == first ? at - 1 : g_log[k - 1]->launches;
        for (int l = from; l < at; l++) on_caller += l >= 0 && g_launch_stream[l] == caller;
        EXPECT(at > 0 && g_launch_stream[at - 1] == caller &&
                   (k == first || on_caller >= 1),
               "chunk %d: %d casts on the caller's stream since the last post, the last launch "
               "before it on stream %lu", k - first, on_caller,
               at > 0 ? (unsigned long)g_launch_stream[at - 1] : 0UL);
    }
    EXPECT(next == count, "the chunks cover %zu of %zu elements", next, count);
}

/* DDPC_CAST_BACK=overlap, a last bucket whose bf16 wire holds 8 MiB or more: it is reduced in 4
 * collectives over consecutive parts of its wire, each cast into the wire on the caller's
 * stream just before it is posted and cast back behind it on the reducer's stream, split inside
 * a gradient (cast from where autograd left it); every element comes back averaged. The bucket
 * before it is one collective. */
static void test_last_bucket_in_chunks(void) {
    enum { CALLER = 5 };
    size_t big = ((size_t)5 << 20) + 3; /* 10 MiB of bf16 */
    size_t numels[2] = {3, big};
    DdpcReducer *r = overlap_reducer(2, numels, 32, 32);
    if (!r) return;
    int nb = ddpc_reducer_num_buckets(r);
    EXPECT(nb == 2, "%d buckets", nb);
    uint16_t *wire[2] = {NULL, NULL};
    float *mem[2] = {NULL, NULL};
    size_t count[2] = {0, 0};
    wire_buckets(r, nb < 2 ? nb : 2, mem, wire, count);
    float g0[3] = {2, 2, 2};
    float *g1 = malloc(big * sizeof *g1);
    for (size_t i = 0; g1 && i < big; i++) g1[i] = 4.0f;
    int direct = -1, unused = -1;
    if (nb == 2 && g1) {
        OK(ddpc_reducer_prepare(r));
        g_nlaunch = 0;
        OK(ddpc_reducer_mark_ready_grad(r, 0, g0, CALLER, &direct));
        OK(ddpc_reducer_mark_ready_grad(r, 1, g1, CALLER, &direct));
        EXPECT(direct == 1, "direct %d", direct);
        EXPECT(g_nlog == 5, "%d collectives for a bucket and a chunked one", g_nlog);
        expect_chunks(wire[1], count[1], CALLER, 1);
        EXPECT(g1[0] == 2.5f && g1[big - 1] == 2.5f, "chunks not cast back as queued");
        OK(ddpc_reducer_finalize(r, CALLER, &unused));
        size_t wrong = 0;
        for (size_t i = 0; i < big; i++) wrong += g1[i] != 2.5f;
        EXPECT(wrong == 0 && g0[0] == 1.5f, "after finalize: %zu wrong elements; g0 %g", wrong,
               (double)g0[0]);
        EXPECT(g_nwaits > 0 && g_waits[g_nwaits - 1][0] == CALLER &&
                   g_waits[g_nwaits - 1][1] == BACK_STREAM,
               "finalize did not order the caller's stream after the casts back");
        clear_log();
    }
    ddpc_reducer_destroy(r);
    free(g1);
    wire_buckets_free(2, mem, wire);
}

/* The same bucket launched by finalize (its second parameter unused), its one gradient having
 * arrived on another stream: the caller's stream waits for that one before the parts are cast
 * into the wire on it, the unused slot goes as zeros, and every element comes back averaged. */
static void test_last_bucket_chunks_at_finalize(void) {
    enum { CALLER = 5, SIDE = 7 };
    size_t big = ((size_t)5 << 20) + 3;
    size_t numels[3] = {3, big, 4};
    /* a first bucket of 32 bytes (parameter 0), then one of up to 64 MiB (1 and 2) */
    DdpcReducer *r = overlap_reducer(3, numels, 32, (size_t)64 << 20);
    if (!r) return;
    int nb = ddpc_reducer_num_buckets(r), bucket[3] = {-1, -1, -1};
    size_t off[3] = {0, 0, 0};
    for (int i = 0; i < 3; i++) OK(ddpc_reducer_param_slot(r, i, &bucket[i], &off[i]));
    EXPECT(nb == 2 && bucket[0] == 0 && bucket[1] == 1 && bucket[2] == 1, "%d buckets: %d %d %d",
           nb, bucket[0], bucket[1], bucket[2]);
    uint16_t *wire[2] = {NULL, NULL};
    float *mem[2] = {NULL, NULL};
    size_t count[2] = {0, 0};
    wire_buckets(r, nb < 2 ? nb : 2, mem, wire, count);
    for (int b = 0; b < nb && b < 2; b++) /* (slots not zeroed) */
        for (size_t i = 0; mem[b] && i < count[b]; i++) mem[b][i] = 9.0f;
    float g0[3] = {2, 2, 2};
    float *g1 = malloc(big * sizeof *g1);
    for (size_t i = 0; g1 && i < big; i++) g1[i] = 4.0f;
    int direct = -1, unused = -1;
    if (nb == 2 && bucket[2] == 1 && g1 && mem[1]) {
        OK(ddpc_reducer_prepare(r));
        g_nlaunch = 0;
        g_nwaits = 0;
        OK(ddpc_reducer_mark_ready_grad(r, 0, g0, CALLER, &direct));
        OK(ddpc_reducer_mark_ready_grad(r, 1, g1, SIDE, &direct));
        EXPECT(g_nlog == 1, "%d collectives before finalize", g_nlog);
        OK(ddpc_reducer_finalize(r, CALLER, &unused));
        EXPECT(unused == 1, "%d unused", unused);
        EXPECT(g_nlog == 5, "%d collectives for a bucket and a chunked one", g_nlog);
        int waited = -1;
        for (int k = 0; k < g_nwaits; k++)
            if (g_waits[k][0] == CALLER && g_waits[k][1] == SIDE) waited = k;
        EXPECT(waited >= 0, "the caller's stream never waited for the gradient's");
        if (g_nlog == 5) expect_chunks(wire[1], count[1], CALLER, 1);
        size_t wrong = 0;
        for (size_t i = 0; i < big; i++) wrong += g1[i] != 2.5f;
        EXPECT(wrong == 0 && g0[0] == 1.5f, "after finalize: %zu wrong elements; g0 %g", wrong,
               (double)g0[0]);
        EXPECT(mem[1][off[2]] == 0.5f && mem[1][off[2] + 3] == 0.5f,
               "the unused slot: %g %g (zeros averaged with the other rank's ones: 0.5)",
               (double)mem[1][off[2]], (double)mem[1][off[2] + 3]);
        clear_log();
    }
    ddpc_reducer_destroy(r);
    free(g1);
    wire_buckets_free(2, mem, wire);
}

/* DDPC_CAST_BACK=overlap, a step abandoned after its last bucket launched (the backward raised
 * before its end): the casts back queued on the reducer's stream write gradients the caller lets
 * go at the next forward, and the posting thread may still run a post's `after` casts. So the
 * next prepare, which says the step did not finish, first waits on the host for that stream and
 * for the posting thread; so does destroy. A finished step waits for neither at the next
 * prepare (the caller's stream waited for the reducer's at finalize). */
static void test_unfinished_overlap_step_waits_for_casts_back(void) {
    enum { CALLER = 5 };
    size_t numels[3] = {3, 5, 2};
    DdpcReducer *r = overlap_reducer(3, numels, 32, 32);
    if (!r) return;
    int nb = ddpc_reducer_num_buckets(r);
    uint16_t *wire[2] = {NULL, NULL};
    float *mem[2] = {NULL, NULL};
    wire_buckets(r, nb < 2 ? nb : 2, mem, wire, NULL);
    EXPECT(nb == 2, "%d buckets", nb);
    if (nb == 2) {
        int unused = -1;
        g_nfinished = g_wait_posted_calls = 0;
        OK(ddpc_reducer_prepare(r)); /* a finished step, then the next prepare */
        for (int i = 0; i < 3; i++) OK(ddpc_reducer_mark_ready(r, i, CALLER));
        OK(ddpc_reducer_finalize(r, CALLER, &unused));
        OK(ddpc_reducer_prepare(r));
        EXPECT(g_nfinished == 0 && g_wait_posted_calls == 0,
               "after a finished step prepare waited on the host: %d streams, %d posting waits",
               g_nfinished, g_wait_posted_calls);
        for (int i = 0; i < 3; i++) OK(ddpc_reducer_mark_ready(r, i, CALLER));
        EXPECT(g_nlog >= 4, "%d collectives: the last bucket did not launch", g_nlog);
        /* no finalize: the backward raised */
        EXPECT(ddpc_reducer_prepare(r) == DDPC_ERR_INVALID &&
                   strstr(ddpc_last_error(), "did not finish") != NULL,
               "the abandoned step was not reported: %s", ddpc_last_error());
        EXPECT(g_nfinished == 1 && g_finished[0] == BACK_STREAM && g_wait_posted_calls == 1,
               "prepare after the abandoned step: %d streams waited for (the first %lu), %d "
               "posting waits", g_nfinished, g_nfinished ? (unsigned long)g_finished[0] : 0UL,
               g_wait_posted_calls);
        clear_log();
    }
    g_nfinished = 0;
    ddpc_reducer_destroy(r);
    EXPECT(g_nfinished == 1 && g_finished[0] == BACK_STREAM,
           "destroy waited for %d streams", g_nfinished);
    wire_buckets_free(2, mem, wire);
}

/* A bucket posted in chunks whose third post fails, in a finalize that launched it (its one
 * parameter unused): two of its collectives are in flight, though no gradient arrived and no
 * bucket counts as launched. The next prepare reports the unfinished step and waits for them,
 * after which the bucket's memory may change and the next step reduces it whole. */
static void test_failed_chunk_post_leaves_no_work_behind(void) {
    enum { CALLER = 5 };
    size_t big = ((size_t)5 << 20) + 3;
    DdpcReducer *r = overlap_reducer(1, &big, 32, 32);
    if (!r) return;
    ddpc_dtype dt;
    int dev;
    size_t count = 0;
    OK(ddpc_reducer_bucket_info(r, 0, &dt, &dev, &count));
    uint16_t *wire = calloc(count, sizeof *wire);
    float *mem = calloc(count, sizeof *mem);
    float *other = calloc(count, sizeof *other);
    if (wire && mem && other) {
        OK(ddpc_reducer_set_bucket_memory(r, 0, mem));
        OK(ddpc_reducer_set_bucket_wire(r, 0, wire));
        int unused = -1;
        OK(ddpc_reducer_prepare(r));
        g_fail_post_at = g_nlog + 2;
        g_aborts = 0;
        EXPECT(ddpc_reducer_finalize(r, CALLER, &unused) == DDPC_ERR_NCCL &&
                   strstr(ddpc_last_error(), "post 2 refused") &&
                   strstr(ddpc_last_error(), "gradient bucket 0"),
               "the refused post was not reported: %s", ddpc_last_error());
        g_fail_post_at = -1;
        EXPECT(g_nlog == 2, "%d chunks posted before the refused one", g_nlog);
        /* the peers, whose collectives this rank will not pair, learn why at once */
        EXPECT(g_aborts == 1 && g_abort_status == DDPC_ERR_NCCL &&
                   strstr(g_abort_why, "post 2 refused") && strstr(g_abort_why, "bucket 0"),
               "%d aborts, status %d: %s", g_aborts, (int)g_abort_status, g_abort_why);
        EXPECT(ddpc_reducer_prepare(r) == DDPC_ERR_INVALID &&
                   strstr(ddpc_last_error(), "did not finish") != NULL,
               "prepare after the failed finalize: %s", ddpc_last_error());
        OK(ddpc_reducer_set_bucket_memory(r, 0, other)); /* nothing in flight on it now */
        clear_log();
        for (size_t i = 0; i < count; i++) other[i] = 4.0f;
        OK(ddpc_reducer_mark_ready(r, 0, CALLER));
        OK(ddpc_reducer_finalize(r, CALLER, &unused));
        EXPECT(g_nlog == 4 && other[0] == 2.5f && other[count - 1] == 2.5f,
               "the next step: %d collectives, %g %g", g_nlog, (double)other[0],
               (double)other[count - 1]);
        clear_log();
    }
    ddpc_reducer_destroy(r);
    free(wire);
    free(mem);
    free(other);
}

/* DDPC_CAST_BACK=overlap: two device buckets reduced in bfloat16. As the last one launches, the
 * first is cast back on the reducer's own stream, which first waits for the caller's (the end
 * of the backward's kernels); at finalize the last one (too small to split) goes back on the
 * caller's stream, which then waits for the reducer's. */
static void test_device_cast_back_overlap(void) {
    size_t numels[3] = {3, 5, 2};
    enum { CALLER = 5 };
    g_streams_made = g_streams_destroyed = 0;
    /* buckets of 32 bytes: parameters 0 and 1 (8 floats), then 2 */
    DdpcReducer *r = overlap_reducer(3, numels, 32, 32);
    if (!r) return;
    EXPECT(ddpc_reducer_num_buckets(r) == 2, "%d buckets", ddpc_reducer_num_buckets(r));
    if (ddpc_reducer_num_buckets(r) != 2) {
        ddpc_reducer_destroy(r);
        return;
    }
    size_t off[3];
    int bucket[3];
    for (int i = 0; i < 3; i++) OK(ddpc_reducer_param_slot(r, i, &bucket[i], &off[i]));
    EXPECT(bucket[0] == 0 && bucket[1] == 0 && bucket[2] == 1, "buckets %d %d %d", bucket[0],
           bucket[1], bucket[2]);
    uint16_t *wire[2];
    float *mem[2];
    wire_buckets(r, 2, mem, wire, NULL);
    for (int step = 0; step < 2; step++) {
        float g0[3] = {2, 2, 2};
        int direct = -1, unused = -1;
        OK(ddpc_reducer_prepare(r));
        g_nlaunch = 0;
        g_nwaits = 0;
        OK(ddpc_reducer_mark_ready_grad(r, 0, g0, CALLER, &direct));
        for (int k = 0; k < 5; k++) mem[0][off[1] + k] = 4.0f;
        OK(ddpc_reducer_mark_ready(r, 1, CALLER)); /* (in its slot) */
        for (int k = 0; k < 2; k++) mem[1][off[2] + k] = 8.0f;
        EXPECT(g0[0] == 2.0f && mem[0][off[1]] == 4.0f && g_nlog == 1,
               "step %d: cast back before the last bucket launched", step);
        int into_wire = g_nlaunch, waits = g_nwaits;
        OK(ddpc_reducer_mark_ready(r, 2, CALLER));
        EXPECT(g_nlog == 2, "step %d: %d collectives", step, g_nlog);
        EXPECT(g0[0] == 1.5f && mem[0][off[1] + 4] == 2.5f && mem[1][off[2]] == 8.0f,
               "step %d: the first bucket not cast back as the last launched: %g %g %g", step,
               (double)g0[0], (double)mem[0][off[1] + 4], (double)mem[1][off[2]]);
        int on_back = 0;
        for (int k = into_wire; k < g_nlaunch; k++) on_back += g_launch_stream[k] == BACK_STREAM;
        EXPECT(on_back == 2, "step %d: %d casts back on the reducer's stream", step, on_back);
        EXPECT(g_nwaits > waits && g_waits[waits][0] == BACK_STREAM &&
                   g_waits[waits][1] == CALLER,
               "step %d: the reducer's stream did not first wait for the caller's", step);
        for (int k = 0; k < into_wire; k++)
            EXPECT(g_launch_stream[k] == CALLER, "step %d: launch %d of the casts into the wire "
                   "on stream %lu", step, k, (unsigned long)g_launch_stream[k]);
        int launches = g_nlaunch;
        OK(ddpc_reducer_finalize(r, CALLER, &unused));
        /* bucket 1: its slot, on the caller's stream */
        EXPECT(g_nlaunch == launches + 1 && g_launch_stream[g_nlaunch - 1] == CALLER,
               "step %d: %d casts back at finalize", step, g_nlaunch - launches);
        int back_after_caller = -1, caller_after_back = -1;
        for (int k = 0; k < g_nwaits; k++) {
            if (g_waits[k][0] == BACK_STREAM && g_waits[k][1] == CALLER) back_after_caller = k;
            if (g_waits[k][0] == CALLER && g_waits[k][1] == BACK_STREAM) caller_after_back = k;
        }
        EXPECT(back_after_caller >= 0 && caller_after_back > back_after_caller,
               "step %d: waits: the reducer's stream after the caller's at %d, the caller's "
               "after it at %d", step, back_after_caller, caller_after_back);
        EXPECT(g0[0] == 1.5f && mem[0][off[1] + 4] == 2.5f && mem[1][off[2] + 1] == 4.5f,
               "step %d: after finalize %g %g %g", step, (double)g0[0],
               (double)mem[0][off[1] + 4], (double)mem[1][off[2] + 1]);
        clear_log();
    }
    EXPECT(g_streams_made == 1, "%d streams made for two steps", g_streams_made);
    ddpc_reducer_destroy(r);
    wire_buckets_free(2, mem, wire);
    test_last_bucket_in_chunks();
    test_last_bucket_chunks_at_finalize();
    test_unfinished_overlap_step_waits_for_casts_back();
    test_failed_chunk_post_leaves_no_work_behind();
}

static void test_bad_arguments(void) {
    size_t numels[2] = {4, 4};
    ddpc_dtype dts[2] = {DDPC_FLOAT32, DDPC_INT64};
    int devs[2] = {-1, -1};
    int order[2] = {1, 1};
    DdpcReducer *r = NULL;
    EXPECT(ddpc_reducer_create(&g_group, 2, numels, dts, devs, NULL, NULL, 64, 64, -1, &r) ==
               DDPC_ERR_INVALID && strstr(ddpc_last_error(), "int64"),
           "an int64 gradient was accepted: %s", ddpc_last_error());
    dts[1] = DDPC_FLOAT32;
    EXPECT(ddpc_reducer_create(&g_group, 2, numels, dts, devs, order, NULL, 64, 64, -1, &r) ==
               DDPC_ERR_INVALID && strstr(ddpc_last_error(), "permutation"),
           "a repeated order entry was accepted: %s", ddpc_last_error());
    EXPECT(ddpc_reducer_create(&g_group, 2, numels, dts, devs, NULL, NULL, 64, 64, DDPC_INT8,
                               &r) == DDPC_ERR_INVALID, "comm dtype int8 accepted");
    OK(ddpc_reducer_create(&g_group, 2, numels, dts, devs, NULL, NULL, 64, 64, -1, &r));
    if (!r) return;
    EXPECT(ddpc_reducer_prepare(r) == DDPC_ERR_INVALID, "prepare without bucket memory");
    EXPECT(ddpc_reducer_set_bucket_memory(r, 0, NULL) == DDPC_ERR_INVALID, "NULL buffer");
    EXPECT(ddpc_reducer_set_bucket_memory(r, 7, NULL) == DDPC_ERR_INVALID, "bucket 7");
    EXPECT(ddpc_reducer_mark_ready(r, 2, 0) == DDPC_ERR_INVALID, "param 2 of 2");
    ddpc_reducer_destroy(r);
    OK(ddpc_reducer_create(&g_group, 0, NULL, NULL, NULL, NULL, NULL, 64, 64, -1, &r));
    if (r) {
        int unused = -1;
        OK(ddpc_reducer_prepare(r));
        OK(ddpc_reducer_finalize(r, 0, &unused));
        EXPECT(unused == 0 && ddpc_reducer_num_buckets(r) == 0, "empty reducer");
        ddpc_reducer_destroy(r);
    }
}

/* A host bucket's collective refused as its last gradient arrives (the second bucket's, after
 * the first was posted): the caller gets the reason naming the bucket, and the group is aborted
 * with it, since the peers would wait for that collective (or pair their next one with this
 * rank's). A bucket whose gradients are all in but whose collective was never posted is not
 * taken as launched: the next prepare reports the step unfinished and waits for the first. */
static void test_refused_post_aborts_the_group(void) {
    size_t numels[2] = {1000, 1000};
    ddpc_dtype dts[2] = {0};
    int devs[2] = {-1, -1};
    DdpcReducer *r = NULL;
    OK(ddpc_reducer_create(&g_group, 2, numels, dts, devs, NULL, NULL, 4000, 4000, -1, &r));
    if (!r) return;
    EXPECT(ddpc_reducer_num_buckets(r) == 2, "%d buckets", ddpc_reducer_num_buckets(r));
    float *mem[2] = {calloc(1000, sizeof(float)), calloc(1000, sizeof(float))};
    if (mem[0] && mem[1]) {
        OK(ddpc_reducer_set_bucket_memory(r, 0, mem[0]));
        OK(ddpc_reducer_set_bucket_memory(r, 1, mem[1]));
        clear_log();
        OK(ddpc_reducer_prepare(r));
        OK(ddpc_reducer_mark_ready(r, 1, 0));
        g_fail_post_at = 1;
        g_aborts = 0;
        EXPECT(ddpc_reducer_mark_ready(r, 0, 0) == DDPC_ERR_NCCL &&
                   strstr(ddpc_last_error(), "gradient bucket 1") &&
                   strstr(ddpc_last_error(), "post 1 refused"),
               "the refused post: %s", ddpc_last_error());
        g_fail_post_at = -1;
        EXPECT(g_aborts == 1 && g_abort_status == DDPC_ERR_NCCL &&
                   strstr(g_abort_why, "gradient bucket 1") && strstr(g_abort_why, "post 1 refused"),
               "%d aborts, status %d: %s", g_aborts, (int)g_abort_status, g_abort_why);
        EXPECT(g_nlog == 1, "%d collectives posted", g_nlog);
        EXPECT(ddpc_reducer_prepare(r) == DDPC_ERR_INVALID &&
                   strstr(ddpc_last_error(), "did not finish"),
               "prepare after the refused post: %s", ddpc_last_error());
        EXPECT(g_nlog == 1 && g_log[0]->done, "the posted collective was not waited for");
        clear_log();
    }
    ddpc_reducer_destroy(r);
    free(mem[0]);
    free(mem[1]);
}

/* With DDPC_GRAD_BATCH=0 each gradient's cast into the wire, or copy into its slot, is queued as
 * it arrives. One that fails to queue (a bad launch) fails that gradient's hook with the
 * launch's reason, and aborts the group with it: the bucket will never be posted here, while
 * the peers post theirs. Which also holds for an interrupt, which the peers see as this rank's
 * failure. */
static void test_failed_gradient_queueing_aborts(void) {
    enum { CALLER = 5 };
    setenv("DDPC_GRAD_BATCH", "0", 1);
    Bf16Bucket w;
    if (bf16_bucket(&w)) {
        float g0[3] = {2, 2, 2};
        int direct = -1;
        OK(ddpc_reducer_prepare(w.r));
        g_fail_stream = CALLER;
        g_aborts = 0;
        EXPECT(ddpc_reducer_mark_ready_grad(w.r, 0, g0, CALLER, &direct) == DDPC_ERR_CUDA &&
                   strstr(ddpc_last_error(), "launch on stream 5"),
               "a cast into the wire that failed to queue: %s", ddpc_last_error());
        g_fail_stream = 0;
        EXPECT(g_aborts == 1 && g_abort_status == DDPC_ERR_CUDA &&
                   strstr(g_abort_why, "launch on stream 5"),
               "the failed cast: %d aborts, status %d: %s", g_aborts, (int)g_abort_status,
               g_abort_why);
        clear_log();
        bf16_bucket_free(&w);
    }
    size_t numels[2] = {4, 4};
    ddpc_dtype dts[2] = {DDPC_FLOAT32, DDPC_FLOAT32};
    int devs[2] = {0, 0}, order[2] = {0, 1};
    DdpcReducer *r = NULL;
    OK(ddpc_reducer_create(&g_group, 2, numels, dts, devs, order, NULL, 1000, 1000, -1, &r));
    float *mem = calloc(8, sizeof(float)), g1[4] = {1, 2, 3, 4};
    if (r && mem) {
        OK(ddpc_reducer_set_bucket_memory(r, 0, mem));
        OK(ddpc_reducer_prepare(r));
        g_fail_stream = CALLER;
        g_aborts = 0;
        EXPECT(ddpc_reducer_mark_ready_copy(r, 1, g1, CALLER) == DDPC_ERR_CUDA &&
                   strstr(ddpc_last_error(), "launch on stream 5"),
               "a copy into the slot that failed to queue: %s", ddpc_last_error());
        g_fail_stream = 0;
        EXPECT(g_aborts == 1 && g_abort_status == DDPC_ERR_CUDA,
               "the failed copy: %d aborts, status %d: %s", g_aborts, (int)g_abort_status,
               g_abort_why);
        /* the same gradient again, now queued, and the rest: the step completes (the abort is
         * the group's business; this reducer is not broken by it) */
        OK(ddpc_reducer_mark_ready_copy(r, 1, g1, CALLER));
        OK(ddpc_reducer_mark_ready(r, 0, CALLER));
        int unused = -1;
        OK(ddpc_reducer_finalize(r, CALLER, &unused));
        EXPECT(g_aborts == 1 && g_nlog == 1 && mem[4 + 3] == 2.5f,
               "after the retry: %d aborts, %d collectives, %g", g_aborts, g_nlog,
               (double)mem[4 + 3]);
        clear_log();
    }
    if (r) ddpc_reducer_destroy(r);
    free(mem);
    unsetenv("DDPC_GRAD_BATCH");
}

/* DDPC_TAIL_BUCKET_MB: the gradients that complete last get buckets of their own, of at most that
 * size, before trailing parameters larger than that. Sequence (reverse order): 9 float32
 * parameters of 100 elements (400 bytes), then one of 1000 (4000 bytes, "the tied embedding");
 * first bucket 400 bytes, cap 2000 (or 5000). */
static const size_t g_tail_numels[10] = {1000, 100, 100, 100, 100, 100, 100, 100, 100, 100};

/* The layout of the last n of those with cap bytes and DDPC_TAIL_BUCKET_MB=mb (NULL: unset):
 * nbuckets buckets, and each {parameter, bucket, offset} of want[]. */
static void check_tail_layout(const char *what, const char *mb, int n, size_t cap, int nbuckets,
                              const int (*want)[3], int nwant) {
    ddpc_dtype dts[10] = {0};
    int devs[10] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    DdpcReducer *r = NULL;
    if (mb)
        setenv("DDPC_TAIL_BUCKET_MB", mb, 1);
    else
        unsetenv("DDPC_TAIL_BUCKET_MB");
    OK(ddpc_reducer_create(&g_group, n, g_tail_numels + 10 - n, dts, devs, NULL, NULL, 400, cap,
                           -1, &r));
    if (!r) return;
    EXPECT(ddpc_reducer_num_buckets(r) == nbuckets, "%s: %d buckets", what,
           ddpc_reducer_num_buckets(r));
    for (int k = 0; k < nwant; k++) {
        int b = -1;
        size_t off = 0;
        OK(ddpc_reducer_param_slot(r, want[k][0], &b, &off));
        EXPECT(b == want[k][1] && off == (size_t)want[k][2], "%s: param %d in bucket %d at %zu",
               what, want[k][0], b, off);
    }
    ddpc_reducer_destroy(r);
}

static void test_tail_buckets(void) {
    /* without: {9}, {8..4}, {3,2,1}, {0} */
    check_tail_layout("no tail", NULL, 10, 2000, 4, (const int[][3]){{1, 2, 200}}, 1);
    /* 0.001 MiB (1048 bytes, two of the small ones): {9}, {8..4}, {3}, {2,1} (the tail), {0} */
    check_tail_layout("tail", "0.001", 10, 2000, 5,
                      (const int[][3]){{3, 2, 0}, {2, 3, 0}, {1, 3, 100}, {0, 4, 0}}, 4);
    /* the same when the last parameter is under the cap (5000): without a tail {9}, {8..1}, {0};
     * with it {9}, {8..3}, {2,1}, {0} */
    check_tail_layout("cap 5000", NULL, 10, 5000, 3, (const int[][3]){{1, 1, 700}}, 1);
    check_tail_layout("tail, cap 5000", "0.001", 10, 5000, 4,
                      (const int[][3]){{3, 1, 500}, {2, 2, 0}, {1, 2, 100}, {0, 3, 0}}, 4);
    /* a tail larger than the cap is the cap: {9}, {8,7,6}, {5..1} (the tail, 2000 bytes), {0} */
    check_tail_layout("big tail", "0.01", 10, 2000, 4,
                      (const int[][3]){{6, 1, 200}, {1, 2, 400}}, 2);
    /* a model smaller than the tail keeps its buckets: {2}, {1, 0} (the last 3 of the sizes) */
    check_tail_layout("small", "1", 3, 2000, 2, (const int[][3]){{0, 1, 100}}, 1);
    setenv("DDPC_TAIL_BUCKET_MB", "lots", 1);
    ddpc_dtype dts[3] = {0};
    int devs[3] = {-1, -1, -1};
    DdpcReducer *r = NULL;
    EXPECT(ddpc_reducer_create(&g_group, 3, g_tail_numels + 7, dts, devs, NULL, NULL, 400, 2000,
                               -1, &r) == DDPC_ERR_INVALID && !r,
           "DDPC_TAIL_BUCKET_MB=lots accepted");
    EXPECT(strstr(ddpc_last_error(), "DDPC_TAIL_BUCKET_MB=lots is not a setting: use a number from 0") != NULL,
           "message: %s", ddpc_last_error());
    unsetenv("DDPC_TAIL_BUCKET_MB");
}

int main(void) {
    unsetenv("DDPC_GRAD_BATCH"); /* the tests set it where they need it */
    unsetenv("DDPC_COMM_CASTS");
    unsetenv("DDPC_TAIL_BUCKET_MB");
    unsetenv("DDPC_CAST_BACK");
    test_assignment_and_launch_order();
    test_tail_buckets();
    test_order_late_dtypes();
    test_mark_ready_copy();
    test_copy_batch_bound();
    test_mark_ready_grad_to_wire();
    test_device_casts_on_comm_stream();
    test_device_cast_back_early();
    test_device_cast_back_overlap();
    test_summed_wire();
    test_bad_arguments();
    test_refused_post_aborts_the_group();
    test_failed_gradient_queueing_aborts();
    clear_log();
    return check_summary("test_reducer");
}
