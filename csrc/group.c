/* group.c: process groups: the backend table, argument checks, sequence numbers, work objects,
 * deadlines, and the abort/"who never arrived" bookkeeping kept in the store. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "group.h"

static const DdpcBackendOps *find_backend(const char *name) {
    if (!name || !strcmp(name, "cpu") || !strcmp(name, "gloo")) return &ddpc_backend_cpu;
    if (!strcmp(name, "nccl")) return &ddpc_backend_nccl;
    return NULL;
}

const char *ddpc_coll_name(ddpc_coll op) {
    switch (op) {
    case DDPC_COLL_ALLREDUCE: return "all_reduce";
    case DDPC_COLL_BROADCAST: return "broadcast";
    case DDPC_COLL_ALLGATHER: return "all_gather";
    case DDPC_COLL_REDUCE_SCATTER: return "reduce_scatter";
    case DDPC_COLL_BARRIER: return "barrier";
    default: return "unknown collective";
    }
}

static void copy_str(char *dst, size_t len, const char *src) {
    snprintf(dst, len, "%s", src ? src : "");
}

ddpc_status ddpc_group_create(const DdpcGroupConfig *cfg, DdpcGroup **out) {
    *out = NULL;
    if (!cfg) return ddpc_error(DDPC_ERR_INVALID, "group config is NULL");
    if (cfg->world_size < 1)
        return ddpc_error(DDPC_ERR_INVALID, "world_size must be >= 1, got %d", cfg->world_size);
    if (cfg->rank < 0 || cfg->rank >= cfg->world_size)
        return ddpc_error(DDPC_ERR_INVALID, "rank must be in [0, %d), got %d", cfg->world_size,
                          cfg->rank);
    if (!cfg->store) return ddpc_error(DDPC_ERR_INVALID, "a process group needs a store");
    DDPC_CHECK(ddpc_settings_check());
    const DdpcBackendOps *ops = find_backend(cfg->backend);
    if (!ops)
        return ddpc_error(DDPC_ERR_INVALID, "unknown backend '%s': use 'cpu' or 'nccl'",
                          cfg->backend);
    DdpcGroup *g = calloc(1, sizeof *g);
    if (!g) return ddpc_error(DDPC_ERR_NOMEM, "out of host memory creating a process group");
    g->rank = cfg->rank;
    g->world = cfg->world_size;
    g->local_rank = cfg->local_rank >= 0 ? cfg->local_rank : cfg->rank;
    g->local_world = cfg->local_world_size > 0 ? cfg->local_world_size : cfg->world_size;
    g->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 600000;
    g->grace_ms = 30000;
    atomic_init(&g->progress_ms, ddpc_now_ms());
    double stall_s = 60.0;
    DDPC_CHECK(ddpc_setting_number("DDPC_STALL_WARN", 60.0, &stall_s));
    g->stall_ms = (int64_t)(stall_s * 1000.0);
    if (g->stall_ms >= g->timeout_ms) g->stall_ms = 0; /* the timeout says it first */
    g->store = cfg->store;
    copy_str(g->prefix, sizeof g->prefix, cfg->prefix && cfg->prefix[0] ? cfg->prefix : "g0");
    copy_str(g->host_id, sizeof g->host_id, cfg->host_id);
    copy_str(g->bind_addr, sizeof g->bind_addr,
             cfg->bind_addr && cfg->bind_addr[0] ? cfg->bind_addr : "127.0.0.1");
    g->want_transport = cfg->transport;
    g->cuda_device = cfg->cuda_device;
    g->ops = ops;
    g->next_seq = 1;
    atomic_init(&g->aborted, 0);
    atomic_init(&g->refs, 1);
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_init(&g->impl_mu, NULL);
    ddpc_status st = ops->init(g);
    if (st != DDPC_OK) {
        ddpc_error_prefix(st, "creating the %s process group (rank %d of %d): ", ops->name,
                          g->rank, g->world);
        pthread_mutex_destroy(&g->impl_mu);
        pthread_mutex_destroy(&g->mu);
        free(g);
        return st;
    }
    DDPC_INFO("GROUP", "rank %d/%d backend %s transport %s prefix %s", g->rank, g->world,
              ops->name, g->transport, g->prefix);
    *out = g;
    return DDPC_OK;
}

/* The struct stays until its last work is released: Python may drop a Work after
 * destroy_process_group, and releasing it reads w->g. */
static void group_unref(DdpcGroup *g) {
    if (atomic_fetch_sub(&g->refs, 1) != 1) return;
    pthread_mutex_destroy(&g->impl_mu);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

void ddpc_group_destroy(DdpcGroup *g) {
    if (!g) return;
    g->ops->destroy(g);
    group_unref(g);
}

int ddpc_group_rank(const DdpcGroup *g) { return g->rank; }
int ddpc_group_size(const DdpcGroup *g) { return g->world; }
const char *ddpc_group_backend(const DdpcGroup *g) { return g->ops->name; }
const char *ddpc_group_transport(const DdpcGroup *g) { return g->transport; }
int64_t ddpc_group_timeout_ms(const DdpcGroup *g) { return g->timeout_ms; }

void ddpc_group_host_id(const DdpcGroup *g, char *buf, size_t len) {
    if (g->host_id[0])
        snprintf(buf, len, "%s", g->host_id);
    else
        ddpc_default_host_id(buf, len);
}

void ddpc_group_key(const DdpcGroup *g, char *buf, size_t len, const char *fmt, ...) {
    int n = snprintf(buf, len, "%s/", g->prefix);
    if (n < 0 || (size_t)n >= len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, len - (size_t)n, fmt, ap);
    va_end(ap);
}

void ddpc_group_abort(DdpcGroup *g, ddpc_status st, const char *why) {
    int expected = 0;
    if (!atomic_compare_exchange_strong(&g->aborted, &expected, 2)) return;
    g->abort_status = st;
    snprintf(g->abort_msg, sizeof g->abort_msg, "%s", why);
    atomic_store(&g->aborted, 1);
    char key[256];
    char val[2200];
    ddpc_group_key(g, key, sizeof key, "abort");
    int n = snprintf(val, sizeof val, "%d:rank %d aborted the group: %s", (int)st, g->rank, why);
    /* Best effort: the store may be the thing that failed. */
    ddpc_store_set(g->store, key, val, (size_t)DDPC_MIN(n, (int)sizeof val - 1));
    ddpc_group_call_abort_hook(g);
}

void ddpc_group_call_abort_hook(DdpcGroup *g) {
    if (!g->ops->abort) return;
    pthread_mutex_lock(&g->impl_mu);
    g->ops->abort(g);
    pthread_mutex_unlock(&g->impl_mu);
}

void ddpc_group_take_impl(DdpcGroup *g) {
    pthread_mutex_lock(&g->impl_mu);
    g->impl = NULL;
    pthread_mutex_unlock(&g->impl_mu);
}

ddpc_status ddpc_group_check_abort(DdpcGroup *g) {
    if (atomic_load(&g->aborted) == 1) return ddpc_error(g->abort_status, "%s", g->abort_msg);
    char key[256];
    const char *keys[1] = {key};
    int present = 0;
    ddpc_group_key(g, key, sizeof key, "abort");
    if (ddpc_store_check(g->store, keys, 1, &present) != DDPC_OK || !present) return DDPC_OK;
    void *val = NULL;
    size_t len = 0;
    if (ddpc_store_get(g->store, key, 1000, &val, &len) != DDPC_OK) return DDPC_OK;
    char *s = val;
    /* "<status>:<message>", written by a peer's ddpc_group_abort; not NUL-terminated. A status
     * outside the failures a peer can report (e.g. "interrupted") is read as a peer failure. */
    char num[16];
    snprintf(num, sizeof num, "%.*s", (int)DDPC_MIN(len, sizeof num - 1), s);
    int code = atoi(num);
    int known = code > 0 && code <= DDPC_ERR_PROTOCOL && code != DDPC_ERR_INTERRUPTED;
    char *colon = memchr(s, ':', len);
    int expected = 0;
    if (atomic_compare_exchange_strong(&g->aborted, &expected, 2)) {
        g->abort_status = known ? (ddpc_status)code : DDPC_ERR_PEER;
        snprintf(g->abort_msg, sizeof g->abort_msg, "%.*s",
                 (int)(colon ? len - (size_t)(colon + 1 - s) : len), colon ? colon + 1 : s);
        atomic_store(&g->aborted, 1);
        ddpc_group_call_abort_hook(g);
    }
    free(val);
    while (atomic_load(&g->aborted) != 1) { /* another thread is filling abort_msg */ }
    return ddpc_error(g->abort_status, "%s", g->abort_msg);
}

int ddpc_group_rank_dead(DdpcGroup *g, int r) {
    char key[64];
    const char *keys[1] = {key};
    int present = 0;
    snprintf(key, sizeof key, "ddpc/dead/%d", r);
    if (ddpc_store_check(g->store, keys, 1, &present) != DDPC_OK) return 0;
    return present;
}

/* A store value as text in buf (at most len - 1 bytes); 0 when the key is missing. */
static int store_text(DdpcGroup *g, const char *key, char *buf, size_t len) {
    const char *keys[1] = {key};
    int present = 0;
    if (ddpc_store_check(g->store, keys, 1, &present) != DDPC_OK || !present) return 0;
    void *val = NULL;
    size_t n = 0;
    if (ddpc_store_get(g->store, key, 1000, &val, &n) != DDPC_OK) return 0;
    snprintf(buf, len, "%.*s", (int)DDPC_MIN(n, len - 1), (const char *)val);
    free(val);
    return 1;
}

int ddpc_group_init_failure(DdpcGroup *g, char *buf, size_t len) {
    char num[32], key[64], why[1200];
    size_t used = 0;
    buf[0] = '\0';
    if (store_text(g, DDPC_STORE_FIRST_FAILED_KEY, num, sizeof num)) {
        int r = atoi(num);
        snprintf(key, sizeof key, DDPC_STORE_FAILED_PREFIX "%d", r);
        if (!store_text(g, key, why, sizeof why)) snprintf(why, sizeof why, "(no message left)");
        snprintf(buf, len, "rank %d failed in init_process_group %s", r, why);
    } else if (store_text(g, DDPC_STORE_FIRST_DEAD_KEY, num, sizeof num)) {
        snprintf(buf, len, "rank %d exited (its store connection dropped) before the group was "
                 "made; look at its output for why it stopped", atoi(num));
    }
    used = strlen(buf);
    /* Said as well when a rank failed: a second claimant of a rank is usually why (a node
     * started with another --nproc-per-node computes other ranks and another WORLD_SIZE). */
    if (used + 1 < len && store_text(g, DDPC_STORE_REFUSED_KEY, why, sizeof why))
        snprintf(buf + used, len - used, "%s%s: two processes claim one rank, so this job's "
                 "ranks do not add up to WORLD_SIZE. With ddpc.launch --nnodes (or torchrun), "
                 "every node must run the same --nproc-per-node and its own --node-rank; else give "
                 "each process its own RANK, and each job its own MASTER_PORT",
                 used ? ". Also, " : "", why);
    return buf[0] != '\0';
}

static void describe_prefix(const char *prefix, char *buf, size_t len);

/* Set once this process published "ddpc/waiting/<rank>" (a timeout); the next collective it
 * posts deletes the key. */
static atomic_int g_waiting_published;

/* The stall note counts from where the timeout does (deadline_ms - timeout_ms), so its "has waited
 * N s" and "gives up after T s" agree. A work not begun (INT64_MAX) has not waited yet. */
int ddpc_group_stall_due(const DdpcGroup *g, DdpcWork *w) {
    int64_t deadline = atomic_load(&w->deadline_ms);
    return g->stall_ms > 0 && !atomic_load(&w->stall_noted) && deadline != INT64_MAX &&
           ddpc_now_ms() - (deadline - g->timeout_ms) >= g->stall_ms;
}

void ddpc_group_note_stall(DdpcGroup *g, DdpcWork *w, const char *what) {
    if (!ddpc_group_stall_due(g, w)) return;
    int64_t waited = ddpc_now_ms() - (atomic_load(&w->deadline_ms) - g->timeout_ms);
    int expected = 0;
    if (!atomic_compare_exchange_strong(&w->stall_noted, &expected, 1)) return;
    char where[160], whom[64];
    describe_prefix(g->prefix, where, sizeof where);
    if (g->world == 2)
        snprintf(whom, sizeof whom, "rank %d", 1 - g->rank);
    else
        snprintf(whom, sizeof whom, "the ranks that have not reached it");
    fprintf(stderr,
            "ddpc: rank %d has waited %.0f s in %s (%s) for %s; it gives up after %.0f s (timeout= "
            "of %s). Nothing is wrong if a rank is only busy (rank 0 evaluating alone, say); if "
            "one is stuck, its Python stack shows where (py-spy dump --pid PID; ddpc.launch "
            "shows the ranks' stacks at the timeout). DDPC_STALL_WARN=0 turns this note off\n",
            g->rank, (double)waited / 1000.0, what, where, whom, (double)g->timeout_ms / 1000.0,
            ddpc_group_timeout_owner(g));
    fflush(stderr);
}

const char *ddpc_group_timeout_owner(const DdpcGroup *g) {
    return strcmp(g->prefix, "g0") == 0 ? "init_process_group" : "new_group";
}

/* "the default group" for "g0", "the group of new_group call #K" for "gK" (ddpc.distributed
 * names its groups so), else the prefix itself. */
static void describe_prefix(const char *prefix, char *buf, size_t len) {
    char *end = NULL;
    long k = prefix[0] == 'g' ? strtol(prefix + 1, &end, 10) : -1;
    if (k == 0 && end && !*end)
        snprintf(buf, len, "the default group");
    else if (k > 0 && end && !*end)
        snprintf(buf, len, "the group of new_group call #%ld", k);
    else
        snprintf(buf, len, "the group with store prefix %s", prefix);
}

static int64_t wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Rank r's "ddpc/waiting/<r>" ("<prefix> <seq> <wall ms>", set when one of its collectives timed
 * out), if it names a group other than g and was set while this rank waited (not before this
 * collective began: then r has caught that timeout and gone on): written into buf as "it is
 * waiting in collective #N of <that group>". Returns whether it did. */
static int waiting_elsewhere(DdpcGroup *g, int r, char *buf, size_t len) {
    char key[64], val[160], prefix[128], where[160];
    unsigned long long seq = 0;
    long long at = 0;
    snprintf(key, sizeof key, "ddpc/waiting/%d", r);
    if (!store_text(g, key, val, sizeof val)) return 0;
    if (sscanf(val, "%127s %llu %lld", prefix, &seq, &at) != 3 || strcmp(prefix, g->prefix) == 0)
        return 0;
    /* (this collective's timeout, which has just run out, began timeout_ms ago: at its post, or
     * when it started executing on a deadline_from_start backend; a second of slack for the
     * clocks) */
    if (at < wall_ms() - g->timeout_ms - 1000) return 0;
    describe_prefix(prefix, where, sizeof where);
    snprintf(buf, len, "never arrived (it is waiting in collective #%llu of %s: every rank must "
             "use the groups in the same order)", seq, where);
    return 1;
}

void ddpc_group_describe_missing(DdpcGroup *g, uint64_t seq, char *buf, size_t len) {
    char key[256];
    char val[160];
    size_t used = 0;
    buf[0] = '\0';
    ddpc_group_key(g, key, sizeof key, "progress/%d", g->rank);
    int n = snprintf(val, sizeof val, "%llu", (unsigned long long)seq);
    ddpc_store_set(g->store, key, val, (size_t)n);
    /* Not under the group's prefix: a peer waiting in another group finds it there. */
    snprintf(key, sizeof key, "ddpc/waiting/%d", g->rank);
    n = snprintf(val, sizeof val, "%s %llu %lld", g->prefix, (unsigned long long)seq,
                 (long long)wall_ms());
    ddpc_store_set(g->store, key, val, (size_t)DDPC_MIN((size_t)n, sizeof val - 1));
    /* Peers that timed out on the same collective publish within a moment of us. */
    int64_t deadline = ddpc_deadline(2000);
    for (int r = 0; r < g->world; r++) {
        if (r == g->rank) continue;
        const char *what = NULL;
        char tmp[256];
        if (ddpc_group_rank_dead(g, r)) {
            what = "exited (its store connection dropped)";
        } else {
            void *pv = NULL;
            size_t pl = 0;
            ddpc_group_key(g, key, sizeof key, "progress/%d", r);
            int64_t left = deadline - ddpc_now_ms();
            if (ddpc_store_get(g->store, key, left > 0 ? left : 1, &pv, &pl) == DDPC_OK) {
                char num[32];
                snprintf(num, sizeof num, "%.*s", (int)DDPC_MIN(pl, sizeof num - 1), (char *)pv);
                unsigned long long theirs = strtoull(num, NULL, 10);
                free(pv);
                if (theirs < seq) {
                    snprintf(tmp, sizeof tmp, "never arrived (it is waiting in collective #%llu)",
                             theirs);
                    what = tmp;
                } else if (theirs > seq) {
                    snprintf(tmp, sizeof tmp, "is already past it (waiting in collective #%llu)",
                             theirs);
                    what = tmp;
                }
            } else if (waiting_elsewhere(g, r, tmp, sizeof tmp)) {
                what = tmp;
            } else {
                what = "never arrived (it is not in any collective: busy, hung or stopped)";
            }
        }
        if (what) {
            int m = snprintf(buf + used, len - used, "%srank %d %s", used ? "; " : "", r, what);
            if (m < 0 || (size_t)m >= len - used) break;
            used += (size_t)m;
        }
    }
    if (!used) snprintf(buf, len, "every rank reached it; the transfer itself stalled");
    atomic_store(&g_waiting_published, 1);
}

/* This rank goes on after a timeout (it caught the error): a peer that times out later must
 * not take it for still waiting where it was. */
static void unpublish_waiting(DdpcGroup *g) {
    /* (a load first: every post comes here, and only one after a timeout has work to do) */
    if (!atomic_load_explicit(&g_waiting_published, memory_order_relaxed) ||
        !atomic_exchange(&g_waiting_published, 0))
        return;
    char key[64];
    int deleted = 0;
    snprintf(key, sizeof key, "ddpc/waiting/%d", g->rank);
    (void)ddpc_store_delete(g->store, key, &deleted);
}

/* ---------------------------------------------------------------- work objects */

static ddpc_status check_args(const DdpcGroup *g, const DdpcCollArgs *a) {
    const char *name = ddpc_coll_name(a->op);
    if ((unsigned)a->op >= DDPC_NUM_COLLS)
        return ddpc_error(DDPC_ERR_INVALID, "unknown collective %d", (int)a->op);
    if ((a->before || a->after) && a->device < 0)
        return ddpc_error(DDPC_ERR_INVALID, "%s: work to queue before or after it needs device "
                          "memory: host work has no stream to queue it on", name);
    if (a->op == DDPC_COLL_BARRIER) return DDPC_OK;
    if (!ddpc_dtype_size(a->dtype))
        return ddpc_error(DDPC_ERR_INVALID, "%s: unsupported dtype code %d", name, (int)a->dtype);
    if ((unsigned)a->redop >= DDPC_NUM_REDOPS)
        return ddpc_error(DDPC_ERR_INVALID, "%s: unknown reduce op %d", name, (int)a->redop);
    if (a->redop == DDPC_AVG && a->dtype >= DDPC_INT32 &&
        (a->op == DDPC_COLL_ALLREDUCE || a->op == DDPC_COLL_REDUCE_SCATTER))
        return ddpc_error(DDPC_ERR_INVALID, "%s: op=AVG of %s elements would round the average "
                          "down (and may overflow): use op=SUM and divide in floating point, or "
                          "pass a floating-point tensor", name, ddpc_dtype_name(a->dtype));
    int reduces = a->op == DDPC_COLL_ALLREDUCE || a->op == DDPC_COLL_REDUCE_SCATTER;
    if (reduces && DDPC_REDOP_BITWISE(a->redop) && a->dtype < DDPC_INT32)
        return ddpc_error(DDPC_ERR_INVALID, "%s: op=%s works on the bits of integer and bool "
                          "elements, not %s ones: pass an integer or bool tensor (a float's bits "
                          "can be viewed as one: x.view(torch.int32))", name,
                          ddpc_redop_name(a->redop), ddpc_dtype_name(a->dtype));
    if (reduces && DDPC_REDOP_BITWISE(a->redop) && g->ops == &ddpc_backend_nccl)
        return ddpc_error(DDPC_ERR_INVALID, "%s: op=%s: NCCL has no bitwise reductions (torch's "
                          "nccl backend refuses them too): for bool elements use MIN (every rank "
                          "True, BAND) or MAX (any rank True, BOR); otherwise run it on the cpu "
                          "backend (a new_group(backend='cpu') of host tensors)", name,
                          ddpc_redop_name(a->redop));
    if (a->count && !a->recv)
        return ddpc_error(DDPC_ERR_INVALID, "%s: the output buffer is NULL", name);
    if ((a->op == DDPC_COLL_ALLGATHER || a->op == DDPC_COLL_REDUCE_SCATTER) && a->count && !a->send)
        return ddpc_error(DDPC_ERR_INVALID, "%s: the input buffer is NULL", name);
    if (a->op == DDPC_COLL_BROADCAST && (a->root < 0 || a->root >= g->world))
        return ddpc_error(DDPC_ERR_INVALID, "broadcast: src must be in [0, %d), got %d", g->world,
                          a->root);
    if ((a->op == DDPC_COLL_ALLREDUCE || a->op == DDPC_COLL_BROADCAST) && a->send &&
        a->send != a->recv)
        return ddpc_error(DDPC_ERR_INVALID, "%s works in place: send must equal recv", name);
    return DDPC_OK;
}

ddpc_status ddpc_group_post(DdpcGroup *g, const DdpcCollArgs *args, DdpcWork **out) {
    *out = NULL;
    DDPC_CHECK(check_args(g, args));
    unpublish_waiting(g);
    if (atomic_load(&g->aborted) == 1)
        return ddpc_error(g->abort_status, "the process group was aborted earlier: %s",
                          g->abort_msg);
    DdpcWork *w = calloc(1, sizeof *w);
    if (!w) return ddpc_error(DDPC_ERR_NOMEM, "out of host memory posting %s",
                              ddpc_coll_name(args->op));
    atomic_init(&w->refs, 1);
    atomic_init(&w->done, 0);
    w->g = g;
    atomic_fetch_add(&g->refs, 1);
    w->args = *args;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    pthread_mutex_lock(&g->mu);
    w->seq = g->next_seq++;
    w->posted_ms = ddpc_now_ms();
    atomic_init(&w->deadline_ms, g->ops->deadline_from_start ? INT64_MAX
                                                             : ddpc_deadline(g->timeout_ms));
    ddpc_status st = g->ops->post(g, w);
    pthread_mutex_unlock(&g->mu);
    if (st != DDPC_OK) {
        ddpc_work_release(w);
        return st;
    }
    *out = w;
    return DDPC_OK;
}

size_t ddpc_group_fast_max_bytes(const DdpcGroup *g) { return g->fast_max_bytes; }
size_t ddpc_group_staged_min_bytes(const DdpcGroup *g) { return g->staged_min_bytes; }
uint64_t ddpc_group_deferred_count(DdpcGroup *g) { return atomic_load(&g->n_deferred); }

ddpc_status ddpc_group_wait_posted(DdpcGroup *g) {
    return g->ops->wait_posted ? g->ops->wait_posted(g) : DDPC_OK;
}

ddpc_status ddpc_group_wait_idle(DdpcGroup *g) {
    return g->ops->wait_idle ? g->ops->wait_idle(g) : DDPC_OK;
}

ddpc_status ddpc_group_window_alloc(DdpcGroup *g, size_t bytes, void **out) {
    *out = NULL;
    if (!bytes)
        return ddpc_error(DDPC_ERR_INVALID, "a symmetric window of 0 bytes: ask for at least one");
    if (!g->ops->window_alloc)
        return ddpc_error(DDPC_ERR_UNAVAILABLE, "the %s backend has no symmetric windows: they "
                          "need the nccl backend", g->ops->name);
    /* Under mu, as every post: the registration is a collective of its own inside NCCL, so no
     * other thread's collective may come between it and the posts before it on one rank only. */
    pthread_mutex_lock(&g->mu);
    ddpc_status st = g->ops->window_alloc(g, bytes, out);
    pthread_mutex_unlock(&g->mu);
    return st;
}

static ddpc_status no_trace(const DdpcGroup *g) {
    return ddpc_error(DDPC_ERR_INVALID, "the %s backend keeps no device timeline: tracing "
                      "collectives needs the nccl backend (CUDA tensors, "
                      "init_process_group(backend='nccl'))", g->ops->name);
}

ddpc_status ddpc_group_trace_start(DdpcGroup *g, size_t capacity) {
    if (!g->ops->trace_start) return no_trace(g);
    if (capacity == 0)
        return ddpc_error(DDPC_ERR_INVALID, "a trace needs room for at least one row: pass a "
                          "capacity of 1 or more");
    pthread_mutex_lock(&g->mu);
    ddpc_status st = g->ops->trace_start(g, capacity);
    pthread_mutex_unlock(&g->mu);
    return st;
}

ddpc_status ddpc_group_trace_mark(DdpcGroup *g, uintptr_t stream) {
    if (!g->ops->trace_mark) return no_trace(g);
    pthread_mutex_lock(&g->mu);
    ddpc_status st = g->ops->trace_mark(g, stream);
    pthread_mutex_unlock(&g->mu);
    return st;
}

ddpc_status ddpc_group_trace_stop(DdpcGroup *g, DdpcTraceRow **rows, size_t *n,
                                  uint64_t *dropped) {
    *rows = NULL;
    *n = 0;
    *dropped = 0;
    if (!g->ops->trace_stop) return no_trace(g);
    void *detached = NULL;
    pthread_mutex_lock(&g->mu);
    ddpc_status st = g->ops->trace_stop(g, &detached);
    pthread_mutex_unlock(&g->mu);
    if (st != DDPC_OK) return st;
    /* Without the lock: waiting for the events must not hold up other threads' collectives.
     * The trace is ours now; the reference keeps the group's memory (which the wait reads for
     * an abort) alive should another thread destroy the group meanwhile. */
    atomic_fetch_add(&g->refs, 1);
    st = g->ops->trace_collect(g, detached, rows, n, dropped);
    group_unref(g);
    return st;
}

ddpc_status ddpc_group_all_reduce_now(DdpcGroup *g, const DdpcCollArgs *args, int *ran) {
    *ran = 0;
    if (!g->ops->all_reduce_now || args->op != DDPC_COLL_ALLREDUCE) return DDPC_OK;
    DDPC_CHECK(check_args(g, args));
    if (atomic_load(&g->aborted) == 1)
        return ddpc_error(g->abort_status, "the process group was aborted earlier: %s",
                          g->abort_msg);
    pthread_mutex_lock(&g->mu);
    ddpc_status st = g->ops->all_reduce_now(g, args, g->next_seq, ran);
    if (*ran) g->next_seq++;
    pthread_mutex_unlock(&g->mu);
    return st;
}

void ddpc_work_begin(DdpcWork *w) {
    atomic_store(&w->g->progress_ms, ddpc_now_ms());
    atomic_store(&w->deadline_ms, ddpc_deadline(w->g->timeout_ms));
}

int ddpc_group_backend_stuck(DdpcGroup *g, int64_t since_ms) {
    int64_t last = DDPC_MAX(atomic_load(&g->progress_ms), since_ms);
    return ddpc_now_ms() - last >= g->timeout_ms + g->grace_ms;
}

void ddpc_work_complete(DdpcWork *w, ddpc_status st) {
    atomic_store(&w->g->progress_ms, ddpc_now_ms());
    pthread_mutex_lock(&w->mu);
    w->status = st;
    if (st != DDPC_OK) w->msg = strdup(ddpc_last_error());
    atomic_store(&w->done, 1);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

int ddpc_work_is_completed(DdpcWork *w) { return atomic_load(&w->done); }
int ddpc_work_failed(DdpcWork *w) { return atomic_load(&w->done) && w->status != DDPC_OK; }
uint64_t ddpc_work_seq(const DdpcWork *w) { return w->seq; }
void ddpc_work_retain(DdpcWork *w) { atomic_fetch_add(&w->refs, 1); }

void ddpc_work_release(DdpcWork *w) {
    if (!w || atomic_fetch_sub(&w->refs, 1) != 1) return;
    DdpcGroup *g = w->g;
    if (g && g->ops->work_free) g->ops->work_free(w);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w->msg);
    free(w);
    if (g) group_unref(g);
}

ddpc_status ddpc_work_wait(DdpcWork *w) {
    /* The backend enforces the deadline and completes the work with a timeout that names the
     * missing ranks; this grace period only guards against a backend that stopped answering.
     * Read each slice: a queued work gets its deadline only when it starts (deadline_from_start),
     * and waits behind the works before it, each of which ends by its own deadline: until then
     * the guard is the backend's progress (ddpc_group_backend_stuck). */
    DdpcGroup *g = w->g;
    pthread_mutex_lock(&w->mu);
    while (!atomic_load(&w->done)) {
        int64_t deadline = atomic_load(&w->deadline_ms);
        int queued = deadline >= INT64_MAX - g->grace_ms;
        int64_t hard = queued ? INT64_MAX : deadline + g->grace_ms;
        int64_t slice = ddpc_slice(hard, DDPC_SLICE_MS);
        if (queued ? ddpc_group_backend_stuck(g, w->posted_ms)
                   : slice <= 0 && ddpc_now_ms() >= hard) {
            pthread_mutex_unlock(&w->mu);
            if (queued)
                return ddpc_error(DDPC_ERR_TIMEOUT,
                                  "%s #%llu on rank %d never started: the %s backend has begun "
                                  "or ended no collective for %.0f s (the timeout plus %.0f s) "
                                  "and stopped answering; this is a bug in ddpc, please report "
                                  "it with the ranks' stacks (py-spy dump --native --pid PID)",
                                  ddpc_coll_name(w->args.op), (unsigned long long)w->seq,
                                  g->rank, g->ops->name,
                                  (double)(g->timeout_ms + g->grace_ms) / 1000.0,
                                  (double)g->grace_ms / 1000.0);
            return ddpc_error(DDPC_ERR_TIMEOUT,
                              "%s #%llu did not finish within the timeout on rank %d and its "
                              "backend stopped answering",
                              ddpc_coll_name(w->args.op), (unsigned long long)w->seq, g->rank);
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t ns = (int64_t)ts.tv_nsec + slice * 1000000;
        ts.tv_sec += ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
        if (!atomic_load(&w->done)) {
            pthread_mutex_unlock(&w->mu);
            DDPC_CHECK(ddpc_check_interrupt());
            pthread_mutex_lock(&w->mu);
        }
    }
    pthread_mutex_unlock(&w->mu);
    if (w->status != DDPC_OK) return ddpc_error(w->status, "%s", w->msg ? w->msg : "failed");
    return DDPC_OK;
}

ddpc_status ddpc_work_wait_stream(DdpcWork *w, uintptr_t stream) {
    if (w->args.device >= 0 && w->g->ops->wait_stream) return w->g->ops->wait_stream(w, stream);
    return ddpc_work_wait(w);
}
