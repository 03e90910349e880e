/* common.c: thread-local error messages, the interrupt hook, clocks and DDPC_DEBUG logging. */
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define DDPC_MSG_LEN 4096

static _Thread_local char tls_msg[DDPC_MSG_LEN];
static _Thread_local int tls_interruptible;
static ddpc_interrupt_hook g_hook;

const char *ddpc_last_error(void) { return tls_msg[0] ? tls_msg : "no error"; }

ddpc_status ddpc_error(ddpc_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_msg, sizeof tls_msg, fmt, ap);
    va_end(ap);
    DDPC_INFO("ERROR", "%s: %s", ddpc_status_name(st), tls_msg);
    return st;
}

ddpc_status ddpc_error_prefix(ddpc_status st, const char *fmt, ...) {
    char old[DDPC_MSG_LEN];
    char pre[DDPC_MSG_LEN];
    va_list ap;
    memcpy(old, tls_msg, sizeof old);
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    /* (a message too long for the buffer is cut: its start says the most) */
    if (snprintf(tls_msg, sizeof tls_msg, "%s%s", pre, old) < 0) tls_msg[0] = '\0';
    return st;
}

const char *ddpc_status_name(ddpc_status st) {
    switch (st) {
    case DDPC_OK: return "ok";
    case DDPC_ERR_INVALID: return "invalid argument";
    case DDPC_ERR_SYSTEM: return "system error";
    case DDPC_ERR_TIMEOUT: return "timeout";
    case DDPC_ERR_PEER: return "peer failure";
    case DDPC_ERR_AUTH: return "authentication failure";
    case DDPC_ERR_MISMATCH: return "mismatch between ranks";
    case DDPC_ERR_CUDA: return "CUDA error";
    case DDPC_ERR_NCCL: return "NCCL error";
    case DDPC_ERR_UNAVAILABLE: return "unavailable";
    case DDPC_ERR_INTERRUPTED: return "interrupted";
    case DDPC_ERR_NOMEM: return "out of memory";
    case DDPC_ERR_NOTFOUND: return "not found";
    case DDPC_ERR_PROTOCOL: return "protocol error";
    }
    return "unknown status";
}

void ddpc_set_interrupt_hook(ddpc_interrupt_hook hook) { g_hook = hook; }
void ddpc_thread_set_interruptible(int on) { tls_interruptible = on; }

ddpc_status ddpc_check_interrupt(void) {
    if (tls_interruptible && g_hook && g_hook())
        return ddpc_error(DDPC_ERR_INTERRUPTED, "interrupted by a signal (KeyboardInterrupt)");
    return DDPC_OK;
}

int ddpc_thread_start(pthread_t *t, void *(*fn)(void *), void *arg, const char *name,
                      int detached) {
    int rc = pthread_create(t, NULL, fn, arg);
    if (rc != 0) return rc;
#ifdef __linux__
    char buf[16];
    snprintf(buf, sizeof buf, "%s", name);
    /* (still joinable here, so *t stays valid even if the thread has already returned) */
    int nrc = pthread_setname_np(*t, buf);
    if (nrc != 0) DDPC_INFO("THREAD", "naming thread '%s' failed: %s", buf, strerror(nrc));
#else
    (void)name;
#endif
    if (detached) pthread_detach(*t);
    return 0;
}

uint64_t ddpc_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int64_t ddpc_now_ms(void) { return (int64_t)(ddpc_now_ns() / 1000000ull); }

int64_t ddpc_deadline(int64_t timeout_ms) {
    if (timeout_ms < 0) return INT64_MAX;
    int64_t now = ddpc_now_ms();
    return timeout_ms > INT64_MAX - now ? INT64_MAX : now + timeout_ms;
}

int64_t ddpc_slice(int64_t deadline_ms, int64_t slice_ms) {
    int64_t left = deadline_ms == INT64_MAX ? slice_ms : deadline_ms - ddpc_now_ms();
    if (left < 0) left = 0;
    return left < slice_ms ? left : slice_ms;
}

static int g_log_level = -1;

int ddpc_log_level_parse(const char *v) {
    if (!v[0] || !strcmp(v, "0") || !strcasecmp(v, "OFF")) return DDPC_LOG_NONE;
    if (!strcmp(v, "1") || !strcasecmp(v, "INFO")) return DDPC_LOG_INFO;
    if (!strcmp(v, "2") || !strcasecmp(v, "TRACE")) return DDPC_LOG_TRACE;
    return -1;
}

int ddpc_log_level(void) {
    if (g_log_level < 0) {
        const char *v = getenv("DDPC_DEBUG");
        int lvl = v ? ddpc_log_level_parse(v) : DDPC_LOG_NONE;
        /* (a value that is not a level: none here; ddpc_settings_check refuses it) */
        g_log_level = lvl < 0 ? DDPC_LOG_NONE : lvl;
    }
    return g_log_level;
}

void ddpc_log(int level, const char *subsys, const char *fmt, ...) {
    char host[64] = "?";
    char line[2048];
    va_list ap;
    (void)level;
    gethostname(host, sizeof host - 1);
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s:%d:%ld ddpc %s %s\n", host, (int)getpid(), (long)syscall(SYS_gettid),
            subsys, line);
}

void ddpc_default_host_id(char *buf, size_t len) {
    char host[256] = "?", boot[64] = "";
    gethostname(host, sizeof host - 1);
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd != -1) {
        ssize_t n = read(fd, boot, sizeof boot - 1);
        close(fd);
        boot[n > 0 ? n : 0] = '\0';
        boot[strcspn(boot, "\n")] = '\0';
    }
    snprintf(buf, len, "%s/%s", host, boot);
}
