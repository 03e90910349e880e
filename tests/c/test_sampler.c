/* test_sampler.c: csrc/sampler.c against a literal transcription of torch's DistributedSampler
 * split (list, pad by repeating from the front, trim, stride), plus the properties of the
 * shuffle: a permutation, padded from its front, the same for every thread count and buffer width,
 * uniform (exactly counted for small n, block statistics for the bucketed path), deterministic.
 * Run by tests/test_sampler.py; prints "ok: ..." and exits 0 when everything holds. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddpc.h"
#include "check.h"

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

/* Runs ddpc_sampler_indices into a fresh buffer; *n receives the count (-1 on failure). */
static int64_t *gen(int64_t len, int R, int rank, int shuffle, uint64_t seed, uint64_t epoch,
                    int drop_last, int pad, int64_t *n) {
    int64_t cap = ddpc_sampler_num_samples(len, R, rank, drop_last, pad);
    int64_t *out = xmalloc((size_t)(cap > 0 ? cap : 1) * sizeof(int64_t));
    ddpc_status st = ddpc_sampler_indices(len, R, rank, shuffle, seed, epoch, drop_last, pad, out,
                                          n);
    EXPECT(st == DDPC_OK, "indices(len=%lld R=%d rank=%d): %s", (long long)len, R, rank,
           ddpc_last_error());
    if (st != DDPC_OK) *n = -1;
    return out;
}

/* torch/utils/data/distributed.py, transcribed: the rank's indices for a given base list. */
static int64_t torch_split(const int64_t *base, int64_t len, int R, int rank, int drop_last,
                           int64_t *out) {
    int64_t num_samples = drop_last && len % R != 0 ? (int64_t)ceil((double)(len - R) / R)
                                                    : (int64_t)ceil((double)len / R);
    int64_t total = num_samples * R;
    int64_t *list = xmalloc((size_t)(total > len ? total : len) * sizeof(int64_t));
    memcpy(list, base, (size_t)len * sizeof(int64_t));
    int64_t size = len;
    if (!drop_last) {
        /* indices += indices[:pad], or (indices * ceil(pad / len))[:pad] when pad > len */
        for (int64_t i = 0; size < total; i++) list[size++] = list[i % len];
    } else {
        size = total;
    }
    int64_t k = 0;
    for (int64_t p = rank; p < size; p += R) out[k++] = list[p];
    free(list);
    return k;
}

static const int64_t kLens[] = {0, 1, 2, 3, 7, 10, 11, 100, 101, 1000, 4099};
static const int kReplicas[] = {1, 2, 3, 4, 8, 13};
#define NLENS (int)(sizeof kLens / sizeof kLens[0])
#define NREPS (int)(sizeof kReplicas / sizeof kReplicas[0])

static void test_torch_split_unshuffled(void) {
    for (int li = 0; li < NLENS; li++)
        for (int ri = 0; ri < NREPS; ri++)
            for (int drop = 0; drop < 2; drop++) {
                int64_t len = kLens[li];
                int R = kReplicas[ri];
                int64_t *base = xmalloc((size_t)(len ? len : 1) * sizeof(int64_t));
                int64_t *want = xmalloc((size_t)(len + R) * sizeof(int64_t));
                for (int64_t i = 0; i < len; i++) base[i] = i;
                for (int rank = 0; rank < R; rank++) {
                    int64_t nw = torch_split(base, len, R, rank, drop, want), n;
                    EXPECT(ddpc_sampler_num_samples(len, R, rank, drop, 1) == nw,
                           "num_samples(len=%lld R=%d drop=%d)=%lld, torch %lld", (long long)len,
                           R, drop, (long long)ddpc_sampler_num_samples(len, R, rank, drop, 1),
                           (long long)nw);
                    int64_t *got = gen(len, R, rank, 0, 0, 0, drop, 1, &n);
                    EXPECT(n == nw, "len=%lld R=%d rank=%d drop=%d: %lld indices, torch %lld",
                           (long long)len, R, rank, drop, (long long)n, (long long)nw);
                    for (int64_t k = 0; k < n && k < nw; k++)
                        EXPECT(got[k] == want[k], "len=%lld R=%d rank=%d drop=%d: [%lld]=%lld, "
                               "torch %lld", (long long)len, R, rank, drop, (long long)k,
                               (long long)got[k], (long long)want[k]);
                    free(got);
                }
                free(base);
                free(want);
            }
}

/* The permutation of (len, seed, epoch), read through replicas=1. */
static int64_t *perm_of(int64_t len, uint64_t seed, uint64_t epoch) {
    int64_t n;
    return gen(len, 1, 0, 1, seed, epoch, 0, 1, &n);
}

static int is_permutation(const int64_t *p, int64_t len) {
    char *seen = calloc((size_t)(len ? len : 1), 1);
    int ok = seen != NULL;
    for (int64_t i = 0; ok && i < len; i++) {
        if (p[i] < 0 || p[i] >= len || seen[p[i]]) ok = 0;
        else seen[p[i]] = 1;
    }
    free(seen);
    return ok;
}

/* With shuffle, each rank's list is torch's split of the permutation (the one replicas=1 yields):
 * the ranks together cover it once, plus padding repeated from its front. That the replicas=1
 * path (built in place, int64) and the others (uint32 scratch) agree is also checked here. */
static void test_shuffled_split(void) {
    for (int li = 0; li < NLENS; li++)
        for (int ri = 0; ri < NREPS; ri++)
            for (int drop = 0; drop < 2; drop++) {
                int64_t len = kLens[li];
                int R = kReplicas[ri];
                int64_t *perm = perm_of(len, 7, 3);
                int64_t *want = xmalloc((size_t)(len + R) * sizeof(int64_t));
                EXPECT(is_permutation(perm, len), "len=%lld: not a permutation", (long long)len);
                for (int rank = 0; rank < R; rank++) {
                    int64_t nw = torch_split(perm, len, R, rank, drop, want), n;
                    int64_t *got = gen(len, R, rank, 1, 7, 3, drop, 1, &n);
                    EXPECT(n == nw, "shuffled len=%lld R=%d rank=%d: %lld indices, want %lld",
                           (long long)len, R, rank, (long long)n, (long long)nw);
                    for (int64_t k = 0; k < n && k < nw; k++)
                        EXPECT(got[k] == want[k], "shuffled len=%lld R=%d rank=%d drop=%d: "
                               "[%lld]=%lld, want %lld", (long long)len, R, rank, drop,
                               (long long)k, (long long)got[k], (long long)want[k]);
                    free(got);
                }
                free(perm);
                free(want);
            }
}

/* pad=0: the ranks' lists are disjoint, cover 0..len-1 exactly, and differ in length by <= 1. */
static void test_unpadded(void) {
    for (int li = 0; li < NLENS; li++)
        for (int ri = 0; ri < NREPS; ri++)
            for (int shuffle = 0; shuffle < 2; shuffle++) {
                int64_t len = kLens[li], total = 0, lo = INT64_MAX, hi = 0;
                int R = kReplicas[ri];
                int64_t *all = xmalloc((size_t)(len ? len : 1) * sizeof(int64_t));
                for (int rank = 0; rank < R; rank++) {
                    int64_t n;
                    int64_t *got = gen(len, R, rank, shuffle, 1, 2, 0, 0, &n);
                    EXPECT(n == ddpc_sampler_num_samples(len, R, rank, 0, 0), "count mismatch");
                    for (int64_t k = 0; k < n && total < len; k++) all[total++] = got[k];
                    lo = n < lo ? n : lo;
                    hi = n > hi ? n : hi;
                    free(got);
                }
                EXPECT(total == len && is_permutation(all, len),
                       "pad=0 len=%lld R=%d shuffle=%d: the ranks do not cover each index once",
                       (long long)len, R, shuffle);
                EXPECT(hi - lo <= 1, "pad=0 len=%lld R=%d: lengths %lld..%lld", (long long)len, R,
                       (long long)lo, (long long)hi);
                free(all);
            }
}

static int same(const int64_t *a, const int64_t *b, int64_t n) {
    return memcmp(a, b, (size_t)n * sizeof(int64_t)) == 0;
}

static void test_determinism(void) {
    const int64_t lens[] = {10, 1000, 200003, 3000017};
    for (int i = 0; i < 4; i++) {
        int64_t len = lens[i];
        int64_t *a = perm_of(len, 42, 5), *b = perm_of(len, 42, 5);
        int64_t *c = perm_of(len, 42, 6), *d = perm_of(len, 43, 5), *e = perm_of(len, 5, 42);
        EXPECT(is_permutation(a, len), "len=%lld: not a permutation", (long long)len);
        EXPECT(same(a, b, len), "len=%lld: same (seed, epoch) gave different orders",
               (long long)len);
        EXPECT(!same(a, c, len), "len=%lld: epochs 5 and 6 gave the same order", (long long)len);
        EXPECT(!same(a, d, len), "len=%lld: seeds 42 and 43 gave the same order", (long long)len);
        EXPECT(!same(a, e, len), "len=%lld: (42, 5) and (5, 42) gave the same order",
               (long long)len);
        free(a); free(b); free(c); free(d); free(e);
    }
}

/* The permutation must not depend on how many threads built it, nor on the buffer width
 * (replicas=1 builds int64 in place, replicas=2 a uint32 scratch). */
static void test_threads_and_widths(void) {
    const int64_t len = 3000017; /* bucketed and threaded */
    setenv("DDPC_SAMPLER_THREADS", "1", 1);
    int64_t *one = perm_of(len, 9, 1);
    const char *counts[] = {"2", "3", "8"};
    for (int i = 0; i < 3; i++) {
        setenv("DDPC_SAMPLER_THREADS", counts[i], 1);
        int64_t *p = perm_of(len, 9, 1);
        EXPECT(same(one, p, len), "%s threads gave another permutation than 1", counts[i]);
        free(p);
    }
    unsetenv("DDPC_SAMPLER_THREADS");
    for (int rank = 0; rank < 2; rank++) {
        int64_t n;
        int64_t *half = gen(len, 2, rank, 1, 9, 1, 0, 1, &n);
        int ok = 1;
        for (int64_t k = 0; k < n; k++) {
            int64_t p = rank + 2 * k;
            if (half[k] != one[p % len]) ok = 0;
        }
        EXPECT(ok, "rank %d of 2 (uint32 scratch) disagrees with the int64 permutation", rank);
        free(half);
    }
    free(one);
    setenv("DDPC_SAMPLER_THREADS", "lots", 1);
    int64_t out[4], n;
    EXPECT(ddpc_sampler_indices(4, 1, 0, 1, 0, 0, 0, 1, out, &n) == DDPC_ERR_INVALID &&
               strstr(ddpc_last_error(), "DDPC_SAMPLER_THREADS"),
           "a bad DDPC_SAMPLER_THREADS was accepted: %s", ddpc_last_error());
    unsetenv("DDPC_SAMPLER_THREADS");
}

/* Small n: all n! orders, counted over many epochs, against a chi-square bound that a uniform
 * shuffle exceeds with probability about 1e-6 (the seeds are fixed, so the test is too). */
static void test_uniform_small(void) {
    const int64_t len = 4;
    const int trials = 48000, nperm = 24;
    long counts[24] = {0};
    for (int t = 0; t < trials; t++) {
        int64_t out[4], n;
        ddpc_sampler_indices(len, 1, 0, 1, 1234, (uint64_t)t, 0, 1, out, &n);
        int code = 0, used = 0;
        /* Lehmer code of the permutation: a number in [0, 24). */
        for (int i = 0; i < 4; i++) {
            int smaller = 0;
            for (int v = 0; v < out[i]; v++) smaller += !(used >> v & 1);
            used |= 1 << out[i];
            code = code * (4 - i) + smaller;
        }
        counts[code]++;
    }
    double expect = (double)trials / nperm, chi2 = 0;
    for (int i = 0; i < nperm; i++) chi2 += (counts[i] - expect) * (counts[i] - expect) / expect;
    EXPECT(chi2 < 70.5, "n=4 orders are not uniform: chi2=%.1f with 23 degrees of freedom", chi2);
}

/* Chi-square of a 16 x 16 table of counts against the uniform n/256 per cell. */
static double chi2_16x16(long t[16][16], int64_t n) {
    double expect = (double)n / 256, chi2 = 0;
    for (int a = 0; a < 16; a++)
        for (int b = 0; b < 16; b++) chi2 += (t[a][b] - expect) * (t[a][b] - expect) / expect;
    return chi2;
}

/* Bucketed path: four 16 x 16 tables of a uniform permutation must each have about n/256 per
 * cell: (position block, value block) catches values kept near their origin, (position block,
 * value mod 16) buckets of a fixed residue, (position mod 16, value mod 16) interleaving, and
 * (block of where v lands, block of where v + 1 lands) bucket draws correlated between
 * neighbouring indices. Each bound: chi2 with 225 dof beyond 340.6 has probability 1e-6. */
static void test_uniform_bucketed(void) {
    const int64_t len = 1 << 20;
    for (uint64_t epoch = 0; epoch < 3; epoch++) {
        int64_t *p = perm_of(len, 77, epoch);
        int64_t *where = xmalloc((size_t)len * sizeof(int64_t));
        static long blocks[16][16], residues[16][16], interleave[16][16], neighbours[16][16];
        memset(blocks, 0, sizeof blocks);
        memset(residues, 0, sizeof residues);
        memset(interleave, 0, sizeof interleave);
        memset(neighbours, 0, sizeof neighbours);
        long fixed = 0;
        for (int64_t i = 0; i < len; i++) {
            blocks[i * 16 / len][p[i] * 16 / len]++;
            residues[i * 16 / len][p[i] % 16]++;
            interleave[i % 16][p[i] % 16]++;
            where[p[i]] = i;
            fixed += p[i] == i;
        }
        for (int64_t v = 0; v + 1 < len; v++)
            neighbours[where[v] * 16 / len][where[v + 1] * 16 / len]++;
        double c1 = chi2_16x16(blocks, len), c2 = chi2_16x16(residues, len),
               c3 = chi2_16x16(interleave, len), c4 = chi2_16x16(neighbours, len - 1);
        EXPECT(c1 < 340.6 && c2 < 340.6 && c3 < 340.6 && c4 < 340.6, "epoch %llu: not uniform: "
               "chi2 of blocks %.1f, residues %.1f, interleave %.1f, neighbours %.1f",
               (unsigned long long)epoch, c1, c2, c3, c4);
        free(where);
        /* A uniform permutation has Poisson(1) fixed points: more than 12 has p < 1e-10. */
        EXPECT(fixed <= 12, "epoch %llu: %ld fixed points", (unsigned long long)epoch, fixed);
        free(p);
    }
}

static int g_interrupt_calls;
static int always_interrupt(void) { return ++g_interrupt_calls > 0; }

static void test_errors(void) {
    int64_t out[8], n = 123;
    struct { int64_t len; int R, rank, drop, pad; const char *needle; } bad[] = {
        {-1, 1, 0, 0, 1, "negative"},
        {10, 0, 0, 0, 1, "num_replicas"},
        {10, -3, 0, 0, 1, "num_replicas"},
        {10, 2, 2, 0, 1, "rank 2"},
        {10, 2, -1, 0, 1, "rank -1"},
        {10, 2, 0, 1, 0, "contradict"},
        {INT64_MAX, 2, 0, 0, 1, "too large"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        EXPECT(ddpc_sampler_num_samples(bad[i].len, bad[i].R, bad[i].rank, bad[i].drop,
                                        bad[i].pad) == -1, "case %zu: num_samples accepted", i);
        ddpc_status st = ddpc_sampler_indices(bad[i].len, bad[i].R, bad[i].rank, 1, 0, 0,
                                              bad[i].drop, bad[i].pad, out, &n);
        EXPECT(st == DDPC_ERR_INVALID && strstr(ddpc_last_error(), bad[i].needle),
               "case %zu: status %d, message '%s' (want '%s')", i, st, ddpc_last_error(),
               bad[i].needle);
    }
    EXPECT(ddpc_sampler_indices(10, 1, 0, 1, 0, 0, 0, 1, out, NULL) == DDPC_ERR_INVALID,
           "NULL n_out accepted");
    EXPECT(ddpc_sampler_indices(10, 1, 0, 1, 0, 0, 0, 1, NULL, &n) == DDPC_ERR_INVALID,
           "NULL out accepted");
    EXPECT(ddpc_sampler_indices(0, 4, 3, 1, 0, 0, 0, 1, NULL, &n) == DDPC_OK && n == 0,
           "an empty dataset needs no buffer");
    int64_t *huge = (int64_t *)&n;
    EXPECT(ddpc_sampler_alloc((int64_t)1 << 60, &huge) == DDPC_ERR_NOMEM && huge == NULL,
           "a 2^63-byte buffer was 'allocated': %s", ddpc_last_error());
    EXPECT(ddpc_sampler_alloc(-1, &huge) == DDPC_ERR_INVALID, "negative count accepted");
    int64_t *buf = NULL;
    EXPECT(ddpc_sampler_alloc(0, &buf) == DDPC_OK && buf, "alloc(0) failed");
    ddpc_sampler_free(buf, 0);
    ddpc_sampler_free(NULL, 5);

    /* A pending Ctrl-C stops a long shuffle with DDPC_ERR_INTERRUPTED, and the next call works. */
    const int64_t len = 1 << 22;
    int64_t *big = NULL;
    EXPECT(ddpc_sampler_alloc(len, &big) == DDPC_OK, "alloc: %s", ddpc_last_error());
    if (big) {
        ddpc_set_interrupt_hook(always_interrupt);
        ddpc_thread_set_interruptible(1);
        ddpc_status st = ddpc_sampler_indices(len, 1, 0, 1, 0, 0, 0, 1, big, &n);
        ddpc_thread_set_interruptible(0);
        ddpc_set_interrupt_hook(NULL);
        EXPECT(st == DDPC_ERR_INTERRUPTED && g_interrupt_calls > 0,
               "interrupt ignored: status %d after %d hook calls", st, g_interrupt_calls);
        EXPECT(ddpc_sampler_indices(len, 1, 0, 1, 0, 0, 0, 1, big, &n) == DDPC_OK && n == len &&
                   is_permutation(big, len),
               "the call after an interrupt failed: %s", ddpc_last_error());
        ddpc_sampler_free(big, len);
    }
}

int main(void) {
    test_torch_split_unshuffled();
    test_shuffled_split();
    test_unpadded();
    test_determinism();
    test_threads_and_widths();
    test_uniform_small();
    test_uniform_bucketed();
    test_errors();
    return check_summary("test_sampler");
}
