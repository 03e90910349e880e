/* comm_cpu.c: the cpu backend: collectives on host memory, run in order by one communication
 * thread per group. Ranks on one host share a memory segment (C11 atomics + futex, no sockets on
 * the data path); ranks on different hosts (or DDPC_CPU_TRANSPORT=tcp) use TCP rings. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "group.h"

/* Shared-memory slot per rank and per buffer (two buffers: a rank fills chunk j+1 while slower
 * ranks still read chunk j). Rank 0 may override it with DDPC_SHM_SLOT_BYTES (a tuning knob;
 * it publishes its choice in the segment so every rank agrees). */
#define SHM_SLOT_DEFAULT (1u << 20)
#define SHM_SLOT_MIN (64u << 10) /* DDPC_SHM_SLOT_BYTES takes 64 KiB to 64 MiB (settings.c) */
#define SHM_MAGIC 0x6464706373686d31ull /* "ddpcshm1" */
/* Elements reduced per call in the shm all_reduce: small enough that the result is still in L1
 * when it is copied into the caller's buffer. */
#define SHM_REDUCE_BYTES (16u << 10)
/* How long a waiter spins before it sleeps on the futex, when every rank has a core of its own. */
#define SPIN_NS 50000ull
/* TCP: bytes per message of the ring algorithms. */
#define TCP_CHUNK (512u << 10)
#define TCP_MAGIC 0x43504444u /* "DDPC" little-endian */
#define TCP_HDR_LEN 24
#define TCP_HELLO_LEN 24
#define DESC_LEN 32

enum { KIND_SINGLE = 0, KIND_SHM = 1, KIND_TCP = 2 };

/* What each rank called; compared across ranks before any data moves. Fields that do not matter
 * for the collective are zero, so that only real differences are reported. */
typedef struct Desc {
    uint64_t seq;
    uint64_t count;
    int32_t op, dtype, redop, root;
} Desc;

/* One rank's control block in the segment, on cache lines of its own. step counts the phases this
 * rank finished (the futex word peers sleep on); waiters says whether anyone sleeps on it. */
typedef struct ShmRank {
    _Atomic uint32_t step;
    _Atomic uint32_t waiters;
    _Atomic int32_t pid;
    _Atomic uint32_t left;      /* 1: the rank destroyed its group (a clean exit) */
    Desc desc[2];               /* by parity of the sequence number */
} __attribute__((aligned(128))) ShmRank;

typedef struct ShmHeader {
    uint64_t magic;
    uint32_t world;
    uint32_t slot_bytes;
    _Atomic uint32_t abort_flag; /* set by a rank that aborted: wakes sleepers on every rank */
    char pad[108];
    ShmRank ranks[];
} ShmHeader;

typedef struct CpuComm {
    DdpcGroup *g;
    int kind;
    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu;         /* guards the queue, stop and current */
    pthread_cond_t cv;
    DdpcWork *head, *tail;
    DdpcWork *current;
    int stop;
    atomic_int stopping;        /* destroy with work in flight: every wait gives up */
    int64_t next_check_ms;      /* when the slow checks (store, peers) run next */
    /* shm */
    ShmHeader *hdr;
    size_t map_len;
    char *data;
    size_t slot;
    uint32_t step;              /* this rank's phase count (mirrors hdr->ranks[rank].step) */
    uint64_t nchunk;            /* chunks done by this group so far: picks the slot buffer */
    uint32_t chunk_done[2];     /* step value once the last chunk in each buffer was read */
    uint64_t spin_ns;
    unsigned char *pid_ok;      /* peer pid is visible from here (same pid namespace) */
    /* tcp */
    int left_fd, right_fd;
    int wake[2];                /* self-pipe: abort and destroy interrupt poll() */
    char *tmp;                  /* TCP_CHUNK-sized receive buffers */
    char *tmp2;
} CpuComm;

/* One collective in progress: what error messages need. */
typedef struct Coll {
    CpuComm *c;
    DdpcWork *w;
    const DdpcCollArgs *a;
    const char *name;
    unsigned long long seq;
    size_t es;
    int rank, world;
} Coll;

/* ---------------------------------------------------------------- descriptors and mismatches */

static Desc make_desc(const Coll *x) {
    const DdpcCollArgs *a = x->a;
    Desc d = {.seq = x->seq, .op = (int32_t)a->op};
    if (a->op == DDPC_COLL_BARRIER) return d;
    d.count = a->count;
    d.dtype = (int32_t)a->dtype;
    if (a->op == DDPC_COLL_ALLREDUCE || a->op == DDPC_COLL_REDUCE_SCATTER)
        d.redop = (int32_t)a->redop;
    /* (an all-reduce or all-gather carries its caller's dst as root: reduce and gather are
     * built on them, and ranks that name different dst values must not pair up) */
    d.root = a->root;
    return d;
}

static int desc_equal(const Desc *a, const Desc *b) {
    return a->seq == b->seq && a->count == b->count && a->op == b->op && a->dtype == b->dtype &&
           a->redop == b->redop && a->root == b->root;
}

static void desc_str(const Desc *d, int with_seq, char *buf, size_t len) {
    const char *name = ddpc_coll_name((ddpc_coll)d->op);
    char seq[48] = "";
    if (with_seq) snprintf(seq, sizeof seq, " (its collective #%llu)", (unsigned long long)d->seq);
    const char *dt = ddpc_dtype_name((ddpc_dtype)d->dtype);
    unsigned long long n = (unsigned long long)d->count;
    char dst[32] = "";
    if (d->root) snprintf(dst, sizeof dst, ", for dst=%d", d->root);
    switch (d->op) {
    case DDPC_COLL_ALLREDUCE:
    case DDPC_COLL_REDUCE_SCATTER:
        snprintf(buf, len, "%s(count=%llu, dtype=%s, op=%s%s)%s", name, n, dt,
                 ddpc_redop_name((ddpc_redop)d->redop), dst, seq);
        break;
    case DDPC_COLL_BROADCAST:
        snprintf(buf, len, "%s(count=%llu, dtype=%s, src=%d)%s", name, n, dt, d->root, seq);
        break;
    case DDPC_COLL_ALLGATHER:
        snprintf(buf, len, "%s(count=%llu, dtype=%s%s)%s", name, n, dt, dst, seq);
        break;
    default:
        snprintf(buf, len, "%s()%s", name, seq);
        break;
    }
}

/* Every rank sees the same descriptors, so every rank reports the same pair: rank 0 and the first
 * rank that differs from it. */
static ddpc_status check_descs(const Coll *x, const Desc *descs) {
    for (int q = 1; q < x->world; q++) {
        if (desc_equal(&descs[0], &descs[q])) continue;
        int seqs = descs[0].seq != descs[q].seq;
        char a[192], b[192];
        desc_str(&descs[0], seqs, a, sizeof a);
        desc_str(&descs[q], seqs, b, sizeof b);
        return ddpc_error(DDPC_ERR_MISMATCH,
                          "%s #%llu: rank 0 called %s but rank %d called %s. Every rank must call "
                          "the same collectives in the same order, with the same element count, "
                          "dtype, op and src/dst",
                          x->name, x->seq, a, q, b);
    }
    return DDPC_OK;
}

static ddpc_status timeout_error(const Coll *x) {
    char missing[1536];
    ddpc_group_describe_missing(x->c->g, x->seq, missing, sizeof missing);
    return ddpc_error(DDPC_ERR_TIMEOUT,
                      "%s #%llu timed out after %gs on rank %d: %s. If the job is only slow, raise "
                      "timeout= in %s; otherwise look at the log of the rank that did not arrive",
                      x->name, x->seq, (double)x->c->g->timeout_ms / 1000.0, x->rank, missing,
                      ddpc_group_timeout_owner(x->c->g));
}

/* The checks every wait makes between slices: abort (ours or a peer's, from the store), destroy,
 * and the work's deadline. Peer liveness is transport specific and checked by the caller. */
/* common_checks' `slow`: 1 for the slow checks (the store's abort key, the stall note), or only
 * the stall note (the caller has looked at the store itself). */
#define SLOW_NOTE_ONLY 2

static ddpc_status common_checks(const Coll *x, int slow) {
    CpuComm *c = x->c;
    if (atomic_load(&c->stopping))
        return ddpc_error(DDPC_ERR_PEER,
                          "%s #%llu: the process group was destroyed on rank %d while the "
                          "collective was in flight",
                          x->name, x->seq, x->rank);
    if (atomic_load(&c->g->aborted) == 1 || slow == 1) DDPC_CHECK(ddpc_group_check_abort(c->g));
    if (ddpc_now_ms() >= x->w->deadline_ms) return timeout_error(x);
    if (slow && ddpc_group_stall_due(c->g, x->w)) {
        char what[96];
        snprintf(what, sizeof what, "%s #%llu", x->name, x->seq);
        ddpc_group_note_stall(c->g, x->w, what);
    }
    return DDPC_OK;
}

/* ---------------------------------------------------------------- shared memory: waiting */

static long futex_call(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, (void *)addr, op, val, ts, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Serial-number comparison, so the 32-bit step counters may wrap. */
static inline int reached(uint32_t v, uint32_t target) { return (int32_t)(v - target) >= 0; }

static void shm_wake_all(CpuComm *c) {
    for (int q = 0; q < c->g->world; q++)
        futex_call(&c->hdr->ranks[q].step, FUTEX_WAKE, INT_MAX, NULL);
}

static void shm_signal(CpuComm *c) {
    ShmRank *me = &c->hdr->ranks[c->g->rank];
    c->step++;
    atomic_store(&me->step, c->step);
    /* seq_cst store, then load: pairs with the waiter's increment-then-recheck, so either the
     * waiter sees the new step or we see the waiter. */
    if (atomic_load(&me->waiters)) futex_call(&me->step, FUTEX_WAKE, INT_MAX, NULL);
}

/* 1 when process pid is gone (or a zombie: killed but not yet reaped by its parent). */
static int pid_dead(int pid) {
    if (kill(pid, 0) == -1 && errno == ESRCH) return 1;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd == -1) return errno == ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    char *paren = strrchr(buf, ')');
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

/* Is rank q, which we wait for, still there? Only q: another rank may have finished and left
 * legitimately, and one that died while q waited for it is reported by q (its abort reaches us
 * through the store and the segment's abort flag). */
static ddpc_status shm_peer_check(const Coll *x, int q) {
    CpuComm *c = x->c;
    ShmRank *r = &c->hdr->ranks[q];
    if (atomic_load(&r->left))
        return ddpc_error(DDPC_ERR_PEER,
                          "%s #%llu: rank %d left the process group (destroy_process_group or "
                          "exit) without joining it; rank %d was waiting for it",
                          x->name, x->seq, q, x->rank);
    int pid = atomic_load(&r->pid);
    if (c->pid_ok[q] ? pid_dead(pid) : ddpc_group_rank_dead(c->g, q))
        return ddpc_error(DDPC_ERR_PEER,
                          "rank %d (pid %d) exited during %s #%llu; rank %d was waiting for it. "
                          "Its own log says why",
                          q, pid, x->name, x->seq, x->rank);
    return DDPC_OK;
}

/* Waits until rank q finished phase `target`. Spins briefly (peers on other cores answer within
 * microseconds), then sleeps on q's step word in slices that check abort, destroy, the deadline
 * and whether the peers are still alive. */
static ddpc_status shm_wait(const Coll *x, int q, uint32_t target) {
    CpuComm *c = x->c;
    ShmRank *r = &c->hdr->ranks[q];
    if (reached(atomic_load_explicit(&r->step, memory_order_acquire), target)) return DDPC_OK;
    uint64_t t0 = ddpc_now_ns();
    for (unsigned i = 1;; i++) {
        if (reached(atomic_load_explicit(&r->step, memory_order_acquire), target)) return DDPC_OK;
        cpu_relax();
        if (!(i & 63)) {
            if (atomic_load_explicit(&c->hdr->abort_flag, memory_order_relaxed)) break;
            if (ddpc_now_ns() - t0 > c->spin_ns) break;
        }
    }
    for (;;) {
        if (reached(atomic_load_explicit(&r->step, memory_order_acquire), target)) return DDPC_OK;
        int64_t now = ddpc_now_ms();
        int slow = now >= c->next_check_ms;
        if (slow) c->next_check_ms = now + DDPC_SLICE_MS;
        /* An abort first: a peer that aborted may well have left or exited since, and its reason
         * is the one worth reporting. */
        int flagged = atomic_load(&c->hdr->abort_flag);
        if (flagged || slow) DDPC_CHECK(ddpc_group_check_abort(c->g));
        if (flagged)
            return ddpc_error(DDPC_ERR_PEER,
                              "%s #%llu: another rank aborted the process group (its reason could "
                              "not be read from the store, which may be gone with rank 0)",
                              x->name, x->seq);
        if (slow) {
            ddpc_status st = shm_peer_check(x, q);
            /* A peer that finished this phase may have left or exited since; it set its step
             * before that, so one more look tells a finished peer from a missing one. */
            if (st != DDPC_OK && !reached(atomic_load(&r->step), target)) return st;
            if (st != DDPC_OK) return DDPC_OK;
        }
        DDPC_CHECK(common_checks(x, slow ? SLOW_NOTE_ONLY : 0));
        atomic_fetch_add(&r->waiters, 1);
        uint32_t v = atomic_load(&r->step);
        if (!reached(v, target)) {
            int64_t ms = DDPC_MIN(ddpc_slice(x->w->deadline_ms, DDPC_SLICE_MS),
                                  DDPC_MAX(c->next_check_ms - now, 1));
            struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
            if (futex_call(&r->step, FUTEX_WAIT, v, &ts) == -1 && errno != EAGAIN &&
                errno != EINTR && errno != ETIMEDOUT) {
                int e = errno;
                atomic_fetch_sub(&r->waiters, 1);
                return ddpc_error(DDPC_ERR_SYSTEM, "%s #%llu: futex(FUTEX_WAIT) on rank %d's step "
                                  "failed: %s", x->name, x->seq, q, strerror(e));
            }
        }
        atomic_fetch_sub(&r->waiters, 1);
        if (reached(atomic_load_explicit(&r->step, memory_order_acquire), target)) return DDPC_OK;
    }
}

static ddpc_status shm_wait_all(const Coll *x, uint32_t target) {
    for (int q = 0; q < x->world; q++)
        if (q != x->rank) DDPC_CHECK(shm_wait(x, q, target));
    return DDPC_OK;
}

/* ---------------------------------------------------------------- shared memory: collectives */

static char *slot_of(CpuComm *c, int r, uint64_t chunk) {
    return c->data + ((size_t)r * 2 + (size_t)(chunk & 1)) * c->slot;
}

/* Starts chunk j: waits until every rank has finished reading this rank's buffer for chunk j-2,
 * which shares the buffer with j. */
static ddpc_status shm_chunk_begin(const Coll *x, uint64_t *j) {
    CpuComm *c = x->c;
    *j = c->nchunk++;
    return shm_wait_all(x, c->chunk_done[*j & 1]);
}

static void shm_chunk_end(CpuComm *c, uint64_t j) {
    shm_signal(c);
    c->chunk_done[j & 1] = c->step;
}

/* Publishes this rank's descriptor. Peers read it after the first phase, whose signal also
 * announces the first chunk's data: a small collective checks arguments without an extra round. */
static void shm_post_desc(const Coll *x) {
    x->c->hdr->ranks[x->rank].desc[x->seq & 1] = make_desc(x);
}

static ddpc_status shm_check_descs(const Coll *x) {
    Desc descs[x->world];
    for (int q = 0; q < x->world; q++) descs[q] = x->c->hdr->ranks[q].desc[x->seq & 1];
    return check_descs(x, descs);
}

static ddpc_status shm_barrier(const Coll *x) {
    shm_post_desc(x);
    shm_signal(x->c);
    DDPC_CHECK(shm_wait_all(x, x->c->step));
    return shm_check_descs(x);
}

/* Each chunk: every rank copies the slices other ranks own into its slot (phase A); rank r
 * reduces slice r from its own buffer and every peer's slot, in rank order so the result is
 * identical everywhere, and leaves it in its own slot (phase B); then every rank copies the
 * other slices' results out of their owners' slots. */
static ddpc_status shm_all_reduce(const Coll *x) {
    CpuComm *c = x->c;
    const DdpcCollArgs *a = x->a;
    int P = x->world, me = x->rank;
    size_t es = x->es, chunk = c->slot / es, align = DDPC_MAX(64 / es, (size_t)1);
    char *buf = a->recv;
    if (a->count == 0) return shm_barrier(x);
    for (size_t off = 0; off < a->count; off += chunk) {
        size_t n = DDPC_MIN(chunk, a->count - off);
        size_t S = ((n + (size_t)P - 1) / (size_t)P + align - 1) / align * align;
        uint64_t j;
        DDPC_CHECK(shm_chunk_begin(x, &j));
        char *mine = slot_of(c, me, j);
        for (int q = 0; q < P; q++) {
            size_t lo = DDPC_MIN((size_t)q * S, n), hi = DDPC_MIN(lo + S, n);
            if (q != me && hi > lo) memcpy(mine + lo * es, buf + (off + lo) * es, (hi - lo) * es);
        }
        if (off == 0) shm_post_desc(x);
        shm_signal(c);
        uint32_t phase_a = c->step;
        DDPC_CHECK(shm_wait_all(x, phase_a));
        if (off == 0) DDPC_CHECK(shm_check_descs(x));
        size_t lo = DDPC_MIN((size_t)me * S, n), hi = DDPC_MIN(lo + S, n);
        size_t blk = DDPC_MAX(SHM_REDUCE_BYTES / es, (size_t)1);
        const void *ins[P];
        for (size_t b = lo; b < hi; b += blk) {
            size_t m = DDPC_MIN(blk, hi - b);
            for (int q = 0; q < P; q++)
                ins[q] = q == me ? (const void *)(buf + (off + b) * es)
                                 : (const void *)(slot_of(c, q, j) + b * es);
            DDPC_CHECK(ddpc_reduce_host_n(mine + b * es, ins, P, m, a->dtype, a->redop));
            memcpy(buf + (off + b) * es, mine + b * es, m * es);
        }
        shm_signal(c);
        uint32_t phase_b = c->step;
        for (int i = 1; i < P; i++) {
            int q = (me + i) % P;
            size_t qlo = DDPC_MIN((size_t)q * S, n), qhi = DDPC_MIN(qlo + S, n);
            if (qhi <= qlo) continue;
            DDPC_CHECK(shm_wait(x, q, phase_b));
            memcpy(buf + (off + qlo) * es, slot_of(c, q, j) + qlo * es, (qhi - qlo) * es);
        }
        shm_chunk_end(c, j);
    }
    return DDPC_OK;
}

static ddpc_status shm_broadcast(const Coll *x) {
    CpuComm *c = x->c;
    const DdpcCollArgs *a = x->a;
    int root = a->root, me = x->rank;
    size_t es = x->es, chunk = c->slot / es;
    char *buf = a->recv;
    if (a->count == 0) return shm_barrier(x);
    for (size_t off = 0; off < a->count; off += chunk) {
        size_t n = DDPC_MIN(chunk, a->count - off);
        uint64_t j;
        DDPC_CHECK(shm_chunk_begin(x, &j));
        if (me == root) memcpy(slot_of(c, root, j), buf + off * es, n * es);
        if (off == 0) shm_post_desc(x);
        shm_signal(c);
        if (off == 0) {
            DDPC_CHECK(shm_wait_all(x, c->step));
            DDPC_CHECK(shm_check_descs(x));
        } else if (me != root) {
            DDPC_CHECK(shm_wait(x, root, c->step));
        }
        if (me != root) memcpy(buf + off * es, slot_of(c, root, j), n * es);
        shm_chunk_end(c, j);
    }
    return DDPC_OK;
}

static ddpc_status shm_all_gather(const Coll *x) {
    CpuComm *c = x->c;
    const DdpcCollArgs *a = x->a;
    int P = x->world, me = x->rank;
    size_t es = x->es, chunk = c->slot / es, cnt = a->count;
    const char *send = a->send;
    char *recv = a->recv;
    if (cnt == 0) return shm_barrier(x);
    if (send != recv + (size_t)me * cnt * es) memmove(recv + (size_t)me * cnt * es, send, cnt * es);
    /* From here on our own block of recv holds the input (send may be that very block). */
    send = recv + (size_t)me * cnt * es;
    for (size_t off = 0; off < cnt; off += chunk) {
        size_t n = DDPC_MIN(chunk, cnt - off);
        uint64_t j;
        DDPC_CHECK(shm_chunk_begin(x, &j));
        memcpy(slot_of(c, me, j), send + off * es, n * es);
        if (off == 0) shm_post_desc(x);
        shm_signal(c);
        uint32_t phase = c->step;
        if (off == 0) {
            DDPC_CHECK(shm_wait_all(x, phase));
            DDPC_CHECK(shm_check_descs(x));
        }
        for (int i = 1; i < P; i++) {
            int q = (me + i) % P;
            DDPC_CHECK(shm_wait(x, q, phase));
            memcpy(recv + ((size_t)q * cnt + off) * es, slot_of(c, q, j), n * es);
        }
        shm_chunk_end(c, j);
    }
    return DDPC_OK;
}

static int overlaps(const char *a, size_t alen, const char *b, size_t blen) {
    return a < b + blen && b < a + alen;
}

/* Whether reduce_scatter's output, written chunk by chunk, could overwrite input that a later
 * chunk still reads. Both transports finish chunk [off, off+n) of the output only after reading
 * [off, off+n) of every input block, and later chunks read higher offsets only. So an output that
 * starts at or below the input writes below every later read, and one that starts on a block
 * boundary overwrites only the part of that block already read; any other overlap (an output
 * starting halfway into block 0, say) overwrites offsets a later chunk has yet to read. */
static int reduce_scatter_needs_staging(const DdpcCollArgs *a, size_t es, int world) {
    uintptr_t in = (uintptr_t)a->send, out = (uintptr_t)a->recv;
    size_t block = a->count * es;
    if (!overlaps(a->recv, block, a->send, (size_t)world * block) || out <= in) return 0;
    return (out - in) % block != 0;
}

/* Each slot holds one sub-slot per rank; rank r reduces block r from its own input and the r-th
 * sub-slot of every peer. */
static ddpc_status shm_reduce_scatter(const Coll *x) {
    CpuComm *c = x->c;
    const DdpcCollArgs *a = x->a;
    int P = x->world, me = x->rank;
    size_t es = x->es, cnt = a->count;
    size_t align = DDPC_MAX(64 / es, (size_t)1);
    size_t chunk = c->slot / es / (size_t)P;
    if (chunk > align) chunk = chunk / align * align;
    const char *send = a->send;
    char *recv = a->recv;
    if (cnt == 0) return shm_barrier(x);
    int in_place = overlaps(recv, cnt * es, send, (size_t)P * cnt * es);
    const void *ins[P];
    for (size_t off = 0; off < cnt; off += chunk) {
        size_t n = DDPC_MIN(chunk, cnt - off);
        uint64_t j;
        DDPC_CHECK(shm_chunk_begin(x, &j));
        char *mine = slot_of(c, me, j);
        for (int q = 0; q < P; q++)
            if (q != me)
                memcpy(mine + (size_t)q * chunk * es, send + ((size_t)q * cnt + off) * es, n * es);
        if (off == 0) shm_post_desc(x);
        shm_signal(c);
        DDPC_CHECK(shm_wait_all(x, c->step));
        if (off == 0) DDPC_CHECK(shm_check_descs(x));
        for (int q = 0; q < P; q++)
            ins[q] = q == me ? (const void *)(send + ((size_t)me * cnt + off) * es)
                             : (const void *)(slot_of(c, q, j) + (size_t)me * chunk * es);
        /* Our own sub-slot is unused: it takes the result when recv aliases the input. */
        char *out = in_place ? mine + (size_t)me * chunk * es : recv + off * es;
        DDPC_CHECK(ddpc_reduce_host_n(out, ins, P, n, a->dtype, a->redop));
        if (in_place) memcpy(recv + off * es, out, n * es);
        shm_chunk_end(c, j);
    }
    return DDPC_OK;
}

/* ---------------------------------------------------------------- shared memory: setup */

static size_t shm_header_bytes(int world) {
    size_t h = sizeof(ShmHeader) + (size_t)world * sizeof(ShmRank);
    return (h + 4095) / 4096 * 4096;
}

/* 1 MiB per slot, less for large worlds so the segment stays within 64 MiB (docker's default
 * /dev/shm). DDPC_SHM_SLOT_BYTES overrides it (a tuning knob; rank 0's value wins). */
static ddpc_status shm_slot_bytes(int world, size_t *out) {
    size_t dflt = DDPC_MIN((size_t)SHM_SLOT_DEFAULT, ((size_t)64 << 20) / (2 * (size_t)world));
    uint64_t slot;
    DDPC_CHECK(ddpc_setting_uint("DDPC_SHM_SLOT_BYTES", dflt, &slot));
    slot = DDPC_MAX(slot, (uint64_t)SHM_SLOT_MIN);
    *out = ((size_t)slot + 4095) / 4096 * 4096;
    return DDPC_OK;
}

static ddpc_status random_bytes(unsigned char *out, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t k = getrandom(out + got, n - got, 0);
        if (k == -1) {
            if (errno == EINTR) continue;
            return ddpc_error(DDPC_ERR_SYSTEM, "getrandom(%zu bytes) failed: %s", n,
                              strerror(errno));
        }
        got += (size_t)k;
    }
    return DDPC_OK;
}

static void hex_of(char *out, const unsigned char *in, size_t n) {
    for (size_t i = 0; i < n; i++) snprintf(out + 2 * i, 3, "%02x", in[i]);
}

static ddpc_status shm_map(CpuComm *c, int fd, const char *name) {
    void *p = mmap(NULL, c->map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED)
        return ddpc_error(DDPC_ERR_SYSTEM, "mmap(%s, %zu bytes) failed: %s", name, c->map_len,
                          strerror(errno));
    c->hdr = p;
    c->data = (char *)p + shm_header_bytes(c->g->world);
    return DDPC_OK;
}

/* Rank 0 creates the segment and gives it real pages up front: tmpfs would otherwise hand out
 * pages on first touch and SIGBUS when /dev/shm is full. */
static ddpc_status shm_create(CpuComm *c, const char *name) {
    DdpcGroup *g = c->g;
    DDPC_CHECK(shm_slot_bytes(g->world, &c->slot));
    c->map_len = shm_header_bytes(g->world) + (size_t)g->world * 2 * c->slot;
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd == -1)
        return ddpc_error(DDPC_ERR_SYSTEM, "shm_open(%s, O_CREAT) failed: %s", name,
                          strerror(errno));
    ddpc_status st = DDPC_OK;
    int rc;
    if (ftruncate(fd, (off_t)c->map_len) == -1) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "ftruncate(%s, %zu) failed: %s", name, c->map_len,
                        strerror(errno));
    } else if ((rc = posix_fallocate(fd, 0, (off_t)c->map_len)) != 0 && rc != EOPNOTSUPP &&
               rc != EINVAL) {
        st = ddpc_error(DDPC_ERR_SYSTEM,
                        "reserving %zu MiB of shared memory in /dev/shm failed: %s (enlarge "
                        "/dev/shm, e.g. docker --shm-size, or set DDPC_CPU_TRANSPORT=tcp)",
                        (c->map_len + (1u << 20) - 1) >> 20, strerror(rc));
    } else {
        st = shm_map(c, fd, name);
    }
    close(fd);
    if (st != DDPC_OK) {
        shm_unlink(name);
        return st;
    }
    c->hdr->magic = SHM_MAGIC;
    c->hdr->world = (uint32_t)g->world;
    c->hdr->slot_bytes = (uint32_t)c->slot;
    return DDPC_OK;
}

static ddpc_status shm_attach(CpuComm *c, const char *name) {
    DdpcGroup *g = c->g;
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd == -1)
        return ddpc_error(DDPC_ERR_SYSTEM,
                          "shm_open(%s) failed: %s (ranks in different containers need a shared "
                          "/dev/shm, e.g. docker --ipc=host)",
                          name, strerror(errno));
    struct stat sb;
    ddpc_status st = DDPC_OK;
    if (fstat(fd, &sb) == -1) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "fstat(%s) failed: %s", name, strerror(errno));
    } else if ((size_t)sb.st_size <= shm_header_bytes(g->world)) {
        st = ddpc_error(DDPC_ERR_PROTOCOL, "shared memory segment %s has %lld bytes, too few",
                        name, (long long)sb.st_size);
    } else {
        c->map_len = (size_t)sb.st_size;
        st = shm_map(c, fd, name);
    }
    close(fd);
    if (st != DDPC_OK) return st;
    c->slot = c->hdr->slot_bytes;
    if (c->hdr->magic != SHM_MAGIC || c->hdr->world != (uint32_t)g->world ||
        c->map_len != shm_header_bytes(g->world) + (size_t)g->world * 2 * c->slot) {
        st = ddpc_error(DDPC_ERR_PROTOCOL,
                        "shared memory segment %s is not this group's (magic %llx, world %u, "
                        "slot %zu, %zu bytes; expected world %d)",
                        name, (unsigned long long)c->hdr->magic, c->hdr->world, c->slot,
                        c->map_len, g->world);
        munmap(c->hdr, c->map_len);
        c->hdr = NULL;
    }
    return st;
}

static ddpc_status store_get_str(DdpcGroup *g, const char *key, char *out, size_t len) {
    void *v = NULL;
    size_t n = 0;
    DDPC_CHECK(ddpc_store_get(g->store, key, g->timeout_ms, &v, &n));
    snprintf(out, len, "%.*s", (int)DDPC_MIN(n, len - 1), (const char *)v);
    free(v);
    return DDPC_OK;
}

static ddpc_status store_set_str(DdpcGroup *g, const char *key, const char *val) {
    return ddpc_store_set(g->store, key, val, strlen(val));
}

/* How long a wait of group creation runs before it looks for a failure (ddpc_group_init_failure). */
#define INIT_SLICE_MS 500

/* Waits for one key per rank, "<prefix>/<fmt % r>"; on timeout the error names the ranks whose
 * key is still missing (the first 16), in words a user knows rather than as store keys. */
static ddpc_status store_wait_ranks(DdpcGroup *g, const char *fmt) {
    int P = g->world;
    char *buf = malloc((size_t)P * 256);
    /* (calloc: GCC cannot see the loop below fill every key before the wait reads them) */
    const char **keys = calloc((size_t)P, sizeof *keys);
    if (!buf || !keys) {
        free(buf);
        free(keys);
        return ddpc_error(DDPC_ERR_NOMEM, "out of host memory waiting for %d store keys", P);
    }
    for (int r = 0; r < P; r++) {
        char name[128];
        snprintf(name, sizeof name, fmt, r);
        ddpc_group_key(g, buf + (size_t)r * 256, 256, "%s", name);
        keys[r] = buf + (size_t)r * 256;
    }
    /* In slices: between them, whether the group can still be made (a rank died, or the store
     * refused a process of this job); else a timeout would be the only news of it. */
    int64_t deadline = ddpc_now_ms() + g->timeout_ms;
    ddpc_status st;
    for (;;) {
        int64_t left = deadline - ddpc_now_ms();
        st = ddpc_store_wait(g->store, keys, P, DDPC_MAX(DDPC_MIN(left, INIT_SLICE_MS), 1));
        if (st != DDPC_ERR_TIMEOUT || left <= INIT_SLICE_MS) break;
        char why[1600];
        if (ddpc_group_init_failure(g, why, sizeof why)) {
            st = ddpc_error(DDPC_ERR_PEER, "%s", why);
            break;
        }
    }
    if (st == DDPC_ERR_TIMEOUT) {
        char missing[200] = "";
        size_t used = 0;
        int n_missing = 0, listed = 0;
        for (int r = 0; r < P; r++) {
            int present = 1;
            if (ddpc_store_check(g->store, &keys[r], 1, &present) != DDPC_OK) break;
            if (present) continue;
            n_missing++;
            if (listed < 16 && used < sizeof missing - 16) {
                int w = snprintf(missing + used, sizeof missing - used, "%s%d", listed ? ", " : "",
                                 r);
                if (w > 0) used += (size_t)w;
                listed++;
            }
        }
        if (n_missing > 0)
            st = ddpc_error(DDPC_ERR_TIMEOUT,
                            "timed out after %.1f s: %d of %d rank(s) never got this far: %s%s "
                            "(%s)",
                            (double)g->timeout_ms / 1000.0, n_missing, P, missing,
                            n_missing > listed ? ", ..." : "",
                            strcmp(ddpc_group_timeout_owner(g), "new_group") == 0
                                ? "did they call new_group too, or fail before it?"
                                : "did they call init_process_group with the same MASTER_ADDR, "
                                  "MASTER_PORT and WORLD_SIZE, or did they fail before it?");
    }
    free(buf);
    free(keys);
    return st;
}

static void shm_release(CpuComm *c) {
    if (c->hdr) munmap(c->hdr, c->map_len);
    c->hdr = NULL;
}

/* Rank 0 creates the segment under a name no other job can guess or collide with; the others
 * attach; everyone reports to the store whether that worked, and the segment is unlinked as soon
 * as all reports are in, so nothing is left behind in /dev/shm even if a rank crashes later. The
 * group uses shared memory only when every rank attached. */
static ddpc_status shm_setup(CpuComm *c) {
    DdpcGroup *g = c->g;
    char key[256], name[128], mine[1024] = "ok", theirs[1024];
    ddpc_status st = DDPC_OK, local;
    int linked = 0; /* rank 0 created the segment and has not unlinked it yet */
    ddpc_group_key(g, key, sizeof key, "cpu/shm/name");
    if (g->rank == 0) {
        unsigned char rnd[12];
        char hex[25], tag[33];
        size_t t = 0;
        for (const char *p = g->prefix; *p && t < sizeof tag - 1; p++)
            if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9'))
                tag[t++] = *p;
        tag[t] = '\0';
        DDPC_CHECK(random_bytes(rnd, sizeof rnd));
        hex_of(hex, rnd, sizeof rnd);
        snprintf(name, sizeof name, "/ddpc-%s-%d-%s", tag, (int)getpid(), hex);
        local = shm_create(c, name);
        linked = local == DDPC_OK;
        char val[1100];
        if (local == DDPC_OK) snprintf(val, sizeof val, "%s", name);
        else snprintf(val, sizeof val, "!rank 0 could not create it: %s", ddpc_last_error());
        if (local != DDPC_OK) snprintf(mine, sizeof mine, "!%s", ddpc_last_error());
        DDPC_CHECK_GOTO(store_set_str(g, key, val), st, fail);
    } else {
        DDPC_CHECK_GOTO(store_get_str(g, key, name, sizeof name), st, fail);
        if (name[0] == '!') {
            local = DDPC_ERR_SYSTEM;
            snprintf(mine, sizeof mine, "%s", name);
        } else {
            local = shm_attach(c, name);
            if (local != DDPC_OK) snprintf(mine, sizeof mine, "!%s", ddpc_last_error());
        }
    }
    if (local == DDPC_OK) atomic_store(&c->hdr->ranks[g->rank].pid, (int32_t)getpid());
    ddpc_group_key(g, key, sizeof key, "cpu/shm/ok/%d", g->rank);
    DDPC_CHECK_GOTO(store_set_str(g, key, mine), st, fail);
    st = store_wait_ranks(g, "cpu/shm/ok/%d");
    if (linked) shm_unlink(name);
    linked = 0;
    if (st != DDPC_OK) goto fail;
    for (int r = 0; r < g->world; r++) {
        ddpc_group_key(g, key, sizeof key, "cpu/shm/ok/%d", r);
        DDPC_CHECK_GOTO(store_get_str(g, key, theirs, sizeof theirs), st, fail);
        if (theirs[0] == '!') {
            st = ddpc_error(DDPC_ERR_SYSTEM, "rank %d could not map the shared memory segment: %s",
                            r, theirs + 1);
            goto fail;
        }
    }
    /* A peer's pid says whether it is alive only inside our pid namespace. */
    for (int r = 0; r < g->world; r++) {
        int pid = atomic_load(&c->hdr->ranks[r].pid);
        c->pid_ok[r] = r != g->rank && pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
    }
    DDPC_INFO("CPU", "rank %d: shared memory %s, %zu MiB, slot %zu KiB", g->rank, name,
              c->map_len >> 20, c->slot >> 10);
    return DDPC_OK;
fail:
    /* A store failure before every rank reported must not leave the segment in /dev/shm. */
    if (linked) shm_unlink(name);
    shm_release(c);
    return st;
}

/* ---------------------------------------------------------------- TCP: wire format */

static void put_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void put_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get_u32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void desc_encode(const Desc *d, unsigned char *p) {
    put_u64(p, d->seq);
    put_u64(p + 8, d->count);
    put_u32(p + 16, (uint32_t)d->op);
    put_u32(p + 20, (uint32_t)d->dtype);
    put_u32(p + 24, (uint32_t)d->redop);
    put_u32(p + 28, (uint32_t)d->root);
}

static Desc desc_decode(const unsigned char *p) {
    Desc d = {.seq = get_u64(p), .count = get_u64(p + 8), .op = (int32_t)get_u32(p + 16),
              .dtype = (int32_t)get_u32(p + 20), .redop = (int32_t)get_u32(p + 24),
              .root = (int32_t)get_u32(p + 28)};
    return d;
}

enum { MSG_DESC = 1, MSG_DATA = 2 };

/* Every message starts with magic, kind, the collective's sequence number and the payload length,
 * so a rank that is out of step is named instead of its bytes being misread. */
static ddpc_status check_header(const Coll *x, const unsigned char *h, uint32_t kind, size_t len,
                                int from) {
    uint32_t magic = get_u32(h), k = get_u32(h + 4);
    unsigned long long seq = get_u64(h + 8), n = get_u64(h + 16);
    if (magic != TCP_MAGIC)
        return ddpc_error(DDPC_ERR_PROTOCOL,
                          "%s #%llu: rank %d received bytes from rank %d that are not a ddpc "
                          "message (magic %08x)", x->name, x->seq, x->rank, from, magic);
    if (seq != x->seq)
        return ddpc_error(DDPC_ERR_MISMATCH,
                          "%s #%llu: rank %d received data of collective #%llu from rank %d: the "
                          "ranks are out of step (every rank must call the same collectives in "
                          "the same order)", x->name, x->seq, x->rank, seq, from);
    if (k != kind || n != len)
        return ddpc_error(DDPC_ERR_PROTOCOL,
                          "%s #%llu: rank %d expected a %s message of %zu bytes from rank %d, got "
                          "a %s message of %llu bytes", x->name, x->seq, x->rank,
                          kind == MSG_DESC ? "descriptor" : "data", len, from,
                          k == MSG_DESC ? "descriptor" : "data", n);
    return DDPC_OK;
}

static ddpc_status peer_closed(const Coll *x, int peer) {
    /* A rank that failed published its reason (ddpc_group_abort) before its sockets closed. */
    DDPC_CHECK(ddpc_group_check_abort(x->c->g));
    return ddpc_error(DDPC_ERR_PEER,
                      "rank %d closed its connection during %s #%llu (it %s); rank %d was "
                      "exchanging data with it. Its own log says why",
                      peer, x->name, x->seq,
                      ddpc_group_rank_dead(x->c->g, peer) ? "exited"
                                                          : "exited, crashed or left the group",
                      x->rank);
}

/* Sends one message to the right neighbour and receives one from the left, at the same time (a
 * ring step), in slices that check abort, destroy and the deadline. */
static ddpc_status tcp_step(const Coll *x, uint32_t kind, const void *sbuf, size_t slen, int send,
                            void *rbuf, size_t rlen, int recv_) {
    CpuComm *c = x->c;
    int P = x->world, right = (x->rank + 1) % P, left = (x->rank + P - 1) % P;
    unsigned char shdr[TCP_HDR_LEN], rhdr[TCP_HDR_LEN];
    put_u32(shdr, TCP_MAGIC);
    put_u32(shdr + 4, kind);
    put_u64(shdr + 8, x->seq);
    put_u64(shdr + 16, slen);
    size_t stotal = send ? TCP_HDR_LEN + slen : 0, rtotal = recv_ ? TCP_HDR_LEN + rlen : 0;
    size_t sent = 0, got = 0;
    while (sent < stotal || got < rtotal) {
        int progress = 0;
        if (sent < stotal) {
            struct iovec iov[2];
            int n = 0;
            if (sent < TCP_HDR_LEN) {
                iov[n].iov_base = shdr + sent;
                iov[n++].iov_len = TCP_HDR_LEN - sent;
                if (slen) {
                    iov[n].iov_base = (void *)sbuf;
                    iov[n++].iov_len = slen;
                }
            } else {
                iov[n].iov_base = (char *)sbuf + (sent - TCP_HDR_LEN);
                iov[n++].iov_len = stotal - sent;
            }
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
            ssize_t k = sendmsg(c->right_fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k > 0) {
                sent += (size_t)k;
                progress = 1;
            } else if (k == -1 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                if (errno == EPIPE || errno == ECONNRESET) return peer_closed(x, right);
                return ddpc_error(DDPC_ERR_SYSTEM, "%s #%llu: send to rank %d failed: %s",
                                  x->name, x->seq, right, strerror(errno));
            }
        }
        if (got < rtotal) {
            /* The header alone first: the payload goes to the caller's buffer only once the
             * header says it is the message we expect. */
            ssize_t k = got < TCP_HDR_LEN
                            ? recv(c->left_fd, rhdr + got, TCP_HDR_LEN - got, MSG_DONTWAIT)
                            : recv(c->left_fd, (char *)rbuf + (got - TCP_HDR_LEN), rtotal - got,
                                   MSG_DONTWAIT);
            if (k > 0) {
                size_t before = got;
                got += (size_t)k;
                progress = 1;
                if (before < TCP_HDR_LEN && got == TCP_HDR_LEN)
                    DDPC_CHECK(check_header(x, rhdr, kind, rlen, left));
            } else if (k == 0) {
                return peer_closed(x, left);
            } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                if (errno == ECONNRESET) return peer_closed(x, left);
                return ddpc_error(DDPC_ERR_SYSTEM, "%s #%llu: receive from rank %d failed: %s",
                                  x->name, x->seq, left, strerror(errno));
            }
        }
        if (progress) continue;
        int64_t now = ddpc_now_ms();
        int slow = now >= c->next_check_ms;
        if (slow) c->next_check_ms = now + DDPC_SLICE_MS;
        DDPC_CHECK(common_checks(x, slow));
        struct pollfd pf[3];
        int n = 0;
        if (sent < stotal) pf[n++] = (struct pollfd){.fd = c->right_fd, .events = POLLOUT};
        if (got < rtotal) pf[n++] = (struct pollfd){.fd = c->left_fd, .events = POLLIN};
        pf[n++] = (struct pollfd){.fd = c->wake[0], .events = POLLIN};
        int64_t ms = DDPC_MIN(ddpc_slice(x->w->deadline_ms, DDPC_SLICE_MS),
                              DDPC_MAX(c->next_check_ms - now, 1));
        int r = poll(pf, (nfds_t)n, (int)ms);
        if (r == -1 && errno != EINTR)
            return ddpc_error(DDPC_ERR_SYSTEM, "%s #%llu: poll failed: %s", x->name, x->seq,
                              strerror(errno));
        if (r > 0 && (pf[n - 1].revents & POLLIN)) {
            char drain[64];
            while (read(c->wake[0], drain, sizeof drain) > 0) {
            }
            c->next_check_ms = 0; /* woken by abort or destroy: look at once */
        }
    }
    return DDPC_OK;
}

/* P-1 ring steps pass every rank's descriptor around, so each rank sees all of them (and a
 * mismatch between any two ranks fails every rank, with the same message). */
static ddpc_status tcp_descs(const Coll *x) {
    int P = x->world, me = x->rank;
    Desc descs[P];
    descs[me] = make_desc(x);
    unsigned char out[DESC_LEN], in[DESC_LEN];
    for (int s = 0; s < P - 1; s++) {
        desc_encode(&descs[(me - s + P) % P], out);
        DDPC_CHECK(tcp_step(x, MSG_DESC, out, DESC_LEN, 1, in, DESC_LEN, 1));
        descs[(me - s - 1 + P) % P] = desc_decode(in);
    }
    return check_descs(x, descs);
}

/* Ring all-reduce (reduce-scatter, then all-gather) over pieces of at most P * TCP_CHUNK bytes,
 * so the receive buffer stays one chunk. Each segment is reduced by one chain of ranks and then
 * copied, so every rank ends with identical bits. */
static ddpc_status tcp_all_reduce(const Coll *x) {
    CpuComm *c = x->c;
    const DdpcCollArgs *a = x->a;
    size_t P = (size_t)x->world, me = (size_t)x->rank, es = x->es;
    size_t piece = TCP_CHUNK / es * P;
    char *buf = a->recv;
    DDPC_CHECK(tcp_descs(x));
    for (size_t off = 0; off < a->count; off += piece) {
        size_t n = DDPC_MIN(piece, a->count - off);
#define SEG_LO(q) (off + (q) * (n / P) + DDPC_MIN((size_t)(q), n % P))
#define SEG_N(q) (n / P + ((size_t)(q) < n % P ? 1 : 0))
        for (size_t s = 0; s + 1 < P; s++) {
            size_t sq = (me + P - s) % P, rq = (me + 2 * P - s - 1) % P;
            DDPC_CHECK(tcp_step(x, MSG_DATA, buf + SEG_LO(sq) * es, SEG_N(sq) * es, 1, c->tmp,
                                SEG_N(rq) * es, 1));
            DDPC_CHECK(ddpc_reduce_host(buf + SEG_LO(rq) * es, c->tmp, SEG_N(rq), a->dtype,
                                        a->redop));
        }
        size_t own = (me + 1) % P;
        if (a->redop == DDPC_AVG)
            DDPC_CHECK(ddpc_reduce_scale(buf + SEG_LO(own) * es, SEG_N(own), a->dtype, (int64_t)P));
        for (size_t s = 0; s + 1 < P; s++) {
            size_t sq = (me + 1 + P - s) % P, rq = (me + P - s) % P;
            DDPC_CHECK(tcp_step(x, MSG_DATA, buf + SEG_LO(sq) * es, SEG_N(sq) * es, 1,
                                buf + SEG_LO(rq) * es, SEG_N(rq) * es, 1));
        }
#undef SEG_LO
#undef SEG_N
    }
    return DDPC_OK;
}

/* Pipelined chain from the root around the ring: a middle rank forwards chunk k-1 while it
 * receives chunk k. */
static ddpc_status tcp_broadcast(const Coll *x) {
    const DdpcCollArgs *a = x->a;
    int P = x->world, pos = (x->rank - a->root + P) % P;
    size_t es = x->es, chunk = TCP_CHUNK / es, nk = (a->count + chunk - 1) / chunk;
    char *buf = a->recv;
    DDPC_CHECK(tcp_descs(x));
#define CH_PTR(k) (buf + (k) * chunk * es)
#define CH_LEN(k) (DDPC_MIN(chunk, a->count - (k) * chunk) * es)
    for (size_t t = 0; t <= nk; t++) {
        int send = pos < P - 1 && (pos == 0 ? t < nk : t >= 1);
        int recv_ = pos > 0 && t < nk;
        size_t sk = pos == 0 ? t : t - 1;
        if (!send && !recv_) continue;
        DDPC_CHECK(tcp_step(x, MSG_DATA, send ? CH_PTR(sk) : NULL, send ? CH_LEN(sk) : 0, send,
                            recv_ ? CH_PTR(t) : NULL, recv_ ? CH_LEN(t) : 0, recv_));
    }
#undef CH_PTR
#undef CH_LEN
    return DDPC_OK;
}

static ddpc_status tcp_all_gather(const Coll *x) {
    const DdpcCollArgs *a = x->a;
    int P = x->world, me = x->rank;
    size_t es = x->es, cnt = a->count, chunk = TCP_CHUNK / es;
    char *recv = a->recv;
    DDPC_CHECK(tcp_descs(x));
    if (a->send != recv + (size_t)me * cnt * es)
        memmove(recv + (size_t)me * cnt * es, a->send, cnt * es);
    for (int s = 0; s < P - 1; s++) {
        size_t sb = (size_t)((me - s + P) % P), rb = (size_t)((me - s - 1 + P) % P);
        for (size_t off = 0; off < cnt; off += chunk) {
            size_t n = DDPC_MIN(chunk, cnt - off) * es;
            DDPC_CHECK(tcp_step(x, MSG_DATA, recv + (sb * cnt + off) * es, n, 1,
                                recv + (rb * cnt + off) * es, n, 1));
        }
    }
    return DDPC_OK;
}

/* Ring reduce-scatter, one chunk of every block at a time: at step s a rank forwards the partial
 * sum of block me-s-1 and receives that of block me-s-2, to which it adds its own input; after
 * P-1 steps it holds block `me`, complete. */
static ddpc_status tcp_reduce_scatter(const Coll *x) {
    CpuComm *c = x->c;
    const DdpcCollArgs *a = x->a;
    size_t P = (size_t)x->world, me = (size_t)x->rank, es = x->es, cnt = a->count;
    size_t chunk = TCP_CHUNK / es;
    const char *send = a->send;
    DDPC_CHECK(tcp_descs(x));
    for (size_t off = 0; off < cnt; off += chunk) {
        size_t n = DDPC_MIN(chunk, cnt - off);
        char *sb = c->tmp2, *rb = c->tmp;
        for (size_t s = 0; s + 1 < P; s++) {
            size_t bs = (me + 2 * P - s - 1) % P, br = (me + 2 * P - s - 2) % P;
            const char *src = s == 0 ? send + (bs * cnt + off) * es : sb;
            DDPC_CHECK(tcp_step(x, MSG_DATA, src, n * es, 1, rb, n * es, 1));
            DDPC_CHECK(ddpc_reduce_host(rb, send + (br * cnt + off) * es, n, a->dtype, a->redop));
            char *t = sb;
            sb = rb;
            rb = t;
        }
        /* sb holds block me; recv may alias the input, so copy only now. */
        memmove((char *)a->recv + off * es, sb, n * es);
        if (a->redop == DDPC_AVG)
            DDPC_CHECK(ddpc_reduce_scale((char *)a->recv + off * es, n, a->dtype, (int64_t)P));
    }
    return DDPC_OK;
}

/* ---------------------------------------------------------------- TCP: setup */

static ddpc_status set_nodelay(int fd) {
    int one = 1;
    DDPC_SYSCHECK(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one),
                  "setsockopt(TCP_NODELAY)");
    return DDPC_OK;
}

static ddpc_status tcp_listen(CpuComm *c, int *lfd, int *port) {
    DdpcGroup *g = c->g;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(g->bind_addr, "0", &hints, &res);
    if (rc != 0)
        return ddpc_error(DDPC_ERR_SYSTEM,
                          "getaddrinfo(%s) for the TCP transport failed: %s (set DDPC_BIND_ADDR to "
                          "an address of this host that the other ranks can reach)",
                          g->bind_addr, gai_strerror(rc));
    ddpc_status st = DDPC_OK;
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd == -1) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "socket() failed: %s", strerror(errno));
        goto out;
    }
    if (bind(fd, res->ai_addr, res->ai_addrlen) == -1) {
        st = ddpc_error(DDPC_ERR_SYSTEM,
                        "bind(%s) for the TCP transport failed: %s (set DDPC_BIND_ADDR to an "
                        "address of this host)", g->bind_addr, strerror(errno));
        goto out;
    }
    if (listen(fd, 64) == -1) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "listen() failed: %s", strerror(errno));
        goto out;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == -1) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "getsockname() failed: %s", strerror(errno));
        goto out;
    }
    *port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                           : ((struct sockaddr_in *)&ss)->sin_port);
out:
    freeaddrinfo(res);
    if (st != DDPC_OK && fd != -1) close(fd);
    else *lfd = fd;
    return st;
}

/* Waits (interruptibly, in slices) until fd is ready for `events`. */
static ddpc_status wait_fd(int fd, short events, int64_t deadline, const char *what) {
    for (;;) {
        struct pollfd pf = {.fd = fd, .events = events};
        int64_t ms = ddpc_slice(deadline, DDPC_SLICE_MS);
        int r = poll(&pf, 1, (int)ms);
        if (r > 0) return DDPC_OK;
        if (r == -1 && errno != EINTR)
            return ddpc_error(DDPC_ERR_SYSTEM, "poll() while %s failed: %s", what, strerror(errno));
        DDPC_CHECK(ddpc_check_interrupt());
        if (ddpc_now_ms() >= deadline)
            return ddpc_error(DDPC_ERR_TIMEOUT, "timed out %s", what);
    }
}

static ddpc_status io_all(int fd, void *buf, size_t len, int out, int64_t deadline,
                          const char *what) {
    size_t done = 0;
    while (done < len) {
        ssize_t k = out ? send(fd, (char *)buf + done, len - done, MSG_NOSIGNAL)
                        : recv(fd, (char *)buf + done, len - done, 0);
        if (k > 0) {
            done += (size_t)k;
        } else if (k == 0) {
            return ddpc_error(DDPC_ERR_PEER, "the connection closed while %s", what);
        } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            DDPC_CHECK(wait_fd(fd, out ? POLLOUT : POLLIN, deadline, what));
        } else {
            return ddpc_error(DDPC_ERR_SYSTEM, "%s failed while %s: %s", out ? "send" : "recv",
                              what, strerror(errno));
        }
    }
    return DDPC_OK;
}

static ddpc_status tcp_connect_right(CpuComm *c, int64_t deadline) {
    DdpcGroup *g = c->g;
    int right = (g->rank + 1) % g->world;
    char key[256], val[512], host[300], port[16], cookie_hex[64], what[400];
    ddpc_group_key(g, key, sizeof key, "cpu/tcp/%d", right);
    DDPC_CHECK(store_get_str(g, key, val, sizeof val));
    if (sscanf(val, "%299s %15s %63s", host, port, cookie_hex) != 3 || strlen(cookie_hex) != 32)
        return ddpc_error(DDPC_ERR_PROTOCOL, "rank %d published a malformed TCP endpoint '%s'",
                          right, val);
    snprintf(what, sizeof what, "connecting to rank %d at %s:%s", right, host, port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(host, port, &hints, &res);
    if (rc != 0)
        return ddpc_error(DDPC_ERR_SYSTEM, "getaddrinfo(%s) failed %s: %s", host, what,
                          gai_strerror(rc));
    ddpc_status st = DDPC_OK;
    int fd = -1;
    for (;;) {
        fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd == -1) {
            st = ddpc_error(DDPC_ERR_SYSTEM, "socket() failed %s: %s", what, strerror(errno));
            goto out;
        }
        int err = 0;
        if (connect(fd, res->ai_addr, res->ai_addrlen) == -1) {
            if (errno != EINPROGRESS) {
                err = errno;
            } else {
                DDPC_CHECK_GOTO(wait_fd(fd, POLLOUT, deadline, what), st, out);
                socklen_t el = sizeof err;
                if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) == -1) err = errno;
            }
        }
        if (!err) break;
        close(fd);
        fd = -1;
        /* The listener is up before its address is published: a refusal means a transient
         * network problem (or a dead rank), so retry until the deadline. */
        if (ddpc_now_ms() >= deadline) {
            st = ddpc_error(DDPC_ERR_TIMEOUT, "timed out %s: %s", what, strerror(err));
            goto out;
        }
        DDPC_CHECK_GOTO(ddpc_check_interrupt(), st, out);
        struct timespec ts = {0, 50 * 1000000L};
        nanosleep(&ts, NULL);
    }
    unsigned char hello[TCP_HELLO_LEN];
    put_u32(hello, TCP_MAGIC);
    put_u32(hello + 4, (uint32_t)g->rank);
    for (int i = 0; i < 16; i++) {
        unsigned v;
        sscanf(cookie_hex + 2 * i, "%2x", &v);
        hello[8 + i] = (unsigned char)v;
    }
    DDPC_CHECK_GOTO(io_all(fd, hello, sizeof hello, 1, deadline, what), st, out);
    DDPC_CHECK_GOTO(set_nodelay(fd), st, out);
    c->right_fd = fd;
    fd = -1;
out:
    if (fd != -1) close(fd);
    freeaddrinfo(res);
    return st;
}

/* Accepts the left neighbour: a connection that does not present our cookie and the expected
 * rank within a few seconds is a stranger (a port scanner, a stale job) and is dropped. */
static ddpc_status tcp_accept_left(CpuComm *c, int lfd, const unsigned char *cookie,
                                   int64_t deadline) {
    DdpcGroup *g = c->g;
    int left = (g->rank + g->world - 1) % g->world;
    char what[128];
    snprintf(what, sizeof what, "waiting for rank %d to connect (TCP transport)", left);
    for (;;) {
        DDPC_CHECK(wait_fd(lfd, POLLIN, deadline, what));
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd == -1) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
                continue;
            return ddpc_error(DDPC_ERR_SYSTEM, "accept() failed %s: %s", what, strerror(errno));
        }
        unsigned char hello[TCP_HELLO_LEN];
        int64_t hello_deadline = DDPC_MIN(deadline, ddpc_deadline(5000));
        ddpc_status st = io_all(fd, hello, sizeof hello, 0, hello_deadline, what);
        if (st == DDPC_OK && get_u32(hello) == TCP_MAGIC && get_u32(hello + 4) == (uint32_t)left &&
            !memcmp(hello + 8, cookie, 16)) {
            st = set_nodelay(fd);
            if (st != DDPC_OK) {
                close(fd);
                return st;
            }
            c->left_fd = fd;
            return DDPC_OK;
        }
        close(fd);
        if (st == DDPC_ERR_INTERRUPTED) return st;
        DDPC_INFO("CPU", "rank %d dropped a connection that is not rank %d of this group", g->rank,
                  left);
    }
}

static ddpc_status tcp_setup(CpuComm *c) {
    DdpcGroup *g = c->g;
    int lfd = -1, port = 0;
    unsigned char cookie[16];
    char cookie_hex[33], key[256], val[400];
    ddpc_status st;
    int64_t deadline = ddpc_deadline(g->timeout_ms);
    c->tmp = malloc(TCP_CHUNK);
    c->tmp2 = malloc(TCP_CHUNK);
    if (!c->tmp || !c->tmp2)
        return ddpc_error(DDPC_ERR_NOMEM, "out of host memory for TCP buffers (%u KiB)",
                          2 * (TCP_CHUNK >> 10));
    DDPC_CHECK(random_bytes(cookie, sizeof cookie));
    hex_of(cookie_hex, cookie, sizeof cookie);
    DDPC_CHECK(tcp_listen(c, &lfd, &port));
    ddpc_group_key(g, key, sizeof key, "cpu/tcp/%d", g->rank);
    snprintf(val, sizeof val, "%s %d %s", g->bind_addr, port, cookie_hex);
    DDPC_CHECK_GOTO(store_set_str(g, key, val), st, out);
    /* Connect first, then accept: connecting completes in the peer's listen backlog, so no rank
     * waits on another's accept. */
    DDPC_CHECK_GOTO(tcp_connect_right(c, deadline), st, out);
    DDPC_CHECK_GOTO(tcp_accept_left(c, lfd, cookie, deadline), st, out);
    DDPC_INFO("CPU", "rank %d: TCP ring via %s:%d", g->rank, g->bind_addr, port);
out:
    close(lfd);
    return st;
}

/* ---------------------------------------------------------------- transport choice */

/* Every rank publishes its host and the transport it asks for; all then decide the same way:
 * TCP if any rank asks for it or the hosts differ, else shared memory (falling back to TCP under
 * AUTO when some rank cannot map the segment). */
static ddpc_status choose_transport(CpuComm *c) {
    DdpcGroup *g = c->g;
    char key[256], val[300], host0[300] = "", other[300] = "";
    char host[256];
    int want_tcp = 0, want_shm = 0, differ = -1;
    ddpc_group_host_id(g, host, sizeof host);
    ddpc_group_key(g, key, sizeof key, "cpu/host/%d", g->rank);
    snprintf(val, sizeof val, "%d|%s", (int)g->want_transport, host);
    DDPC_CHECK(store_set_str(g, key, val));
    ddpc_status st = store_wait_ranks(g, "cpu/host/%d");
    if (st != DDPC_OK) return ddpc_error_prefix(st, "exchanging host ids: ");
    for (int r = 0; r < g->world; r++) {
        ddpc_group_key(g, key, sizeof key, "cpu/host/%d", r);
        DDPC_CHECK(store_get_str(g, key, val, sizeof val));
        int want = atoi(val);
        const char *h = strchr(val, '|');
        h = h ? h + 1 : "";
        want_tcp |= want == DDPC_TRANSPORT_TCP;
        want_shm |= want == DDPC_TRANSPORT_SHM;
        if (r == 0) snprintf(host0, sizeof host0, "%s", h);
        else if (differ < 0 && strcmp(h, host0)) {
            differ = r;
            snprintf(other, sizeof other, "%s", h);
        }
    }
    if (want_tcp && want_shm)
        return ddpc_error(DDPC_ERR_INVALID, "some ranks set DDPC_CPU_TRANSPORT=shm and others tcp: "
                          "set the same value on every rank");
    if (differ >= 0 && want_shm)
        return ddpc_error(DDPC_ERR_INVALID,
                          "DDPC_CPU_TRANSPORT=shm needs every rank on one host, but rank 0 runs on "
                          "'%s' and rank %d on '%s': use DDPC_CPU_TRANSPORT=auto or tcp",
                          host0, differ, other);
    if (differ < 0 && !want_tcp) {
        st = shm_setup(c);
        if (st == DDPC_OK) {
            c->kind = KIND_SHM;
            snprintf(g->transport, sizeof g->transport, "shm");
            return DDPC_OK;
        }
        if (want_shm || st == DDPC_ERR_TIMEOUT || st == DDPC_ERR_INTERRUPTED)
            return ddpc_error_prefix(st, "setting up the shared-memory transport: ");
        DDPC_INFO("CPU", "rank %d: shared memory unavailable, using TCP: %s", g->rank,
                  ddpc_last_error());
    }
    DDPC_CHECK(tcp_setup(c));
    c->kind = KIND_TCP;
    snprintf(g->transport, sizeof g->transport, "tcp");
    return DDPC_OK;
}

/* ---------------------------------------------------------------- the communication thread */

static ddpc_status run_single(const Coll *x) {
    const DdpcCollArgs *a = x->a;
    if ((a->op == DDPC_COLL_ALLGATHER || a->op == DDPC_COLL_REDUCE_SCATTER) && a->count &&
        a->send != a->recv)
        memmove(a->recv, a->send, a->count * x->es);
    return DDPC_OK;
}

/* An output that overlaps the input where the transports cannot write it in place
 * (reduce_scatter_needs_staging) takes the result in a buffer of its own first, and gets it only
 * once every input byte has been read: the same bits as with separate buffers, for an extra
 * output-sized buffer (1/world of the input) in this rare case only. */
static ddpc_status reduce_scatter(const Coll *x, int shm) {
    if (!reduce_scatter_needs_staging(x->a, x->es, x->world))
        return shm ? shm_reduce_scatter(x) : tcp_reduce_scatter(x);
    size_t bytes = x->a->count * x->es;
    void *staged = malloc(bytes);
    if (!staged)
        return ddpc_error(DDPC_ERR_NOMEM,
                          "%s #%llu: out of host memory for a %zu-byte buffer on rank %d: the "
                          "output overlaps the input, not at a block boundary, so the result is "
                          "built apart before it is copied in. Pass an output that does not "
                          "overlap the input (or is exactly this rank's block of it), or free "
                          "host memory", x->name, x->seq, bytes, x->rank);
    DdpcCollArgs args = *x->a;
    args.recv = staged;
    Coll y = *x;
    y.a = &args;
    ddpc_status st = shm ? shm_reduce_scatter(&y) : tcp_reduce_scatter(&y);
    if (st == DDPC_OK) memcpy(x->a->recv, staged, bytes);
    free(staged);
    return st;
}

static ddpc_status run_coll(CpuComm *c, DdpcWork *w) {
    Coll x = {.c = c, .w = w, .a = &w->args, .name = ddpc_coll_name(w->args.op),
              .seq = (unsigned long long)w->seq, .rank = c->g->rank, .world = c->g->world};
    x.es = w->args.op == DDPC_COLL_BARRIER ? 1 : ddpc_dtype_size(w->args.dtype);
    if (atomic_load(&c->g->aborted) == 1) return ddpc_group_check_abort(c->g);
    if (c->kind == KIND_SINGLE) return run_single(&x);
    int shm = c->kind == KIND_SHM;
    switch (w->args.op) {
    case DDPC_COLL_ALLREDUCE: return shm ? shm_all_reduce(&x) : tcp_all_reduce(&x);
    case DDPC_COLL_BROADCAST: return shm ? shm_broadcast(&x) : tcp_broadcast(&x);
    case DDPC_COLL_ALLGATHER:
        if (!x.a->count) return shm ? shm_barrier(&x) : tcp_descs(&x);
        return shm ? shm_all_gather(&x) : tcp_all_gather(&x);
    case DDPC_COLL_REDUCE_SCATTER:
        if (!x.a->count) return shm ? shm_barrier(&x) : tcp_descs(&x);
        return reduce_scatter(&x, shm);
    case DDPC_COLL_BARRIER: return shm ? shm_barrier(&x) : tcp_descs(&x);
    default:
        return ddpc_error(DDPC_ERR_INVALID, "unknown collective %d", (int)w->args.op);
    }
}

static void *comm_main(void *arg) {
    CpuComm *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        while (!c->head && !c->stop) pthread_cond_wait(&c->cv, &c->mu);
        DdpcWork *w = c->stop ? NULL : c->head;
        if (!w) {
            pthread_mutex_unlock(&c->mu);
            return NULL;
        }
        c->head = w->next;
        if (!c->head) c->tail = NULL;
        w->next = NULL;
        c->current = w;
        pthread_mutex_unlock(&c->mu);
        /* Its timeout counts from now, not from its post: async works queued behind slow ones
         * (or behind a rank that arrives late) are not late themselves. */
        ddpc_work_begin(w);
        DDPC_TRACE("CPU", "rank %d: %s #%llu count %zu start", c->g->rank,
                   ddpc_coll_name(w->args.op), (unsigned long long)w->seq, w->args.count);
        ddpc_status st = run_coll(c, w);
        if (st != DDPC_OK) {
            /* The group is out of step after any failure: abort it, so that peers blocked in this
             * collective fail now with our reason, and later calls fail at once. */
            char msg[2048];
            snprintf(msg, sizeof msg, "%s", ddpc_last_error());
            ddpc_group_abort(c->g, st, msg);
            ddpc_error(st, "%s", msg);
        }
        DDPC_TRACE("CPU", "rank %d: %s #%llu done: %s", c->g->rank, ddpc_coll_name(w->args.op),
                   (unsigned long long)w->seq, ddpc_status_name(st));
        pthread_mutex_lock(&c->mu);
        c->current = NULL;
        pthread_mutex_unlock(&c->mu);
        ddpc_work_complete(w, st);
        ddpc_work_release(w);
    }
}

static void cpu_wake(CpuComm *c) {
    if (c->hdr) shm_wake_all(c);
    if (c->wake[1] != -1) {
        ssize_t k = write(c->wake[1], "x", 1);
        (void)k; /* a full pipe already wakes the poller */
    }
}

static void cpu_abort(DdpcGroup *g) {
    CpuComm *c = g->impl;
    if (!c) return;
    if (c->hdr) atomic_store(&c->hdr->abort_flag, 1);
    cpu_wake(c);
}

static void comm_free(CpuComm *c) {
    shm_release(c);
    if (c->left_fd != -1) close(c->left_fd);
    if (c->right_fd != -1) close(c->right_fd);
    if (c->wake[0] != -1) close(c->wake[0]);
    if (c->wake[1] != -1) close(c->wake[1]);
    free(c->tmp);
    free(c->tmp2);
    free(c->pid_ok);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static void cpu_destroy(DdpcGroup *g) {
    CpuComm *c = g->impl;
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    int busy = c->current != NULL;
    DdpcWork *queued = c->head;
    c->head = c->tail = NULL;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (busy) {
        atomic_store(&c->stopping, 1);
        cpu_wake(c);
    }
    if (c->thread_started) pthread_join(c->thread, NULL);
    while (queued) {
        DdpcWork *w = queued;
        queued = w->next;
        w->next = NULL;
        ddpc_error(DDPC_ERR_PEER, "%s #%llu never ran: the process group was destroyed first",
                   ddpc_coll_name(w->args.op), (unsigned long long)w->seq);
        ddpc_work_complete(w, DDPC_ERR_PEER);
        ddpc_work_release(w);
    }
    if (c->hdr) {
        /* Peers still waiting for us learn that we left on purpose, not that we crashed. */
        atomic_store(&c->hdr->ranks[g->rank].left, 1);
        shm_wake_all(c);
    }
    ddpc_group_take_impl(g); /* an abort hook on another thread is done with c */
    comm_free(c);
}

/* ddpc_group_wait_idle: the communication thread has nothing queued or running. Each work ends
 * by its deadline at the latest, so this ends too, unless the thread is stuck: then it fails
 * (ddpc_group_backend_stuck). */
static ddpc_status cpu_wait_idle(DdpcGroup *g) {
    CpuComm *c = g->impl;
    if (!c) return DDPC_OK;
    int64_t since = ddpc_now_ms();
    for (;;) {
        pthread_mutex_lock(&c->mu);
        int busy = (c->head || c->current) && !c->stop;
        pthread_mutex_unlock(&c->mu);
        if (!busy) return DDPC_OK;
        DDPC_CHECK(ddpc_check_interrupt());
        if (ddpc_group_backend_stuck(g, since))
            return ddpc_error(DDPC_ERR_TIMEOUT,
                              "waiting for rank %d's collectives to end: the cpu backend has "
                              "begun or ended none for %.0f s (the timeout plus %.0f s) and "
                              "stopped answering; this is a bug in ddpc, please report it with "
                              "the ranks' stacks (py-spy dump --native --pid PID)", g->rank,
                              (double)(g->timeout_ms + g->grace_ms) / 1000.0,
                              (double)g->grace_ms / 1000.0);
        poll(NULL, 0, 2);
    }
}

static ddpc_status cpu_post(DdpcGroup *g, DdpcWork *w) {
    CpuComm *c = g->impl;
    if (w->args.device >= 0)
        return ddpc_error(DDPC_ERR_INVALID,
                          "%s: the cpu backend works on host memory, but the buffer is on CUDA "
                          "device %d: use backend='nccl' or move it to the cpu",
                          ddpc_coll_name(w->args.op), w->args.device);
    pthread_mutex_lock(&c->mu);
    if (c->stop) {
        pthread_mutex_unlock(&c->mu);
        return ddpc_error(DDPC_ERR_INVALID, "%s: the process group is being destroyed",
                          ddpc_coll_name(w->args.op));
    }
    ddpc_work_retain(w);
    w->next = NULL;
    if (c->tail) c->tail->next = w;
    else c->head = w;
    c->tail = w;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return DDPC_OK;
}

static int usable_cpus(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static ddpc_status cpu_init(DdpcGroup *g) {
    CpuComm *c = calloc(1, sizeof *c);
    if (!c) return ddpc_error(DDPC_ERR_NOMEM, "out of host memory creating the cpu backend");
    c->g = g;
    c->left_fd = c->right_fd = c->wake[0] = c->wake[1] = -1;
    atomic_init(&c->stopping, 0);
    int rc = pthread_mutex_init(&c->mu, NULL);
    if (rc == 0 && (rc = pthread_cond_init(&c->cv, NULL)) != 0) pthread_mutex_destroy(&c->mu);
    if (rc != 0) {
        free(c);
        return ddpc_error(DDPC_ERR_SYSTEM, "pthread_mutex/cond_init failed: %s", strerror(rc));
    }
    ddpc_status st = DDPC_OK;
    /* Spinning only pays when every rank has a core; oversubscribed, it steals the peer's. */
    c->spin_ns = g->world <= usable_cpus() ? SPIN_NS : 0;
    c->pid_ok = calloc((size_t)g->world, 1);
    if (!c->pid_ok) {
        st = ddpc_error(DDPC_ERR_NOMEM, "out of host memory creating the cpu backend");
        goto fail;
    }
    if (pipe2(c->wake, O_CLOEXEC | O_NONBLOCK) == -1) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "pipe2() failed: %s", strerror(errno));
        goto fail;
    }
    if (g->world == 1) {
        c->kind = KIND_SINGLE;
        snprintf(g->transport, sizeof g->transport, "%s",
                 g->want_transport == DDPC_TRANSPORT_TCP ? "tcp" : "shm");
    } else {
        DDPC_CHECK_GOTO(choose_transport(c), st, fail);
    }
    /* The thread takes no signals: they belong to the caller's (Python's) threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = ddpc_thread_start(&c->thread, comm_main, c, "ddpc-comm", 0);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "pthread_create (communication thread) failed: %s",
                        strerror(rc));
        goto fail;
    }
    c->thread_started = 1;
    g->impl = c;
    return DDPC_OK;
fail:
    comm_free(c);
    return st;
}

const DdpcBackendOps ddpc_backend_cpu = {
    .name = "cpu",
    .deadline_from_start = 1,
    .init = cpu_init,
    .post = cpu_post,
    .wait_stream = NULL,
    .abort = cpu_abort,
    .destroy = cpu_destroy,
    .wait_idle = cpu_wait_idle,
    .work_free = NULL,
};
