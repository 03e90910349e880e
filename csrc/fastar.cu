/* fastar.cu: the one-shot all-reduce kernel for small messages between the GPUs of one host (the
 * protocol is described in fastar.h). One launch does the whole collective: a latency of a few
 * microseconds where NCCL's ring needs tens, and no host work beyond the launch. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"
#include "fastar.h"

namespace {

constexpr int kThreads = 512;
/* 16-byte units per thread before another block is worth its barrier. */
constexpr int kUnitsPerThread = 2;

template <typename T> struct Acc { using type = float; };  // float, __half, __nv_bfloat16
template <> struct Acc<double> { using type = double; };
template <> struct Acc<int32_t> { using type = uint32_t; };  // wrap-around sums, as NCCL
template <> struct Acc<int64_t> { using type = uint64_t; };

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ uint32_t to_acc(int32_t x) { return (uint32_t)x; }
__device__ __forceinline__ uint64_t to_acc(int64_t x) { return (uint64_t)x; }

template <typename T> __device__ __forceinline__ T from_acc(typename Acc<T>::type v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ int32_t from_acc<int32_t>(uint32_t v) { return (int32_t)v; }
template <> __device__ __forceinline__ int64_t from_acc<int64_t>(uint64_t v) { return (int64_t)v; }

/* Combines in the accumulator type; min/max of integers compare the signed values. */
template <typename T, int OP>
__device__ __forceinline__ typename Acc<T>::type combine(typename Acc<T>::type a,
                                                         typename Acc<T>::type b) {
    using A = typename Acc<T>::type;
    using S = typename std::conditional<std::is_integral<T>::value, T, A>::type;
    if (OP == DDPC_SUM || OP == DDPC_AVG) return a + b;
    if (OP == DDPC_PROD) return a * b;
    S sa = (S)a, sb = (S)b;
    if (OP == DDPC_MIN) return (A)(sb < sa ? sb : sa);
    return (A)(sb > sa ? sb : sa);
}

/* The same bits as an unsigned integer of T's size: what __ldcg can load. */
template <int N> struct Bits;
template <> struct Bits<2> { using type = unsigned short; };
template <> struct Bits<4> { using type = unsigned int; };
template <> struct Bits<8> { using type = unsigned long long; };

/* Loads that skip the L1 cache: a peer rewrote this memory since the last call. */
template <typename U> __device__ __forceinline__ U load_cg(const U *p) {
    using B = typename Bits<sizeof(U)>::type;
    B b = __ldcg(reinterpret_cast<const B *>(p));
    U u;
    memcpy(&u, &b, sizeof u);
    return u;
}
template <> __device__ __forceinline__ uint4 load_cg<uint4>(const uint4 *p) { return __ldcg(p); }

__device__ __forceinline__ uint64_t globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Records the first failure in the control block: the details first, the code last, so the host
 * never reads a code with stale details. */
__device__ void report(DdpcFastCtl *ctl, uint32_t code, uint64_t epoch, int peer,
                       uint32_t peer_count) {
    if (atomicCAS((unsigned int *)&ctl->claim, 0u, 1u) == 0u) {
        ctl->err_epoch = (uint32_t)epoch;
        ctl->err_peer = peer;
        ctl->err_peer_count = peer_count;
        __threadfence_system();
        ctl->err_code = code;
        __threadfence_system();
    }
}

/* Reduces the world's copies of one unit U (a 16-byte pack of T, or one T) in rank order. */
template <typename T, int OP, typename U>
__device__ __forceinline__ U reduce_unit(const DdpcFastArgs &a, const U *in, size_t slot,
                                         size_t i) {
    constexpr int kPer = sizeof(U) / sizeof(T);
    using A = typename Acc<T>::type;
    A acc[kPer];
    for (int r = 0; r < a.world; r++) {
        U u = r == a.rank ? in[i]
                          : load_cg(reinterpret_cast<const U *>(a.base[a.rank] + slot +
                                                                (size_t)r * a.sub_bytes) + i);
        const T *v = reinterpret_cast<const T *>(&u);
#pragma unroll
        for (int k = 0; k < kPer; k++)
            acc[k] = r == 0 ? to_acc(v[k]) : combine<T, OP>(acc[k], to_acc(v[k]));
    }
    U res;
    T *o = reinterpret_cast<T *>(&res);
#pragma unroll
    for (int k = 0; k < kPer; k++) {
        A x = acc[k];
        if (OP == DDPC_AVG) x = x / (A)a.world;
        o[k] = from_acc<T>(x);
    }
    return res;
}

/* units16 = the message's size in 16-byte units (the last one may be partial): block b covers the
 * same bytes on every rank. VEC: this rank's buffer is 16-byte aligned, so it moves the block's
 * whole units as vectors and only a partial last unit element by element. */
template <typename T, int OP, bool VEC>
__global__ void __launch_bounds__(kThreads) fast_allreduce_kernel(DdpcFastArgs a, size_t units16) {
    constexpr size_t kE = 16 / sizeof(T);
    __shared__ int failed;
    const int t = threadIdx.x;
    /* No look at ctl->abort here: it lies in pinned host memory, and one PCIe read per block
     * cost about 0.5 us per block, serialized (41 us instead of 13 us for 1 MiB on 2 H200s). The
     * wait below checks it; the push before it only writes into peers' slots, which stay mapped
     * until every rank has finished its calls (see fast_teardown in comm_nccl.c). */
    if (t == 0) failed = 0;
    __syncthreads();
    const int b = blockIdx.x;
    const size_t chunk = (units16 + gridDim.x - 1) / gridDim.x;
    const size_t lo16 = min(units16, (size_t)b * chunk), hi16 = min(units16, lo16 + chunk);
    const size_t elo = lo16 * kE, ehi = min(hi16 * kE, a.count);
    const size_t vhi = VEC ? max(lo16, min(hi16, a.count / kE)) : lo16; /* whole units: vectors */
    const size_t tail = VEC ? max(elo, vhi * kE) : elo;                 /* the rest: elements */
    const T *in = static_cast<const T *>(a.in);
    T *out = static_cast<T *>(a.out);
    const size_t slot = DDPC_FAST_FLAGS_BYTES + (size_t)(a.epoch & 1u) * DDPC_FAST_SLOT_BYTES;
    const uint64_t count20 = a.count & ((1u << DDPC_FAST_COUNT_BITS) - 1);

    if (!failed) {
        /* 1. Push this block's share of the input into every peer's slot. */
        for (int p = 0; p < a.world; p++) {
            if (p == a.rank) continue;
            char *dst = a.base[p] + slot + (size_t)a.rank * a.sub_bytes;
            if (VEC)
                for (size_t i = lo16 + t; i < vhi; i += blockDim.x)
                    reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(in)[i];
            for (size_t i = tail + t; i < ehi; i += blockDim.x) reinterpret_cast<T *>(dst)[i] = in[i];
        }
        /* Every thread's stores reach the peers before any flag says they did. */
        __threadfence_system();
        __syncthreads();
        if (t < a.world && t != a.rank) {
            volatile uint64_t *flag = reinterpret_cast<volatile uint64_t *>(a.base[t]) +
                                      (size_t)b * DDPC_FAST_MAX_RANKS + a.rank;
            *flag = (a.epoch << DDPC_FAST_COUNT_BITS) | count20;
        }

        /* 2. Wait for every peer's flag of this call (or the next one: a peer may be one ahead;
         * a flag left from an older call is always lower). */
        if (t < a.world && t != a.rank) {
            volatile uint64_t *flag = reinterpret_cast<volatile uint64_t *>(a.base[a.rank]) +
                                      (size_t)b * DDPC_FAST_MAX_RANKS + t;
            const uint64_t start = globaltimer();
            for (uint32_t spins = 1;; spins++) {
                const uint64_t v = *flag;
                const uint64_t e = v >> DDPC_FAST_COUNT_BITS;
                if (e >= a.epoch) {
                    const uint64_t c = v & ((1u << DDPC_FAST_COUNT_BITS) - 1);
                    if (e == a.epoch && c != count20) {
                        report(a.ctl, DDPC_FAST_MISMATCH, a.epoch, t, (uint32_t)c);
                        failed = 1;
                    }
                    break;
                }
                if ((spins & 255u) == 0) {
                    if (a.ctl->abort) {
                        report(a.ctl, DDPC_FAST_ABORTED, a.epoch, t, 0);
                        failed = 1;
                        break;
                    }
                    if (globaltimer() - start > a.timeout_ns) {
                        report(a.ctl, DDPC_FAST_TIMEOUT, a.epoch, t, 0);
                        failed = 1;
                        break;
                    }
                }
            }
            /* The peers' data was written under a system-scope fence before their flags. */
            __threadfence_system();
        }
        __syncthreads();
    }

    /* 3. Reduce the copies in rank order: every rank computes the same bits. */
    if (!failed) {
        if (VEC)
            for (size_t i = lo16 + t; i < vhi; i += blockDim.x)
                reinterpret_cast<uint4 *>(out)[i] = reduce_unit<T, OP, uint4>(
                    a, reinterpret_cast<const uint4 *>(in), slot, i);
        for (size_t i = tail + t; i < ehi; i += blockDim.x)
            out[i] = reduce_unit<T, OP, T>(a, in, slot, i);
    }

    /* 4. The last block to finish (failed or not) tells the host the call is over. */
    __syncthreads();
    if (t == 0) {
        __threadfence();
        unsigned int *done = reinterpret_cast<unsigned int *>(a.base[a.rank] +
                                                              DDPC_FAST_COUNTER_OFFSET);
        if (atomicAdd(done, 1u) == gridDim.x - 1) {
            atomicExch(done, 0u);
            a.ctl->done_epoch = (uint32_t)a.epoch;
            __threadfence_system();
        }
    }
}

template <typename T, int OP>
cudaError_t launch_op(const DdpcFastArgs &a, cudaStream_t s) {
    const size_t bytes = a.count * sizeof(T);
    const size_t units16 = (bytes + 15) / 16;
    const bool vec = ((uintptr_t)a.in | (uintptr_t)a.out) % 16 == 0;
    const size_t per_block = (size_t)kThreads * kUnitsPerThread;
    int blocks = (int)((units16 + per_block - 1) / per_block);
    blocks = blocks < 1 ? 1 : blocks > DDPC_FAST_MAX_BLOCKS ? DDPC_FAST_MAX_BLOCKS : blocks;
    if (vec)
        fast_allreduce_kernel<T, OP, true><<<blocks, kThreads, 0, s>>>(a, units16);
    else
        fast_allreduce_kernel<T, OP, false><<<blocks, kThreads, 0, s>>>(a, units16);
    return cudaGetLastError();
}

template <typename T> cudaError_t launch_type(const DdpcFastArgs &a, cudaStream_t s) {
    switch (a.redop) {
    case DDPC_SUM: return launch_op<T, DDPC_SUM>(a, s);
    case DDPC_AVG: return launch_op<T, DDPC_AVG>(a, s);
    case DDPC_MIN: return launch_op<T, DDPC_MIN>(a, s);
    case DDPC_MAX: return launch_op<T, DDPC_MAX>(a, s);
    case DDPC_PROD: return launch_op<T, DDPC_PROD>(a, s);
    default: return cudaErrorInvalidValue;
    }
}

}  // namespace

extern "C" int ddpc_fast_supported(int dtype, int redop) {
    if (redop < 0 || redop > DDPC_PROD) return 0;  // (bitwise ops never reach NCCL's paths)
    switch (dtype) {
    case DDPC_FLOAT32:
    case DDPC_FLOAT64:
    case DDPC_FLOAT16:
    case DDPC_BFLOAT16: return 1;
    case DDPC_INT32:
    case DDPC_INT64: return redop != DDPC_AVG;  // integer averages go to NCCL
    default: return 0;
    }
}

extern "C" ddpc_status ddpc_fast_launch(const DdpcFastArgs *a, uintptr_t stream) {
    if (!ddpc_fast_supported(a->dtype, a->redop))
        return ddpc_error(DDPC_ERR_INVALID, "fast all_reduce: unsupported dtype %d / op %d",
                          a->dtype, a->redop);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    cudaError_t e = cudaSuccess;
    switch (a->dtype) {
    case DDPC_FLOAT32: e = launch_type<float>(*a, s); break;
    case DDPC_FLOAT64: e = launch_type<double>(*a, s); break;
    case DDPC_FLOAT16: e = launch_type<__half>(*a, s); break;
    case DDPC_BFLOAT16: e = launch_type<__nv_bfloat16>(*a, s); break;
    case DDPC_INT32: e = launch_type<int32_t>(*a, s); break;
    case DDPC_INT64: e = launch_type<int64_t>(*a, s); break;
    default: break;
    }
    if (e != cudaSuccess)
        return ddpc_error(DDPC_ERR_CUDA, "launching the fast all_reduce kernel (%zu elements) "
                          "failed: %s (%s)", a->count, cudaGetErrorName(e), cudaGetErrorString(e));
    return DDPC_OK;
}
