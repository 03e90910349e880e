/* staged.c: the copy-engine all-reduce through pinned shared host memory (see staged.h). */
#include "staged.h"

#ifdef DDPC_WITH_CUDA

#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

typedef CUresult (*StreamValueFn)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

/* One sender's counters in one receiver's mailbox, each written only by that sender's GPU (or by
 * the receiver's host after an abort). A cache line each, so no two writers share one. */
typedef struct Mailbox {
    volatile uint32_t sent;      /* chunks whose send slot the sender has filled */
    volatile uint32_t read_send; /* chunks of the receiver's send slots the sender has read */
    volatile uint32_t reduced;   /* chunks whose out slot the sender has filled */
    volatile uint32_t read_out;  /* chunks of the receiver's out slots the sender has read */
    char pad[48];
} Mailbox;

enum { F_SENT = 0, F_READ_SEND = 4, F_REDUCED = 8, F_READ_OUT = 12 };

struct DdpcStaged {
    int rank, world;
    size_t chunk_bytes;  /* bytes of one chunk (a multiple of 4096, so of every element size) */
    size_t seg_cap;      /* the most bytes one segment of a chunk can have */
    char *map;           /* the shared segment */
    size_t map_len;
    int registered;
    CUdeviceptr map_dev; /* its device address */
    Mailbox *mail;       /* [world receivers][world senders], then the aborted words */
    size_t send_off, out_off; /* send slots [world][SLOTS][chunk_bytes], out slots [..][seg_cap] */
    void *scratch;       /* device: (world - 1) segments from the peers */
    /* One stream per step, so a step waiting for a peer holds back only later chunks of that
     * step: send (device to host), reduce (host to device, kernel), publish (device to host);
     * gather (host to device) runs on the caller's stream. */
    cudaStream_t side, red, pub;
    cudaEvent_t start, reduced, side_done, pub_done;
    uint32_t t;          /* chunks issued so far (all ranks alike) */
    StreamValueFn wait_value, write_value;
    char name[96];
    int unlinked;
};

int ddpc_staged_supported(ddpc_dtype dt, ddpc_redop op) {
    return (dt == DDPC_FLOAT32 || dt == DDPC_FLOAT64 || dt == DDPC_FLOAT16 ||
            dt == DDPC_BFLOAT16) && (op == DDPC_SUM || op == DDPC_AVG);
}

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* The largest chunk: 16 MiB for 2 ranks (32 MiB / world), fewer host calls per gradient bucket
 * (each chunk costs about 16 queued operations), halved while the segment would take more than
 * half of /dev/shm's free space (docker's default /dev/shm is 64 MiB). DDPC_STAGED_CHUNK_BYTES
 * sets it exactly; rank 0's choice holds for all ranks. */
ddpc_status ddpc_staged_chunk_bytes(int world, size_t *out) {
    uint64_t set;
    DDPC_CHECK(ddpc_setting_uint("DDPC_STAGED_CHUNK_BYTES", 0, &set)); /* 64 KiB to 64 MiB */
    if (set) {
        *out = round_up((size_t)set, 4096);
        return DDPC_OK;
    }
    size_t cb = round_up(((size_t)32 << 20) / (size_t)(world > 1 ? world : 2), 4096);
    struct statvfs fs;
    if (statvfs("/dev/shm", &fs) == 0) {
        size_t avail = (size_t)fs.f_bavail * (size_t)fs.f_frsize;
        while (cb > ((size_t)256 << 10) && ddpc_staged_segment_bytes(world, cb) > avail / 2)
            cb = round_up(cb / 2, 4096);
    }
    *out = cb;
    return DDPC_OK;
}

static size_t seg_cap_of(int world, size_t chunk_bytes) {
    /* A segment has at most ceil(n / world) elements rounded up to 16: chunk/world + 128 bytes. */
    return round_up(chunk_bytes / (size_t)world + 128, 256);
}

/* The mailboxes, then one cache line per rank holding its aborted word. */
static size_t mail_bytes(int world) {
    return round_up((size_t)world * (size_t)world * sizeof(Mailbox) + (size_t)world * 64, 4096);
}

static volatile uint32_t *aborted_word(const DdpcStaged *s, int r);

size_t ddpc_staged_segment_bytes(int world, size_t chunk_bytes) {
    return mail_bytes(world) + (size_t)world * DDPC_STAGED_SLOTS *
                                   (chunk_bytes + seg_cap_of(world, chunk_bytes));
}

static ddpc_status get_entry(const char *sym, StreamValueFn *fn) {
    void *p = NULL;
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion(sym, &p, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !p)
        return ddpc_error(DDPC_ERR_CUDA, "the CUDA driver does not provide %s (%s): a driver for "
                          "CUDA 12 or newer is needed", sym,
                          e != cudaSuccess ? cudaGetErrorString(e) : "symbol not found");
    *fn = (StreamValueFn)p;
    return DDPC_OK;
}

static void staged_free(DdpcStaged *s) {
    if (s->scratch) (void)cudaFree(s->scratch);
    if (s->start) (void)cudaEventDestroy(s->start);
    if (s->reduced) (void)cudaEventDestroy(s->reduced);
    if (s->side_done) (void)cudaEventDestroy(s->side_done);
    if (s->pub_done) (void)cudaEventDestroy(s->pub_done);
    if (s->side) (void)cudaStreamDestroy(s->side);
    if (s->red) (void)cudaStreamDestroy(s->red);
    if (s->pub) (void)cudaStreamDestroy(s->pub);
    if (s->registered) (void)cudaHostUnregister(s->map);
    if (s->map) munmap(s->map, s->map_len);
    (void)cudaGetLastError();
    ddpc_staged_unlink(s);
    free(s);
}

ddpc_status ddpc_staged_open(int rank, int world, size_t chunk_bytes, const char *shm_name,
                             int create, DdpcStaged **out) {
    *out = NULL;
    if (world < 2 || world > DDPC_STAGED_MAX_RANKS || rank < 0 || rank >= world)
        return ddpc_error(DDPC_ERR_INVALID, "staged all-reduce: rank %d of %d (it takes 2 to %d "
                          "ranks)", rank, world, DDPC_STAGED_MAX_RANKS);
    DdpcStaged *s = calloc(1, sizeof *s);
    if (!s) return ddpc_error(DDPC_ERR_NOMEM, "out of host memory for the staged all-reduce");
    s->rank = rank;
    s->world = world;
    s->chunk_bytes = chunk_bytes;
    s->seg_cap = seg_cap_of(world, chunk_bytes);
    s->map_len = ddpc_staged_segment_bytes(world, chunk_bytes);
    s->send_off = mail_bytes(world);
    s->out_off = s->send_off + (size_t)world * DDPC_STAGED_SLOTS * chunk_bytes;
    snprintf(s->name, sizeof s->name, "%s", shm_name);
    s->unlinked = !create; /* only the creator removes the name */
    ddpc_status st = DDPC_OK;
    int fd = shm_open(shm_name, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
    if (fd < 0) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "shm_open(%s) failed: %s", shm_name, strerror(errno));
        s->unlinked = 1;
        goto fail;
    }
    if (create) {
        int rc = ftruncate(fd, (off_t)s->map_len) == 0 ? 0 : errno;
        /* Reserve the pages now: a tmpfs too small for them would otherwise kill the process
         * with SIGBUS at first touch instead of failing here. */
        if (!rc) rc = posix_fallocate(fd, 0, (off_t)s->map_len);
        if (rc && rc != EOPNOTSUPP && rc != EINVAL) {
            st = ddpc_error(DDPC_ERR_SYSTEM, "reserving %zu bytes for %s in /dev/shm failed: %s "
                            "(a container needs a larger /dev/shm, e.g. docker --shm-size=1g; or "
                            "set DDPC_STAGED_ALLREDUCE=0)", s->map_len, shm_name, strerror(rc));
            close(fd);
            goto fail;
        }
    } else {
        struct stat sb;
        memset(&sb, 0, sizeof sb);
        if (fstat(fd, &sb) != 0 || (size_t)sb.st_size != s->map_len) {
            st = ddpc_error(DDPC_ERR_PROTOCOL, "%s has %lld bytes, not %zu: the ranks run "
                            "different ddpc builds or DDPC_STAGED_CHUNK_BYTES settings", shm_name,
                            (long long)sb.st_size, s->map_len);
            close(fd);
            goto fail;
        }
    }
    s->map = mmap(NULL, s->map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (s->map == MAP_FAILED) {
        s->map = NULL;
        st = ddpc_error(DDPC_ERR_SYSTEM, "mmap(%s, %zu bytes) failed: %s", shm_name, s->map_len,
                        strerror(errno));
        goto fail;
    }
    s->mail = (Mailbox *)s->map;
    DDPC_CUDACHECK_GOTO(cudaHostRegister(s->map, s->map_len,
                                         cudaHostRegisterMapped | cudaHostRegisterPortable),
                        st, fail);
    s->registered = 1;
    void *dev = NULL;
    DDPC_CUDACHECK_GOTO(cudaHostGetDevicePointer(&dev, s->map, 0), st, fail);
    s->map_dev = (CUdeviceptr)(uintptr_t)dev;
    DDPC_CHECK_GOTO(get_entry("cuStreamWaitValue32", &s->wait_value), st, fail);
    DDPC_CHECK_GOTO(get_entry("cuStreamWriteValue32", &s->write_value), st, fail);
    int least = 0, greatest = 0;
    DDPC_CUDACHECK_GOTO(cudaDeviceGetStreamPriorityRange(&least, &greatest), st, fail);
    DDPC_CUDACHECK_GOTO(cudaStreamCreateWithPriority(&s->side, cudaStreamNonBlocking, greatest),
                        st, fail);
    DDPC_CUDACHECK_GOTO(cudaStreamCreateWithPriority(&s->red, cudaStreamNonBlocking, greatest),
                        st, fail);
    DDPC_CUDACHECK_GOTO(cudaStreamCreateWithPriority(&s->pub, cudaStreamNonBlocking, greatest),
                        st, fail);
    DDPC_CUDACHECK_GOTO(cudaEventCreateWithFlags(&s->start, cudaEventDisableTiming), st, fail);
    DDPC_CUDACHECK_GOTO(cudaEventCreateWithFlags(&s->reduced, cudaEventDisableTiming), st, fail);
    DDPC_CUDACHECK_GOTO(cudaEventCreateWithFlags(&s->side_done, cudaEventDisableTiming), st, fail);
    DDPC_CUDACHECK_GOTO(cudaEventCreateWithFlags(&s->pub_done, cudaEventDisableTiming), st, fail);
    DDPC_CUDACHECK_GOTO(cudaMalloc(&s->scratch, (size_t)(world - 1) * s->seg_cap), st, fail);
    *out = s;
    return DDPC_OK;
fail:
    staged_free(s);
    return st;
}

void ddpc_staged_unlink(DdpcStaged *s) {
    if (!s || s->unlinked) return;
    s->unlinked = 1;
    if (shm_unlink(s->name) != 0 && errno != ENOENT)
        DDPC_INFO("NCCL", "shm_unlink(%s) failed: %s", s->name, strerror(errno));
}

/* ---------------------------------------------------------------- one all-reduce */

typedef struct Chunk {
    char *base;   /* the chunk's first element in the caller's buffer */
    size_t n;     /* its elements */
    size_t per;   /* elements per segment (the last ones may be shorter or empty) */
    uint32_t t;   /* its number among all chunks of this group */
    int slot;
} Chunk;

static size_t seg_start(const Chunk *c, int j) {
    size_t v = c->per * (size_t)j;
    return v < c->n ? v : c->n;
}

static CUdeviceptr mail_dev(const DdpcStaged *s, int receiver, int sender, int field) {
    return s->map_dev + ((size_t)receiver * (size_t)s->world + (size_t)sender) * sizeof(Mailbox) +
           (size_t)field;
}

static char *send_slot(const DdpcStaged *s, int r, int slot) {
    return s->map + s->send_off + ((size_t)r * DDPC_STAGED_SLOTS + (size_t)slot) * s->chunk_bytes;
}

static char *out_slot(const DdpcStaged *s, int r, int slot) {
    return s->map + s->out_off + ((size_t)r * DDPC_STAGED_SLOTS + (size_t)slot) * s->seg_cap;
}

static ddpc_status cu_check(CUresult r, const char *what, uint32_t value) {
    if (r == CUDA_SUCCESS) return DDPC_OK;
    return ddpc_error(DDPC_ERR_CUDA, "%s (value %u) failed with CUresult %d", what, value, (int)r);
}

/* Tells every peer that this rank's `field` reached value, after the work queued on stream. */
static ddpc_status signal_peers(DdpcStaged *s, cudaStream_t stream, int field, uint32_t value) {
    for (int p = 0; p < s->world; p++) {
        if (p == s->rank) continue;
        DDPC_CHECK(cu_check(s->write_value((CUstream)stream, mail_dev(s, p, s->rank, field), value,
                                           CU_STREAM_WRITE_VALUE_DEFAULT),
                            "cuStreamWriteValue32 (staged all-reduce)", value));
    }
    return DDPC_OK;
}

/* Holds stream until peer q's `field` in this rank's mailbox reaches value (cyclically). */
static ddpc_status wait_peer(DdpcStaged *s, cudaStream_t stream, int q, int field, uint32_t value) {
    return cu_check(s->wait_value((CUstream)stream, mail_dev(s, s->rank, q, field), value,
                                  CU_STREAM_WAIT_VALUE_GEQ),
                    "cuStreamWaitValue32 (staged all-reduce)", value);
}

static ddpc_status copy(void *dst, const void *src, size_t bytes, cudaStream_t stream) {
    if (!bytes) return DDPC_OK;
    DDPC_CUDACHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
    return DDPC_OK;
}

/* 1 (send stream): the segments this rank does not own, into its send slot. */
static ddpc_status send_chunk(DdpcStaged *s, const Chunk *c, size_t es) {
    const int r = s->rank;
    for (int q = 0; q < s->world; q++)
        if (q != r)
            DDPC_CHECK(wait_peer(s, s->side, q, F_READ_SEND, c->t - DDPC_STAGED_SLOTS + 1));
    char *slot = send_slot(s, r, c->slot);
    size_t own0 = seg_start(c, r), own1 = seg_start(c, r + 1);
    DDPC_CHECK(copy(slot, c->base, own0 * es, s->side));
    DDPC_CHECK(copy(slot + own1 * es, c->base + own1 * es, (c->n - own1) * es, s->side));
    return signal_peers(s, s->side, F_SENT, c->t + 1);
}

/* 2 (reduce stream): the peers' copies of this rank's segment, summed into it. */
static ddpc_status reduce_chunk(DdpcStaged *s, const Chunk *c, size_t es, ddpc_dtype dt, int div) {
    cudaStream_t stream = s->red;
    const int r = s->rank;
    size_t off = seg_start(c, r), n = seg_start(c, r + 1) - off;
    const void *srcs[DDPC_STAGED_MAX_RANKS];
    int k = 0;
    for (int q = 0; q < s->world; q++) {
        if (q == r) continue;
        DDPC_CHECK(wait_peer(s, stream, q, F_SENT, c->t + 1));
        char *dst = (char *)s->scratch + (size_t)k * s->seg_cap;
        DDPC_CHECK(copy(dst, send_slot(s, q, c->slot) + off * es, n * es, stream));
        srcs[k++] = dst;
    }
    DDPC_CHECK(signal_peers(s, stream, F_READ_SEND, c->t + 1));
    DDPC_CHECK(ddpc_device_reduce_into(c->base + off * es, srcs, k, dt, n, div, (uintptr_t)stream));
    DDPC_CUDACHECK(cudaEventRecord(s->reduced, stream));
    return DDPC_OK;
}

/* 3 (publish stream): this rank's reduced segment into its out slot. The event was recorded by
 * reduce_chunk of this chunk and not yet re-recorded (the caller's order guarantees it). */
static ddpc_status publish_chunk(DdpcStaged *s, const Chunk *c, size_t es) {
    const int r = s->rank;
    DDPC_CUDACHECK(cudaStreamWaitEvent(s->pub, s->reduced, 0));
    for (int q = 0; q < s->world; q++)
        if (q != r)
            DDPC_CHECK(wait_peer(s, s->pub, q, F_READ_OUT, c->t - DDPC_STAGED_SLOTS + 1));
    size_t off = seg_start(c, r), n = seg_start(c, r + 1) - off;
    DDPC_CHECK(copy(out_slot(s, r, c->slot), c->base + off * es, n * es, s->pub));
    return signal_peers(s, s->pub, F_REDUCED, c->t + 1);
}

/* 4 (the caller's stream): the peers' reduced segments into the buffer. */
static ddpc_status gather_chunk(DdpcStaged *s, const Chunk *c, size_t es, cudaStream_t stream) {
    for (int q = 0; q < s->world; q++) {
        if (q == s->rank) continue;
        DDPC_CHECK(wait_peer(s, stream, q, F_REDUCED, c->t + 1));
        size_t off = seg_start(c, q), n = seg_start(c, q + 1) - off;
        DDPC_CHECK(copy(c->base + off * es, out_slot(s, q, c->slot), n * es, stream));
    }
    return signal_peers(s, stream, F_READ_OUT, c->t + 1);
}

static Chunk chunk_of(const DdpcStaged *s, char *buf, size_t count, size_t es, size_t ce,
                      size_t k, uint32_t t0) {
    Chunk c;
    c.base = buf + k * ce * es;
    c.n = DDPC_MIN(ce, count - k * ce);
    c.per = round_up((c.n + (size_t)s->world - 1) / (size_t)s->world, 16);
    c.t = t0 + (uint32_t)k;
    c.slot = (int)(c.t % DDPC_STAGED_SLOTS);
    return c;
}

ddpc_status ddpc_staged_all_reduce(DdpcStaged *s, void *buf, size_t count, ddpc_dtype dt,
                                   ddpc_redop op, uintptr_t stream_, void *ready) {
    if (!ddpc_staged_supported(dt, op))
        return ddpc_error(DDPC_ERR_INVALID, "staged all-reduce: %s of %s is not supported",
                          ddpc_redop_name(op), ddpc_dtype_name(dt));
    if (!count) return DDPC_OK;
    cudaStream_t stream = (cudaStream_t)stream_;
    size_t es = ddpc_dtype_size(dt);
    /* The largest chunks: each costs about 16 queued operations on the host (splitting calls of
     * 1-4 MiB in 4 chunks made them slower: 150 us instead of 105 at 1 MiB on 2 H200s). */
    size_t ce = s->chunk_bytes / es;
    size_t nk = (count + ce - 1) / ce;
    uint32_t t0 = __atomic_load_n(&s->t, __ATOMIC_RELAXED);
    /* Whatever happens below, every rank counts the same chunks (a failure aborts the group). */
    __atomic_store_n(&s->t, t0 + (uint32_t)nk, __ATOMIC_RELAXED);
    int div = op == DDPC_AVG ? s->world : 1;
    char *b = buf;
    /* The send and reduce steps read and write buf: they start after the caller's work on it,
     * and (without `ready`) after everything queued on the stream before this call. */
    cudaEvent_t from = (cudaEvent_t)ready;
    if (!from) {
        DDPC_CUDACHECK(cudaEventRecord(s->start, stream));
        from = s->start;
    }
    DDPC_CUDACHECK(cudaStreamWaitEvent(s->side, from, 0));
    DDPC_CUDACHECK(cudaStreamWaitEvent(s->red, from, 0));
    /* The four steps of consecutive chunks overlap. Every wait is for a step issued earlier on
     * every rank, so the issue order is a schedule that cannot deadlock however the streams are
     * mapped onto hardware queues. */
    for (size_t k = 0; k <= nk; k++) {
        Chunk cur = chunk_of(s, b, count, es, ce, k < nk ? k : 0, t0);
        Chunk prev = chunk_of(s, b, count, es, ce, k ? k - 1 : 0, t0);
        if (k < nk) DDPC_CHECK(send_chunk(s, &cur, es));
        if (k >= 1) DDPC_CHECK(publish_chunk(s, &prev, es));
        if (k < nk) DDPC_CHECK(reduce_chunk(s, &cur, es, dt, div));
        if (k >= 1) DDPC_CHECK(gather_chunk(s, &prev, es, stream));
    }
    /* The buffer is the caller's again only when the send and publish streams have read it too
     * (the publish of the last chunk comes after its reduction). */
    DDPC_CUDACHECK(cudaEventRecord(s->side_done, s->side));
    DDPC_CUDACHECK(cudaStreamWaitEvent(stream, s->side_done, 0));
    DDPC_CUDACHECK(cudaEventRecord(s->pub_done, s->pub));
    DDPC_CUDACHECK(cudaStreamWaitEvent(stream, s->pub_done, 0));
    return DDPC_OK;
}

static volatile uint32_t *aborted_word(const DdpcStaged *s, int r) {
    return (volatile uint32_t *)(s->map + (size_t)s->world * (size_t)s->world * sizeof(Mailbox) +
                                 (size_t)r * 64);
}

int ddpc_staged_peer_aborted(const DdpcStaged *s) {
    if (!s || !s->map) return -1;
    __sync_synchronize();
    for (int r = 0; r < s->world; r++)
        if (*aborted_word(s, r)) return r;
    return -1;
}

void ddpc_staged_unblock(DdpcStaged *s) {
    if (!s || !s->mail) return;
    /* First tell the peers, through memory they check before they report a staged all-reduce
     * done: once released, this rank's streams run on without their waits and signal the peers
     * with whatever they move. */
    *aborted_word(s, s->rank) = 1;
    __sync_synchronize();
    /* Far ahead of every value awaited (at most t + 1), yet less than 2^31 ahead: the cyclic
     * comparison of cuStreamWaitValue32 passes. Only this rank's own mailbox: its peers' waits
     * stay as they are. */
    uint32_t v = __atomic_load_n(&s->t, __ATOMIC_RELAXED) + (1u << 30);
    for (int q = 0; q < s->world; q++) {
        Mailbox *m = &s->mail[(size_t)s->rank * (size_t)s->world + (size_t)q];
        m->sent = v;
        m->read_send = v;
        m->reduced = v;
        m->read_out = v;
    }
    __sync_synchronize();
}

void ddpc_staged_close(DdpcStaged *s, uintptr_t stream, int aborted) {
    if (!s) return;
    struct timespec tick = {.tv_sec = 0, .tv_nsec = 1000000L};
    int drained = 0;
    for (int i = 0; i < 5000; i++) {
        /* A peer that is still running may lower a counter again: unblock on every round. */
        if (aborted) ddpc_staged_unblock(s);
        cudaError_t a = cudaStreamQuery(s->side);
        if (a == cudaSuccess) a = cudaStreamQuery(s->red);
        if (a == cudaSuccess) a = cudaStreamQuery(s->pub);
        cudaError_t b = stream ? cudaStreamQuery((cudaStream_t)stream) : cudaSuccess;
        if (a == cudaSuccess && b == cudaSuccess) {
            drained = 1;
            break;
        }
        if ((a != cudaSuccess && a != cudaErrorNotReady) ||
            (b != cudaSuccess && b != cudaErrorNotReady))
            break;
        nanosleep(&tick, NULL);
    }
    (void)cudaGetLastError();
    if (!drained) {
        DDPC_INFO("NCCL", "rank %d: the staged all-reduce's streams did not drain at shutdown; "
                  "its memory stays allocated", s->rank);
        ddpc_staged_unlink(s);
        return;
    }
    staged_free(s);
}

#endif /* DDPC_WITH_CUDA */
