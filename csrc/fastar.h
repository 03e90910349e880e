/* fastar.h: the one-shot all-reduce for small messages between the GPUs of one host (fastar.cu
 * holds the kernel, comm_nccl.c the setup through CUDA IPC and the calls). Shared by C and CUDA.
 *
 * Every rank owns one region of device memory, mapped into every peer through CUDA IPC:
 *   flags  [DDPC_FAST_MAX_BLOCKS][DDPC_FAST_MAX_RANKS] uint64: written by peers, read locally
 *   slot 0, slot 1 (DDPC_FAST_SLOT_BYTES each): rank r's data of a call lands at r * sub_bytes
 * A call pushes the caller's slice into every peer's slot (remote stores over NVLink), fences,
 * raises its flag in each peer, waits for the peers' flags in its own region, and reduces the
 * local copies in rank order, so every rank computes bitwise the same result. Calls alternate
 * between the two slots: a peer can be at most one call ahead (it cannot start call k+2 before
 * this rank has signalled call k+1, which it does only after finishing call k). */
#ifndef DDPC_FASTAR_H
#define DDPC_FASTAR_H

#include <stddef.h>
#include <stdint.h>

#include "ddpc.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DDPC_FAST_MAX_RANKS 8
#define DDPC_FAST_MAX_BLOCKS 32
#define DDPC_FAST_FLAGS_BYTES 4096
#define DDPC_FAST_SLOT_BYTES (2u << 20)
#define DDPC_FAST_REGION_BYTES (DDPC_FAST_FLAGS_BYTES + 2 * (size_t)DDPC_FAST_SLOT_BYTES)
/* The largest message: one-shot reads world-1 copies, beyond this NCCL's ring is as fast. */
#define DDPC_FAST_MAX_BYTES (1u << 20)

enum { DDPC_FAST_OK = 0, DDPC_FAST_TIMEOUT = 1, DDPC_FAST_MISMATCH = 2, DDPC_FAST_ABORTED = 3 };

/* A flag is (epoch << DDPC_FAST_COUNT_BITS) | count: epochs never wrap in practice (2^44 calls),
 * so a flag left from an old call is always below the one awaited, and a message of at most
 * DDPC_FAST_MAX_BYTES has at most 2^19 elements, so the count fits exactly. */
#define DDPC_FAST_COUNT_BITS 20
/* Where in the flags area each rank keeps its count of finished blocks of the current call. */
#define DDPC_FAST_COUNTER_OFFSET (DDPC_FAST_FLAGS_BYTES - 8)

/* In pinned host memory mapped into the device: the kernel reports here, the host aborts here. */
typedef struct DdpcFastCtl {
    volatile uint32_t abort;      /* set by the host: kernels give up (and skip a call not begun) */
    volatile uint32_t done_epoch; /* low 32 bits of the last call all of whose blocks finished */
    volatile uint32_t claim;      /* taken by the first block that reports a failure */
    volatile uint32_t err_code;   /* DDPC_FAST_*, written after the details below */
    volatile uint32_t err_epoch;  /* low 32 bits of the call that failed */
    volatile int32_t err_peer;    /* the rank it waited for */
    volatile uint32_t err_peer_count; /* mismatch: the element count that peer passed */
} DdpcFastCtl;

typedef struct DdpcFastArgs {
    char *base[DDPC_FAST_MAX_RANKS]; /* every rank's region in this process's address space */
    const void *in;
    void *out;
    size_t count;                 /* elements */
    size_t sub_bytes;             /* each rank's share of a slot */
    uint64_t epoch;               /* 1, 2, 3, ... per call; the same on every rank */
    int rank, world;
    int dtype, redop;             /* ddpc_dtype, ddpc_redop */
    DdpcFastCtl *ctl;             /* device pointer of the control block */
    uint64_t timeout_ns;          /* how long a block waits for a peer */
} DdpcFastArgs;

/* 1 when the kernel handles this dtype and reduction. */
int ddpc_fast_supported(int dtype, int redop);
/* Queues the kernel on `stream` (current device); the message says what failed. */
ddpc_status ddpc_fast_launch(const DdpcFastArgs *a, uintptr_t stream);

#ifdef __cplusplus
}
#endif
#endif /* DDPC_FASTAR_H */
