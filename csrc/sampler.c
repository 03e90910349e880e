/* sampler.c: DistributedSampler index generation: torch.utils.data.DistributedSampler's split
 * (padding from the front, drop_last trimming, rank striding) over a permutation that is a pure
 * function of (length, seed, epoch), so every rank, process and machine computes the same one. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"

/* The permutation is part of the reproducibility contract: a run restarted from a checkpoint, or
 * on other machines, must see the same data order. Treat everything from here to permute() as a
 * file format (key derivation, xoshiro256**, Lemire's bounded draw, segments, buckets, streams,
 * the Fisher-Yates direction): changing any of it changes every user's order. It is not torch's
 * permutation: torch draws from its own Mersenne-Twister based generator seeded with seed + epoch.
 * We hash seed and epoch separately, so (seed 1, epoch 0) and (seed 0, epoch 1) differ. */

__extension__ typedef unsigned __int128 ddpc_u128;

typedef struct {
    uint64_t s[4];
} Rng;

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t splitmix64(uint64_t *x) {
    *x += 0x9e3779b97f4a7c15ull;
    return mix64(*x);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t perm_key(uint64_t seed, uint64_t epoch) {
    return mix64(mix64(seed ^ 0x6464706373616d70ull) ^ epoch); /* "ddpcsamp" */
}

/* Independent stream s of a key: xoshiro256** seeded through splitmix64, as its authors advise. */
static void rng_stream(Rng *r, uint64_t key, uint64_t s) {
    uint64_t x = key ^ mix64(s + 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

/* xoshiro256** (Blackman & Vigna). */
static uint64_t rng_next(Rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* Uniform in [0, bound), bound >= 1, without modulo bias: Lemire, "Fast random integer
 * generation in an interval" (2019). The division runs only in the rare rejection zone. */
static uint64_t rng_bounded(Rng *r, uint64_t bound) {
    ddpc_u128 m = (ddpc_u128)rng_next(r) * bound;
    uint64_t lo = (uint64_t)m;
    if (lo < bound) {
        uint64_t threshold = (0 - bound) % bound;
        while (lo < threshold) {
            m = (ddpc_u128)rng_next(r) * bound;
            lo = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

/* The shuffle is Sanders' algorithm ("Random permutations on distributed, external and
 * hierarchical memory", 1998): every index goes to one of k buckets, uniformly and independently,
 * then each bucket is Fisher-Yates shuffled and the buckets are concatenated in order. The result
 * is a uniform permutation, like one Fisher-Yates over everything, but every random access stays
 * inside a cache-sized bucket (one Fisher-Yates over 1e8 indices is 1e8 cache and TLB misses:
 * 1-2 s even with prefetching), and the work splits into independent tasks: NSEG segments of the
 * input, each drawing its buckets from its own stream, then the buckets, each with its own stream.
 * Threads take tasks in any order; the permutation never depends on how many there are. */
#define NSEG 64
#define BUCKET_TARGET_BITS 17 /* about 2^17 indices per bucket: 512 KiB of uint32, cache-sized */
#define BUCKET_MAX_BITS 10    /* at most 1024 buckets: the scatter's write streams stay cached */

/* log2 of the number of buckets for n indices (0: one plain Fisher-Yates). */
static int bucket_bits(uint64_t n) {
    int bits = 0;
    while (bits < BUCKET_MAX_BITS && (n >> (BUCKET_TARGET_BITS + bits)) > 0) bits++;
    return bits;
}

/* ---------------------------------------------------------------- tasks on threads */

#define MAX_THREADS DDPC_SAMPLER_MAX_THREADS
/* Below this many indices one thread is faster than starting others. */
#define PARALLEL_MIN ((uint64_t)1 << 20)
/* How often the calling thread looks for Ctrl-C (it takes the GIL to do so). */
#define INTERRUPT_CHECK_MS 50

typedef void (*task_fn)(void *ctx, uint64_t task);

typedef struct {
    task_fn fn;
    void *ctx;
    uint64_t ntasks;
    atomic_uint_fast64_t next;
    atomic_int stop;
} TaskQueue;

static void queue_drain(TaskQueue *q) {
    while (!atomic_load_explicit(&q->stop, memory_order_relaxed)) {
        uint64_t t = atomic_fetch_add(&q->next, 1);
        if (t >= q->ntasks) return;
        q->fn(q->ctx, t);
    }
}

static void *queue_worker(void *arg) {
    queue_drain(arg);
    return NULL;
}

/* Runs fn(ctx, 0..ntasks-1) on up to nthreads threads, the caller being one of them. Tasks write
 * disjoint memory, so the order they run in does not matter. A thread that cannot be started is
 * not an error: the others take its share. */
static ddpc_status run_tasks(int nthreads, uint64_t ntasks, task_fn fn, void *ctx) {
    TaskQueue q = {.fn = fn, .ctx = ctx, .ntasks = ntasks};
    pthread_t tids[MAX_THREADS];
    int started = 0;
    atomic_init(&q.next, 0);
    atomic_init(&q.stop, 0);
    while (started + 1 < nthreads && (uint64_t)started + 1 < ntasks) {
        int rc = ddpc_thread_start(&tids[started], queue_worker, &q, "ddpc-sampler", 0);
        if (rc != 0) {
            DDPC_INFO("SAMPLER", "pthread_create failed: %s; continuing with %d threads",
                      strerror(rc), started + 1);
            break;
        }
        started++;
    }
    ddpc_status st = DDPC_OK;
    int64_t next_check = 0; /* the first check comes after the first task */
    for (;;) {
        uint64_t t = atomic_fetch_add(&q.next, 1);
        if (t >= ntasks) break;
        fn(ctx, t);
        if (ddpc_now_ms() >= next_check) {
            next_check = ddpc_now_ms() + INTERRUPT_CHECK_MS;
            st = ddpc_check_interrupt();
            if (st != DDPC_OK) {
                atomic_store(&q.stop, 1);
                break;
            }
        }
    }
    for (int i = 0; i < started; i++) {
        int rc = pthread_join(tids[i], NULL);
        if (rc != 0 && st == DDPC_OK)
            st = ddpc_error(DDPC_ERR_SYSTEM, "sampler: pthread_join failed: %s", strerror(rc));
    }
    return st;
}

/* DDPC_SAMPLER_THREADS, else the CPUs this process may run on, at most 8: every rank of a host
 * shuffles at the same moment, so more would only fight over the same cores. */
static ddpc_status thread_count(uint64_t n, int *out) {
    *out = 1;
    uint64_t asked;
    DDPC_CHECK(ddpc_setting_uint("DDPC_SAMPLER_THREADS", 0, &asked)); /* 1 to MAX_THREADS */
    if (asked) {
        *out = (int)asked;
        return DDPC_OK;
    }
    if (n < PARALLEL_MIN) return DDPC_OK;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        *out = DDPC_MIN(CPU_COUNT(&set), 8);
    } else {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        DDPC_INFO("SAMPLER", "sched_getaffinity failed: %s; using the %ld online CPUs",
                  strerror(errno), c);
        *out = c > 0 ? (int)DDPC_MIN(c, 8) : 1;
    }
    if (*out < 1) *out = 1;
    return DDPC_OK;
}

/* ---------------------------------------------------------------- the permutation */

typedef struct {
    uint64_t key, n, seg_len;
    int bits;
    uint64_t *cursor;   /* NSEG x k: counts, then write cursors of segment s into bucket b */
    uint64_t *bstart;   /* k + 1 bucket boundaries */
    void *a;            /* uint32_t or int64_t, by wide */
    int wide;
} Perm;

/* Segment s of the identity 0..n-1: the bucket of each index is the next `bits` bits of stream
 * 2s (top bits first, as many per draw as fit). Counting and scattering draw the same buckets
 * because both restart the segment's stream. */
static void perm_segment(Perm *p, uint64_t s, int scatter) {
    uint64_t lo = s * p->seg_len, hi = DDPC_MIN(p->n, lo + p->seg_len), x = 0;
    uint64_t *cur = p->cursor + (s << p->bits);
    int bits = p->bits, per_draw = 64 / bits, left = 0;
    uint32_t *a32 = p->a;
    int64_t *a64 = p->a;
    Rng r;
    rng_stream(&r, p->key, 2 * s);
    for (uint64_t i = lo; i < hi; i++) {
        if (left == 0) {
            x = rng_next(&r);
            left = per_draw;
        }
        uint64_t b = x >> (64 - bits);
        x <<= bits;
        left--;
        if (!scatter)
            cur[b]++;
        else if (p->wide)
            a64[cur[b]++] = (int64_t)i;
        else
            a32[cur[b]++] = (uint32_t)i;
    }
}

static void task_count(void *ctx, uint64_t s) { perm_segment(ctx, s, 0); }
static void task_scatter(void *ctx, uint64_t s) { perm_segment(ctx, s, 1); }

/* Fisher-Yates from the top: for i = len-1 .. 1 swap a[i] with a[j], j uniform in [0, i]. */
#define DEFINE_FISHER_YATES(name, T)                                                               \
    static void name(T *a, uint64_t len, Rng *r) {                                                 \
        for (uint64_t i = len; i > 1; i--) {                                                       \
            uint64_t j = rng_bounded(r, i);                                                        \
            T t = a[i - 1];                                                                        \
            a[i - 1] = a[j];                                                                       \
            a[j] = t;                                                                              \
        }                                                                                          \
    }
DEFINE_FISHER_YATES(fisher_yates_u32, uint32_t)
DEFINE_FISHER_YATES(fisher_yates_i64, int64_t)

/* Bucket b is Fisher-Yates shuffled with stream 2b + 1. */
static void task_bucket(void *ctx, uint64_t b) {
    Perm *p = ctx;
    uint64_t lo = p->bstart[b], len = p->bstart[b + 1] - lo;
    Rng r;
    rng_stream(&r, p->key, 2 * b + 1);
    if (p->wide)
        fisher_yates_i64((int64_t *)p->a + lo, len, &r);
    else
        fisher_yates_u32((uint32_t *)p->a + lo, len, &r);
}

/* First touch of a fresh buffer (page faults and zeroing; on a VM also the host's faults) can
 * cost more than the shuffle. The scatter would take it all in its first tasks, since every
 * segment writes into every bucket; touching each page here, in short tasks, spreads it over the
 * threads and lets the caller see Ctrl-C between tasks. */
#define PREFAULT_TASK ((uint64_t)32 << 20)
#define TOUCH_STRIDE 4096

typedef struct {
    volatile char *base;
    uint64_t bytes;
} Prefault;

static void task_prefault(void *ctx, uint64_t t) {
    const Prefault *f = ctx;
    uint64_t lo = t * PREFAULT_TASK, hi = DDPC_MIN(f->bytes, lo + PREFAULT_TASK);
    for (uint64_t o = lo; o < hi; o += TOUCH_STRIDE) f->base[o] = 0;
}

/* a[0..n) = the permutation of (n, key); a is int64_t when wide, else uint32_t (n <= 2^32). */
static ddpc_status permute(void *a, int wide, uint64_t n, uint64_t key, int nthreads) {
    Perm p = {.key = key, .n = n, .bits = bucket_bits(n), .a = a, .wide = wide};
    uint64_t k = (uint64_t)1 << p.bits;
    if (p.bits == 0) {
        Rng r;
        rng_stream(&r, key, 1);
        for (uint64_t i = 0; i < n; i++) {
            if (wide)
                ((int64_t *)a)[i] = (int64_t)i;
            else
                ((uint32_t *)a)[i] = (uint32_t)i;
        }
        if (wide)
            fisher_yates_i64(a, n, &r);
        else
            fisher_yates_u32(a, n, &r);
        return DDPC_OK;
    }
    p.seg_len = (n + NSEG - 1) / NSEG;
    p.cursor = calloc(NSEG * k + k + 1, sizeof(uint64_t));
    if (!p.cursor)
        return ddpc_error(DDPC_ERR_NOMEM, "sampler: calloc of %llu bucket counters failed",
                          (unsigned long long)(NSEG * k + k + 1));
    p.bstart = p.cursor + NSEG * k;
    Prefault f = {.base = a, .bytes = n * (wide ? sizeof(int64_t) : sizeof(uint32_t))};
    ddpc_status st = run_tasks(nthreads, (f.bytes + PREFAULT_TASK - 1) / PREFAULT_TASK,
                               task_prefault, &f);
    if (st == DDPC_OK) st = run_tasks(nthreads, NSEG, task_count, &p);
    if (st == DDPC_OK) {
        /* Bucket b holds segment 0's share of it, then segment 1's, ...: cursor[s][b] becomes
         * where segment s starts writing into bucket b. */
        uint64_t pos = 0;
        for (uint64_t b = 0; b < k; b++) {
            p.bstart[b] = pos;
            for (uint64_t s = 0; s < NSEG; s++) {
                uint64_t c = p.cursor[(s << p.bits) + b];
                p.cursor[(s << p.bits) + b] = pos;
                pos += c;
            }
        }
        p.bstart[k] = pos;
        st = run_tasks(nthreads, NSEG, task_scatter, &p);
    }
    if (st == DDPC_OK) st = run_tasks(nthreads, k, task_bucket, &p);
    free(p.cursor);
    return st;
}

/* ---------------------------------------------------------------- the split */

/* Big buffers get a transparent-huge-page hint: it makes first touch (a fresh buffer every epoch)
 * and the scatter's page walks several times cheaper. Small ones come from malloc. */
#define HUGE_MIN ((size_t)4 << 20)

static ddpc_status big_alloc(size_t bytes, void **out) {
    *out = NULL;
    if (bytes < HUGE_MIN) {
        *out = malloc(bytes ? bytes : 1);
        if (!*out)
            return ddpc_error(DDPC_ERR_NOMEM, "sampler: malloc of %zu bytes failed", bytes);
        return DDPC_OK;
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return ddpc_error(DDPC_ERR_NOMEM, "sampler: mmap of %zu bytes failed: %s", bytes,
                          strerror(errno));
#ifdef MADV_HUGEPAGE
    /* Only a hint: kernels built without THP refuse it, and then normal pages serve. */
    if (madvise(p, bytes, MADV_HUGEPAGE) != 0)
        DDPC_TRACE("SAMPLER", "madvise(MADV_HUGEPAGE, %zu bytes): %s", bytes, strerror(errno));
#endif
    *out = p;
    return DDPC_OK;
}

static void big_free(void *p, size_t bytes) {
    if (!p) return;
    if (bytes < HUGE_MIN) {
        free(p);
        return;
    }
    if (munmap(p, bytes) != 0)
        DDPC_INFO("SAMPLER", "munmap of %zu bytes failed: %s", bytes, strerror(errno));
}

ddpc_status ddpc_sampler_alloc(int64_t count, int64_t **out) {
    if (!out) return ddpc_error(DDPC_ERR_INVALID, "sampler: out is NULL");
    *out = NULL;
    if (count < 0 || (uint64_t)count > SIZE_MAX / sizeof(int64_t))
        return ddpc_error(DDPC_ERR_INVALID, "sampler: cannot allocate %lld indices",
                          (long long)count);
    return big_alloc((size_t)count * sizeof(int64_t), (void **)out);
}

void ddpc_sampler_free(int64_t *buf, int64_t count) {
    if (buf && count >= 0) big_free(buf, (size_t)count * sizeof(int64_t));
}

static ddpc_status check_args(int64_t length, int replicas, int rank, int drop_last, int pad) {
    if (length < 0)
        return ddpc_error(DDPC_ERR_INVALID, "sampler: dataset length %lld is negative",
                          (long long)length);
    if (replicas < 1)
        return ddpc_error(DDPC_ERR_INVALID,
                          "sampler: num_replicas is %d; expected at least 1 (the world size)",
                          replicas);
    if (rank < 0 || rank >= replicas)
        return ddpc_error(DDPC_ERR_INVALID,
                          "sampler: rank %d is outside [0, %d]; expected 0 <= rank < num_replicas",
                          rank, replicas - 1);
    if (drop_last && !pad)
        return ddpc_error(DDPC_ERR_INVALID,
                          "sampler: drop_last=True and pad=False contradict each other: drop_last "
                          "trims the dataset to equal rank lengths, pad=False keeps every sample "
                          "exactly once; choose one");
    /* Keeps total_size and every rank + k * replicas within int64. */
    if (length > INT64_MAX - replicas)
        return ddpc_error(DDPC_ERR_INVALID, "sampler: dataset length %lld is too large",
                          (long long)length);
    return DDPC_OK;
}

/* torch: num_samples = ceil((len - R) / R) when drop_last and len % R != 0, which is floor(len/R),
 * else ceil(len / R). Unpadded: rank r owns positions r, r + R, ... below len. */
static int64_t num_samples(int64_t length, int replicas, int rank, int drop_last, int pad) {
    if (!pad) return length > rank ? (length - rank + replicas - 1) / replicas : 0;
    if (drop_last) return length / replicas;
    return (length + replicas - 1) / replicas;
}

int64_t ddpc_sampler_num_samples(int64_t length, int replicas, int rank, int drop_last, int pad) {
    if (check_args(length, replicas, rank, drop_last, pad) != DDPC_OK) return -1;
    return num_samples(length, replicas, rank, drop_last, pad);
}

/* out[k] = perm[(rank + k * replicas) % length] for k in one task's range; perm NULL is the
 * identity. Position p of torch's padded list holds perm[p % length]: padding repeats the list
 * from its front, as many times as needed, and drop_last keeps a prefix. */
#define GATHER_TASK ((int64_t)1 << 18)

typedef struct {
    int64_t *out, count, length;
    int replicas, rank, wide;
    const void *perm;
} Gather;

static void task_gather(void *ctx, uint64_t t) {
    const Gather *g = ctx;
    int64_t k0 = (int64_t)t * GATHER_TASK, k1 = DDPC_MIN(g->count, k0 + GATHER_TASK);
    const uint32_t *p32 = g->perm;
    const int64_t *p64 = g->perm;
    for (int64_t k = k0, p = g->rank + k0 * g->replicas; k < k1; k++, p += g->replicas) {
        int64_t q = p < g->length ? p : p % g->length;
        g->out[k] = !g->perm ? q : g->wide ? p64[q] : (int64_t)p32[q];
    }
}

ddpc_status ddpc_sampler_indices(int64_t length, int replicas, int rank, int shuffle,
                                 uint64_t seed, uint64_t epoch, int drop_last, int pad,
                                 int64_t *out, int64_t *n_out) {
    DDPC_CHECK(check_args(length, replicas, rank, drop_last, pad));
    if (!n_out) return ddpc_error(DDPC_ERR_INVALID, "sampler: n_out is NULL");
    *n_out = 0;
    int64_t count = num_samples(length, replicas, rank, drop_last, pad);
    if (count == 0) return DDPC_OK;
    if (!out)
        return ddpc_error(DDPC_ERR_INVALID, "sampler: out is NULL but rank %d reads %lld indices",
                          rank, (long long)count);
    uint64_t n = (uint64_t)length;
    int nthreads;
    DDPC_CHECK(thread_count(n, &nthreads));
    uint64_t key = perm_key(seed, epoch);
    Gather g = {.out = out, .count = count, .length = length, .replicas = replicas, .rank = rank};
    if (shuffle && replicas == 1) {
        /* The whole permutation, unpadded and untrimmed: build it straight in out. */
        DDPC_CHECK(permute(out, 1, n, key, nthreads));
        *n_out = count;
        return DDPC_OK;
    }
    void *perm = NULL;
    size_t bytes = 0;
    ddpc_status st = DDPC_OK;
    if (shuffle) {
        /* Half the memory traffic when indices fit 32 bits; the order is the same either way. */
        g.wide = n > (uint64_t)UINT32_MAX + 1;
        size_t elem = g.wide ? sizeof(int64_t) : sizeof(uint32_t);
        if (n > SIZE_MAX / elem)
            return ddpc_error(DDPC_ERR_NOMEM, "sampler: a permutation of %lld indices does not "
                              "fit in memory", (long long)length);
        bytes = n * elem;
        DDPC_CHECK(big_alloc(bytes, &perm));
        st = permute(perm, g.wide, n, key, nthreads);
        g.perm = perm;
    }
    if (st == DDPC_OK) {
        uint64_t ntasks = ((uint64_t)count + GATHER_TASK - 1) / GATHER_TASK;
        st = run_tasks(nthreads, ntasks, task_gather, &g);
    }
    if (st == DDPC_OK) *n_out = count;
    big_free(perm, bytes);
    return st;
}
