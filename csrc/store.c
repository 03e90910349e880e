/* store.c: the TCP rendezvous store. Rank 0 serves it from one poll() thread over non-blocking
 * sockets; every rank is a client that proves it knows the job token (HMAC-SHA256 over a random
 * nonce) before any key is read or written. SHA-256 and HMAC are implemented here.
 *
 * Wire protocol (integers little-endian):
 *   server -> client greeting: "DDPC" u32 version u8 nonce[32]                       (40 bytes)
 *   client -> server answer:   "DDPC" u32 version i32 rank u8 hmac_sha256(token, nonce)[32] (44)
 *   server -> client verdict:  u8 1 (accepted) or 0 (refused, then the server closes)
 *   then frames both ways: u32 len, then len bytes: request = u8 cmd + fields, reply = u8 status
 *   + fields. A key or value field is u32 length + bytes. A client sends one request at a time.
 *   GET and WAIT carry a server-side wait (ms, capped) so a client waits in short slices. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common.h"

#define STORE_VERSION 1u
#define STORE_MAGIC "DDPC"
#define NONCE_LEN 32
#define MAC_LEN 32
#define GREETING_LEN (4 + 4 + NONCE_LEN)
#define ANSWER_LEN (4 + 4 + 4 + MAC_LEN)

#define MAX_KEY 4096u
#define MAX_VALUE (64u << 20)
#define MAX_KEYS 65536u
/* The largest request is a compare-and-set: cmd, key, two values and their length fields. */
#define MAX_FRAME (1u + 3u * 4u + MAX_KEY + 2u * MAX_VALUE)
#define AUTH_TIMEOUT_MS 5000
#define MAX_SERVER_WAIT_MS 1000u   /* longest one request may wait server-side */
#define READ_BURST (1u << 20)      /* bytes read from one client before serving the others */

enum { CMD_SET = 1, CMD_GET, CMD_ADD, CMD_CAS, CMD_DELETE, CMD_CHECK, CMD_WAIT, CMD_NUM_KEYS,
       CMD_BYE };
enum { REPLY_OK = 0, REPLY_NOTFOUND = 1, REPLY_INVALID = 2, REPLY_NOMEM = 3 };

/* ---------------------------------------------------------------- SHA-256 and HMAC (FIPS 180-4,
 * RFC 2104) */

typedef struct {
    uint32_t h[8];
    uint64_t bytes;
    uint8_t buf[64];
    size_t fill;
} Sha256;

static const uint32_t sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static uint32_t ror32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void sha256_block(Sha256 *s, const uint8_t *p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ror32(w[i - 15], 7) ^ ror32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror32(w[i - 2], 17) ^ ror32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3];
    uint32_t e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (ror32(e, 6) ^ ror32(e, 11) ^ ror32(e, 25)) + ((e & f) ^ (~e & g)) +
                      sha256_k[i] + w[i];
        uint32_t t2 = (ror32(a, 2) ^ ror32(a, 13) ^ ror32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    s->h[0] += a; s->h[1] += b; s->h[2] += c; s->h[3] += d;
    s->h[4] += e; s->h[5] += f; s->h[6] += g; s->h[7] += h;
}

static void sha256_init(Sha256 *s) {
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, h0, sizeof h0);
    s->bytes = 0;
    s->fill = 0;
}

static void sha256_update(Sha256 *s, const void *data, size_t len) {
    const uint8_t *p = data;
    s->bytes += len;
    while (len > 0) {
        size_t take = DDPC_MIN(len, 64 - s->fill);
        memcpy(s->buf + s->fill, p, take);
        s->fill += take;
        p += take;
        len -= take;
        if (s->fill == 64) {
            sha256_block(s, s->buf);
            s->fill = 0;
        }
    }
}

static void sha256_final(Sha256 *s, uint8_t out[32]) {
    uint64_t bits = s->bytes * 8;
    uint8_t pad[72] = {0x80};
    /* Pad to 56 mod 64, then the message length in bits, big-endian. */
    size_t padlen = (s->fill < 56 ? 56 : 120) - s->fill;
    for (int i = 0; i < 8; i++) pad[padlen + (size_t)i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_update(s, pad, padlen + 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->h[i];
    }
}

void ddpc_sha256(const void *data, size_t len, uint8_t out[32]) {
    Sha256 s;
    sha256_init(&s);
    sha256_update(&s, data, len);
    sha256_final(&s, out);
}

void ddpc_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                      uint8_t out[32]) {
    uint8_t k[64] = {0}, pad[64], inner[32];
    Sha256 s;
    if (key_len > 64) ddpc_sha256(key, key_len, k);
    else if (key_len > 0) memcpy(k, key, key_len);
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
    sha256_init(&s);
    sha256_update(&s, pad, 64);
    sha256_update(&s, msg, msg_len);
    sha256_final(&s, inner);
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
    sha256_init(&s);
    sha256_update(&s, pad, 64);
    sha256_update(&s, inner, 32);
    sha256_final(&s, out);
}

/* Compares without an early exit, so the time taken says nothing about where a guess differs. */
static int equal_const_time(const uint8_t *a, const uint8_t *b, size_t n) {
    volatile uint8_t diff = 0;
    for (size_t i = 0; i < n; i++) diff |= (uint8_t)(a[i] ^ b[i]);
    return diff == 0;
}

/* ---------------------------------------------------------------- byte buffers */

typedef struct {
    uint8_t *p;
    size_t len, cap;
} Buf;

static int buf_reserve(Buf *b, size_t extra) {
    if (extra <= b->cap - b->len) return 0;
    if (extra > SIZE_MAX / 2 - b->len) return -1;
    size_t cap = DDPC_MAX(b->cap * 2, b->len + extra);
    cap = DDPC_MAX(cap, (size_t)256);
    uint8_t *p = realloc(b->p, cap);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const void *d, size_t n) {
    if (buf_reserve(b, n)) return -1;
    if (n) memcpy(b->p + b->len, d, n);
    b->len += n;
    return 0;
}

static void put_u32le(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32le(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int buf_u8(Buf *b, uint8_t v) { return buf_put(b, &v, 1); }

static int buf_u32(Buf *b, uint32_t v) {
    uint8_t t[4];
    put_u32le(t, v);
    return buf_put(b, t, 4);
}

static int buf_i64(Buf *b, int64_t v) {
    uint8_t t[8];
    for (int i = 0; i < 8; i++) t[i] = (uint8_t)((uint64_t)v >> (8 * i));
    return buf_put(b, t, 8);
}

static int buf_field(Buf *b, const void *d, size_t n) {
    return buf_u32(b, (uint32_t)n) || buf_put(b, d, n);
}

static void buf_consume(Buf *b, size_t n) {
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

static void buf_free(Buf *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

/* Reads fields of a received frame; any overrun sets bad instead of reading past the end. */
typedef struct {
    const uint8_t *p;
    size_t left;
    int bad;
} Rd;

static const uint8_t *rd_take(Rd *r, size_t n) {
    if (r->bad || n > r->left) {
        r->bad = 1;
        return NULL;
    }
    const uint8_t *p = r->p;
    r->p += n;
    r->left -= n;
    return p;
}

static uint32_t rd_u32(Rd *r) {
    const uint8_t *p = rd_take(r, 4);
    return p ? get_u32le(p) : 0;
}

static int64_t rd_i64(Rd *r) {
    const uint8_t *p = rd_take(r, 8);
    uint64_t v = 0;
    if (p)
        for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return (int64_t)v;
}

/* A length-prefixed field of at most max bytes (and at least min). */
static const uint8_t *rd_field(Rd *r, size_t min, size_t max, size_t *n) {
    *n = rd_u32(r);
    if (!r->bad && (*n < min || *n > max)) r->bad = 1;
    return rd_take(r, r->bad ? SIZE_MAX : *n);
}

/* ---------------------------------------------------------------- the key-value table */

typedef struct Entry {
    struct Entry *next;
    uint64_t hash;
    uint8_t *key;
    size_t klen;
    uint8_t *val;
    size_t vlen;
} Entry;

typedef struct {
    Entry **slots;
    size_t nslots, count;
} Table;

static uint64_t hash_key(const uint8_t *k, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ k[i]) * 1099511628211ull;
    return h;
}

static Entry **table_slot(Table *t, const uint8_t *k, size_t n) {
    if (!t->nslots) return NULL;
    uint64_t h = hash_key(k, n);
    Entry **pp = &t->slots[h & (t->nslots - 1)];
    for (; *pp; pp = &(*pp)->next)
        if ((*pp)->hash == h && (*pp)->klen == n && !memcmp((*pp)->key, k, n)) return pp;
    return pp;
}

static Entry *table_find(Table *t, const uint8_t *k, size_t n) {
    Entry **pp = table_slot(t, k, n);
    return pp ? *pp : NULL;
}

static int table_grow(Table *t) {
    size_t n = t->nslots ? t->nslots * 2 : 64;
    Entry **slots = calloc(n, sizeof *slots);
    if (!slots) return -1;
    for (size_t i = 0; i < t->nslots; i++) {
        for (Entry *e = t->slots[i], *next; e; e = next) {
            next = e->next;
            e->next = slots[e->hash & (n - 1)];
            slots[e->hash & (n - 1)] = e;
        }
    }
    free(t->slots);
    t->slots = slots;
    t->nslots = n;
    return 0;
}

/* Copies val into the key's entry (created if missing). On failure the old value is kept. */
static int table_set(Table *t, const uint8_t *k, size_t klen, const void *val, size_t vlen) {
    if (t->count >= t->nslots && table_grow(t)) return -1;
    Entry **pp = table_slot(t, k, klen);
    uint8_t *v = malloc(vlen ? vlen : 1);
    if (!v) return -1;
    if (vlen) memcpy(v, val, vlen);
    if (*pp) {
        free((*pp)->val);
        (*pp)->val = v;
        (*pp)->vlen = vlen;
        return 0;
    }
    Entry *e = calloc(1, sizeof *e);
    uint8_t *kc = malloc(klen ? klen : 1);
    if (!e || !kc) {
        free(e);
        free(kc);
        free(v);
        return -1;
    }
    memcpy(kc, k, klen);
    *e = (Entry){.next = NULL, .hash = hash_key(k, klen), .key = kc, .klen = klen, .val = v,
                 .vlen = vlen};
    *pp = e;
    t->count++;
    return 0;
}

static int table_delete(Table *t, const uint8_t *k, size_t klen) {
    Entry **pp = table_slot(t, k, klen);
    if (!pp || !*pp) return 0;
    Entry *e = *pp;
    *pp = e->next;
    free(e->key);
    free(e->val);
    free(e);
    t->count--;
    return 1;
}

static void table_free(Table *t) {
    for (size_t i = 0; i < t->nslots; i++) {
        for (Entry *e = t->slots[i], *next; e; e = next) {
            next = e->next;
            free(e->key);
            free(e->val);
            free(e);
        }
    }
    free(t->slots);
    memset(t, 0, sizeof *t);
}

/* ---------------------------------------------------------------- server */

/* The server's verdict when the answer is right but another live client holds its rank. */
#define VERDICT_RANK_TAKEN 2

typedef struct {
    int fd;
    int authed;
    int rank;            /* registered rank, -1 for none */
    int clean;           /* sent a goodbye: its close is not a death */
    int eof;             /* the peer closed or reset: serve what is buffered, then drop it */
    int gone;            /* closed; removed at the end of the loop iteration */
    int parked;          /* the frame at the head of `in` waits for keys until park_deadline */
    int64_t park_deadline;
    int64_t auth_deadline;
    uint8_t nonce[NONCE_LEN];
    char peer[80];
    Buf in, out;
} Client;

struct DdpcStoreServer {
    int listen_fd;
    int wake[2];           /* a byte written here wakes poll() to stop */
    int port;
    char where[300];       /* "host:port" for log lines */
    uint8_t *token;
    size_t token_len;
    pthread_t thread;
    atomic_int stop;
    Table table;
    Client **clients;
    size_t nclients, cap;
    int dirty;             /* a key was created or changed: parked clients may be satisfied */
    int64_t accept_paused_until;
};

static void fmt_addr(const struct sockaddr *sa, char *out, size_t len) {
    char ip[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const void *)sa;
        inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
        port = ntohs(a->sin_port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const void *)sa;
        inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip);
        port = ntohs(a->sin6_port);
    }
    snprintf(out, len, "%s:%d", ip, port);
}

static void client_drop(DdpcStoreServer *s, Client *cl, const char *why) {
    if (cl->gone) return;
    DDPC_INFO("STORE", "%s: dropping client %s%s: %s", s->where, cl->peer,
              cl->authed && cl->rank >= 0 ? " (a registered rank)" : "", why);
    close(cl->fd);
    cl->gone = 1;
    if (cl->authed && cl->rank >= 0 && !cl->clean) {
        char key[64], val[200];
        int kn = snprintf(key, sizeof key, "ddpc/dead/%d", cl->rank);
        int vn = snprintf(val, sizeof val,
                          "rank %d (%s) lost its store connection without a clean close: the "
                          "process exited, crashed or was killed", cl->rank, cl->peer);
        if (table_set(&s->table, (const uint8_t *)key, (size_t)kn, val, (size_t)vn))
            ddpc_log(DDPC_LOG_INFO, "STORE", "%s: out of memory recording that rank %d died",
                     s->where, cl->rank);
        else
            DDPC_INFO("STORE", "%s: rank %d died: set %s", s->where, cl->rank, key);
        /* The first rank to die, in one key, so a rank waiting for all the others asks once
         * rather than once per rank (ddpc_group_init_failure). */
        static const char first[] = DDPC_STORE_FIRST_DEAD_KEY;
        if (!table_find(&s->table, (const uint8_t *)first, sizeof first - 1)) {
            vn = snprintf(val, sizeof val, "%d", cl->rank);
            (void)table_set(&s->table, (const uint8_t *)first, sizeof first - 1, val, (size_t)vn);
        }
        s->dirty = 1;
    }
}

static void client_flush(DdpcStoreServer *s, Client *cl) {
    while (!cl->gone && cl->out.len) {
        ssize_t n = send(cl->fd, cl->out.p, cl->out.len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            buf_consume(&cl->out, (size_t)n);
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return;
        } else {
            char why[160];
            snprintf(why, sizeof why, "send failed: %s", n < 0 ? strerror(errno) : "0 bytes");
            client_drop(s, cl, why);
        }
    }
}

/* Reads what the socket holds, up to a burst (so one flooding client cannot starve the others)
 * and up to the buffer limit: the greeting answer before authentication, one maximum frame
 * after (a client sends one request, then waits for the reply). */
static void client_read(DdpcStoreServer *s, Client *cl) {
    size_t limit = cl->authed ? 4 + (size_t)MAX_FRAME : ANSWER_LEN;
    size_t got = 0;
    while (!cl->eof && !cl->gone && cl->in.len < limit && got < READ_BURST) {
        size_t want = DDPC_MIN(limit - cl->in.len, (size_t)65536);
        if (buf_reserve(&cl->in, want)) {
            client_drop(s, cl, "out of memory for its message");
            return;
        }
        ssize_t n = recv(cl->fd, cl->in.p + cl->in.len, want, MSG_DONTWAIT);
        if (n > 0) {
            cl->in.len += (size_t)n;
            got += (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return;
        } else {
            cl->eof = 1;
        }
    }
}

static int reply_begin(Client *cl, size_t *hdr, uint8_t status) {
    *hdr = cl->out.len;
    return buf_u32(&cl->out, 0) || buf_u8(&cl->out, status);
}

static void reply_end(Client *cl, size_t hdr) {
    put_u32le(cl->out.p + hdr, (uint32_t)(cl->out.len - hdr - 4));
}

static int reply_simple(Client *cl, uint8_t status, const void *payload, size_t n) {
    size_t hdr;
    if (reply_begin(cl, &hdr, status) || buf_put(&cl->out, payload, n)) return -1;
    reply_end(cl, hdr);
    return 0;
}

static int reply_error(Client *cl, uint8_t status, const char *msg) {
    return reply_simple(cl, status, msg, strlen(msg));
}

enum { SERVE_DONE, SERVE_PARKED, SERVE_BAD, SERVE_BYE, SERVE_NOMEM };

/* A GET or WAIT whose keys are missing: park it (first time) or keep it parked until its
 * deadline; then answer NOTFOUND so the client can check for Ctrl-C and its own deadline. */
static int serve_missing(Client *cl, uint32_t wait_ms, int64_t now) {
    if (!cl->parked && wait_ms > 0) {
        cl->parked = 1;
        cl->park_deadline = now + DDPC_MIN(wait_ms, MAX_SERVER_WAIT_MS);
    }
    return cl->parked && now < cl->park_deadline ? SERVE_PARKED : SERVE_DONE;
}

/* Executes (or re-examines, when parked) the request at the head of cl->in. */
static int serve_frame(DdpcStoreServer *s, Client *cl, const uint8_t *body, size_t len,
                       int64_t now) {
    Rd r = {body + 1, len - 1, 0};
    size_t klen, vlen, elen;
    const uint8_t *key, *val, *exp;
    Entry *e;
    switch (body[0]) {
    case CMD_SET:
        key = rd_field(&r, 1, MAX_KEY, &klen);
        val = rd_field(&r, 0, MAX_VALUE, &vlen);
        if (r.bad || r.left) return SERVE_BAD;
        if (table_set(&s->table, key, klen, val, vlen)) return SERVE_NOMEM;
        s->dirty = 1;
        return reply_simple(cl, REPLY_OK, NULL, 0) ? SERVE_NOMEM : SERVE_DONE;
    case CMD_GET: {
        uint32_t wait_ms = rd_u32(&r);
        key = rd_field(&r, 1, MAX_KEY, &klen);
        if (r.bad || r.left) return SERVE_BAD;
        e = table_find(&s->table, key, klen);
        if (!e) {
            int st = serve_missing(cl, wait_ms, now);
            if (st == SERVE_PARKED) return st;
            return reply_simple(cl, REPLY_NOTFOUND, NULL, 0) ? SERVE_NOMEM : SERVE_DONE;
        }
        return reply_simple(cl, REPLY_OK, e->val, e->vlen) ? SERVE_NOMEM : SERVE_DONE;
    }
    case CMD_ADD: {
        int64_t delta = rd_i64(&r), cur = 0;
        key = rd_field(&r, 1, MAX_KEY, &klen);
        if (r.bad || r.left) return SERVE_BAD;
        e = table_find(&s->table, key, klen);
        if (e) {
            char num[32], *end;
            if (e->vlen == 0 || e->vlen >= sizeof num)
                return reply_error(cl, REPLY_INVALID, "the key holds a value that is not an "
                                   "integer") ? SERVE_NOMEM : SERVE_DONE;
            memcpy(num, e->val, e->vlen);
            num[e->vlen] = '\0';
            errno = 0;
            cur = strtoll(num, &end, 10);
            if (errno || *end)
                return reply_error(cl, REPLY_INVALID, "the key holds a value that is not an "
                                   "integer") ? SERVE_NOMEM : SERVE_DONE;
        }
        if (__builtin_add_overflow(cur, delta, &cur))
            return reply_error(cl, REPLY_INVALID, "the sum overflows a 64-bit integer")
                       ? SERVE_NOMEM : SERVE_DONE;
        char text[32];
        int n = snprintf(text, sizeof text, "%lld", (long long)cur);
        if (table_set(&s->table, key, klen, text, (size_t)n)) return SERVE_NOMEM;
        s->dirty = 1;
        size_t hdr;
        if (reply_begin(cl, &hdr, REPLY_OK) || buf_i64(&cl->out, cur)) return SERVE_NOMEM;
        reply_end(cl, hdr);
        return SERVE_DONE;
    }
    case CMD_CAS:
        key = rd_field(&r, 1, MAX_KEY, &klen);
        exp = rd_field(&r, 0, MAX_VALUE, &elen);
        val = rd_field(&r, 0, MAX_VALUE, &vlen);
        if (r.bad || r.left) return SERVE_BAD;
        e = table_find(&s->table, key, klen);
        /* An empty expected value also matches a missing key, like torch's compare_set. */
        if (e ? (e->vlen == elen && (elen == 0 || !memcmp(e->val, exp, elen))) : elen == 0) {
            if (table_set(&s->table, key, klen, val, vlen)) return SERVE_NOMEM;
            s->dirty = 1;
            e = table_find(&s->table, key, klen);
        }
        return reply_simple(cl, REPLY_OK, e ? e->val : NULL, e ? e->vlen : 0) ? SERVE_NOMEM
                                                                               : SERVE_DONE;
    case CMD_DELETE: {
        key = rd_field(&r, 1, MAX_KEY, &klen);
        if (r.bad || r.left) return SERVE_BAD;
        uint8_t deleted = (uint8_t)table_delete(&s->table, key, klen);
        return reply_simple(cl, REPLY_OK, &deleted, 1) ? SERVE_NOMEM : SERVE_DONE;
    }
    case CMD_CHECK:
    case CMD_WAIT: {
        uint32_t wait_ms = body[0] == CMD_WAIT ? rd_u32(&r) : 0;
        uint32_t n = rd_u32(&r), missing = 0;
        if (n > MAX_KEYS) return SERVE_BAD;
        for (uint32_t i = 0; i < n && !r.bad; i++) {
            key = rd_field(&r, 1, MAX_KEY, &klen);
            if (!r.bad && !table_find(&s->table, key, klen)) missing++;
        }
        if (r.bad || r.left) return SERVE_BAD;
        if (body[0] == CMD_CHECK) {
            uint8_t present = missing == 0;
            return reply_simple(cl, REPLY_OK, &present, 1) ? SERVE_NOMEM : SERVE_DONE;
        }
        if (!missing) return reply_simple(cl, REPLY_OK, NULL, 0) ? SERVE_NOMEM : SERVE_DONE;
        if (serve_missing(cl, wait_ms, now) == SERVE_PARKED) return SERVE_PARKED;
        /* The indices of the missing keys, so the client's timeout message can name them. */
        size_t hdr;
        if (reply_begin(cl, &hdr, REPLY_NOTFOUND) || buf_u32(&cl->out, missing)) return SERVE_NOMEM;
        r = (Rd){body + 9, len - 9, 0};
        for (uint32_t i = 0; i < n; i++) {
            key = rd_field(&r, 1, MAX_KEY, &klen);
            if (!table_find(&s->table, key, klen) && buf_u32(&cl->out, i)) return SERVE_NOMEM;
        }
        reply_end(cl, hdr);
        return SERVE_DONE;
    }
    case CMD_NUM_KEYS: {
        if (r.left) return SERVE_BAD;
        size_t hdr;
        if (reply_begin(cl, &hdr, REPLY_OK) || buf_i64(&cl->out, (int64_t)s->table.count))
            return SERVE_NOMEM;
        reply_end(cl, hdr);
        return SERVE_DONE;
    }
    case CMD_BYE:
        return r.left ? SERVE_BAD : SERVE_BYE;
    }
    return SERVE_BAD;
}

/* Another live client registered as `rank`, or NULL. One whose peer has closed (a process that
 * died and is being replaced) is dropped here rather than counted. */
static Client *rank_holder(DdpcStoreServer *s, const Client *cl, int rank) {
    for (size_t i = 0; i < s->nclients; i++) {
        Client *o = s->clients[i];
        if (o == cl || o->gone || !o->authed || o->rank != rank) continue;
        char b;
        ssize_t n = recv(o->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
        if (o->eof || n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK &&
                                 errno != EINTR)) {
            client_drop(s, o, "its connection closed (found when its rank connected again)");
            continue;
        }
        return o;
    }
    return NULL;
}

/* Checks the client's answer to the greeting: magic, version and the HMAC of our nonce; then
 * that no other live client holds the rank it registers. Verdicts: 1 accepted, 0 refused (the
 * token), VERDICT_RANK_TAKEN. */
static void client_authenticate(DdpcStoreServer *s, Client *cl) {
    uint8_t mac[MAC_LEN], verdict;
    const uint8_t *a = cl->in.p;
    ddpc_hmac_sha256(s->token, s->token_len, cl->nonce, NONCE_LEN, mac);
    int ok = !memcmp(a, STORE_MAGIC, 4) && get_u32le(a + 4) == STORE_VERSION;
    ok = equal_const_time(a + 12, mac, MAC_LEN) && ok;
    int32_t rank = (int32_t)get_u32le(a + 8);
    Client *holder = ok && rank >= 0 ? rank_holder(s, cl, rank) : NULL;
    verdict = holder ? VERDICT_RANK_TAKEN : (uint8_t)ok;
    if (buf_put(&cl->out, &verdict, 1)) {
        client_drop(s, cl, "out of memory");
        return;
    }
    client_flush(s, cl);
    if (holder) {
        char why[200];
        snprintf(why, sizeof why, "it registers rank %d, which client %s holds", (int)rank,
                 holder->peer);
        /* The ranks waiting for this job's others learn it too (ddpc_group_init_failure): the
         * refused process fails, but its job's ranks would otherwise wait out their timeout. */
        static const char key[] = DDPC_STORE_REFUSED_KEY;
        char val[300];
        int vn = snprintf(val, sizeof val, "the store refused a second process claiming rank %d "
                          "(from %s; %s holds it)", (int)rank, cl->peer, holder->peer);
        if (vn > 0 && table_set(&s->table, (const uint8_t *)key, sizeof key - 1, val,
                                (size_t)DDPC_MIN(vn, (int)sizeof val - 1)) == 0)
            s->dirty = 1;
        client_drop(s, cl, why);
        return;
    }
    if (!ok) {
        DDPC_INFO("STORE", "%s: authentication failed for client %s: %s", s->where, cl->peer,
                 memcmp(a, STORE_MAGIC, 4) ? "it does not speak the ddpc store protocol"
                 : get_u32le(a + 4) != STORE_VERSION ? "it speaks another protocol version"
                 : "its token (DDPC_TOKEN) does not match this store's");
        client_drop(s, cl, "authentication failed");
        return;
    }
    cl->authed = 1;
    cl->rank = (int32_t)get_u32le(a + 8);
    if (cl->rank < 0) cl->rank = -1;
    buf_consume(&cl->in, ANSWER_LEN);
    if (cl->rank >= 0)
        DDPC_INFO("STORE", "%s: client %s authenticated as rank %d", s->where, cl->peer, cl->rank);
    else
        DDPC_INFO("STORE", "%s: client %s authenticated (no rank)", s->where, cl->peer);
}

/* Authenticates, then executes buffered requests in order, one at a time: the next only once
 * the previous reply is fully sent, so a client that does not read cannot grow our memory. */
static void client_serve(DdpcStoreServer *s, Client *cl, int64_t now) {
    if (cl->gone) return;
    if (!cl->authed) {
        if (cl->in.len >= ANSWER_LEN) client_authenticate(s, cl);
        else if (cl->eof) client_drop(s, cl, "closed the connection before authenticating");
        else if (now >= cl->auth_deadline)
            client_drop(s, cl, "it did not authenticate in time");
        if (cl->gone || !cl->authed) return;
    }
    while (!cl->gone && cl->out.len == 0 && cl->in.len >= 4) {
        uint32_t flen = get_u32le(cl->in.p);
        if (flen == 0 || flen > MAX_FRAME) {
            char why[128];
            snprintf(why, sizeof why, "malformed message: length %u (allowed 1 to %u)", flen,
                     (unsigned)MAX_FRAME);
            client_drop(s, cl, why);
            return;
        }
        if (cl->in.len < 4 + (size_t)flen) break;
        switch (serve_frame(s, cl, cl->in.p + 4, flen, now)) {
        case SERVE_PARKED:
            if (cl->eof) client_drop(s, cl, "the connection closed while it waited");
            return;
        case SERVE_BAD:
            client_drop(s, cl, "malformed request (bad command, field length or count)");
            return;
        case SERVE_NOMEM:
            client_drop(s, cl, "out of memory serving its request");
            return;
        case SERVE_BYE:
            cl->clean = 1;
            client_drop(s, cl, "it said goodbye");
            return;
        default:
            break;
        }
        cl->parked = 0;
        buf_consume(&cl->in, 4 + (size_t)flen);
        client_flush(s, cl);
    }
    if (cl->gone) return;
    if (cl->eof) client_drop(s, cl, "the connection closed");
    else if (cl->in.len >= 4 + (size_t)MAX_FRAME)
        client_drop(s, cl, "sent more than one request without waiting for the replies");
}

static void server_accept(DdpcStoreServer *s, int64_t now) {
    for (;;) {
        struct sockaddr_storage addr;
        socklen_t alen = sizeof addr;
        int fd = accept4(s->listen_fd, (struct sockaddr *)&addr, &alen,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            /* Out of descriptors or memory: retry later instead of spinning on a ready socket. */
            ddpc_log(DDPC_LOG_INFO, "STORE", "%s: accept failed: %s (retrying in 100 ms)",
                     s->where, strerror(errno));
            s->accept_paused_until = now + 100;
            return;
        }
        int one = 1;
        char fail[160] = "";
        Client *cl = calloc(1, sizeof *cl);
        if (s->nclients == s->cap) {
            size_t cap = s->cap ? s->cap * 2 : 16;
            Client **p = realloc(s->clients, cap * sizeof *p);
            if (p) {
                s->clients = p;
                s->cap = cap;
            }
        }
        if (!cl || s->nclients == s->cap)
            snprintf(fail, sizeof fail, "out of memory");
        else if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one))
            snprintf(fail, sizeof fail, "setsockopt(TCP_NODELAY) failed: %s", strerror(errno));
        else if (getrandom(cl->nonce, NONCE_LEN, 0) != NONCE_LEN)
            snprintf(fail, sizeof fail, "getrandom() for the challenge failed: %s",
                     strerror(errno));
        else if (buf_put(&cl->out, STORE_MAGIC, 4) || buf_u32(&cl->out, STORE_VERSION) ||
                 buf_put(&cl->out, cl->nonce, NONCE_LEN))
            snprintf(fail, sizeof fail, "out of memory");
        if (fail[0]) {
            ddpc_log(DDPC_LOG_INFO, "STORE", "%s: refusing a connection: %s", s->where, fail);
            close(fd);
            if (cl) buf_free(&cl->out);
            free(cl);
            continue;
        }
        cl->fd = fd;
        cl->rank = -1;
        cl->auth_deadline = now + AUTH_TIMEOUT_MS;
        fmt_addr((struct sockaddr *)&addr, cl->peer, sizeof cl->peer);
        s->clients[s->nclients++] = cl;
        DDPC_INFO("STORE", "%s: connection from %s", s->where, cl->peer);
        client_flush(s, cl);
    }
}

static int server_poll_timeout(DdpcStoreServer *s, int64_t now) {
    int64_t next = INT64_MAX;
    for (size_t i = 0; i < s->nclients; i++) {
        Client *cl = s->clients[i];
        if (!cl->authed) next = DDPC_MIN(next, cl->auth_deadline);
        if (cl->parked) next = DDPC_MIN(next, cl->park_deadline);
    }
    if (s->accept_paused_until > now) next = DDPC_MIN(next, s->accept_paused_until);
    if (next == INT64_MAX) return -1;
    return next <= now ? 0 : (int)DDPC_MIN(next - now, (int64_t)60000);
}

static void *server_main(void *arg) {
    DdpcStoreServer *s = arg;
    struct pollfd *pfd = NULL;
    size_t pcap = 0;
    while (!atomic_load(&s->stop)) {
        size_t n = 2 + s->nclients;
        if (n > pcap) {
            struct pollfd *p = realloc(pfd, n * 2 * sizeof *p);
            if (!p) {
                ddpc_log(DDPC_LOG_INFO, "STORE", "%s: out of memory for the poll set: the "
                         "store stops serving", s->where);
                break;
            }
            pfd = p;
            pcap = n * 2;
        }
        int64_t now = ddpc_now_ms();
        pfd[0] = (struct pollfd){.fd = s->wake[0], .events = POLLIN, .revents = 0};
        pfd[1] = (struct pollfd){.fd = s->accept_paused_until > now ? -1 : s->listen_fd,
                                 .events = POLLIN, .revents = 0};
        for (size_t i = 0; i < s->nclients; i++) {
            Client *cl = s->clients[i];
            short ev = (short)((cl->eof ? 0 : POLLIN) | (cl->out.len ? POLLOUT : 0));
            pfd[2 + i] = (struct pollfd){.fd = cl->fd, .events = ev, .revents = 0};
        }
        if (poll(pfd, (nfds_t)n, server_poll_timeout(s, now)) < 0) {
            if (errno == EINTR) continue;
            ddpc_log(DDPC_LOG_INFO, "STORE", "%s: poll failed: %s: the store stops serving",
                     s->where, strerror(errno));
            break;
        }
        now = ddpc_now_ms();
        if (pfd[1].revents & POLLIN) server_accept(s, now);
        for (size_t i = 0; i + 2 < n; i++) {
            Client *cl = s->clients[i];
            if (pfd[2 + i].revents & (POLLIN | POLLHUP | POLLERR)) client_read(s, cl);
            if (pfd[2 + i].revents & POLLOUT) client_flush(s, cl);
        }
        for (size_t i = 0; i < s->nclients; i++) client_serve(s, s->clients[i], now);
        /* A change may satisfy parked requests, whose replies may unblock further requests. */
        while (s->dirty) {
            s->dirty = 0;
            for (size_t i = 0; i < s->nclients; i++)
                if (s->clients[i]->parked) client_serve(s, s->clients[i], now);
        }
        size_t kept = 0;
        for (size_t i = 0; i < s->nclients; i++) {
            Client *cl = s->clients[i];
            if (cl->gone) {
                buf_free(&cl->in);
                buf_free(&cl->out);
                free(cl);
            } else {
                s->clients[kept++] = cl;
            }
        }
        s->nclients = kept;
    }
    /* Stop listening before dropping the clients: a client that reconnects once its connection
     * drops (a rank back at init_process_group) then finds the port closed and retries until the
     * next store is up, instead of landing in this one's backlog and being cut off unanswered. */
    if (s->listen_fd >= 0) close(s->listen_fd);
    s->listen_fd = -1;
    for (size_t i = 0; i < s->nclients; i++) {
        s->clients[i]->clean = 1; /* the server is going away, not the rank */
        client_drop(s, s->clients[i], "the store is stopping");
        buf_free(&s->clients[i]->in);
        buf_free(&s->clients[i]->out);
        free(s->clients[i]);
    }
    s->nclients = 0;
    free(pfd);
    return NULL;
}

static void server_free(DdpcStoreServer *s) {
    if (s->listen_fd >= 0) close(s->listen_fd);
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
    table_free(&s->table);
    free(s->clients);
    free(s->token);
    free(s);
}

/* Binds and listens on the first address of host that accepts us. */
static ddpc_status server_listen(DdpcStoreServer *s, const char *host, int port) {
    struct addrinfo hints = {0}, *res = NULL;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int gai = getaddrinfo(host, portstr, &hints, &res);
    if (gai)
        return ddpc_error(DDPC_ERR_INVALID, "store server: cannot resolve host '%s': %s (give "
                          "an address or hostname of this machine, e.g. 127.0.0.1)", host,
                          gai_strerror(gai));
    int err = 0;
    const char *call = "socket";
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        int one = 1;
        int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            err = errno;
            call = "socket";
            continue;
        }
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one))
            call = "setsockopt(SO_REUSEADDR)";
        else if (bind(fd, ai->ai_addr, ai->ai_addrlen)) call = "bind";
        else if (listen(fd, SOMAXCONN)) call = "listen";
        else {
            struct sockaddr_storage addr;
            socklen_t alen = sizeof addr;
            if (getsockname(fd, (struct sockaddr *)&addr, &alen) == 0) {
                s->listen_fd = fd;
                s->port = ntohs(addr.ss_family == AF_INET6
                                    ? ((struct sockaddr_in6 *)&addr)->sin6_port
                                    : ((struct sockaddr_in *)&addr)->sin_port);
                break;
            }
            call = "getsockname";
        }
        err = errno;
        close(fd);
    }
    freeaddrinfo(res);
    if (s->listen_fd < 0)
        return ddpc_error(DDPC_ERR_SYSTEM, "store server: %s on %s:%d failed: %s%s", call, host,
                          port, strerror(err),
                          err == EADDRINUSE ? " (another process holds this port: pick another "
                                              "MASTER_PORT, or 0 for a free one)"
                          : err == EADDRNOTAVAIL ? " (that address is not one of this machine's)"
                                                 : "");
    return DDPC_OK;
}

ddpc_status ddpc_store_server_start(const char *host, int port, const char *token,
                                    DdpcStoreServer **out) {
    if (!out) return ddpc_error(DDPC_ERR_INVALID, "ddpc_store_server_start: out is NULL");
    *out = NULL;
    if (!host || !*host) host = "127.0.0.1";
    if (port < 0 || port > 65535)
        return ddpc_error(DDPC_ERR_INVALID, "store server: port %d is out of range (expected 0 "
                          "to 65535; 0 picks a free port)", port);
    if (!token || !*token)
        return ddpc_error(DDPC_ERR_INVALID, "store server: the token is empty: the store needs "
                          "a job secret (DDPC_TOKEN) that every client must prove it knows");
    DdpcStoreServer *s = calloc(1, sizeof *s);
    if (!s) return ddpc_error(DDPC_ERR_NOMEM, "store server: out of memory");
    s->listen_fd = s->wake[0] = s->wake[1] = -1;
    s->token_len = strlen(token);
    s->token = malloc(s->token_len);
    ddpc_status st = DDPC_OK;
    if (!s->token) {
        st = ddpc_error(DDPC_ERR_NOMEM, "store server: out of memory");
        goto fail;
    }
    memcpy(s->token, token, s->token_len);
    DDPC_CHECK_GOTO(server_listen(s, host, port), st, fail);
    snprintf(s->where, sizeof s->where, "%s:%d", host, s->port);
    if (pipe2(s->wake, O_CLOEXEC | O_NONBLOCK)) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "store server: pipe2 failed: %s", strerror(errno));
        goto fail;
    }
    int rc = ddpc_thread_start(&s->thread, server_main, s, "ddpc-store", 0);
    if (rc) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "store server: pthread_create failed: %s", strerror(rc));
        goto fail;
    }
    DDPC_INFO("STORE", "serving the store on %s", s->where);
    *out = s;
    return DDPC_OK;
fail:
    server_free(s);
    return st;
}

int ddpc_store_server_port(const DdpcStoreServer *s) { return s ? s->port : -1; }

void ddpc_store_server_stop(DdpcStoreServer *s) {
    if (!s) return;
    atomic_store(&s->stop, 1);
    ssize_t n;
    do n = write(s->wake[1], "x", 1);
    while (n < 0 && errno == EINTR);
    /* A full pipe (n < 0, EAGAIN) already holds a wake-up byte, so the thread wakes anyway. */
    pthread_join(s->thread, NULL);
    DDPC_INFO("STORE", "stopped the store on %s", s->where);
    server_free(s);
}

/* ---------------------------------------------------------------- client */

struct DdpcStore {
    int fd;
    pthread_mutex_t mu;       /* one request/response at a time: threads share the connection */
    char host[256];
    int port;
    int rank;
    int64_t io_timeout_ms;    /* how long a reply may take beyond its server-side wait */
    int broken;               /* lost, or out of step after a failed exchange */
    ddpc_status broken_st;
    char broken_msg[1024];
    int unacked;              /* sets posted without waiting whose replies are still unread */
};

/* Posted sets (ddpc_store_set_posted): at most this many replies left unread, each for a value of
 * at most POSTED_MAX_VALUE bytes, so the server's input never holds more than one frame's worth
 * and our socket buffers hold the replies. */
#define MAX_UNACKED 32
#define POSTED_MAX_VALUE 4096u

enum { IO_OK, IO_CLOSED, IO_TIMEOUT, IO_INTERRUPTED, IO_FAILED };

/* Sends or receives exactly n bytes on a non-blocking socket, until deadline. Ctrl-C is only
 * honoured after interrupt_after, so an ordinary exchange is never cut in half. */
static int io_exact(int fd, int sending, void *p, size_t n, int64_t deadline,
                    int64_t interrupt_after, int *err) {
    uint8_t *b = p;
    while (n > 0) {
        ssize_t k = sending ? send(fd, b, n, MSG_NOSIGNAL) : recv(fd, b, n, 0);
        if (k > 0) {
            b += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0) return IO_CLOSED;
        if (errno == EINTR) continue;
        if (errno == ECONNRESET || errno == EPIPE) return IO_CLOSED;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            *err = errno;
            return IO_FAILED;
        }
        struct pollfd pfd = {fd, sending ? POLLOUT : POLLIN, 0};
        int64_t ms = ddpc_slice(deadline, DDPC_SLICE_MS);
        if (poll(&pfd, 1, (int)ms) < 0 && errno != EINTR) {
            *err = errno;
            return IO_FAILED;
        }
        int64_t now = ddpc_now_ms();
        if (!pfd.revents && now >= deadline) return IO_TIMEOUT;
        if (!pfd.revents && now >= interrupt_after && ddpc_check_interrupt() != DDPC_OK)
            return IO_INTERRUPTED;
    }
    return IO_OK;
}

static const char *cmd_name(uint8_t cmd) {
    static const char *names[] = {"?", "set", "get", "add", "compare_set", "delete_key",
                                  "check", "wait", "num_keys", "close"};
    return cmd < sizeof names / sizeof *names ? names[cmd] : "?";
}

/* Remembers why the connection is unusable; later calls report the same. Returns st. */
static ddpc_status client_break(DdpcStore *c, ddpc_status st) {
    c->broken = 1;
    c->broken_st = st;
    snprintf(c->broken_msg, sizeof c->broken_msg, "%s", ddpc_last_error());
    return st;
}

static ddpc_status lost_connection(DdpcStore *c, const char *op) {
    return ddpc_error(DDPC_ERR_PEER, "store %s: lost the connection to the rendezvous store at "
                      "%s:%d: rank 0, which serves it, probably exited (look at rank 0's output "
                      "for its error)", op, c->host, c->port);
}

/* What a failed exchange (io, an IO_ code other than IO_OK, with errno err) means for the
 * connection, as the error of operation op that waited up to waited_s for its reply. */
static ddpc_status io_failure(DdpcStore *c, int io, int err, const char *op, double waited_s) {
    switch (io) {
    case IO_CLOSED:
        return client_break(c, lost_connection(c, op));
    case IO_TIMEOUT:
        return client_break(c, ddpc_error(DDPC_ERR_TIMEOUT, "store %s: no reply from the "
                                          "rendezvous store at %s:%d within %.1f s: rank 0, which "
                                          "serves it, may be hung or overloaded", op, c->host,
                                          c->port, waited_s));
    case IO_INTERRUPTED:
        /* The reply may still come, so the connection is out of step: later calls say so, and
         * this one reports the interrupt itself. */
        c->broken = 1;
        c->broken_st = DDPC_ERR_PEER;
        snprintf(c->broken_msg, sizeof c->broken_msg, "store: the connection to %s:%d was "
                 "abandoned in the middle of a %s (interrupted); connect a new Store", c->host,
                 c->port, op);
        return DDPC_ERR_INTERRUPTED;
    default:
        return client_break(c, ddpc_error(DDPC_ERR_SYSTEM, "store %s: socket I/O with %s:%d "
                                          "failed: %s", op, c->host, c->port, strerror(err)));
    }
}

/* Reads one reply frame into resp (its length checked). Returns an IO_ code; a bad length or no
 * memory breaks the connection and sets *st. */
static int recv_reply(DdpcStore *c, Buf *resp, int64_t deadline, int64_t interrupt_after,
                      int *err, const char *op, ddpc_status *st) {
    uint8_t hdr[4];
    resp->len = 0;
    int io = io_exact(c->fd, 0, hdr, 4, deadline, interrupt_after, err);
    if (io != IO_OK) return io;
    uint32_t len = get_u32le(hdr);
    if (len == 0 || len > MAX_FRAME) {
        *st = client_break(c, ddpc_error(DDPC_ERR_PROTOCOL, "store %s: the store at %s:%d sent a "
                                         "reply of %u bytes (allowed 1 to %u): is it a ddpc "
                                         "store of the same version?", op, c->host, c->port, len,
                                         (unsigned)MAX_FRAME));
        return IO_FAILED;
    }
    if (buf_reserve(resp, len)) {
        *st = client_break(c, ddpc_error(DDPC_ERR_NOMEM, "store %s: out of memory for a reply of "
                                         "%u bytes", op, len));
        return IO_FAILED;
    }
    io = io_exact(c->fd, 0, resp->p, len, deadline, interrupt_after, err);
    if (io == IO_OK) resp->len = len;
    return io;
}

/* Reads the replies of the sets posted without waiting (their requests went out before the one
 * being answered now, and the server answers in order). A refused one fails the call that reads
 * it: the caller learns of it at its next store call. */
static int recv_acks(DdpcStore *c, int64_t deadline, int64_t interrupt_after, int *err,
                     ddpc_status *st) {
    Buf ack = {0};
    int io = IO_OK;
    while (c->unacked > 0) {
        io = recv_reply(c, &ack, deadline, interrupt_after, err, "set (posted)", st);
        if (io != IO_OK) break;
        c->unacked--;
        if (ack.p[0] != REPLY_OK && *st == DDPC_OK)
            *st = ddpc_error(DDPC_ERR_INVALID, "store set (posted earlier, not waited for): the "
                             "store at %s:%d refused it (reply status %d: %.*s)", c->host, c->port,
                             ack.p[0], (int)DDPC_MIN(ack.len - 1, (size_t)400),
                             (const char *)ack.p + 1);
    }
    buf_free(&ack);
    return io;
}

/* One request/response. req holds the frame with 4 bytes reserved for its length; the reply
 * (status byte first) lands in resp. wait_ms is how long the server may hold the request. */
static ddpc_status store_rpc(DdpcStore *c, Buf *req, int64_t wait_ms, Buf *resp) {
    const char *op = cmd_name(req->p[4]);
    ddpc_status st = DDPC_OK;
    int err = 0, io;
    put_u32le(req->p, (uint32_t)(req->len - 4));
    resp->len = 0;
    DDPC_PTHREADCHECK(pthread_mutex_lock(&c->mu), "pthread_mutex_lock(store)");
    if (c->broken) {
        st = ddpc_error(c->broken_st, "%s", c->broken_msg);
        goto out;
    }
    int64_t now = ddpc_now_ms();
    int64_t deadline = c->io_timeout_ms < 0 ? INT64_MAX : now + wait_ms + c->io_timeout_ms;
    int64_t interrupt_after = now + wait_ms + 1000;
    io = io_exact(c->fd, 1, req->p, req->len, deadline, interrupt_after, &err);
    if (io == IO_OK) io = recv_acks(c, deadline, interrupt_after, &err, &st);
    if (io == IO_OK) {
        ddpc_status ack_st = st;
        st = DDPC_OK;
        io = recv_reply(c, resp, deadline, interrupt_after, &err, op, &st);
        if (io == IO_OK && ack_st != DDPC_OK) {
            /* (this request was answered; the error is an earlier posted set's) */
            st = ack_st;
            goto out;
        }
    }
    if (st != DDPC_OK) goto out; /* recv_reply broke the connection and said why */
    if (io != IO_OK) st = io_failure(c, io, err, op, (double)(wait_ms + c->io_timeout_ms) / 1e3);
out:
    pthread_mutex_unlock(&c->mu);
    return st;
}

static ddpc_status check_key(const char *op, const char *key) {
    if (!key) return ddpc_error(DDPC_ERR_INVALID, "store %s: key is NULL", op);
    size_t n = strlen(key);
    if (n == 0 || n > MAX_KEY)
        return ddpc_error(DDPC_ERR_INVALID, "store %s: key of %zu bytes (expected 1 to %u "
                          "bytes)", op, n, MAX_KEY);
    return DDPC_OK;
}

static ddpc_status check_value(const char *op, const char *key, const void *val, size_t len) {
    if (len > MAX_VALUE)
        return ddpc_error(DDPC_ERR_INVALID, "store %s: the value for key '%s' has %zu bytes, "
                          "more than the store's limit of %u MiB: the store is for small "
                          "rendezvous data", op, key, len, MAX_VALUE >> 20);
    if (len && !val)
        return ddpc_error(DDPC_ERR_INVALID, "store %s: value is NULL but its length is %zu", op,
                          len);
    return DDPC_OK;
}

/* Starts a request frame: 4 bytes for the length (filled by store_rpc), then the command. */
static ddpc_status req_begin(Buf *b, uint8_t cmd) {
    if (buf_u32(b, 0) || buf_u8(b, cmd))
        return ddpc_error(DDPC_ERR_NOMEM, "store %s: out of memory", cmd_name(cmd));
    return DDPC_OK;
}

static ddpc_status req_done(Buf *b, int failed) {
    if (failed)
        return ddpc_error(DDPC_ERR_NOMEM, "store %s: out of memory", cmd_name(b->p[4]));
    if (b->len - 4 > MAX_FRAME)
        return ddpc_error(DDPC_ERR_INVALID, "store %s: the request has %zu bytes, more than the "
                          "store's limit of %u", cmd_name(b->p[4]), b->len - 4, MAX_FRAME);
    return DDPC_OK;
}

/* Maps a reply status other than OK to an error (NOTFOUND is left to the caller). */
static ddpc_status reply_status(DdpcStore *c, const Buf *resp, const char *op, const char *key) {
    switch (resp->p[0]) {
    case REPLY_OK:
    case REPLY_NOTFOUND:
        return DDPC_OK;
    case REPLY_INVALID:
        return ddpc_error(DDPC_ERR_INVALID, "store %s on key '%s': %.*s", op, key ? key : "",
                          (int)DDPC_MIN(resp->len - 1, (size_t)400), (const char *)resp->p + 1);
    case REPLY_NOMEM:
        return ddpc_error(DDPC_ERR_NOMEM, "store %s: the store at %s:%d is out of memory", op,
                          c->host, c->port);
    }
    return client_break(c, ddpc_error(DDPC_ERR_PROTOCOL, "store %s: unknown reply status %d from "
                                      "%s:%d", op, resp->p[0], c->host, c->port));
}

static ddpc_status expect_len(DdpcStore *c, const Buf *resp, size_t n, const char *op) {
    if (resp->len == n) return DDPC_OK;
    return client_break(c, ddpc_error(DDPC_ERR_PROTOCOL, "store %s: a reply of %zu bytes from "
                                      "%s:%d, expected %zu", op, resp->len, c->host, c->port, n));
}

/* One round trip of a command: an error status in the reply becomes the matching error (naming
 * key, which may be NULL). On DDPC_OK resp->p[0] is REPLY_OK or REPLY_NOTFOUND and, when
 * reply_len is not 0, the reply is exactly reply_len bytes long. */
static ddpc_status store_call(DdpcStore *c, Buf *req, int64_t wait_ms, const char *key,
                              size_t reply_len, Buf *resp) {
    const char *op = cmd_name(req->p[4]);
    DDPC_CHECK(store_rpc(c, req, wait_ms, resp));
    DDPC_CHECK(reply_status(c, resp, op, key));
    return reply_len ? expect_len(c, resp, reply_len, op) : DDPC_OK;
}

/* Hands the reply buffer over as a value, without its status byte. */
static void reply_take_value(Buf *resp, void **val, size_t *len) {
    *len = resp->len - 1;
    memmove(resp->p, resp->p + 1, *len);
    *val = resp->p;
    resp->p = NULL;
}

static int64_t get_i64le(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return (int64_t)v;
}

/* Opens a TCP connection to host:port, retrying while nobody listens yet (rank 0 may start
 * after us), until the deadline. */
static ddpc_status client_dial(DdpcStore *c, int64_t deadline, int64_t timeout_ms) {
    char portstr[16];
    int64_t pause = 20;
    const char *last = "no attempt finished";
    snprintf(portstr, sizeof portstr, "%d", c->port);
    for (;;) {
        struct addrinfo hints = {0}, *res = NULL;
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_NUMERICSERV;
        int gai = getaddrinfo(c->host, portstr, &hints, &res);
        if (gai && gai != EAI_AGAIN)
            return ddpc_error(DDPC_ERR_INVALID, "store: cannot resolve the store's host '%s': %s "
                              "(check MASTER_ADDR)", c->host, gai_strerror(gai));
        if (gai) last = gai_strerror(gai);
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
            if (fd < 0) {
                last = strerror(errno);
                continue;
            }
            int rc = connect(fd, ai->ai_addr, ai->ai_addrlen), err = rc ? errno : 0;
            while (err == EINPROGRESS || err == EINTR) {
                struct pollfd pfd = {fd, POLLOUT, 0};
                int pr = poll(&pfd, 1, (int)ddpc_slice(deadline, DDPC_SLICE_MS));
                if (pr < 0 && errno != EINTR) {
                    err = errno;
                } else if (pr > 0) {
                    socklen_t len = sizeof err;
                    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len)) err = errno;
                } else if (ddpc_now_ms() >= deadline) {
                    err = ETIMEDOUT;
                } else if (ddpc_check_interrupt() != DDPC_OK) {
                    close(fd);
                    freeaddrinfo(res);
                    return DDPC_ERR_INTERRUPTED;
                }
            }
            if (!err) {
                c->fd = fd;
                freeaddrinfo(res);
                DDPC_INFO("STORE", "connected to the store at %s:%d", c->host, c->port);
                return DDPC_OK;
            }
            last = strerror(err);
            close(fd);
        }
        if (res) freeaddrinfo(res);
        if (ddpc_now_ms() >= deadline) break;
        DDPC_CHECK(ddpc_check_interrupt());
        /* Back off up to half a second: quick when rank 0 is just starting, quiet if it is not. */
        poll(NULL, 0, (int)DDPC_MIN(pause, ddpc_slice(deadline, DDPC_SLICE_MS * 5)));
        pause = DDPC_MIN(pause * 2, (int64_t)500);
    }
    return ddpc_error(DDPC_ERR_TIMEOUT, "store: could not connect to the rendezvous store at "
                      "%s:%d within %.1f s (last error: %s). Rank 0 serves it: check that rank 0 "
                      "is running and got as far as init_process_group, that MASTER_ADDR:"
                      "MASTER_PORT (%s:%d) name rank 0's host and port, and that no firewall "
                      "blocks that port", c->host, c->port, (double)timeout_ms / 1e3, last,
                      c->host, c->port);
}

/* Answers the server's challenge and reads its verdict. */
static ddpc_status client_handshake(DdpcStore *c, const char *token, int64_t deadline) {
    uint8_t greet[GREETING_LEN], answer[ANSWER_LEN], verdict = 0;
    int err = 0, one = 1;
    DDPC_SYSCHECK(setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one),
                  "setsockopt(TCP_NODELAY) on the store connection");
    int io = io_exact(c->fd, 0, greet, sizeof greet, deadline, 0, &err);
    if (io == IO_CLOSED)
        return ddpc_error(DDPC_ERR_PROTOCOL, "store: %s:%d closed the connection without the "
                          "ddpc store greeting: it is not this job's store (check MASTER_PORT), "
                          "or the store is shutting down", c->host, c->port);
    if (io == IO_TIMEOUT)
        return ddpc_error(DDPC_ERR_TIMEOUT, "store: connected to %s:%d but got no ddpc store "
                          "greeting: another program may listen on that port (check MASTER_PORT)",
                          c->host, c->port);
    if (io == IO_INTERRUPTED) return DDPC_ERR_INTERRUPTED;
    if (io != IO_OK)
        return ddpc_error(DDPC_ERR_SYSTEM, "store: reading the greeting of %s:%d failed: %s",
                          c->host, c->port, strerror(err));
    if (memcmp(greet, STORE_MAGIC, 4))
        return ddpc_error(DDPC_ERR_PROTOCOL, "store: %s:%d is not a ddpc rendezvous store (its "
                          "greeting is wrong): check MASTER_ADDR and MASTER_PORT", c->host,
                          c->port);
    if (get_u32le(greet + 4) != STORE_VERSION)
        return ddpc_error(DDPC_ERR_PROTOCOL, "store: the store at %s:%d speaks protocol version "
                          "%u, this ddpc speaks %u: run the same ddpc version on every rank",
                          c->host, c->port, get_u32le(greet + 4), STORE_VERSION);
    memcpy(answer, STORE_MAGIC, 4);
    put_u32le(answer + 4, STORE_VERSION);
    put_u32le(answer + 8, (uint32_t)(int32_t)c->rank);
    ddpc_hmac_sha256(token, strlen(token), greet + 8, NONCE_LEN, answer + 12);
    io = io_exact(c->fd, 1, answer, sizeof answer, deadline, 0, &err);
    if (io == IO_OK) io = io_exact(c->fd, 0, &verdict, 1, deadline, 0, &err);
    if (io == IO_INTERRUPTED) return DDPC_ERR_INTERRUPTED;
    if (io == IO_TIMEOUT)
        return ddpc_error(DDPC_ERR_TIMEOUT, "store: the store at %s:%d did not answer our "
                          "authentication in time: rank 0 may be hung or overloaded", c->host,
                          c->port);
    if (io == IO_FAILED)
        return ddpc_error(DDPC_ERR_SYSTEM, "store: authenticating with %s:%d failed: %s", c->host,
                          c->port, strerror(err));
    if (io == IO_CLOSED || verdict == 0)
        return ddpc_error(DDPC_ERR_AUTH, "store: the rendezvous store at %s:%d refused this "
                          "process: its token (DDPC_TOKEN%s) does not match this job's store. "
                          "Give every rank the same DDPC_TOKEN (ddpc.launch does it for you; when "
                          "you start ranks yourself, export one value to all of them), and check "
                          "that MASTER_ADDR:MASTER_PORT is this job's store, not another job's",
                          c->host, c->port, *token ? "" : ", empty here");
    if (verdict == VERDICT_RANK_TAKEN)
        return ddpc_error(DDPC_ERR_MISMATCH, "store: the rendezvous store at %s:%d already has a "
                          "process registered as rank %d: two processes claim rank %d. Give each "
                          "process of the job its own RANK (0 to WORLD_SIZE-1), and each job its "
                          "own MASTER_PORT (a process of another job on this port, with the same "
                          "DDPC_TOKEN, joins this one). With ddpc.launch --nnodes, each node must "
                          "run the same --nproc-per-node and its own --node-rank", c->host,
                          c->port, c->rank, c->rank);
    if (verdict != 1)
        return ddpc_error(DDPC_ERR_PROTOCOL, "store: unexpected verdict %d from %s:%d", verdict,
                          c->host, c->port);
    return DDPC_OK;
}

ddpc_status ddpc_store_connect(const char *host, int port, const char *token, int rank,
                               int64_t timeout_ms, DdpcStore **out) {
    if (!out) return ddpc_error(DDPC_ERR_INVALID, "ddpc_store_connect: out is NULL");
    *out = NULL;
    if (!host || !*host) host = "127.0.0.1";
    if (port <= 0 || port > 65535)
        return ddpc_error(DDPC_ERR_INVALID, "store: port %d is out of range (expected 1 to "
                          "65535: the port rank 0 serves the store on, MASTER_PORT)", port);
    if (strlen(host) >= sizeof ((DdpcStore *)0)->host)
        return ddpc_error(DDPC_ERR_INVALID, "store: host name of %zu characters is too long",
                          strlen(host));
    DdpcStore *c = calloc(1, sizeof *c);
    if (!c) return ddpc_error(DDPC_ERR_NOMEM, "store: out of memory");
    c->fd = -1;
    snprintf(c->host, sizeof c->host, "%s", host);
    c->port = port;
    c->rank = rank < 0 ? -1 : rank;
    /* Replies get at least a second: a short connect timeout must not make every request fail. */
    c->io_timeout_ms = timeout_ms < 0 ? -1 : DDPC_MAX(timeout_ms, (int64_t)1000);
    int rc = pthread_mutex_init(&c->mu, NULL);
    if (rc) {
        free(c);
        return ddpc_error(DDPC_ERR_SYSTEM, "store: pthread_mutex_init failed: %s", strerror(rc));
    }
    int64_t deadline = ddpc_deadline(timeout_ms);
    ddpc_status st;
    DDPC_CHECK_GOTO(client_dial(c, deadline, timeout_ms), st, fail);
    /* The handshake gets at least a second even when dialing used up most of the timeout. */
    deadline = DDPC_MAX(deadline, ddpc_now_ms() + 1000);
    DDPC_CHECK_GOTO(client_handshake(c, token ? token : "", deadline), st, fail);
    DDPC_INFO("STORE", "authenticated with the store at %s:%d%s", c->host, c->port,
              c->rank >= 0 ? " (registered this rank)" : "");
    *out = c;
    return DDPC_OK;
fail:
    if (c->fd >= 0) close(c->fd);
    pthread_mutex_destroy(&c->mu);
    free(c);
    return st;
}

/* Says goodbye (so the server does not report this rank dead) and waits briefly for the server
 * to close its side, which tells us it has processed the goodbye. */
void ddpc_store_close(DdpcStore *c) {
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    if (!c->broken) {
        uint8_t bye[5], sink[64];
        int err = 0;
        put_u32le(bye, 1);
        bye[4] = CMD_BYE;
        int64_t deadline = ddpc_deadline(1000);
        if (io_exact(c->fd, 1, bye, sizeof bye, deadline, INT64_MAX, &err) == IO_OK &&
            shutdown(c->fd, SHUT_WR) == 0) {
            while (io_exact(c->fd, 0, sink, 1, deadline, INT64_MAX, &err) == IO_OK) {}
        }
    }
    close(c->fd);
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_destroy(&c->mu);
    DDPC_INFO("STORE", "closed the connection to the store at %s:%d", c->host, c->port);
    free(c);
}

ddpc_status ddpc_store_set(DdpcStore *c, const char *key, const void *val, size_t len) {
    if (!c) return ddpc_error(DDPC_ERR_INVALID, "store set: the store is NULL");
    DDPC_CHECK(check_key("set", key));
    DDPC_CHECK(check_value("set", key, val, len));
    Buf req = {0}, resp = {0};
    ddpc_status st;
    DDPC_CHECK_GOTO(req_begin(&req, CMD_SET), st, out);
    DDPC_CHECK_GOTO(req_done(&req, buf_field(&req, key, strlen(key)) || buf_field(&req, val, len)),
                    st, out);
    st = store_call(c, &req, 0, key, 1, &resp);
out:
    buf_free(&req);
    buf_free(&resp);
    return st;
}

ddpc_status ddpc_store_set_posted(DdpcStore *c, const char *key, const void *val, size_t len) {
    if (!c) return ddpc_error(DDPC_ERR_INVALID, "store set_posted: the store is NULL");
    DDPC_CHECK(check_key("set_posted", key));
    DDPC_CHECK(check_value("set_posted", key, val, len));
    if (len > POSTED_MAX_VALUE)
        return ddpc_error(DDPC_ERR_INVALID, "store set_posted: the value for key '%s' has %zu "
                          "bytes; a set that is not waited for takes at most %u (use set)", key,
                          len, POSTED_MAX_VALUE);
    Buf req = {0};
    ddpc_status st = DDPC_OK;
    DDPC_CHECK_GOTO(req_begin(&req, CMD_SET), st, done);
    DDPC_CHECK_GOTO(req_done(&req, buf_field(&req, key, strlen(key)) || buf_field(&req, val, len)),
                    st, done);
    put_u32le(req.p, (uint32_t)(req.len - 4));
    int rc = pthread_mutex_lock(&c->mu);
    if (rc) {
        st = ddpc_error(DDPC_ERR_SYSTEM, "pthread_mutex_lock(store) failed: %s", strerror(rc));
        goto done;
    }
    if (c->broken) {
        st = ddpc_error(c->broken_st, "%s", c->broken_msg);
        goto out;
    }
    int err = 0, io;
    int64_t now = ddpc_now_ms();
    int64_t deadline = c->io_timeout_ms < 0 ? INT64_MAX : now + c->io_timeout_ms;
    io = IO_OK;
    if (c->unacked >= MAX_UNACKED) io = recv_acks(c, deadline, now + 1000, &err, &st);
    if (st != DDPC_OK) goto out; /* an earlier posted set was refused, or a reply was bad */
    if (io == IO_OK) io = io_exact(c->fd, 1, req.p, req.len, deadline, now + 1000, &err);
    if (io == IO_OK) c->unacked++;
    else st = io_failure(c, io, err, "set_posted", (double)c->io_timeout_ms / 1e3);
out:
    pthread_mutex_unlock(&c->mu);
done:
    buf_free(&req);
    return st;
}

ddpc_status ddpc_store_get(DdpcStore *c, const char *key, int64_t timeout_ms, void **val,
                           size_t *len) {
    if (!c || !val || !len) return ddpc_error(DDPC_ERR_INVALID, "store get: NULL argument");
    DDPC_CHECK(check_key("get", key));
    *val = NULL;
    *len = 0;
    Buf req = {0}, resp = {0};
    ddpc_status st;
    int64_t start = ddpc_now_ms(), deadline = ddpc_deadline(timeout_ms);
    for (;;) {
        int64_t slice = ddpc_slice(deadline, DDPC_SLICE_MS);
        req.len = 0;
        DDPC_CHECK_GOTO(req_begin(&req, CMD_GET), st, out);
        DDPC_CHECK_GOTO(req_done(&req, buf_u32(&req, (uint32_t)slice) ||
                                           buf_field(&req, key, strlen(key))), st, out);
        DDPC_CHECK_GOTO(store_call(c, &req, slice, key, 0, &resp), st, out);
        if (resp.p[0] == REPLY_OK) break;
        if (timeout_ms == 0) {
            st = ddpc_error(DDPC_ERR_NOTFOUND, "store get: key '%s' is not in the store", key);
            goto out;
        }
        int64_t now = ddpc_now_ms();
        if (now >= deadline) {
            st = ddpc_error(DDPC_ERR_TIMEOUT, "store get: timed out after %.1f s waiting for key "
                            "'%s' in the rendezvous store at %s:%d: no rank has set it (is the "
                            "rank that should set it alive and at the same point of the program?)",
                            (double)(now - start) / 1e3, key, c->host, c->port);
            goto out;
        }
        DDPC_CHECK_GOTO(ddpc_check_interrupt(), st, out);
    }
    reply_take_value(&resp, val, len);
    st = DDPC_OK;
out:
    buf_free(&req);
    buf_free(&resp);
    return st;
}

ddpc_status ddpc_store_add(DdpcStore *c, const char *key, int64_t delta, int64_t *out_value) {
    if (!c || !out_value) return ddpc_error(DDPC_ERR_INVALID, "store add: NULL argument");
    DDPC_CHECK(check_key("add", key));
    Buf req = {0}, resp = {0};
    ddpc_status st;
    DDPC_CHECK_GOTO(req_begin(&req, CMD_ADD), st, out);
    DDPC_CHECK_GOTO(req_done(&req, buf_i64(&req, delta) || buf_field(&req, key, strlen(key))), st,
                    out);
    DDPC_CHECK_GOTO(store_call(c, &req, 0, key, 9, &resp), st, out);
    *out_value = get_i64le(resp.p + 1);
out:
    buf_free(&req);
    buf_free(&resp);
    return st;
}

ddpc_status ddpc_store_cas(DdpcStore *c, const char *key, const void *expected, size_t expected_len,
                           const void *desired, size_t desired_len, void **cur, size_t *cur_len) {
    if (!c || !cur || !cur_len)
        return ddpc_error(DDPC_ERR_INVALID, "store compare_set: NULL argument");
    DDPC_CHECK(check_key("compare_set", key));
    DDPC_CHECK(check_value("compare_set", key, expected, expected_len));
    DDPC_CHECK(check_value("compare_set", key, desired, desired_len));
    *cur = NULL;
    *cur_len = 0;
    Buf req = {0}, resp = {0};
    ddpc_status st;
    DDPC_CHECK_GOTO(req_begin(&req, CMD_CAS), st, out);
    DDPC_CHECK_GOTO(req_done(&req, buf_field(&req, key, strlen(key)) ||
                                       buf_field(&req, expected, expected_len) ||
                                       buf_field(&req, desired, desired_len)), st, out);
    DDPC_CHECK_GOTO(store_call(c, &req, 0, key, 0, &resp), st, out);
    reply_take_value(&resp, cur, cur_len);
out:
    buf_free(&req);
    buf_free(&resp);
    return st;
}

ddpc_status ddpc_store_delete(DdpcStore *c, const char *key, int *deleted) {
    if (!c) return ddpc_error(DDPC_ERR_INVALID, "store delete_key: the store is NULL");
    DDPC_CHECK(check_key("delete_key", key));
    Buf req = {0}, resp = {0};
    ddpc_status st;
    DDPC_CHECK_GOTO(req_begin(&req, CMD_DELETE), st, out);
    DDPC_CHECK_GOTO(req_done(&req, buf_field(&req, key, strlen(key))), st, out);
    DDPC_CHECK_GOTO(store_call(c, &req, 0, key, 2, &resp), st, out);
    if (deleted) *deleted = resp.p[1];
out:
    buf_free(&req);
    buf_free(&resp);
    return st;
}

/* Builds a CHECK or WAIT frame for the key list. */
static ddpc_status req_keys(Buf *req, uint8_t cmd, const char *const *keys, int nkeys,
                            int64_t wait_ms) {
    const char *op = cmd_name(cmd);
    if (nkeys < 0 || (unsigned)nkeys > MAX_KEYS || (nkeys > 0 && !keys))
        return ddpc_error(DDPC_ERR_INVALID, "store %s: %d keys (expected 0 to %u and a key "
                          "array)", op, nkeys, MAX_KEYS);
    for (int i = 0; i < nkeys; i++) DDPC_CHECK(check_key(op, keys[i]));
    req->len = 0;
    DDPC_CHECK(req_begin(req, cmd));
    int failed = (cmd == CMD_WAIT && buf_u32(req, (uint32_t)wait_ms)) ||
                 buf_u32(req, (uint32_t)nkeys);
    for (int i = 0; i < nkeys && !failed; i++) failed = buf_field(req, keys[i], strlen(keys[i]));
    return req_done(req, failed);
}

ddpc_status ddpc_store_check(DdpcStore *c, const char *const *keys, int nkeys, int *present) {
    if (!c || !present) return ddpc_error(DDPC_ERR_INVALID, "store check: NULL argument");
    Buf req = {0}, resp = {0};
    ddpc_status st;
    DDPC_CHECK_GOTO(req_keys(&req, CMD_CHECK, keys, nkeys, 0), st, out);
    DDPC_CHECK_GOTO(store_call(c, &req, 0, NULL, 2, &resp), st, out);
    *present = resp.p[1];
out:
    buf_free(&req);
    buf_free(&resp);
    return st;
}

/* The timeout message of wait: which keys are still missing (the first few), from the reply. */
static ddpc_status wait_timeout(DdpcStore *c, const char *const *keys, int nkeys, const Buf *resp,
                                int64_t elapsed_ms) {
    char names[1200];
    size_t used = 0;
    uint32_t missing = resp->len >= 5 ? get_u32le(resp->p + 1) : 0, shown = 0;
    names[0] = '\0';
    for (uint32_t i = 0; i < missing && shown < 8 && 5 + 4 * (size_t)(i + 1) <= resp->len; i++) {
        uint32_t k = get_u32le(resp->p + 5 + 4 * (size_t)i);
        if (k >= (uint32_t)nkeys) continue;
        int n = snprintf(names + used, sizeof names - used, "%s'%.200s'", shown ? ", " : "",
                         keys[k]);
        if (n < 0 || (size_t)n >= sizeof names - used) break;
        used += (size_t)n;
        shown++;
    }
    if (shown < missing && shown > 0 && used + 30 < sizeof names)
        snprintf(names + used, sizeof names - used, " and %u more", missing - shown);
    return ddpc_error(DDPC_ERR_TIMEOUT, "store wait: timed out after %.1f s waiting for %u of %d "
                      "keys in the rendezvous store at %s:%d; still missing: %s",
                      (double)elapsed_ms / 1e3, missing, nkeys, c->host, c->port, names);
}

ddpc_status ddpc_store_wait(DdpcStore *c, const char *const *keys, int nkeys, int64_t timeout_ms) {
    if (!c) return ddpc_error(DDPC_ERR_INVALID, "store wait: the store is NULL");
    Buf req = {0}, resp = {0};
    ddpc_status st;
    int64_t start = ddpc_now_ms(), deadline = ddpc_deadline(timeout_ms);
    for (;;) {
        int64_t slice = ddpc_slice(deadline, DDPC_SLICE_MS);
        DDPC_CHECK_GOTO(req_keys(&req, CMD_WAIT, keys, nkeys, slice), st, out);
        DDPC_CHECK_GOTO(store_call(c, &req, slice, NULL, 0, &resp), st, out);
        if (resp.p[0] == REPLY_OK) break;
        int64_t now = ddpc_now_ms();
        if (now >= deadline) {
            st = wait_timeout(c, keys, nkeys, &resp, now - start);
            goto out;
        }
        DDPC_CHECK_GOTO(ddpc_check_interrupt(), st, out);
    }
out:
    buf_free(&req);
    buf_free(&resp);
    return st;
}

ddpc_status ddpc_store_num_keys(DdpcStore *c, int64_t *out_count) {
    if (!c || !out_count) return ddpc_error(DDPC_ERR_INVALID, "store num_keys: NULL argument");
    Buf req = {0}, resp = {0};
    ddpc_status st;
    DDPC_CHECK_GOTO(req_begin(&req, CMD_NUM_KEYS), st, out);
    DDPC_CHECK_GOTO(store_call(c, &req, 0, NULL, 9, &resp), st, out);
    *out_count = get_i64le(resp.p + 1);
out:
    buf_free(&req);
    buf_free(&resp);
    return st;
}
