/* test_store.c: unit test of the rendezvous store (csrc/store.c) without Python: SHA-256 and
 * HMAC test vectors, an in-process server with client threads exercising every command, waits,
 * timeouts, a wrong token, rank death detection and a server that goes away. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common.h"
#include "check.h"

static const char *TOKEN = "job-secret-123";

static void hex(const uint8_t *d, size_t n, char *out) {
    for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", d[i]);
}

static size_t unhex(const char *h, uint8_t *out) {
    size_t n = strlen(h) / 2;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        sscanf(h + 2 * i, "%2x", &v);
        out[i] = (uint8_t)v;
    }
    return n;
}

static void test_sha256(void) {
    struct { const char *msg; const char *digest; } v[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
        {"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqr"
         "lmnopqrsmnopqrstnopqrstu",
         "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
    };
    uint8_t d[32];
    char h[65];
    for (size_t i = 0; i < sizeof v / sizeof *v; i++) {
        ddpc_sha256(v[i].msg, strlen(v[i].msg), d);
        hex(d, 32, h);
        EXPECT(!strcmp(h, v[i].digest), "sha256('%s') = %s, expected %s", v[i].msg, h,
               v[i].digest);
    }
    /* One million 'a': many blocks, and the 55/56/64-byte padding edges along the way. */
    char *a = malloc(1000000);
    memset(a, 'a', 1000000);
    ddpc_sha256(a, 1000000, d);
    hex(d, 32, h);
    EXPECT(!strcmp(h, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
           "sha256(1e6 x 'a') = %s", h);
    free(a);
}

static void test_hmac(void) {
    /* RFC 4231 test cases 1, 2, 3, 4, 6 and 7 (keys and messages in hex). */
    struct { const char *key, *msg, *mac; } v[] = {
        {"0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b", "4869205468657265",
         "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
        {"4a656665", "7768617420646f2079612077616e7420666f72206e6f7468696e673f",
         "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
        {"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
         "dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd"
         "dddddddddddddd",
         "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
        {"0102030405060708090a0b0c0d0e0f10111213141516171819",
         "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd"
         "cdcdcdcdcdcdcdcd",
         "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
        {"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
         "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
         "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
         "54657374205573696e67204c6172676572205468616e20426c6f636b2d53697a65204b6579202d2048617368"
         "204b6579204669727374",
         "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
        {"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
         "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
         "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
         "5468697320697320612074657374207573696e672061206c6172676572207468616e20626c6f636b2d73697a"
         "65206b657920616e642061206c6172676572207468616e20626c6f636b2d73697a6520646174612e20546865"
         "206b6579206e6565647320746f20626520686173686564206265666f7265206265696e672075736564206279"
         "2074686520484d414320616c676f726974686d2e",
         "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
    };
    uint8_t key[200], msg[200], mac[32];
    char h[65];
    for (size_t i = 0; i < sizeof v / sizeof *v; i++) {
        size_t kn = unhex(v[i].key, key), mn = unhex(v[i].msg, msg);
        ddpc_hmac_sha256(key, kn, msg, mn, mac);
        hex(mac, 32, h);
        EXPECT(!strcmp(h, v[i].mac), "HMAC vector %zu: %s, expected %s", i, h, v[i].mac);
    }
}

typedef struct {
    DdpcStore *c;
    const char *key;
    const char *val;
    int delay_ms;
    int adds;
    ddpc_status st;
} Job;

static void *set_later(void *arg) {
    Job *j = arg;
    poll(NULL, 0, j->delay_ms);
    j->st = ddpc_store_set(j->c, j->key, j->val, strlen(j->val));
    return NULL;
}

static void *add_many(void *arg) {
    Job *j = arg;
    int64_t v;
    j->st = DDPC_OK;
    for (int i = 0; i < j->adds && j->st == DDPC_OK; i++)
        j->st = ddpc_store_add(j->c, j->key, 1, &v);
    return NULL;
}

static int has_key(DdpcStore *c, const char *key) {
    int present = -1;
    const char *keys[1] = {key};
    if (ddpc_store_check(c, keys, 1, &present) != DDPC_OK) return -1;
    return present;
}

static void test_commands(DdpcStore *c, DdpcStore *c2) {
    void *v = NULL;
    size_t n = 0;
    int64_t x = 0, before = 0, after = 0;
    const char bin[] = {'a', 0, 'b', (char)0xff};

    OK(ddpc_store_num_keys(c, &before));
    OK(ddpc_store_set(c, "bin", bin, sizeof bin));
    OK(ddpc_store_get(c2, "bin", 1000, &v, &n));
    EXPECT(n == sizeof bin && v && !memcmp(v, bin, n), "binary value came back as %zu bytes", n);
    free(v);
    OK(ddpc_store_set(c, "empty", NULL, 0));
    OK(ddpc_store_get(c, "empty", 0, &v, &n));
    EXPECT(n == 0 && v, "empty value: %zu bytes", n);
    free(v);

    OK(ddpc_store_add(c, "n", 5, &x));
    EXPECT(x == 5, "add to a missing key gave %lld", (long long)x);
    OK(ddpc_store_add(c2, "n", -2, &x));
    EXPECT(x == 3, "add -2 gave %lld", (long long)x);
    OK(ddpc_store_get(c, "n", 0, &v, &n));
    EXPECT(n == 1 && !memcmp(v, "3", 1), "counter stored as '%.*s'", (int)n, (char *)v);
    free(v);
    EXPECT(ddpc_store_add(c, "bin", 1, &x) == DDPC_ERR_INVALID, "add on a non-integer: %s",
           ddpc_last_error());
    EXPECT(strstr(ddpc_last_error(), "not an integer"), "%s", ddpc_last_error());

    /* compare_set: missing + empty expected sets; a mismatch leaves the value; a match swaps. */
    OK(ddpc_store_cas(c, "cas", NULL, 0, "one", 3, &v, &n));
    EXPECT(n == 3 && !memcmp(v, "one", 3), "cas on a missing key stored '%.*s'", (int)n, (char *)v);
    free(v);
    OK(ddpc_store_cas(c, "cas", "nope", 4, "two", 3, &v, &n));
    EXPECT(n == 3 && !memcmp(v, "one", 3), "mismatched cas returned '%.*s'", (int)n, (char *)v);
    free(v);
    OK(ddpc_store_cas(c2, "cas", "one", 3, "two", 3, &v, &n));
    EXPECT(n == 3 && !memcmp(v, "two", 3), "matching cas returned '%.*s'", (int)n, (char *)v);
    free(v);
    OK(ddpc_store_cas(c, "cas-missing", "x", 1, "y", 1, &v, &n));
    EXPECT(n == 0 && has_key(c, "cas-missing") == 0,
           "cas with a non-empty expected value created the key");
    free(v);

    int deleted = -1;
    OK(ddpc_store_delete(c, "cas", &deleted));
    EXPECT(deleted == 1, "delete of an existing key returned %d", deleted);
    OK(ddpc_store_delete(c, "cas", &deleted));
    EXPECT(deleted == 0, "second delete returned %d", deleted);
    EXPECT(has_key(c, "cas") == 0, "deleted key still present");

    const char *both[2] = {"bin", "n"}, *mixed[2] = {"bin", "missing"};
    int present = -1;
    OK(ddpc_store_check(c, both, 2, &present));
    EXPECT(present == 1, "check of two present keys: %d", present);
    OK(ddpc_store_check(c, mixed, 2, &present));
    EXPECT(present == 0, "check with a missing key: %d", present);
    OK(ddpc_store_wait(c, both, 2, 1000));

    OK(ddpc_store_num_keys(c, &after));
    EXPECT(after == before + 3, "num_keys went from %lld to %lld, expected +3 (bin, empty, n)",
           (long long)before, (long long)after);

    /* Argument errors are caught before anything is sent. */
    char longkey[5000];
    memset(longkey, 'k', sizeof longkey - 1);
    longkey[sizeof longkey - 1] = '\0';
    EXPECT(ddpc_store_set(c, longkey, "v", 1) == DDPC_ERR_INVALID, "a 4999-byte key was accepted");
    EXPECT(ddpc_store_set(c, "", "v", 1) == DDPC_ERR_INVALID, "an empty key was accepted");
    EXPECT(ddpc_store_set(c, "big", bin, (size_t)65 << 20) == DDPC_ERR_INVALID,
           "a 65 MiB value was accepted");
    EXPECT(strstr(ddpc_last_error(), "64 MiB"), "%s", ddpc_last_error());

    /* A large value crosses many socket buffers both ways. */
    size_t big = (size_t)3 << 20;
    char *bv = malloc(big);
    for (size_t i = 0; i < big; i++) bv[i] = (char)(i * 7);
    OK(ddpc_store_set(c, "large", bv, big));
    OK(ddpc_store_get(c2, "large", 1000, &v, &n));
    EXPECT(n == big && !memcmp(v, bv, big), "3 MiB value came back as %zu bytes", n);
    free(v);
    free(bv);
}

/* Sets posted without waiting: more than the replies left unread at once (32), in order, seen by
 * the other client; the next ordinary call reads the replies; values over 4 KiB are refused
 * before anything is sent; a connection with posted sets in flight closes cleanly. */
static void test_posted_sets(int port, DdpcStore *c2) {
    DdpcStore *c = NULL;
    OK(ddpc_store_connect("127.0.0.1", port, TOKEN, 7, 5000, &c));
    if (!c) return;
    char key[32], val[32];
    for (int i = 0; i < 100; i++) {
        snprintf(key, sizeof key, "posted/%d", i % 40);
        snprintf(val, sizeof val, "v%d", i);
        OK(ddpc_store_set_posted(c, key, val, strlen(val)));
    }
    void *v = NULL;
    size_t n = 0;
    OK(ddpc_store_get(c, "posted/39", 0, &v, &n)); /* reads the unread replies first */
    EXPECT(n == 3 && !memcmp(v, "v79", 3), "posted/39 holds '%.*s'", (int)n, (char *)v);
    free(v);
    for (int i = 60; i < 100; i++) { /* the last write of each key wins: sets kept their order */
        snprintf(key, sizeof key, "posted/%d", i % 40);
        snprintf(val, sizeof val, "v%d", i);
        v = NULL;
        OK(ddpc_store_get(c2, key, 1000, &v, &n));
        EXPECT(v && n == strlen(val) && !memcmp(v, val, n), "%s holds '%.*s', want %s", key,
               (int)n, v ? (char *)v : "", val);
        free(v);
    }
    static char big[4097];
    memset(big, 'x', sizeof big);
    EXPECT(ddpc_store_set_posted(c, "posted/big", big, sizeof big) == DDPC_ERR_INVALID,
           "a posted set of 4097 bytes: %s", ddpc_last_error());
    EXPECT(strstr(ddpc_last_error(), "use set"), "%s", ddpc_last_error());
    OK(ddpc_store_set_posted(c, "posted/big", big, 4096));
    OK(ddpc_store_set_posted(c, "posted/last", "end", 3));
    ddpc_store_close(c); /* replies unread: close still says goodbye */
    v = NULL;
    OK(ddpc_store_get(c2, "posted/last", 1000, &v, &n));
    EXPECT(n == 3 && v && !memcmp(v, "end", 3), "posted/last holds %zu bytes", n);
    free(v);
    EXPECT(has_key(c2, "ddpc/dead/7") == 0, "a clean close after posted sets counted as a death");
}

static void test_waits(DdpcStore *c, DdpcStore *c2) {
    void *v = NULL;
    size_t n = 0;
    pthread_t t;
    Job j = {c2, "late", "arrived", 300, 0, DDPC_OK};
    int64_t t0 = ddpc_now_ms();
    pthread_create(&t, NULL, set_later, &j);
    OK(ddpc_store_get(c, "late", 5000, &v, &n));
    int64_t waited = ddpc_now_ms() - t0;
    pthread_join(t, NULL);
    OK(j.st);
    EXPECT(n == 7 && !memcmp(v, "arrived", 7), "waiting get returned '%.*s'", (int)n, (char *)v);
    EXPECT(waited >= 250 && waited < 4000, "waiting get returned after %lld ms", (long long)waited);
    free(v);

    Job j2 = {c2, "late2", "x", 300, 0, DDPC_OK};
    const char *keys[2] = {"late", "late2"};
    pthread_create(&t, NULL, set_later, &j2);
    OK(ddpc_store_wait(c, keys, 2, 5000));
    pthread_join(t, NULL);

    t0 = ddpc_now_ms();
    EXPECT(ddpc_store_get(c, "never-set", 250, &v, &n) == DDPC_ERR_TIMEOUT, "get of a missing "
           "key: %s", ddpc_last_error());
    waited = ddpc_now_ms() - t0;
    EXPECT(strstr(ddpc_last_error(), "'never-set'") && strstr(ddpc_last_error(), "timed out after"),
           "timeout message: %s", ddpc_last_error());
    EXPECT(waited >= 240 && waited < 3000, "a 250 ms get returned after %lld ms",
           (long long)waited);
    EXPECT(ddpc_store_get(c, "never-set", 0, &v, &n) == DDPC_ERR_NOTFOUND, "get with timeout 0: %s",
           ddpc_last_error());

    const char *wk[3] = {"late", "missing-a", "missing-b"};
    EXPECT(ddpc_store_wait(c, wk, 3, 200) == DDPC_ERR_TIMEOUT, "wait: %s", ddpc_last_error());
    const char *msg = ddpc_last_error();
    EXPECT(strstr(msg, "'missing-a'") && strstr(msg, "'missing-b'") && !strstr(msg, "'late'") &&
           strstr(msg, "2 of 3"), "wait timeout message: %s", msg);

    /* The connection still works after timeouts: they are answered, not abandoned. */
    OK(ddpc_store_set(c, "after-timeout", "ok", 2));

    /* Threads share one connection: the mutex keeps request/response pairs together. */
    Job jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (Job){c, "shared-counter", NULL, 0, 250, DDPC_OK};
        pthread_create(&th[i], NULL, add_many, &jobs[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        OK(jobs[i].st);
    }
    int64_t total = 0;
    OK(ddpc_store_add(c, "shared-counter", 0, &total));
    EXPECT(total == 1000, "4 threads x 250 adds on one connection gave %lld", (long long)total);
}

/* Connects with a raw socket, authenticates as `rank` by hand, then closes without goodbye. */
static int raw_login_and_vanish(int port, const char *token, int rank) {
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    uint8_t greet[40], answer[44], verdict = 0;
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) return -1;
    if (recv(fd, greet, sizeof greet, MSG_WAITALL) != (ssize_t)sizeof greet) return -1;
    memcpy(answer, greet, 8); /* magic and version */
    for (int i = 0; i < 4; i++) answer[8 + i] = (uint8_t)((uint32_t)rank >> (8 * i));
    ddpc_hmac_sha256(token, strlen(token), greet + 8, 32, answer + 12);
    if (send(fd, answer, sizeof answer, 0) != (ssize_t)sizeof answer) return -1;
    if (recv(fd, &verdict, 1, MSG_WAITALL) != 1) return -1;
    close(fd);
    return verdict;
}

static void test_auth_and_ranks(int port, DdpcStore *c) {
    DdpcStore *bad = NULL;
    int64_t before = 0, after = 0;
    OK(ddpc_store_num_keys(c, &before));
    EXPECT(ddpc_store_connect("127.0.0.1", port, "wrong-token", 3, 2000, &bad) == DDPC_ERR_AUTH,
           "a wrong token: %s", ddpc_last_error());
    EXPECT(bad == NULL && strstr(ddpc_last_error(), "DDPC_TOKEN"), "%s", ddpc_last_error());
    EXPECT(ddpc_store_connect(NULL, port, NULL, -1, 2000, &bad) == DDPC_ERR_AUTH,
           "no token: %s", ddpc_last_error());
    OK(ddpc_store_num_keys(c, &after));
    EXPECT(after == before && has_key(c, "ddpc/dead/3") == 0,
           "refused clients changed the store (%lld -> %lld keys)", (long long)before,
           (long long)after);

    /* An unclean drop of a registered rank publishes ddpc/dead/<rank>; a clean close does not. */
    EXPECT(raw_login_and_vanish(port, TOKEN, 7) == 1, "raw login as rank 7 was refused");
    void *v = NULL;
    size_t n = 0;
    OK(ddpc_store_get(c, "ddpc/dead/7", 3000, &v, &n));
    EXPECT(v && strstr((char *)v, "rank 7"), "dead-rank value: '%.*s'", (int)n, (char *)v);
    free(v);
    EXPECT(raw_login_and_vanish(port, "wrong", 9) == 0, "a wrong raw login was accepted");
    DdpcStore *r8 = NULL;
    OK(ddpc_store_connect("127.0.0.1", port, TOKEN, 8, 2000, &r8));
    if (r8) ddpc_store_close(r8);
    poll(NULL, 0, 200);
    EXPECT(has_key(c, "ddpc/dead/8") == 0, "a clean close marked rank 8 dead");
    EXPECT(has_key(c, "ddpc/dead/9") == 0, "a refused login marked rank 9 dead");

    DdpcStoreServer *s = NULL;
    EXPECT(ddpc_store_server_start(NULL, 0, "", &s) == DDPC_ERR_INVALID && !s,
           "a server with an empty token started");
}

typedef struct {
    DdpcStore *c;
    ddpc_status st;
    char msg[1024];
} Waiter;

static void *wait_forever(void *arg) {
    Waiter *w = arg;
    void *v = NULL;
    size_t n = 0;
    w->st = ddpc_store_get(w->c, "never", 20000, &v, &n);
    snprintf(w->msg, sizeof w->msg, "%s", ddpc_last_error());
    free(v);
    return NULL;
}

int main(void) {
    test_sha256();
    test_hmac();

    DdpcStoreServer *srv = NULL;
    DdpcStore *c = NULL, *c2 = NULL;
    OK(ddpc_store_server_start(NULL, 0, TOKEN, &srv));
    if (!srv) return 1;
    int port = ddpc_store_server_port(srv);
    EXPECT(port > 0, "port %d", port);
    OK(ddpc_store_connect(NULL, port, TOKEN, -1, 5000, &c));
    OK(ddpc_store_connect("localhost", port, TOKEN, 1, 5000, &c2));
    if (!c || !c2) return 1;
    test_commands(c, c2);
    test_posted_sets(port, c2);
    test_waits(c, c2);
    test_auth_and_ranks(port, c);
    ddpc_store_close(c2);

    /* Nothing listens on a port we just released: the client retries, then names host:port. */
    DdpcStoreServer *tmp = NULL;
    OK(ddpc_store_server_start(NULL, 0, TOKEN, &tmp));
    int free_port = ddpc_store_server_port(tmp);
    ddpc_store_server_stop(tmp);
    DdpcStore *none = NULL;
    int64_t t0 = ddpc_now_ms();
    EXPECT(ddpc_store_connect(NULL, free_port, TOKEN, -1, 400, &none) == DDPC_ERR_TIMEOUT,
           "connect to nothing: %s", ddpc_last_error());
    char where[64];
    snprintf(where, sizeof where, "127.0.0.1:%d", free_port);
    EXPECT(strstr(ddpc_last_error(), where) && strstr(ddpc_last_error(), "rank 0"), "%s",
           ddpc_last_error());
    EXPECT(ddpc_now_ms() - t0 >= 350, "gave up after %lld ms", (long long)(ddpc_now_ms() - t0));

    /* The server goes away while a client waits: the waiter learns at once. */
    Waiter w = {c, DDPC_OK, ""};
    pthread_t t;
    pthread_create(&t, NULL, wait_forever, &w);
    poll(NULL, 0, 200);
    t0 = ddpc_now_ms();
    ddpc_store_server_stop(srv);
    pthread_join(t, NULL);
    EXPECT(w.st == DDPC_ERR_PEER && strstr(w.msg, "lost the connection") &&
           strstr(w.msg, "rank 0"), "waiter got %d: %s", (int)w.st, w.msg);
    EXPECT(ddpc_now_ms() - t0 < 3000, "the waiter took %lld ms to notice",
           (long long)(ddpc_now_ms() - t0));
    EXPECT(ddpc_store_set(c, "k", "v", 1) == DDPC_ERR_PEER, "a call after the loss: %s",
           ddpc_last_error());
    ddpc_store_close(c);

    return check_summary("test_store");
}
