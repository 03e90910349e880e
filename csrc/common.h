/* common.h: internal helpers of the C core: CHECK macros for system, CUDA and NCCL calls.
 * The failure is described once, where it happens, then passed up by DDPC_CHECK. */
#ifndef DDPC_COMMON_H
#define DDPC_COMMON_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "ddpc.h"

/* pthread_create(t, fn, arg), then names the new thread (at most 15 characters: "ddpc-watchdog"),
 * as top -H, ps -L, gdb and py-spy show it, from here: the name is in place before the caller
 * goes on. detached: the thread is detached after it is named (never joined). Returns
 * pthread_create's result; naming is best effort (a failure is logged at DDPC_DEBUG=INFO). */
int ddpc_thread_start(pthread_t *t, void *(*fn)(void *), void *arg, const char *name,
                      int detached);

/* A DDPC_DEBUG value: DDPC_LOG_NONE/INFO/TRACE, or -1 when it is not one. */
int ddpc_log_level_parse(const char *v);

#define DDPC_SAMPLER_MAX_THREADS 64

/* Propagates a non-OK status (the message is already set). */
#define DDPC_CHECK(call)                     \
    do {                                     \
        ddpc_status st_ = (call);            \
        if (st_ != DDPC_OK) return st_;      \
    } while (0)

/* Same, but jumps to a cleanup label with the status stored in `st`. */
#define DDPC_CHECK_GOTO(call, st, label)     \
    do {                                     \
        (st) = (call);                       \
        if ((st) != DDPC_OK) goto label;     \
    } while (0)

/* A system call that returns -1 and sets errno. */
#define DDPC_SYSCHECK(call, what)                                                          \
    do {                                                                                   \
        if ((call) == -1)                                                                  \
            return ddpc_error(DDPC_ERR_SYSTEM, "%s failed: %s (%s:%d)", (what),            \
                              strerror(errno), __FILE__, __LINE__);                        \
    } while (0)

/* Like DDPC_SYSCHECK but for calls that return an errno value (pthread_*). */
#define DDPC_PTHREADCHECK(call, what)                                                      \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_ != 0)                                                                      \
            return ddpc_error(DDPC_ERR_SYSTEM, "%s failed: %s (%s:%d)", (what),            \
                              strerror(rc_), __FILE__, __LINE__);                          \
    } while (0)

#ifdef DDPC_WITH_CUDA
#include <cuda_runtime_api.h>

/* A CUDA runtime call: the message names the call, the error and where it happened. */
#define DDPC_CUDACHECK(call)                                                               \
    do {                                                                                   \
        cudaError_t ce_ = (call);                                                          \
        if (ce_ != cudaSuccess)                                                            \
            return ddpc_error(DDPC_ERR_CUDA, "%s failed: %s (%s) (%s:%d)", #call,          \
                              cudaGetErrorName(ce_), cudaGetErrorString(ce_), __FILE__,    \
                              __LINE__);                                                   \
    } while (0)

#define DDPC_CUDACHECK_GOTO(call, st, label)                                               \
    do {                                                                                   \
        cudaError_t ce_ = (call);                                                          \
        if (ce_ != cudaSuccess) {                                                          \
            (st) = ddpc_error(DDPC_ERR_CUDA, "%s failed: %s (%s) (%s:%d)", #call,          \
                              cudaGetErrorName(ce_), cudaGetErrorString(ce_), __FILE__,    \
                              __LINE__);                                                   \
            goto label;                                                                    \
        }                                                                                  \
    } while (0)
#endif

#define DDPC_MIN(a, b) ((a) < (b) ? (a) : (b))
#define DDPC_MAX(a, b) ((a) > (b) ? (a) : (b))

/* "hostname/boot id": equal for two processes exactly when they share a machine (and a boot). */
void ddpc_default_host_id(char *buf, size_t len);

/* SHA-256 and HMAC-SHA256 (store.c): the store's challenge-response authentication. */
void ddpc_sha256(const void *data, size_t len, uint8_t out[32]);
void ddpc_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                      uint8_t out[32]);

#endif /* DDPC_COMMON_H */
