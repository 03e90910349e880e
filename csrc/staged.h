/* staged.h: the all-reduce of large device buffers between GPUs of one host that may not reach
 * each other directly (NCCL_P2P_DISABLE=1, or no P2P between them), through pinned shared host
 * memory moved by the copy engines. comm_nccl.c decides when to use it and sets it up with the
 * peers through the store; staged.c does the work.
 *
 * Why: without P2P, NCCL stages through host memory with SM copies, about 11 GB/s between two
 * H200s, so a step's gradients (325 MB in bfloat16 for a GPT-2 sized model) take longer than the
 * backward pass they should hide behind. cudaMemcpyAsync to and from pinned memory runs on the
 * copy engines at PCIe speed in both directions at once, and takes no SMs from the backward.
 *
 * How: a buffer is cut into chunks and each chunk into one segment per rank. For each chunk a rank
 *   1. copies the segments it does not own into its send slot (device to host),
 *   2. copies its own segment of every peer's send slot into device scratch (host to device) and
 *      reduces them into its buffer (a kernel),
 *   3. copies that reduced segment into its out slot (device to host),
 *   4. copies the peers' reduced segments from their out slots into its buffer (host to device).
 * Only the owner reduces a segment, so every rank ends with bitwise the same values. Ordering
 * across processes is on the GPU: each step ends with cuStreamWriteValue32 of a counter into
 * every peer's mailbox in the shared memory, and the step that needs it starts with
 * cuStreamWaitValue32 on this rank's mailbox. Each step has its own stream (the gather runs on
 * the caller's), so a step waiting for a peer holds back only that step of later chunks, and
 * both PCIe directions stay busy. Every wait is for a step that every rank issues earlier in
 * the same per-chunk order, so no schedule of the streams (even all on one hardware queue) can
 * deadlock. Counters only grow (compared cyclically): slots are reused after the peers said
 * they read them.
 *
 * Failure: the counters a rank waits on live in its own mailbox, so after an abort the host writes
 * them far ahead (ddpc_staged_unblock) and its streams drain. Released streams still signal the
 * peers, with whatever data they moved, so the aborting rank first sets its aborted word in the
 * segment, and a rank reports a staged all-reduce done only after checking that no rank's word is
 * set (ddpc_staged_peer_aborted): an abort anywhere fails the call everywhere instead of a peer
 * reporting a wrong sum as done. Work the caller queued on the device behind the collective (a
 * stream wait, as the gradient reducer uses) may still run on such a sum before the error
 * surfaces on the host, as after an NCCL abort. Peers that keep running can lower a released
 * counter again, so the unblock is repeated until the streams are idle.
 *
 * Without more, consecutive calls do not overlap: a call starts on the caller's stream after the
 * previous one (they may share a buffer). Within a call the four steps of consecutive chunks do.
 * With a `ready` event (ddpc_staged_all_reduce) its send and reduce steps start from that event
 * instead: the caller vouches that no earlier call touches the buffer (the nccl backend passes
 * one when no queued collective touches it, unless DDPC_STAGED_OVERLAP=0). */
#ifndef DDPC_STAGED_H
#define DDPC_STAGED_H

#include <stddef.h>
#include <stdint.h>

#include "ddpc.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DDPC_STAGED_MAX_RANKS 8
#define DDPC_STAGED_SLOTS 4

typedef struct DdpcStaged DdpcStaged;

/* 1 when the staged path handles this dtype and reduction (float types; sum and average). */
int ddpc_staged_supported(ddpc_dtype dt, ddpc_redop op);

/* The chunk size for `world` ranks (DDPC_STAGED_CHUNK_BYTES overrides it; a value that is not a
 * setting is an error) and the bytes of the shared segment it needs. */
ddpc_status ddpc_staged_chunk_bytes(int world, size_t *out);
size_t ddpc_staged_segment_bytes(int world, size_t chunk_bytes);

/* Maps the shared segment `shm_name` (created, with the space reserved, when `create`), registers
 * it with CUDA, and makes the streams, events and scratch on the current device. The error
 * message says what failed; nothing is left behind (a created name is unlinked). */
ddpc_status ddpc_staged_open(int rank, int world, size_t chunk_bytes, const char *shm_name,
                             int create, DdpcStaged **out);

/* Removes the segment's name (once every rank has it mapped, or after a failed setup). */
void ddpc_staged_unlink(DdpcStaged *s);

/* Queues the all-reduce of count elements at buf (device memory of the current device) on
 * `stream`: it starts after the work queued there so far, and the work queued there later starts
 * after it. Every rank must call it with the same count, dtype and op, in the same order.
 * ready (a cudaEvent_t, or NULL): when given, the copies out of buf start once it has completed
 * instead of after everything queued on `stream`, so the call overlaps the ones before it. Only
 * for a buf that nothing queued earlier reads or writes. */
ddpc_status ddpc_staged_all_reduce(DdpcStaged *s, void *buf, size_t count, ddpc_dtype dt,
                                   ddpc_redop op, uintptr_t stream, void *ready);

/* After an abort: marks this rank aborted in the segment, then releases every wait its streams
 * have queued or will queue. Only memory writes: safe from any thread, repeatable. */
void ddpc_staged_unblock(DdpcStaged *s);

/* The lowest rank that has marked itself aborted, or -1. Check it after a staged all-reduce has
 * finished on the device and before reporting it done. */
int ddpc_staged_peer_aborted(const DdpcStaged *s);

/* Frees everything once its streams and `stream` are idle. aborted: keep unblocking while
 * waiting (a clean close never releases a wait). When they do not drain within a few seconds
 * the memory stays allocated (a peer or the device may still touch it) and a message says so. */
void ddpc_staged_close(DdpcStaged *s, uintptr_t stream, int aborted);

#ifdef __cplusplus
}
#endif
#endif /* DDPC_STAGED_H */
