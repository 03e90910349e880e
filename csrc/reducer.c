/* reducer.c: the DDP gradient reducer: assigns parameters to flat buckets, tracks which gradients
 * are ready during backward, all-reduces (averages) each bucket as soon as it and every bucket
 * before it are complete, and at the end of backward zeroes unused slots and waits for all. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "group.h"

/* Slots start on this boundary so vectorized optimizer kernels see aligned gradients. */
#define SLOT_ALIGN_BYTES 16

enum { DUE_CAST = 1, DUE_COPY = 2 };
enum { UNWIRED_COMM = 1, UNWIRED_BACK = 2 };
/* DDPC_CAST_BACK, in the order of its choices */
enum { CAST_BACK_END = 0, CAST_BACK_EARLY = 1, CAST_BACK_OVERLAP = 2 };

/* Gradients to be copied into a bucket wait for each other only while they hold this many bytes:
 * each keeps the tensor autograd made alive until then, and training on one GPU frees it at once.
 * Small ones (biases, norms: most of a transformer's parameters) share a launch; a large one
 * goes at once, with those waiting, as when each went alone. */
#define COPY_BATCH_BYTES ((size_t)1 << 20)

/* With DDPC_CAST_BACK=overlap, the last device wire bucket is reduced in up to LAST_CHUNKS
 * collectives when its wire holds at least LAST_CHUNK_MIN_BYTES (see post_chunks). */
#define LAST_CHUNKS 4
#define LAST_CHUNK_MIN_BYTES ((size_t)8 << 20)

/* Elements [lo, hi) of bucket bk: one of those collectives, and what its cast back covers. */
typedef struct BucketChunk {
    struct Bucket *bk;
    size_t lo, hi;
} BucketChunk;

typedef struct Bucket {
    ddpc_dtype dtype;
    int device;
    int late;           /* launched only by finalize */
    int comm_dtype;     /* dtype on the wire, or -1: reduced in `dtype` */
    size_t count;       /* elements, padding included */
    int first;          /* its parameters are r->bucket_params[first .. first + nparams) */
    int nparams;
    void *buf;          /* caller's memory; NULL until given, and while released */
    void *comm_buf;     /* the wire buffer (comm_dtype >= 0), while the caller gives one */
    int summed;         /* the wire is summed, not averaged, and the cast back divides by the
                         * world size: NCCL's symmetric kernels only sum (set_bucket_summed) */
    int released;       /* the caller took its memory back until the bucket's gradients arrive */
    int pending;        /* parameters not yet ready this step */
    int ndirect;        /* of them, how many went straight to the wire (see mark_ready_grad) */
    int ndue;           /* gradients whose copy or cast is still to be queued (flush_due) */
    size_t due_copy_bytes; /* of them, the bytes of those to be copied */
    uintptr_t due_stream; /* the stream those go on: the one their gradients came on */
    int launched;
    int unwired;        /* the reduced values are cast back already: UNWIRED_COMM (behind the
                         * collective on the communication stream: see unwire_after) or
                         * UNWIRED_BACK (on the reducer's cast-back stream: see unwire_early) */
    DdpcWork *work;     /* in flight between launch and the end of finalize (a bucket reduced
                         * in chunks: the last chunk's; see post_chunks) */
    BucketChunk chunks[LAST_CHUNKS];
    struct DdpcReducer *owner;
} Bucket;

struct DdpcReducer {
    DdpcGroup *g;
    int nparams;
    size_t *numels;
    ddpc_dtype *dtypes;
    int *devices;
    int nbuckets;
    Bucket *buckets;
    int *bucket_params;   /* parameters of every bucket, bucket by bucket, in layout order */
    int *param_bucket;
    size_t *param_offset;
    pthread_mutex_t mu;   /* hooks may run on more than one autograd thread */
    /* the step in progress */
    int step_active;
    ddpc_status abort_st; /* set by fail_step under mu, published by publish_abort after it */
    int next_launch;      /* every bucket before it is launched */
    uint8_t *ready;
    int *ready_count;
    uint8_t *direct;      /* the gradient went to the wire from where autograd left it... */
    void **grad_at;       /* ...which is here, and the reduced values go back there */
    uint8_t *due;         /* DUE_CAST / DUE_COPY: the gradient at grad_at waits to be cast to
                           * the wire / copied into its slot, with the rest of its bucket's */
    int *flushed;         /* parameters whose copy was queued since ddpc_reducer_take_flushed */
    int nflushed;
    uint8_t *listed;      /* in flushed (each at most once: it has room for every parameter) */
    int batch;            /* copies and casts wait for their bucket (DDPC_GRAD_BATCH=0: not) */
    int defer;            /* buckets go to the backend's posting thread (DdpcCollArgs.defer;
                           * DDPC_NCCL_POST_THREAD=0 when the reducer is made: not) */
    int comm_casts;       /* DDPC_COMM_CASTS=1: device wire buckets cast on the communication
                           * stream (see wire_before); else on the caller's, back at finalize */
    int cast_back;        /* DDPC_CAST_BACK: CAST_BACK_EARLY: device wire buckets cast back on
                           * back_stream as soon as their collective is done (see unwire_early);
                           * CAST_BACK_OVERLAP: there as the last bucket launches, beside its
                           * collectives (see unwire_beside_last, post_chunks) */
    uintptr_t back_stream; /* made by the first such cast back; 0 until then */
    int *seen;            /* parameters in the order they became ready */
    int nseen;
    /* the last finished step */
    int *last_order;
    int *last_count;
    /* host time (ns) spent queueing device work, for ddpc_reducer_host_times */
    uint64_t copy_ns, launch_ns;
};

static ddpc_status alloc_array(void **p, size_t n, size_t size, const char *what) {
    *p = calloc(n ? n : 1, size);
    if (!*p)
        return ddpc_error(DDPC_ERR_NOMEM, "out of host memory allocating the reducer's %s (%zu x %zu "
                          "bytes)", what, n, size);
    return DDPC_OK;
}

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static int is_float(int dt) {
    return dt == DDPC_FLOAT32 || dt == DDPC_FLOAT64 || dt == DDPC_FLOAT16 || dt == DDPC_BFLOAT16;
}

static ddpc_status check_create_args(int nparams, const size_t *numels, const ddpc_dtype *dtypes,
                                     const int *devices, const int *order,
                                     size_t first_bucket_bytes, size_t bucket_cap_bytes,
                                     int comm_dtype, uint8_t *seen) {
    if (nparams < 0)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: nparams must be >= 0, got %d", nparams);
    if (nparams > 0 && (!numels || !dtypes || !devices))
        return ddpc_error(DDPC_ERR_INVALID, "reducer: numels, dtypes and devices must not be NULL");
    if (!first_bucket_bytes || !bucket_cap_bytes)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: bucket sizes must be > 0 bytes (first %zu, "
                          "cap %zu)", first_bucket_bytes, bucket_cap_bytes);
    if (comm_dtype >= 0 && comm_dtype != DDPC_FLOAT16 && comm_dtype != DDPC_BFLOAT16)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: the communication dtype must be float16 "
                          "(%d) or bfloat16 (%d), got code %d", DDPC_FLOAT16, DDPC_BFLOAT16,
                          comm_dtype);
    for (int i = 0; i < nparams; i++) {
        if (!is_float(dtypes[i]))
            return ddpc_error(DDPC_ERR_INVALID, "reducer: parameter %d has dtype %s (code %d); "
                              "gradients must be float32, float64, float16 or bfloat16", i,
                              ddpc_dtype_name(dtypes[i]), (int)dtypes[i]);
        if (devices[i] < -1)
            return ddpc_error(DDPC_ERR_INVALID, "reducer: parameter %d has device %d; use -1 for "
                              "host memory or a CUDA ordinal", i, devices[i]);
        if (numels[i] > SIZE_MAX / 16)
            return ddpc_error(DDPC_ERR_INVALID, "reducer: parameter %d has %zu elements, too many",
                              i, numels[i]);
    }
    if (order) {
        for (int k = 0; k < nparams; k++) {
            int p = order[k];
            if (p < 0 || p >= nparams || seen[p])
                return ddpc_error(DDPC_ERR_INVALID, "reducer: order must be a permutation of "
                                  "0..%d, but entry %d is %d (%s)", nparams - 1, k, p,
                                  p < 0 || p >= nparams ? "out of range" : "a repeat");
            seen[p] = 1;
        }
    }
    return DDPC_OK;
}

/* With tail_bytes (DDPC_TAIL_BUCKET_MB), marks in tail[] the gradients expected to complete last
 * (per dtype and device, late ones aside): the last tail_bytes of the sequence before any
 * trailing parameters larger than tail_bytes (a tied embedding, complete only at the very end,
 * which gets a bucket of its own anyway). assign_buckets gives them buckets of their own, of at
 * most tail_bytes, so what is reduced after the backward's last kernel is that much rather than
 * a whole bucket. A key whose gradients would all be tail gets none: its buckets stay as they
 * are. */
static void mark_tail(const DdpcReducer *r, const int *seq, const uint8_t *late,
                      size_t tail_bytes, uint8_t *tail) {
    typedef struct {
        ddpc_dtype dtype;
        int device, phase, first_pos, first_tail; /* phase 0: trailing big ones, 1: tail, 2: done */
        size_t acc;
    } TailKey;
    int n = r->nparams, nkeys = 0;
    TailKey keys[DDPC_NUM_DTYPES * 4];
    for (int pos = n - 1; pos >= 0; pos--) {
        int p = seq[pos];
        if (late && late[p]) continue;
        TailKey *k = NULL;
        for (int j = 0; j < nkeys && !k; j++)
            if (keys[j].dtype == r->dtypes[p] && keys[j].device == r->devices[p]) k = &keys[j];
        if (!k) {
            if (nkeys == (int)(sizeof keys / sizeof keys[0])) continue; /* (no tail for more) */
            k = &keys[nkeys++];
            *k = (TailKey){.dtype = r->dtypes[p], .device = r->devices[p], .first_tail = -1};
        }
        k->first_pos = pos;
        size_t bytes = r->numels[p] * ddpc_dtype_size(r->dtypes[p]);
        if (k->phase == 2 || (k->phase == 0 && bytes > tail_bytes)) continue;
        k->phase = 1;
        if (k->acc + bytes > tail_bytes) {
            k->phase = 2;
            continue;
        }
        k->acc += bytes;
        k->first_tail = pos;
        tail[pos] = 1;
    }
    for (int j = 0; j < nkeys; j++) {
        if (keys[j].first_tail < 0 || keys[j].first_tail > keys[j].first_pos) continue;
        for (int pos = 0; pos < n; pos++) /* all of the key would be tail: none is */
            if (r->dtypes[seq[pos]] == keys[j].dtype && r->devices[seq[pos]] == keys[j].device)
                tail[pos] = 0;
    }
}

/* Buckets are opened in sequence order, so their indices follow the position of their first
 * parameter: the order in which backward is expected to complete them. */
static ddpc_status assign_buckets(DdpcReducer *r, const int *seq, const uint8_t *late,
                                  size_t first_bytes, size_t cap_bytes, size_t tail_bytes,
                                  int comm_dtype) {
    typedef struct {
        ddpc_dtype dtype;
        int device, late, cur, nclosed, cur_tail;
        size_t bytes;
    } Key;
    int n = r->nparams;
    Key *keys = NULL;
    uint8_t *tail = NULL;
    int nkeys = 0;
    ddpc_status st;
    DDPC_CHECK_GOTO(alloc_array((void **)&keys, (size_t)n, sizeof *keys, "bucket keys"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&tail, (size_t)n, 1, "tail flags"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->buckets, (size_t)n, sizeof *r->buckets, "buckets"),
                    st, fail);
    tail_bytes = DDPC_MIN(tail_bytes, cap_bytes); /* (no tail bucket outgrows the others) */
    if (tail_bytes) mark_tail(r, seq, late, tail_bytes, tail);
    for (int pos = 0; pos < n; pos++) {
        int p = seq[pos];
        int lt = late && late[p];
        size_t bytes = r->numels[p] * ddpc_dtype_size(r->dtypes[p]);
        Key *k = NULL;
        for (int j = 0; j < nkeys && !k; j++)
            if (keys[j].dtype == r->dtypes[p] && keys[j].device == r->devices[p] &&
                keys[j].late == lt)
                k = &keys[j];
        if (!k) {
            k = &keys[nkeys++];
            *k = (Key){.dtype = r->dtypes[p], .device = r->devices[p], .late = lt, .cur = -1};
        }
        size_t limit = tail[pos] ? tail_bytes : !lt && k->nclosed == 0 ? first_bytes : cap_bytes;
        /* (the tail starts a bucket of its own) */
        if (k->cur >= 0 && (k->bytes + bytes > limit || tail[pos] != k->cur_tail)) {
            k->cur = -1;
            k->nclosed++;
        }
        if (k->cur < 0) {
            k->cur = r->nbuckets++;
            k->bytes = 0;
            k->cur_tail = tail[pos];
            Bucket *b = &r->buckets[k->cur];
            b->dtype = r->dtypes[p];
            b->device = r->devices[p];
            b->late = lt;
            b->owner = r;
            b->comm_dtype = comm_dtype >= 0 && comm_dtype != (int)b->dtype ? comm_dtype : -1;
        }
        k->bytes += bytes;
        Bucket *b = &r->buckets[k->cur];
        size_t esize = ddpc_dtype_size(b->dtype);
        size_t off = align_up(b->count, DDPC_MAX((size_t)1, SLOT_ALIGN_BYTES / esize));
        r->param_bucket[p] = k->cur;
        r->param_offset[p] = off;
        b->count = off + r->numels[p];
        b->nparams++;
    }
    /* Each bucket's parameter list, in layout (= sequence) order. */
    for (int b = 0, first = 0; b < r->nbuckets; b++) {
        r->buckets[b].first = first;
        first += r->buckets[b].nparams;
        r->buckets[b].nparams = 0;
    }
    for (int pos = 0; pos < n; pos++) {
        Bucket *b = &r->buckets[r->param_bucket[seq[pos]]];
        r->bucket_params[b->first + b->nparams++] = seq[pos];
    }
    free(keys);
    free(tail);
    return DDPC_OK;
fail:
    free(keys);
    free(tail);
    return st;
}

/* Frees the reducer and its arrays (NULL-safe); the mutex and works are the caller's. */
static void free_arrays(DdpcReducer *r) {
    if (!r) return;
    free(r->numels);
    free(r->dtypes);
    free(r->devices);
    free(r->buckets);
    free(r->bucket_params);
    free(r->param_bucket);
    free(r->param_offset);
    free(r->ready);
    free(r->ready_count);
    free(r->direct);
    free(r->grad_at);
    free(r->due);
    free(r->flushed);
    free(r->listed);
    free(r->seen);
    free(r->last_order);
    free(r->last_count);
    free(r);
}

/* DDPC_TAIL_BUCKET_MB (off when unset or 0; for comparisons): the size of the buckets of the
 * gradients that complete last (mark_tail), in MiB. */
static ddpc_status tail_bucket_bytes(size_t *out) {
    double mb;
    DDPC_CHECK(ddpc_setting_number("DDPC_TAIL_BUCKET_MB", 0.0, &mb)); /* 0 to 1e9 */
    *out = (size_t)(mb * 1048576.0);
    return DDPC_OK;
}

ddpc_status ddpc_reducer_create(DdpcGroup *g, int nparams, const size_t *numels,
                                const ddpc_dtype *dtypes, const int *devices, const int *order,
                                const uint8_t *late, size_t first_bucket_bytes,
                                size_t bucket_cap_bytes, int comm_dtype, DdpcReducer **out) {
    *out = NULL;
    if (!g) return ddpc_error(DDPC_ERR_INVALID, "reducer: the process group is NULL");
    uint8_t *seen = NULL;
    int *seq = NULL;
    DdpcReducer *r = NULL;
    ddpc_status st;
    DDPC_CHECK_GOTO(alloc_array((void **)&seen, (size_t)DDPC_MAX(nparams, 0), 1, "order check"),
                    st, fail);
    DDPC_CHECK_GOTO(check_create_args(nparams, numels, dtypes, devices, order, first_bucket_bytes,
                                      bucket_cap_bytes, comm_dtype, seen), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r, 1, sizeof *r, "state"), st, fail);
    r->g = g;
    r->nparams = nparams;
    DDPC_CHECK_GOTO(ddpc_setting_flag("DDPC_GRAD_BATCH", 1, &r->batch), st, fail);
    DDPC_CHECK_GOTO(ddpc_setting_flag("DDPC_NCCL_POST_THREAD", 1, &r->defer), st, fail);
    DDPC_CHECK_GOTO(ddpc_setting_flag("DDPC_COMM_CASTS", 0, &r->comm_casts), st, fail);
    DDPC_CHECK_GOTO(ddpc_setting_choice("DDPC_CAST_BACK", &r->cast_back), st, fail);
    size_t tail_bytes = 0;
    DDPC_CHECK_GOTO(tail_bucket_bytes(&tail_bytes), st, fail);
    size_t n = (size_t)nparams;
    DDPC_CHECK_GOTO(alloc_array((void **)&r->numels, n, sizeof *r->numels, "numels"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->dtypes, n, sizeof *r->dtypes, "dtypes"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->devices, n, sizeof *r->devices, "devices"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->bucket_params, n, sizeof(int), "bucket params"), st,
                    fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->param_bucket, n, sizeof(int), "param buckets"), st,
                    fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->param_offset, n, sizeof(size_t), "param offsets"), st,
                    fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->ready, n, 1, "ready flags"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->ready_count, n, sizeof(int), "ready counts"), st,
                    fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->direct, n, 1, "direct flags"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->grad_at, n, sizeof(void *), "gradient addresses"), st,
                    fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->due, n, 1, "queued copies"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->flushed, n, sizeof(int), "copied list"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->listed, n, 1, "copied flags"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->seen, n, sizeof(int), "ready order"), st, fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->last_order, n, sizeof(int), "observed order"), st,
                    fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&r->last_count, n, sizeof(int), "observed counts"), st,
                    fail);
    DDPC_CHECK_GOTO(alloc_array((void **)&seq, n, sizeof(int), "sequence"), st, fail);
    for (int i = 0; i < nparams; i++) {
        r->numels[i] = numels[i];
        r->dtypes[i] = dtypes[i];
        r->devices[i] = devices[i];
        r->last_order[i] = -1;
    }
    /* Late parameters go after all others, each group in the given order. */
    int k = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int j = 0; j < nparams; j++) {
            int p = order ? order[j] : nparams - 1 - j;
            if ((late && late[p]) == pass) seq[k++] = p;
        }
    DDPC_CHECK_GOTO(assign_buckets(r, seq, late, first_bucket_bytes, bucket_cap_bytes, tail_bytes,
                                   comm_dtype),
                    st, fail);
    int rc = pthread_mutex_init(&r->mu, NULL);
    if (rc != 0) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "reducer: pthread_mutex_init failed: %s", strerror(rc));
        goto fail;
    }
    DDPC_INFO("REDUCER", "rank %d: %d parameters in %d buckets (first %zu bytes, cap %zu bytes, "
              "tail %zu bytes, comm dtype %d)", ddpc_group_rank(g), nparams, r->nbuckets,
              first_bucket_bytes, bucket_cap_bytes, tail_bytes, comm_dtype);
    free(seen);
    free(seq);
    *out = r;
    return DDPC_OK;
fail:
    free(seen);
    free(seq);
    free_arrays(r);
    return st;
}

/* The first failure of several steps, with its message (later ones overwrite the last error). */
static void keep_first(ddpc_status st, ddpc_status *first, char *msg, size_t len) {
    if (st == DDPC_OK || *first != DDPC_OK) return;
    *first = st;
    snprintf(msg, len, "%s", ddpc_last_error());
}

/* Waits for every collective still in flight and drops it; then for what the posting thread may
 * still be doing with them (an abort completes a work while its `after` casts may still be
 * queueing) and for the casts on back_stream (DDPC_CAST_BACK=early|overlap), which read the
 * wires and write the gradients that the caller lets go next. Outside a finished step these
 * have not been ordered before the caller's stream. Returns the first failure. */
static ddpc_status drain(DdpcReducer *r) {
    ddpc_status first = DDPC_OK;
    char msg[1024] = "";
    for (int b = 0; b < r->nbuckets; b++) {
        Bucket *bk = &r->buckets[b];
        if (!bk->work) continue;
        keep_first(ddpc_work_wait(bk->work), &first, msg, sizeof msg);
        ddpc_work_release(bk->work);
        bk->work = NULL;
    }
    keep_first(ddpc_group_wait_posted(r->g), &first, msg, sizeof msg);
    if (r->back_stream) {
        ddpc_status st = ddpc_device_stream_finish(r->back_stream, ddpc_group_timeout_ms(r->g));
        if (st != DDPC_OK) ddpc_error_prefix(st, "the gradients' casts back: ");
        keep_first(st, &first, msg, sizeof msg);
    }
    if (first != DDPC_OK) return ddpc_error(first, "%s", msg);
    return DDPC_OK;
}

void ddpc_reducer_destroy(DdpcReducer *r) {
    if (!r) return;
    drain(r);
    if (r->back_stream) ddpc_device_stream_destroy(r->back_stream);
    pthread_mutex_destroy(&r->mu);
    free_arrays(r);
}

int ddpc_reducer_num_buckets(const DdpcReducer *r) { return r->nbuckets; }

static ddpc_status check_bucket(const DdpcReducer *r, int b) {
    if (b < 0 || b >= r->nbuckets)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: bucket %d does not exist (there are %d)", b,
                          r->nbuckets);
    return DDPC_OK;
}

static ddpc_status check_param(const DdpcReducer *r, int i) {
    if (i < 0 || i >= r->nparams)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: parameter %d does not exist (there are %d)",
                          i, r->nparams);
    return DDPC_OK;
}

ddpc_status ddpc_reducer_bucket_info(const DdpcReducer *r, int b, ddpc_dtype *dtype, int *device,
                                     size_t *count) {
    DDPC_CHECK(check_bucket(r, b));
    *dtype = r->buckets[b].dtype;
    *device = r->buckets[b].device;
    *count = r->buckets[b].count;
    return DDPC_OK;
}

int ddpc_reducer_bucket_comm_dtype(const DdpcReducer *r, int b) {
    return b >= 0 && b < r->nbuckets ? r->buckets[b].comm_dtype : -1;
}

ddpc_status ddpc_reducer_param_slot(const DdpcReducer *r, int i, int *bucket, size_t *offset) {
    DDPC_CHECK(check_param(r, i));
    *bucket = r->param_bucket[i];
    *offset = r->param_offset[i];
    return DDPC_OK;
}

/* The memory of a bucket may change while no collective reads it and, in the step in progress,
 * none of its gradients has been marked ready yet (they were written to the old memory). Called
 * with r->mu held. */
static ddpc_status check_bucket_idle(const DdpcReducer *r, int b) {
    const Bucket *bk = &r->buckets[b];
    if (bk->work || (r->step_active && bk->launched))
        return ddpc_error(DDPC_ERR_INVALID, "reducer: bucket %d's memory cannot change while it "
                          "is being reduced", b);
    /* (gradients that went straight to the wire never touched the bucket's memory) */
    if (r->step_active && bk->nparams - bk->pending > bk->ndirect)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: bucket %d's memory cannot change after %d "
                          "of its %d gradients were marked ready in this backward pass", b,
                          bk->nparams - bk->pending - bk->ndirect, bk->nparams);
    return DDPC_OK;
}

ddpc_status ddpc_reducer_set_bucket_memory(DdpcReducer *r, int b, void *buf) {
    DDPC_CHECK(check_bucket(r, b));
    Bucket *bk = &r->buckets[b];
    if (bk->count && !buf)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: bucket %d holds %zu elements but its buffer "
                          "is NULL", b, bk->count);
    pthread_mutex_lock(&r->mu);
    ddpc_status st = check_bucket_idle(r, b);
    if (st == DDPC_OK) {
        bk->buf = buf;
        bk->released = 0;
    }
    pthread_mutex_unlock(&r->mu);
    return st;
}

/* Sets bucket b's wire buffer (what 0) or whether it is summed (what 1), which may not change
 * while the bucket is in use: launched, or holding a gradient cast into the wire. */
static ddpc_status set_wire_field(DdpcReducer *r, int b, int what, void *comm_buf, int summed) {
    Bucket *bk = &r->buckets[b];
    pthread_mutex_lock(&r->mu);
    ddpc_status st = DDPC_OK;
    if (bk->work || (r->step_active && (bk->launched || bk->ndirect > 0)))
        st = ddpc_error(DDPC_ERR_INVALID, "reducer: bucket %d's %s cannot change while it is in "
                        "use", b, what ? "summing" : "wire buffer");
    else if (what)
        bk->summed = summed != 0;
    else
        bk->comm_buf = comm_buf;
    pthread_mutex_unlock(&r->mu);
    return st;
}

ddpc_status ddpc_reducer_set_bucket_wire(DdpcReducer *r, int b, void *comm_buf) {
    DDPC_CHECK(check_bucket(r, b));
    if (r->buckets[b].comm_dtype < 0)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: bucket %d is reduced in its own dtype and "
                          "has no wire buffer", b);
    return set_wire_field(r, b, 0, comm_buf, 0);
}

ddpc_status ddpc_reducer_set_bucket_summed(DdpcReducer *r, int b, int summed) {
    DDPC_CHECK(check_bucket(r, b));
    if (r->buckets[b].comm_dtype < 0 || r->buckets[b].device < 0)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: bucket %d has no device wire buffer to sum "
                          "into", b);
    return set_wire_field(r, b, 1, NULL, summed);
}

ddpc_status ddpc_reducer_release_bucket(DdpcReducer *r, int b) {
    DDPC_CHECK(check_bucket(r, b));
    Bucket *bk = &r->buckets[b];
    pthread_mutex_lock(&r->mu);
    ddpc_status st = check_bucket_idle(r, b);
    if (st == DDPC_OK) {
        bk->buf = NULL; /* (the wire buffer is given and taken back by set_bucket_wire) */
        bk->released = 1;
    }
    pthread_mutex_unlock(&r->mu);
    return st;
}

/* A bucket reduced in another dtype whose wire buffer was not given (or taken back). Called with
 * r->mu held. */
static ddpc_status check_has_wire(const DdpcReducer *r, int b) {
    const Bucket *bk = &r->buckets[b];
    if (bk->count && bk->comm_dtype >= 0 && !bk->comm_buf)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: bucket %d is reduced in %s but has no wire "
                          "buffer: call set_bucket_wire before its gradients are marked ready or "
                          "the step is finalized", b,
                          ddpc_dtype_name((ddpc_dtype)bk->comm_dtype));
    return DDPC_OK;
}

/* A bucket that the caller released and has not given memory again. Called with r->mu held. */
static ddpc_status check_has_memory(const DdpcReducer *r, int b) {
    const Bucket *bk = &r->buckets[b];
    if (bk->count && !bk->buf)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: bucket %d has no memory (it was released): "
                          "call set_bucket_memory before its gradients are marked ready or the "
                          "step is finalized", b);
    return DDPC_OK;
}

static void reset_step(DdpcReducer *r) {
    memset(r->ready, 0, (size_t)r->nparams);
    memset(r->ready_count, 0, (size_t)r->nparams * sizeof(int));
    memset(r->direct, 0, (size_t)r->nparams);
    memset(r->grad_at, 0, (size_t)r->nparams * sizeof(void *));
    memset(r->due, 0, (size_t)r->nparams);
    memset(r->listed, 0, (size_t)r->nparams);
    r->nflushed = 0;
    r->nseen = 0;
    r->next_launch = 0;
    for (int b = 0; b < r->nbuckets; b++) {
        r->buckets[b].pending = r->buckets[b].nparams;
        r->buckets[b].ndirect = 0;
        r->buckets[b].ndue = 0;
        r->buckets[b].due_copy_bytes = 0;
        r->buckets[b].launched = 0;
        r->buckets[b].unwired = 0;
    }
}

ddpc_status ddpc_reducer_prepare(DdpcReducer *r) {
    for (int b = 0; b < r->nbuckets; b++)
        if (r->buckets[b].count && !r->buckets[b].buf && !r->buckets[b].released)
            return ddpc_error(DDPC_ERR_INVALID, "reducer: bucket %d has no memory yet: call "
                              "set_bucket_memory for every bucket before the first step", b);
    pthread_mutex_lock(&r->mu);
    /* (a bucket's collectives are posted only when it launches, except after a failure part of
     * the way through a bucket posted in chunks) */
    int unfinished = r->step_active && (r->nseen > 0 || r->next_launch > 0);
    for (int b = 0; b < r->nbuckets && !unfinished; b++) unfinished = r->buckets[b].work != NULL;
    int seen = r->nseen;
    ddpc_status st = unfinished ? drain(r) : DDPC_OK;
    reset_step(r);
    r->step_active = 1;
    pthread_mutex_unlock(&r->mu);
    if (st != DDPC_OK)
        return ddpc_error_prefix(st, "reducer: waiting for the collectives of an unfinished "
                                 "backward pass: ");
    if (unfinished)
        return ddpc_error(DDPC_ERR_INVALID,
                          "reducer: the previous backward pass did not finish: %d of %d "
                          "parameters had their gradient ready, but the end-of-backward reduction "
                          "never ran (the backward raised, or the loss did not depend on the "
                          "wrapped model's output), so that step's gradients were not averaged. "
                          "The reducer has been reset: zero the gradients and continue", seen,
                          r->nparams);
    return DDPC_OK;
}

/* What the cast back multiplies by: 1, or 1/world for a summed wire. */
static float back_scale(const DdpcReducer *r, const Bucket *bk) {
    return bk->summed ? 1.0f / (float)ddpc_group_size(r->g) : 1.0f;
}

/* Casts elements [off, off + n) of a bucket-shaped array into another (host or device). */
static ddpc_status cast_slots(const Bucket *bk, void *dst, ddpc_dtype dst_dt, const void *src,
                              ddpc_dtype src_dt, size_t off, size_t n, float scale,
                              uintptr_t stream) {
    if (!n) return DDPC_OK;
    void *d = (char *)dst + off * ddpc_dtype_size(dst_dt);
    const void *s = (const char *)src + off * ddpc_dtype_size(src_dt);
    if (bk->device < 0) return ddpc_convert_host(d, dst_dt, s, src_dt, n);
    return ddpc_device_cast(d, dst_dt, s, src_dt, n, scale, stream);
}

/* Casts between each wire slot of bk and where its parameter's gradient lies, for the
 * parameters whose direct flag equals `direct` (direct: the gradient autograd left, grad_at;
 * else its bucket slot) and, when `only` is given, whose flag there is set: into the wire when
 * to_wire, else out of it. On a device, a few launches for all of them. Called with r->mu held. */
static ddpc_status cast_params(DdpcReducer *r, const Bucket *bk, int direct, int to_wire,
                               const uint8_t *only, size_t lo, size_t hi, uintptr_t stream) {
    ddpc_dtype cdt = (ddpc_dtype)bk->comm_dtype;
    size_t csz = ddpc_dtype_size(cdt), esz = ddpc_dtype_size(bk->dtype);
    enum { BATCH = 64 };
    void *dsts[BATCH];
    const void *srcs[BATCH];
    size_t counts[BATCH];
    int n = 0;
    for (int j = 0; j <= bk->nparams; j++) {
        if (n == BATCH || (j == bk->nparams && n > 0)) {
            ddpc_dtype ddt = to_wire ? cdt : bk->dtype, sdt = to_wire ? bk->dtype : cdt;
            if (bk->device < 0) {
                for (int k = 0; k < n; k++)
                    DDPC_CHECK(ddpc_convert_host(dsts[k], ddt, srcs[k], sdt, counts[k]));
            } else {
                DDPC_CHECK(ddpc_device_cast_many_scaled(n, dsts, ddt, srcs, sdt, counts,
                                                        to_wire ? 1.0f : back_scale(r, bk),
                                                        stream));
            }
            n = 0;
        }
        if (j == bk->nparams) break;
        int p = r->bucket_params[bk->first + j];
        if (r->direct[p] != direct || (only && !only[p])) continue;
        /* (only the part of its slot within [lo, hi)) */
        size_t from = DDPC_MAX(lo, r->param_offset[p]);
        size_t to = DDPC_MIN(hi, r->param_offset[p] + r->numels[p]);
        if (from >= to) continue;
        size_t skip = from - r->param_offset[p];
        char *wire = (char *)bk->comm_buf + from * csz;
        char *grad = direct ? (char *)r->grad_at[p] + skip * esz : (char *)bk->buf + from * esz;
        dsts[n] = to_wire ? wire : grad;
        srcs[n] = to_wire ? grad : wire;
        counts[n] = to - from;
        n++;
    }
    return DDPC_OK;
}

/* bk's due copies (and, when casts, its due casts) are queued: nothing of them waits any more. A
 * copied gradient's source is not read again; a cast one stays at grad_at for the cast back. */
static void dues_queued(DdpcReducer *r, Bucket *bk, int casts) {
    for (int j = 0; bk->ndue && j < bk->nparams; j++) {
        int p = r->bucket_params[bk->first + j];
        if (r->due[p] == DUE_COPY)
            r->grad_at[p] = NULL;
        else if (!casts || !r->due[p])
            continue;
        r->due[p] = 0;
        bk->ndue--;
    }
    bk->due_copy_bytes = 0;
}

/* Queues the copies into slots and casts to the wire that bk's gradients wait for, in a few
 * launches on the stream they came on; then work queued on `then` comes after them (what
 * autograd did to order the caller's streams happened before these were queued). The copied
 * ones join r->flushed: their caller may now point the parameters' .grad at their slots. With
 * casts 0, the casts stay due (for wire_before). Called with r->mu held. */
static ddpc_status flush_due(DdpcReducer *r, Bucket *bk, uintptr_t then, int casts) {
    if (!bk->ndue || (!casts && !bk->due_copy_bytes)) return DDPC_OK;
    enum { BATCH = 64 };
    void *dsts[BATCH];
    const void *srcs[BATCH];
    size_t counts[BATCH];
    int ps[BATCH];
    size_t esz = ddpc_dtype_size(bk->dtype);
    int n = 0;
    for (int j = 0; j <= bk->nparams; j++) {
        if (n == BATCH || (j == bk->nparams && n > 0)) {
            if (bk->device < 0) {
                for (int k = 0; k < n; k++) memcpy(dsts[k], srcs[k], counts[k] * esz);
            } else {
                DDPC_CHECK(ddpc_device_cast_many(n, dsts, bk->dtype, srcs, bk->dtype, counts,
                                                 bk->due_stream));
            }
            for (int k = 0; k < n; k++) /* listed only once queued */
                if (!r->listed[ps[k]]) {
                    r->listed[ps[k]] = 1;
                    r->flushed[r->nflushed++] = ps[k];
                }
            n = 0;
        }
        if (j == bk->nparams) break;
        int p = r->bucket_params[bk->first + j];
        if (r->due[p] != DUE_COPY) continue;
        dsts[n] = (char *)bk->buf + r->param_offset[p] * esz;
        srcs[n] = r->grad_at[p];
        counts[n] = r->numels[p];
        ps[n++] = p;
    }
    if (casts) DDPC_CHECK(cast_params(r, bk, 1, 1, r->due, 0, bk->count, bk->due_stream));
    if (bk->device >= 0) DDPC_CHECK(ddpc_device_stream_wait(then, bk->due_stream));
    dues_queued(r, bk, casts);
    return DDPC_OK;
}

/* Nothing of parameter i's gradient waits any more: it lies in its slot after all, or a newer one
 * replaces it (whose source is then never read). */
static void clear_due(DdpcReducer *r, int i) {
    if (!r->due[i]) return;
    Bucket *bk = &r->buckets[r->param_bucket[i]];
    if (r->due[i] == DUE_COPY) bk->due_copy_bytes -= r->numels[i] * ddpc_dtype_size(r->dtypes[i]);
    r->due[i] = 0;
    bk->ndue--;
}

/* Parameter i's gradient at src waits to be copied or cast (what) with the rest of its bucket's,
 * on stream: one launch per bucket rather than one per gradient, which the host issuing a
 * backward is short of. Those queued on another stream go first, on theirs. */
static ddpc_status set_due(DdpcReducer *r, int i, int what, const void *src, uintptr_t stream) {
    Bucket *bk = &r->buckets[r->param_bucket[i]];
    clear_due(r, i);
    if (bk->ndue && bk->due_stream != stream) DDPC_CHECK(flush_due(r, bk, stream, 1));
    bk->ndue++;
    r->due[i] = (uint8_t)what;
    r->grad_at[i] = (void *)src;
    bk->due_stream = stream;
    if (what == DUE_COPY) bk->due_copy_bytes += r->numels[i] * ddpc_dtype_size(r->dtypes[i]);
    /* Listed as copied already (an earlier gradient went at a stream change): the caller points
     * .grad at the slot when it reads the list, which lets this source go, so it goes now. */
    int now = !r->batch || bk->due_copy_bytes >= COPY_BATCH_BYTES ||
              (what == DUE_COPY && r->listed[i]);
    return now ? flush_due(r, bk, stream, 1) : DDPC_OK;
}

static ddpc_status unwire(DdpcReducer *r, Bucket *bk, uintptr_t stream);

/* Into the wire, elements [lo, hi) of bk: the gradients left where autograd made them whose
 * casts are due, and those in their slots. The dues stay marked (dues_queued clears them once
 * every part is queued). Called with r->mu held. */
static ddpc_status to_wire_range(DdpcReducer *r, Bucket *bk, size_t lo, size_t hi,
                                 uintptr_t stream) {
    if (bk->ndue) DDPC_CHECK(cast_params(r, bk, 1, 1, r->due, lo, hi, stream));
    if (bk->ndirect == 0)
        return cast_slots(bk, bk->comm_buf, (ddpc_dtype)bk->comm_dtype, bk->buf, bk->dtype, lo,
                          hi - lo, 1.0f, stream);
    /* the gradients in their slots join those cast to the wire on arrival */
    return cast_params(r, bk, 0, 1, NULL, lo, hi, stream);
}

/* The same for the whole bucket, its dues then queued. Called with r->mu held. */
static ddpc_status to_wire(DdpcReducer *r, Bucket *bk, uintptr_t stream) {
    DDPC_CHECK(to_wire_range(r, bk, 0, bk->count, stream));
    dues_queued(r, bk, 1);
    return DDPC_OK;
}

/* With DDPC_COMM_CASTS=1 (off by default: no consistent gain in session 7's paired runs, -0.003
 * on average over four), a device wire bucket's casts go on the communication stream, around its
 * collective, beside the backward's kernels rather than between them: into the wire once that
 * stream has caught up with the caller's (wire_before), and the reduced values back into the
 * slots and the gradients cast from where they lay right behind the collective (unwire_after),
 * so finalize only waits. Both run inside the post, on the thread that posts it, with r->mu
 * held. */
static ddpc_status wire_before(void *ctx, uintptr_t comm_stream) {
    Bucket *bk = ctx;
    return to_wire(bk->owner, bk, comm_stream);
}

static ddpc_status unwire_after(void *ctx, uintptr_t comm_stream) {
    Bucket *bk = ctx;
    DDPC_CHECK(unwire(bk->owner, bk, comm_stream));
    bk->unwired = UNWIRED_COMM;
    return DDPC_OK;
}

/* With DDPC_CAST_BACK=early (off by default: no consistent gain in session 17's paired runs), a
 * device wire bucket's reduced values go back (unwire) as soon as its collective is done, on a
 * stream of the reducer's own (back_stream, made here the first time, on the communicator's
 * device, which is current), so they overlap the rest of the backward rather than wait for
 * finalize; finalize then orders the caller's stream after that stream. Off the communication
 * stream, the casts do not hold up the collectives behind them.
 *
 * This runs inside the post, on the posting thread when the post is deferred, without r->mu:
 * it reads only what the bucket's launch fixed (its buffers, and its parameters' direct flags,
 * grad_at and offsets), which nothing changes until the collective is done (a second gradient
 * for a launched bucket is refused before it changes anything, and prepare drains first). The
 * posts of a group run their `after` one at a time, in posting order, so back_stream is made
 * once; finalize reads it and `unwired` after waiting for the work, which was marked enqueued
 * after this returned. */
static ddpc_status unwire_early(void *ctx, uintptr_t comm_stream) {
    Bucket *bk = ctx;
    DdpcReducer *r = bk->owner;
    if (!r->back_stream) DDPC_CHECK(ddpc_device_stream_create(&r->back_stream));
    DDPC_CHECK(ddpc_device_stream_wait(r->back_stream, comm_stream));
    DDPC_CHECK(unwire(r, bk, r->back_stream));
    bk->unwired = UNWIRED_BACK;
    return DDPC_OK;
}

static ddpc_status unwire_range(DdpcReducer *r, Bucket *bk, size_t lo, size_t hi,
                                uintptr_t stream);

/* With DDPC_CAST_BACK=overlap, the last device wire bucket (the one reduced after the
 * backward's last kernel) is reduced in chunks, each cast back as soon as its collective is
 * queued, on back_stream (made at the launch, under r->mu): the casts back of the first chunks
 * run beside the collectives of the next ones instead of all after the last. Like
 * unwire_early, this runs inside each post without r->mu and reads only what the launch fixed.
 */
static ddpc_status unwire_chunk(void *ctx, uintptr_t comm_stream) {
    const BucketChunk *c = ctx;
    DdpcReducer *r = c->bk->owner;
    DDPC_CHECK(ddpc_device_stream_wait(r->back_stream, comm_stream));
    return unwire_range(r, c->bk, c->lo, c->hi, r->back_stream);
}

/* Posts the collectives of a bucket split into chunks (see unwire_chunk), each right after its
 * part's casts into the wire on the caller's stream (whole->stream; each post orders its
 * collective after what that stream has queued): the first part's collective runs beside the
 * next parts' casts, rather than after all of them. bk->work is the last one's (they complete
 * in posting order), the others' are let go once posted. */
static ddpc_status post_chunks(DdpcReducer *r, Bucket *bk, const DdpcCollArgs *whole) {
    size_t esz = ddpc_dtype_size(whole->dtype);
    /* chunk edges on multiples of 1024 elements: a slot split there keeps its alignment */
    size_t step = align_up((bk->count + LAST_CHUNKS - 1) / LAST_CHUNKS, 1024);
    int n = 0;
    for (size_t lo = 0; lo < bk->count; lo += step) {
        BucketChunk *c = &bk->chunks[n];
        c->bk = bk;
        c->lo = lo;
        c->hi = DDPC_MIN(bk->count, lo + step);
        DdpcCollArgs a = *whole;
        a.recv = (char *)whole->recv + lo * esz;
        a.count = c->hi - lo;
        a.after = unwire_chunk;
        a.hook_ctx = c;
        DDPC_CHECK(to_wire_range(r, bk, c->lo, c->hi, whole->stream));
        DdpcWork *w = NULL;
        DDPC_CHECK(ddpc_group_post(r->g, &a, &w));
        if (bk->work) ddpc_work_release(bk->work);
        bk->work = w;
        n++;
    }
    dues_queued(r, bk, 1);
    bk->unwired = UNWIRED_BACK;
    return DDPC_OK;
}

/* With DDPC_CAST_BACK=overlap, as the last bucket launches: the device wire buckets before it
 * are cast back on back_stream, which first waits for the caller's stream (where the backward's
 * kernels are queued, then the last bucket's casts into the wire unless it goes in chunks) and
 * then for each one's collective. So they run beside the last bucket's collective, which moves
 * its bytes over the link between the GPUs, rather than after it (the default) or beside the
 * backward's kernels, whose memory bandwidth they would take (DDPC_CAST_BACK=early); and ahead
 * of the last bucket's own casts back on that stream (post_chunks). Called with r->mu held,
 * every bucket before the last launched. */
static ddpc_status unwire_beside_last(DdpcReducer *r, uintptr_t stream) {
    int last = r->nbuckets - 1, any = 0;
    for (int b = 0; b < last && !any; b++) {
        const Bucket *bk = &r->buckets[b];
        any = bk->work && bk->comm_dtype >= 0 && bk->device >= 0 && !bk->unwired;
    }
    if (!any) return DDPC_OK;
    if (!r->back_stream) DDPC_CHECK(ddpc_device_stream_create(&r->back_stream));
    DDPC_CHECK(ddpc_device_stream_wait(r->back_stream, stream));
    for (int b = 0; b < last; b++) {
        Bucket *bk = &r->buckets[b];
        if (!bk->work || bk->comm_dtype < 0 || bk->device < 0 || bk->unwired) continue;
        ddpc_status st = ddpc_work_wait_stream(bk->work, r->back_stream);
        if (st == DDPC_OK) st = unwire(r, bk, r->back_stream);
        if (st != DDPC_OK)
            return ddpc_error_prefix(st, "reducer: casting gradient bucket %d back: ", b);
        bk->unwired = UNWIRED_BACK;
    }
    return DDPC_OK;
}

static ddpc_status launch_bucket(DdpcReducer *r, int b, uintptr_t stream) {
    Bucket *bk = &r->buckets[b];
    bk->launched = 1;
    if (!bk->count) return DDPC_OK;
    int wire = bk->comm_dtype >= 0;
    ddpc_dtype dt = wire ? (ddpc_dtype)bk->comm_dtype : bk->dtype;
    /* Not around a staged all-reduce: casts into the wire before it would make it wait for the
     * ones before it (see ddpc.h), and casts back behind it on the communication stream made a
     * step 0.6 ms slower without P2P in one run (the later staged calls queue behind them). */
    size_t staged = ddpc_group_staged_min_bytes(r->g);
    int before = wire && bk->device >= 0 && r->comm_casts &&
                 !(staged && bk->count * ddpc_dtype_size(dt) >= staged);
    /* DDPC_CAST_BACK=overlap: the last bucket in chunks, each cast into the wire just before its
     * collective (post_chunks) */
    int chunked = wire && bk->device >= 0 && r->cast_back == CAST_BACK_OVERLAP && !before &&
                  b == r->nbuckets - 1 && bk->count * ddpc_dtype_size(dt) >= LAST_CHUNK_MIN_BYTES &&
                  !(staged && bk->count * ddpc_dtype_size(dt) >= staged);
    /* the copies into slots (and, unless they go on the communication stream or with each chunk,
     * the casts) go on the gradients' stream, and the collective's stream waits for them */
    ddpc_status st = flush_due(r, bk, stream, !before && !chunked);
    if (st == DDPC_OK && (before || chunked) && bk->ndue && bk->due_stream != stream)
        st = ddpc_device_stream_wait(stream, bk->due_stream);
    if (st == DDPC_OK && wire && !before && !chunked) st = to_wire(r, bk, stream);
    if (st != DDPC_OK)
        return ddpc_error_prefix(st, "reducer: queueing gradient bucket %d's copies and casts "
                                 "(%zu x %s): ", b, bk->count, ddpc_dtype_name(bk->dtype));
    int early = wire && bk->device >= 0 && r->cast_back == CAST_BACK_EARLY && !before;
    DdpcCollArgs a = {
        .op = DDPC_COLL_ALLREDUCE, .send = NULL, .recv = wire ? bk->comm_buf : bk->buf,
        .count = bk->count, .dtype = dt, .redop = bk->summed ? DDPC_SUM : DDPC_AVG, .root = 0,
        .device = bk->device,
        .stream = stream, .before = before ? wire_before : NULL,
        .after = before ? unwire_after : early ? unwire_early : NULL, .hook_ctx = bk,
        .defer = r->defer && !before,
    };
    if (r->cast_back == CAST_BACK_OVERLAP && b == r->nbuckets - 1)
        st = unwire_beside_last(r, stream);
    if (st == DDPC_OK && chunked && !r->back_stream)
        st = ddpc_device_stream_create(&r->back_stream);
    if (st == DDPC_OK)
        st = chunked ? post_chunks(r, bk, &a) : ddpc_group_post(r->g, &a, &bk->work);
    if (st != DDPC_OK)
        return ddpc_error_prefix(st, "reducer: all_reduce of gradient bucket %d (%zu x %s): ", b,
                                 bk->count, ddpc_dtype_name(dt));
    DDPC_TRACE("REDUCER", "rank %d launched bucket %d (%zu x %s) as collective #%llu",
               ddpc_group_rank(r->g), b, bk->count, ddpc_dtype_name(dt),
               (unsigned long long)ddpc_work_seq(bk->work));
    return DDPC_OK;
}

/* This rank could not queue its part of a step's communication (a bucket's copies, casts or
 * collectives; a chunked bucket perhaps part-way through its collectives): its peers would wait
 * for collectives it will never post, until the timeout, and any later collective of this rank
 * would pair with the wrong one of theirs. So the group is to be aborted (publish_abort, once
 * r->mu is let go): every rank's next or pending collective then fails at once with this rank's
 * reason, rather than after the timeout with only "rank N never arrived". Not for a mistake in
 * the arguments (DDPC_ERR_INVALID: a bad cast, a buffer on the wrong device), which every rank
 * makes alike at the same bucket, leaving no collective unpaired; the next prepare reports the
 * step unfinished and the group goes on. Returns st. Called with r->mu held. */
static ddpc_status fail_step(DdpcReducer *r, ddpc_status st) {
    if (st != DDPC_ERR_INVALID && !r->abort_st) r->abort_st = st;
    return st;
}

/* Takes what fail_step set; called with r->mu held, before letting it go. */
static ddpc_status take_abort(DdpcReducer *r) {
    ddpc_status st = r->abort_st;
    r->abort_st = DDPC_OK;
    return st;
}

/* Aborts the group for a failure of fail_step's (st from take_abort; nothing when DDPC_OK), with
 * the message of the call's error (ret) as the reason, and returns ret with that message as it
 * was (publishing may overwrite it). Called without r->mu: ddpc_group_abort writes to the store.
 * An interrupt (Ctrl-C while the step waited) reaches the peers as this rank's failure. */
static ddpc_status publish_abort(DdpcReducer *r, ddpc_status st, ddpc_status ret) {
    if (st == DDPC_OK) return ret;
    char msg[4096];
    snprintf(msg, sizeof msg, "%s", ddpc_last_error());
    ddpc_group_abort(r->g, st == DDPC_ERR_INTERRUPTED ? DDPC_ERR_PEER : st, msg);
    return ddpc_error(ret, "%s", msg);
}

static ddpc_status launch(DdpcReducer *r, int b, uintptr_t stream) {
    uint64_t t0 = ddpc_now_ns();
    ddpc_status st = launch_bucket(r, b, stream);
    r->launch_ns += ddpc_now_ns() - t0;
    return st == DDPC_OK ? st : fail_step(r, st);
}

/* Launches buckets in index order while the next one is complete, so every rank posts the same
 * collectives in the same order whatever order its gradients arrive in. */
static ddpc_status launch_complete(DdpcReducer *r, uintptr_t stream) {
    while (r->next_launch < r->nbuckets) {
        Bucket *bk = &r->buckets[r->next_launch];
        if (bk->late || bk->pending > 0) break;
        DDPC_CHECK(launch(r, r->next_launch, stream));
        r->next_launch++;
    }
    return DDPC_OK;
}

/* Takes parameter i's gradient (numels[i] dense elements of its dtype at src, on the bucket's
 * device) into its slot: the copy waits for the rest of its bucket's (set_due) while they hold
 * under COPY_BATCH_BYTES, so the caller keeps src alive, and .grad on it, until
 * ddpc_reducer_take_flushed lists the parameter. Called with r->mu held, before the bucket
 * launches. */
static ddpc_status copy_into_slot(DdpcReducer *r, int i, const void *src, uintptr_t stream) {
    const Bucket *bk = &r->buckets[r->param_bucket[i]];
    const char *dst = (const char *)bk->buf + r->param_offset[i] * ddpc_dtype_size(r->dtypes[i]);
    if (!r->numels[i] || dst == (const char *)src) {
        clear_due(r, i);
        return DDPC_OK;
    }
    return set_due(r, i, DUE_COPY, src, stream);
}

/* Takes parameter i's gradient at src (where autograd left it) straight to its slot of the wire
 * buffer, and remembers where it lies so finalize can write the reduced values back there. The
 * cast waits for the rest of the bucket's (set_due); the caller keeps src alive until finalize.
 * Called with r->mu held, before the bucket launches. */
static ddpc_status cast_to_wire(DdpcReducer *r, int i, const void *src, uintptr_t stream) {
    Bucket *bk = &r->buckets[r->param_bucket[i]];
    int was = r->direct[i];
    if (!was) { /* (first: the cast goes to the wire slots of direct parameters) */
        r->direct[i] = 1;
        bk->ndirect++;
    }
    ddpc_status st = set_due(r, i, DUE_CAST, src, stream);
    if (st != DDPC_OK && !was && !r->due[i]) {
        r->direct[i] = 0;
        bk->ndirect--;
    }
    return st;
}

/* Takes parameter i's gradient: already in its slot (src NULL), to be copied there (src, how
 * 1), or (how 2) left where it is when its bucket goes over the wire in another dtype: cast
 * straight into the wire buffer, which spares the bucket a copy and a full-width read. *direct
 * says which of the last two happened. */
static ddpc_status mark_ready(DdpcReducer *r, int i, uintptr_t stream, const void *src, int how,
                              int *direct) {
    DDPC_CHECK(check_param(r, i));
    ddpc_status st = DDPC_OK;
    if (direct) *direct = 0;
    pthread_mutex_lock(&r->mu);
    uint64_t t0 = ddpc_now_ns();
    Bucket *bk = &r->buckets[r->param_bucket[i]];
    int to_wire = how == 2 && src && bk->comm_dtype >= 0 && bk->comm_buf;
    if (!r->step_active) {
        st = ddpc_error(DDPC_ERR_INVALID, "reducer: parameter %d was marked ready outside a step "
                        "(prepare was not called, or finalize already ran)", i);
    } else if (bk->count && bk->comm_dtype >= 0 && !bk->comm_buf) {
        st = check_has_wire(r, r->param_bucket[i]);
    } else if (!to_wire && bk->count && !bk->buf) {
        st = check_has_memory(r, r->param_bucket[i]);
    } else if (r->ready[i]) {
        r->ready_count[i]++;
        if (bk->launched)
            st = ddpc_error(DDPC_ERR_INVALID,
                            "reducer: parameter %d received a gradient a second time in one "
                            "backward pass after its bucket (%d) was already being reduced. Its "
                            "gradient is accumulated more than once per backward (e.g. a weight "
                            "reused in several reentrant checkpoint segments) although it was not "
                            "in the first step, which decided the buckets", i,
                            r->param_bucket[i]);
        else if (to_wire && (st = cast_to_wire(r, i, src, stream)) != DDPC_OK)
            st = fail_step(r, st);
        else if (!to_wire) {
            /* Copied into its slot (src) or there already: whatever waited goes from there, and
             * one that went to the wire before stays in the slot, where finalize leaves the
             * reduced values. */
            if (src) {
                if ((st = copy_into_slot(r, i, src, stream)) != DDPC_OK) st = fail_step(r, st);
            } else {
                clear_due(r, i);
                r->grad_at[i] = NULL;
            }
            if (st == DDPC_OK && r->direct[i]) {
                r->direct[i] = 0;
                bk->ndirect--;
            }
        }
    } else if (to_wire && (st = cast_to_wire(r, i, src, stream)) != DDPC_OK) {
        /* nothing marked: the caller's error says what failed, the peers through the abort */
        st = fail_step(r, st);
    } else if (!to_wire && src && (st = copy_into_slot(r, i, src, stream)) != DDPC_OK) {
        st = fail_step(r, st); /* likewise */
    } else {
        r->ready[i] = 1;
        r->ready_count[i]++;
        r->seen[r->nseen++] = i;
        bk->pending--;
        r->copy_ns += ddpc_now_ns() - t0; /* the launches count their own time */
        t0 = 0;
        st = launch_complete(r, stream);
    }
    if (t0) r->copy_ns += ddpc_now_ns() - t0;
    if (st == DDPC_OK && direct) *direct = r->direct[i];
    ddpc_status ab = take_abort(r);
    pthread_mutex_unlock(&r->mu);
    return publish_abort(r, ab, st);
}

ddpc_status ddpc_reducer_mark_ready(DdpcReducer *r, int i, uintptr_t stream) {
    return mark_ready(r, i, stream, NULL, 0, NULL);
}

ddpc_status ddpc_reducer_mark_ready_copy(DdpcReducer *r, int i, const void *src,
                                         uintptr_t stream) {
    if (!src)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: mark_ready_copy of parameter %d: NULL "
                          "source", i);
    return mark_ready(r, i, stream, src, 1, NULL);
}

ddpc_status ddpc_reducer_mark_ready_grad(DdpcReducer *r, int i, const void *src,
                                         uintptr_t stream, int *direct) {
    if (!src || !direct)
        return ddpc_error(DDPC_ERR_INVALID, "reducer: mark_ready_grad of parameter %d: NULL "
                          "%s", i, !src ? "source" : "result pointer");
    return mark_ready(r, i, stream, src, 2, direct);
}

int ddpc_reducer_param_state(DdpcReducer *r, int i) {
    if (i < 0 || i >= r->nparams) return 0;
    pthread_mutex_lock(&r->mu);
    const Bucket *bk = &r->buckets[r->param_bucket[i]];
    int st = (!bk->count || bk->buf ? DDPC_PARAM_HAS_MEMORY : 0) |
             (bk->count && bk->comm_dtype >= 0 ? DDPC_PARAM_WIRE_BUCKET : 0) |
             (bk->comm_dtype >= 0 && bk->comm_buf ? DDPC_PARAM_HAS_WIRE : 0);
    pthread_mutex_unlock(&r->mu);
    return st;
}

int ddpc_reducer_mark_would_launch(DdpcReducer *r, int i) {
    if (i < 0 || i >= r->nparams) return 0;
    pthread_mutex_lock(&r->mu);
    const Bucket *bk = &r->buckets[r->param_bucket[i]];
    int yes = r->step_active && !r->ready[i] && !bk->late && bk->pending == 1 &&
              r->param_bucket[i] == r->next_launch;
    pthread_mutex_unlock(&r->mu);
    return yes;
}

int ddpc_reducer_unready(DdpcReducer *r, int *out) {
    int n = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->nparams; i++)
        if (!r->ready[i]) out[n++] = i;
    pthread_mutex_unlock(&r->mu);
    return n;
}

static ddpc_status zero_range(const Bucket *bk, size_t from, size_t to, uintptr_t stream) {
    size_t esize = ddpc_dtype_size(bk->dtype);
    char *p = (char *)bk->buf + from * esize;
    size_t bytes = (to - from) * esize;
    if (!bytes) return DDPC_OK;
    if (bk->device < 0) {
        memset(p, 0, bytes);
        return DDPC_OK;
    }
    return ddpc_device_zero(p, bytes, stream);
}

/* Zeroes the slots of bk's parameters that never became ready, merging neighbours (the padding
 * between them is zero already) into one range. */
static ddpc_status zero_unready(DdpcReducer *r, Bucket *bk, uintptr_t stream, int *unused) {
    size_t run_from = 0, run_to = 0;
    int in_run = 0;
    for (int j = 0; j < bk->nparams; j++) {
        int p = r->bucket_params[bk->first + j];
        if (r->ready[p]) {
            if (in_run) DDPC_CHECK(zero_range(bk, run_from, run_to, stream));
            in_run = 0;
            continue;
        }
        (*unused)++;
        if (!in_run) run_from = r->param_offset[p];
        run_to = r->param_offset[p] + r->numels[p];
        in_run = 1;
    }
    if (in_run) DDPC_CHECK(zero_range(bk, run_from, run_to, stream));
    bk->pending = 0;
    return DDPC_OK;
}

/* After a wire bucket's collective: the reduced values of its elements [lo, hi) back into the
 * bucket (when any of its gradients lives there) and into the gradients that went to the wire
 * from where autograd left them. */
static ddpc_status unwire_range(DdpcReducer *r, Bucket *bk, size_t lo, size_t hi,
                                uintptr_t stream) {
    if (bk->ndirect < bk->nparams)
        DDPC_CHECK(cast_slots(bk, bk->buf, bk->dtype, bk->comm_buf, (ddpc_dtype)bk->comm_dtype, lo,
                              hi - lo, back_scale(r, bk), stream));
    return bk->ndirect ? cast_params(r, bk, 1, 0, NULL, lo, hi, stream) : DDPC_OK;
}

/* The same for the whole bucket. Called with r->mu held. */
static ddpc_status unwire(DdpcReducer *r, Bucket *bk, uintptr_t stream) {
    return unwire_range(r, bk, 0, bk->count, stream);
}

ddpc_status ddpc_reducer_finalize(DdpcReducer *r, uintptr_t stream, int *unused) {
    ddpc_status st = DDPC_OK, ab;
    int nunused = 0;
    pthread_mutex_lock(&r->mu);
    if (!r->step_active) {
        st = ddpc_error(DDPC_ERR_INVALID, "reducer: finalize without a step in progress (prepare "
                        "was not called, or finalize already ran)");
        goto out;
    }
    /* Every bucket still to launch must have memory before any is zeroed or launched, so that a
     * failure leaves no rank with a partial set of collectives posted by this call. */
    for (int b = r->next_launch; b < r->nbuckets; b++) {
        if (r->buckets[b].ndirect < r->buckets[b].nparams)
            DDPC_CHECK_GOTO(check_has_memory(r, b), st, out);
        DDPC_CHECK_GOTO(check_has_wire(r, b), st, out);
    }
    for (int b = r->next_launch; b < r->nbuckets; b++)
        if (r->buckets[b].pending > 0 &&
            (st = zero_unready(r, &r->buckets[b], stream, &nunused)) != DDPC_OK) {
            fail_step(r, st); /* the buckets before were posted during the backward */
            goto out;
        }
    for (; r->next_launch < r->nbuckets; r->next_launch++)
        DDPC_CHECK_GOTO(launch(r, r->next_launch, stream), st, out);
    int back = 0;
    for (int b = 0; b < r->nbuckets; b++) {
        Bucket *bk = &r->buckets[b];
        if (!bk->work) continue;
        st = ddpc_work_wait_stream(bk->work, stream);
        if (st != DDPC_OK) {
            ddpc_error_prefix(st, "reducer: gradient bucket %d: ", b);
            goto out;
        }
        if (bk->comm_dtype >= 0 && !bk->unwired && (st = unwire(r, bk, stream)) != DDPC_OK)
            goto out;
        back |= bk->unwired == UNWIRED_BACK;
        ddpc_work_release(bk->work);
        bk->work = NULL;
    }
    if (back && (st = ddpc_device_stream_wait(stream, r->back_stream)) != DDPC_OK) {
        ddpc_error_prefix(st, "reducer: ordering the caller's stream after the casts back: ");
        goto out;
    }
    for (int i = 0; i < r->nparams; i++) {
        r->last_order[i] = i < r->nseen ? r->seen[i] : -1;
        r->last_count[i] = r->ready_count[i];
    }
    r->step_active = 0;
    DDPC_TRACE("REDUCER", "rank %d finished a step: %d of %d parameters unused",
               ddpc_group_rank(r->g), nunused, r->nparams);
out:
    ab = take_abort(r);
    pthread_mutex_unlock(&r->mu);
    if (unused) *unused = nunused;
    return publish_abort(r, ab, st);
}

int ddpc_reducer_take_flushed(DdpcReducer *r, int *out) {
    pthread_mutex_lock(&r->mu);
    int n = r->nflushed;
    for (int k = 0; k < n; k++) {
        out[k] = r->flushed[k];
        r->listed[out[k]] = 0;
    }
    r->nflushed = 0;
    pthread_mutex_unlock(&r->mu);
    return n;
}

void ddpc_reducer_host_times(DdpcReducer *r, uint64_t out[2], int reset) {
    pthread_mutex_lock(&r->mu);
    out[0] = r->copy_ns;
    out[1] = r->launch_ns;
    if (reset) r->copy_ns = r->launch_ns = 0;
    pthread_mutex_unlock(&r->mu);
}

ddpc_status ddpc_reducer_observed_order(const DdpcReducer *r, int *order, int *ready_count) {
    DdpcReducer *m = (DdpcReducer *)r; /* the lock is not part of the logical state */
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < r->nparams; i++) {
        if (order) order[i] = r->last_order[i];
        if (ready_count) ready_count[i] = r->last_count[i];
    }
    pthread_mutex_unlock(&m->mu);
    return DDPC_OK;
}
