/* test_group.c: unit test of csrc/group.c with the real group code and a fake backend whose queue
 * is driven by the test. ddpc_work_wait's guard against a backend that stopped answering: a work
 * queued behind a running one on a deadline_from_start backend (the cpu backend's case) fails
 * once the backend has begun or ended nothing for the timeout plus the grace period, and not
 * while it keeps moving; a running work fails at its deadline plus the grace period. The checks
 * of a post's arguments: bitwise reductions refused for float elements and on the nccl backend.
 * The store is not used on these paths (its calls fail loudly if they are). Built and run by
 * tests/test_reduce_c.py. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "group.h"
#include "check.h"

/* ---------------------------------------------------------------- fakes */

static int g_store_calls;

ddpc_status ddpc_store_set(DdpcStore *c, const char *key, const void *val, size_t len) {
    (void)c, (void)key, (void)val, (void)len;
    g_store_calls++;
    return ddpc_error(DDPC_ERR_INVALID, "no store in this test");
}
ddpc_status ddpc_store_get(DdpcStore *c, const char *key, int64_t timeout_ms, void **val,
                           size_t *len) {
    (void)c, (void)key, (void)timeout_ms, (void)val, (void)len;
    g_store_calls++;
    return ddpc_error(DDPC_ERR_INVALID, "no store in this test");
}
ddpc_status ddpc_store_delete(DdpcStore *c, const char *key, int *deleted) {
    (void)c, (void)key, (void)deleted;
    g_store_calls++;
    return ddpc_error(DDPC_ERR_INVALID, "no store in this test");
}
ddpc_status ddpc_store_check(DdpcStore *c, const char *const *keys, int nkeys, int *present) {
    (void)c, (void)keys, (void)nkeys, (void)present;
    g_store_calls++;
    return ddpc_error(DDPC_ERR_INVALID, "no store in this test");
}

/* The fake backend keeps what is posted in order; the test begins and completes works itself. */
#define MAX_Q 16
static DdpcWork *g_q[MAX_Q];
static int g_nq;

static ddpc_status fake_init(DdpcGroup *g) {
    snprintf(g->transport, sizeof g->transport, "fake");
    return DDPC_OK;
}
static ddpc_status fake_post(DdpcGroup *g, DdpcWork *w) {
    (void)g;
    if (g_nq == MAX_Q) return ddpc_error(DDPC_ERR_INVALID, "fake queue full");
    ddpc_work_retain(w);
    g_q[g_nq++] = w;
    return DDPC_OK;
}
static void fake_destroy(DdpcGroup *g) {
    (void)g;
    for (int i = 0; i < g_nq; i++) {
        if (!ddpc_work_is_completed(g_q[i])) {
            ddpc_error(DDPC_ERR_PEER, "destroyed");
            ddpc_work_complete(g_q[i], DDPC_ERR_PEER);
        }
        ddpc_work_release(g_q[i]);
    }
    g_nq = 0;
}

const DdpcBackendOps ddpc_backend_cpu = {
    .name = "cpu", .deadline_from_start = 1, .init = fake_init, .post = fake_post,
    .destroy = fake_destroy,
};
const DdpcBackendOps ddpc_backend_nccl = {
    .name = "nccl", .deadline_from_start = 0, .init = fake_init, .post = fake_post,
    .destroy = fake_destroy,
};

/* ---------------------------------------------------------------- helpers */

static DdpcGroup *make_group_of(const char *backend, int64_t timeout_ms, int64_t grace_ms) {
    DdpcGroupConfig cfg = {
        .rank = 0, .world_size = 2, .local_rank = 0, .local_world_size = 2, .backend = backend,
        .timeout_ms = timeout_ms, .store = (DdpcStore *)&g_store_calls, .prefix = "g0",
        .cuda_device = -1,
    };
    DdpcGroup *g = NULL;
    OK(ddpc_group_create(&cfg, &g));
    if (g) g->grace_ms = grace_ms;
    return g;
}

static DdpcGroup *make_group(int64_t timeout_ms, int64_t grace_ms) {
    return make_group_of("cpu", timeout_ms, grace_ms);
}

static DdpcWork *post_barrier(DdpcGroup *g) {
    DdpcCollArgs a = {.op = DDPC_COLL_BARRIER, .device = -1};
    DdpcWork *w = NULL;
    OK(ddpc_group_post(g, &a, &w));
    return w;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A backend that keeps moving: begins each queued work, holds it `hold_ms` (under the
 * timeout), completes it. */
typedef struct {
    int n;
    long hold_ms;
} Mover;

static void *move(void *arg) {
    Mover *m = arg;
    for (int i = 0; i < m->n; i++) {
        ddpc_work_begin(g_q[i]);
        sleep_ms(m->hold_ms);
        ddpc_work_complete(g_q[i], DDPC_OK);
    }
    return NULL;
}

/* ---------------------------------------------------------------- tests */

/* A work queued behind one that began and never ends: its wait fails once nothing has moved for
 * timeout + grace, saying it never started and that the backend stopped answering. */
static void queued_behind_a_stuck_work_fails(void) {
    DdpcGroup *g = make_group(400, 300);
    if (!g) return;
    DdpcWork *first = post_barrier(g), *second = post_barrier(g);
    if (!first || !second) return;
    int64_t t0 = ddpc_now_ms();
    ddpc_work_begin(g_q[0]); /* ... and the backend's thread sticks in it */
    ddpc_status st = ddpc_work_wait(second);
    int64_t took = ddpc_now_ms() - t0;
    EXPECT(st == DDPC_ERR_TIMEOUT, "status %d", (int)st);
    EXPECT(took >= 650 && took < 5000, "failed after %lld ms, expected about 700",
           (long long)took);
    EXPECT(strstr(ddpc_last_error(), "never started") &&
               strstr(ddpc_last_error(), "stopped answering") &&
               strstr(ddpc_last_error(), "barrier #2"),
           "message: %s", ddpc_last_error());
    /* the running one fails at its own deadline plus the grace period */
    st = ddpc_work_wait(first);
    EXPECT(st == DDPC_ERR_TIMEOUT && strstr(ddpc_last_error(), "did not finish within"),
           "status %d: %s", (int)st, ddpc_last_error());
    ddpc_work_release(first);
    ddpc_work_release(second);
    ddpc_group_destroy(g);
}

/* Works queued behind others that each take under the timeout: the last one waits longer than
 * timeout + grace in all, and still succeeds (the guard counts from the last progress). */
static void queued_behind_moving_works_succeeds(void) {
    DdpcGroup *g = make_group(400, 300);
    if (!g) return;
    enum { N = 6 };
    DdpcWork *w[N];
    for (int i = 0; i < N; i++) {
        w[i] = post_barrier(g);
        if (!w[i]) return;
    }
    Mover m = {N, 250};
    pthread_t t;
    int64_t t0 = ddpc_now_ms();
    EXPECT(pthread_create(&t, NULL, move, &m) == 0, "pthread_create");
    OK(ddpc_work_wait(w[N - 1]));
    int64_t took = ddpc_now_ms() - t0;
    EXPECT(took >= 1400, "the last work ended after %lld ms, before the ones ahead of it could",
           (long long)took);
    pthread_join(t, NULL);
    for (int i = 0; i < N; i++) ddpc_work_release(w[i]);
    ddpc_group_destroy(g);
}

/* A work posted long after the backend last moved (an idle group) is not failed at once: the
 * guard counts from its post when that is later. */
static void idle_group_then_post_is_not_stuck(void) {
    DdpcGroup *g = make_group(200, 100);
    if (!g) return;
    sleep_ms(500); /* idle longer than timeout + grace */
    DdpcWork *w = post_barrier(g);
    if (!w) return;
    EXPECT(!ddpc_group_backend_stuck(g, w->posted_ms), "a fresh post reads as stuck");
    Mover m = {1, 50};
    pthread_t t;
    EXPECT(pthread_create(&t, NULL, move, &m) == 0, "pthread_create");
    OK(ddpc_work_wait(w));
    pthread_join(t, NULL);
    ddpc_work_release(w);
    ddpc_group_destroy(g);
}

/* BAND, BOR and BXOR: of integers on the cpu backend; refused for floats (naming the op and
 * the dtype) and on the nccl backend (NCCL has none), before anything is queued. */
static void bitwise_ops_are_checked_at_the_post(void) {
    int32_t buf[4] = {0};
    DdpcCollArgs a = {.op = DDPC_COLL_ALLREDUCE, .send = buf, .recv = buf, .count = 4,
                      .dtype = DDPC_INT32, .redop = DDPC_BXOR, .device = -1};
    DdpcWork *w = NULL;
    DdpcGroup *g = make_group(1000, 1000);
    if (!g) return;
    OK(ddpc_group_post(g, &a, &w));
    EXPECT(w && g_nq == 1, "an int32 bxor was not queued");
    if (w) {
        ddpc_work_complete(w, DDPC_OK);
        ddpc_work_release(w);
    }
    for (int dt = DDPC_FLOAT32; dt <= DDPC_BFLOAT16; dt++) {
        a.dtype = (ddpc_dtype)dt;
        a.redop = DDPC_BAND;
        w = NULL;
        EXPECT(ddpc_group_post(g, &a, &w) == DDPC_ERR_INVALID && !w &&
                   strstr(ddpc_last_error(), "op=band works on the bits of integer and bool") &&
                   strstr(ddpc_last_error(), ddpc_dtype_name((ddpc_dtype)dt)),
               "%s band: %s", ddpc_dtype_name((ddpc_dtype)dt), ddpc_last_error());
    }
    /* broadcast and all_gather carry no reduction: their redop field is not looked at */
    DdpcCollArgs b = {.op = DDPC_COLL_BROADCAST, .recv = buf, .count = 4,
                      .dtype = DDPC_FLOAT32, .redop = DDPC_BOR, .device = -1};
    OK(ddpc_group_post(g, &b, &w));
    if (w) {
        ddpc_work_complete(w, DDPC_OK);
        ddpc_work_release(w);
    }
    EXPECT(g_nq == 2, "%d works queued, expected 2", g_nq);
    ddpc_group_destroy(g);

    g = make_group_of("nccl", 1000, 1000);
    if (!g) return;
    a.dtype = DDPC_INT64;
    for (int op = DDPC_BAND; op <= DDPC_BXOR; op++) {
        a.redop = (ddpc_redop)op;
        a.op = op == DDPC_BOR ? DDPC_COLL_REDUCE_SCATTER : DDPC_COLL_ALLREDUCE;
        a.count = op == DDPC_BOR ? 2 : 4;
        w = NULL;
        EXPECT(ddpc_group_post(g, &a, &w) == DDPC_ERR_INVALID && !w &&
                   strstr(ddpc_last_error(), "NCCL has no bitwise reductions") &&
                   strstr(ddpc_last_error(), ddpc_redop_name((ddpc_redop)op)),
               "nccl %s: %s", ddpc_redop_name((ddpc_redop)op), ddpc_last_error());
    }
    EXPECT(g_nq == 0, "%d works queued on nccl", g_nq);
    ddpc_group_destroy(g);
}

int main(void) {
    bitwise_ops_are_checked_at_the_post();
    queued_behind_a_stuck_work_fails();
    queued_behind_moving_works_succeeds();
    idle_group_then_post_is_not_stuck();
    EXPECT(g_store_calls == 0, "the store was called %d times", g_store_calls);
    return check_summary("test_group");
}
