/* kernels.cu: CUDA kernels of the core: zeroing, a cast with a scale between the float dtypes
 * (the reducer's bfloat16/float16 wire format, and the divide of an average), and the embedding
 * rows' packing and accumulation. Each `_kernel` has a plain launcher that owns the geometry and
 * checks the launch with cudaGetLastError. */
#include <cub/block/block_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <ctime>
#include <type_traits>

#include "common.h"

namespace {

constexpr int kBlock = 256;
/* Grid-stride loops cover any n; more blocks than this only add scheduling work. */
constexpr size_t kMaxGrid = 65536;
/* Elements per thread and iteration on the vectorized path (16 bytes of float32). */
constexpr int kVec = 4;

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

/* Half types compute in float; anything that touches float64 computes in double. */
template <typename Dst, typename Src>
using acc_t = typename std::conditional<std::is_same<Dst, double>::value ||
                                            std::is_same<Src, double>::value,
                                        double, float>::type;

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> struct Convert;
template <> struct Convert<float> {
    template <typename A> __device__ static float from(A v) { return static_cast<float>(v); }
};
template <> struct Convert<double> {
    template <typename A> __device__ static double from(A v) { return static_cast<double>(v); }
};
/* A double result rounds once, straight to the half type: going through float would round
 * twice, and the compiler may fuse the two conversions anyway. */
template <> struct Convert<__half> {
    __device__ static __half from(float v) { return __float2half_rn(v); }
    __device__ static __half from(double v) { return __double2half(v); }
};
template <> struct Convert<__nv_bfloat16> {
    __device__ static __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
    __device__ static __nv_bfloat16 from(double v) { return __double2bfloat16(v); }
};

template <typename Dst, typename Src>
__device__ __forceinline__ Dst cast_one(Src x, acc_t<Dst, Src> scale) {
    return Convert<Dst>::from(static_cast<acc_t<Dst, Src>>(to_acc(x)) * scale);
}

/* kVec elements moved as one aligned load or store. */
template <typename T> struct alignas(sizeof(T) * kVec) Pack {
    T v[kVec];
};

/* dst and src may be the same array (an in-place scale): each element is read and written by the
 * same thread, so no __restrict__. */
template <typename Dst, typename Src>
__global__ void cast_scale_kernel(Dst *dst, const Src *src, size_t n, acc_t<Dst, Src> scale) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = cast_one<Dst, Src>(src[i], scale);
}

/* Both arrays aligned to a Pack: whole packs first, then the n % kVec tail elements by the first
 * threads of the grid. */
template <typename Dst, typename Src>
__global__ void cast_scale_vec_kernel(Dst *dst, const Src *src, size_t n,
                                      acc_t<Dst, Src> scale) {
    size_t npack = n / kVec;
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    const Pack<Src> *in = reinterpret_cast<const Pack<Src> *>(src);
    Pack<Dst> *out = reinterpret_cast<Pack<Dst> *>(dst);
    for (size_t i = tid; i < npack; i += stride) {
        Pack<Src> a = in[i];
        Pack<Dst> b;
#pragma unroll
        for (int k = 0; k < kVec; k++) b.v[k] = cast_one<Dst, Src>(a.v[k], scale);
        out[i] = b;
    }
    size_t tail = npack * kVec + tid;
    if (tail < n) dst[tail] = cast_one<Dst, Src>(src[tail], scale);
}

template <typename Dst, typename Src>
ddpc_status cast_launch(void *dst, const void *src, size_t n, float scale, cudaStream_t stream,
                        const char *what) {
    using A = acc_t<Dst, Src>;
    bool vec = reinterpret_cast<uintptr_t>(dst) % alignof(Pack<Dst>) == 0 &&
               reinterpret_cast<uintptr_t>(src) % alignof(Pack<Src>) == 0;
    /* The vectorized kernel needs at least n % kVec threads for the tail: one block has them. */
    size_t threads = vec ? n / kVec : n;
    size_t grid = threads ? ceil_div(threads, kBlock) : 1;
    if (grid > kMaxGrid) grid = kMaxGrid;
    if (vec)
        cast_scale_vec_kernel<Dst, Src><<<(unsigned)grid, kBlock, 0, stream>>>(
            static_cast<Dst *>(dst), static_cast<const Src *>(src), n, static_cast<A>(scale));
    else
        cast_scale_kernel<Dst, Src><<<(unsigned)grid, kBlock, 0, stream>>>(
            static_cast<Dst *>(dst), static_cast<const Src *>(src), n, static_cast<A>(scale));
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return ddpc_error(DDPC_ERR_CUDA,
                          "launching the %s cast of %zu elements (grid %zu x %d, %s) failed: %s "
                          "(%s); the stream must belong to the current device (%s:%d)",
                          what, n, grid, kBlock, vec ? "vectorized" : "scalar",
                          cudaGetErrorName(e), cudaGetErrorString(e), __FILE__, __LINE__);
    return DDPC_OK;
}

template <typename Dst>
ddpc_status cast_from(void *dst, const void *src, ddpc_dtype src_dt, size_t n, float scale,
                      cudaStream_t stream, const char *what) {
    switch (src_dt) {
    case DDPC_FLOAT32: return cast_launch<Dst, float>(dst, src, n, scale, stream, what);
    case DDPC_FLOAT64: return cast_launch<Dst, double>(dst, src, n, scale, stream, what);
    case DDPC_FLOAT16: return cast_launch<Dst, __half>(dst, src, n, scale, stream, what);
    case DDPC_BFLOAT16: return cast_launch<Dst, __nv_bfloat16>(dst, src, n, scale, stream, what);
    default: break;
    }
    return ddpc_error(DDPC_ERR_INVALID, "device cast %s: unsupported source dtype", what);
}

/* Embedding rows (python/ddpc/_rows.py): block j looks at position j of the sorted ids; when it
 * starts a run of equal ids, it sums that run's rows in sorted order (row perm[k], or row k when
 * perm is NULL) and adds the sum times scale to grad's row of that id. The order of every
 * addition is fixed by the sorted ids alone, so every rank computes the same bits from the same
 * inputs. Ids < 0 (padding), == skip (the embedding's padding_idx) or >= num_rows are left out. */
template <typename G, typename R>
__global__ void rows_accumulate_kernel(G *grad, size_t num_rows, size_t width,
                                       const int64_t *__restrict__ ids,
                                       const int64_t *__restrict__ perm, size_t n,
                                       const R *__restrict__ rows, int64_t skip,
                                       acc_t<G, R> scale) {
    size_t j = blockIdx.x;
    int64_t id = ids[j];
    if (j > 0 && ids[j - 1] == id) return;
    if (id < 0 || id == skip || (uint64_t)id >= num_rows) return;
    using A = acc_t<G, R>;
    G *out = grad + (size_t)id * width;
    for (size_t c = threadIdx.x; c < width; c += blockDim.x) {
        A acc = 0;
        for (size_t k = j; k < n && ids[k] == id; k++)
            acc += static_cast<A>(to_acc(rows[(perm ? (size_t)perm[k] : k) * width + c]));
        out[c] = Convert<G>::from(static_cast<A>(to_acc(out[c])) + acc * scale);
    }
}

template <typename G, typename R>
ddpc_status rows_accumulate_launch(void *grad, size_t num_rows, size_t width, const int64_t *ids,
                                   const int64_t *perm, size_t n, const void *rows, int64_t skip,
                                   double scale, cudaStream_t stream) {
    unsigned threads = width >= 256 ? 256 : 32 * (unsigned)ceil_div(width, 32);
    rows_accumulate_kernel<G, R><<<(unsigned)n, threads, 0, stream>>>(
        static_cast<G *>(grad), num_rows, width, ids, perm, n, static_cast<const R *>(rows), skip,
        static_cast<acc_t<G, R>>(scale));
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return ddpc_error(DDPC_ERR_CUDA,
                          "launching the embedding rows' accumulation (%zu rows of %zu, grid %zu "
                          "x %u) failed: %s (%s); the stream must belong to the current device "
                          "(%s:%d)",
                          n, width, n, threads, cudaGetErrorName(e), cudaGetErrorString(e),
                          __FILE__, __LINE__);
    return DDPC_OK;
}

/* Calls f(TypeTag<T>()) with T the device type of float dtype dt (the caller has checked
 * is_float_dtype): one place for the dtype switch of the kernels that take two float dtypes. */
template <typename T>
struct TypeTag {
    using type = T;
};

template <typename F>
ddpc_status with_float_type(ddpc_dtype dt, F &&f) {
    switch (dt) {
    case DDPC_FLOAT32: return f(TypeTag<float>());
    case DDPC_FLOAT64: return f(TypeTag<double>());
    case DDPC_FLOAT16: return f(TypeTag<__half>());
    default: return f(TypeTag<__nv_bfloat16>());
    }
}

/* One block per slot j < cap of a rank's part of the rows' all-gather: ids_out[j] is the j-th
 * sorted index (-1 past n) and rows_out[j, :] the lookup output's gradient row perm[j] in the
 * wire dtype (zeros without a source; rows past n are left alone: ids -1 are never read). */
template <typename W, typename S>
__global__ void rows_pack_kernel(int64_t *ids_out, W *rows_out, size_t width,
                                 const int64_t *__restrict__ sorted_ids,
                                 const int64_t *__restrict__ perm, size_t n,
                                 const S *__restrict__ src) {
    size_t j = blockIdx.x;
    if (threadIdx.x == 0) ids_out[j] = j < n ? sorted_ids[j] : -1;
    if (j >= n) return;
    W *out = rows_out + j * width;
    if (!src) {
        for (size_t c = threadIdx.x; c < width; c += blockDim.x) out[c] = Convert<W>::from(0.0f);
        return;
    }
    const S *in = src + (perm ? (size_t)perm[j] : j) * width;
    for (size_t c = threadIdx.x; c < width; c += blockDim.x)
        out[c] = Convert<W>::from(static_cast<acc_t<W, S>>(to_acc(in[c])));
}

template <typename W, typename S>
ddpc_status rows_pack_launch(void *ids_out, void *rows_out, size_t cap, size_t width,
                             const int64_t *sorted_ids, const int64_t *perm, size_t n,
                             const void *src, cudaStream_t stream) {
    unsigned threads = width >= 256 ? 256 : 32 * (unsigned)ceil_div(width, 32);
    rows_pack_kernel<W, S><<<(unsigned)cap, threads, 0, stream>>>(
        static_cast<int64_t *>(ids_out), static_cast<W *>(rows_out), width, sorted_ids, perm, n,
        static_cast<const S *>(src));
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return ddpc_error(DDPC_ERR_CUDA,
                          "launching the embedding rows' packing (%zu of %zu slots, width %zu) "
                          "failed: %s (%s); the stream must belong to the current device (%s:%d)",
                          n, cap, width, cudaGetErrorName(e), cudaGetErrorString(e), __FILE__,
                          __LINE__);
    return DDPC_OK;
}

/* The embedding rows' sort of one lookup's indices: one block of kSortThreads threads, each
 * holding kSortItems consecutive indices (CUB's blocked arrangement, whose radix sort keeps equal
 * keys in input order: a stable sort). Up to DDPC_DEVICE_SORT_IDS_MAX indices, padded with the
 * largest key, which sorts after every real one of the end_bit bits it compares. */
constexpr int kSortThreads = 1024;
constexpr int kSortItems = DDPC_DEVICE_SORT_IDS_MAX / kSortThreads;
static_assert(kSortItems * kSortThreads == DDPC_DEVICE_SORT_IDS_MAX, "sort capacity");

__global__ void __launch_bounds__(kSortThreads)
sort_ids_kernel(const int64_t *__restrict__ ids, unsigned n, int end_bit,
                int64_t *__restrict__ sorted, int64_t *__restrict__ perm) {
    using Sort = cub::BlockRadixSort<uint32_t, kSortThreads, kSortItems, uint32_t, 4>;
    __shared__ typename Sort::TempStorage temp;
    uint32_t keys[kSortItems], pos[kSortItems];
    for (int i = 0; i < kSortItems; i++) {
        unsigned k = threadIdx.x * kSortItems + i;
        keys[i] = k < n ? static_cast<uint32_t>(ids[k]) : 0xffffffffu;
        pos[i] = k;
    }
    Sort(temp).Sort(keys, pos, 0, end_bit);
    for (int i = 0; i < kSortItems; i++) {
        unsigned k = threadIdx.x * kSortItems + i;
        if (k < n) {
            sorted[k] = keys[i];
            perm[k] = pos[i];
        }
    }
}

struct Srcs {
    const void *p[DDPC_DEVICE_REDUCE_MAX_SRCS];
};

template <typename T>
__global__ void reduce_into_kernel(T *dst, Srcs srcs, int nsrc, size_t n, int div) {
    using A = acc_t<T, T>;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        A acc = to_acc(dst[i]);
        for (int s = 0; s < nsrc; s++) acc += to_acc(static_cast<const T *>(srcs.p[s])[i]);
        if (div != 1) acc /= static_cast<A>(div);
        dst[i] = Convert<T>::from(acc);
    }
}

template <typename T>
ddpc_status reduce_launch(void *dst, const Srcs &srcs, int nsrc, size_t n, int div,
                          cudaStream_t stream, ddpc_dtype dt) {
    size_t grid = ceil_div(n, kBlock);
    /* A memory-bound pass: a few waves of blocks keep HBM busy, more only add scheduling. */
    if (grid > 1024) grid = 1024;
    reduce_into_kernel<T><<<(unsigned)grid, kBlock, 0, stream>>>(static_cast<T *>(dst), srcs, nsrc,
                                                                   n, div);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return ddpc_error(DDPC_ERR_CUDA,
                          "launching the %s reduction of %zu elements from %d sources (grid %zu x "
                          "%d) failed: %s (%s); the stream must belong to the current device "
                          "(%s:%d)",
                          ddpc_dtype_name(dt), n, nsrc, grid, kBlock, cudaGetErrorName(e),
                          cudaGetErrorString(e), __FILE__, __LINE__);
    return DDPC_OK;
}

/* Many (dst, src, n) arrays in one launch: block b works on array t, the one with
 * start[t] <= b < start[t + 1], elements [(b - start[t]) * kManyChunk, ... + kManyChunk). */
constexpr int kMany = 24;
constexpr size_t kManyChunk = 4096;
/* Packs per thread on the vectorized path: a block's chunk in one round of loads. */
constexpr int kManyPacks = (int)(kManyChunk / kVec / kBlock);
static_assert(kManyChunk % ((size_t)kVec * kBlock) == 0, "a chunk is whole packs per thread");
struct ManyArgs {
    void *dst[kMany];
    const void *src[kMany];
    size_t n[kMany];
    unsigned start[kMany + 1];
    int count;
    float scale; /* every element is multiplied by it (1: a plain cast) */
};

/* An array whose source and destination are both aligned to a Pack (as torch's allocations and
 * the reducer's slots are) moves as packs: each thread issues all its loads before its first
 * store, so a block keeps kManyChunk elements in flight instead of kBlock, which a memory-bound
 * cast needs to approach the GPU's bandwidth. Others go element by element. Either way each
 * element gets the same cast_one, so the bits do not depend on the path. */
template <typename Dst, typename Src>
__global__ void __launch_bounds__(kBlock) cast_many_kernel(ManyArgs a) {
    using A = acc_t<Dst, Src>;
    const A scale = static_cast<A>(a.scale);
    unsigned b = blockIdx.x;
    int t = 0;
    while (t + 1 < a.count && a.start[t + 1] <= b) t++;
    size_t from = (size_t)(b - a.start[t]) * kManyChunk;
    size_t to = from + kManyChunk < a.n[t] ? from + kManyChunk : a.n[t];
    Dst *dst = static_cast<Dst *>(a.dst[t]);
    const Src *src = static_cast<const Src *>(a.src[t]);
    if (reinterpret_cast<uintptr_t>(dst) % alignof(Pack<Dst>) == 0 &&
        reinterpret_cast<uintptr_t>(src) % alignof(Pack<Src>) == 0) {
        /* from is a multiple of kManyChunk, so of kVec: the chunk starts on a pack */
        const Pack<Src> *in = reinterpret_cast<const Pack<Src> *>(src + from);
        Pack<Dst> *out = reinterpret_cast<Pack<Dst> *>(dst + from);
        size_t npack = (to - from) / kVec;
        Pack<Src> v[kManyPacks];
#pragma unroll
        for (int k = 0; k < kManyPacks; k++) {
            size_t i = threadIdx.x + (size_t)k * kBlock;
            if (i < npack) v[k] = in[i];
        }
#pragma unroll
        for (int k = 0; k < kManyPacks; k++) {
            size_t i = threadIdx.x + (size_t)k * kBlock;
            if (i < npack) {
                Pack<Dst> o;
#pragma unroll
                for (int e = 0; e < kVec; e++) o.v[e] = cast_one<Dst, Src>(v[k].v[e], scale);
                out[i] = o;
            }
        }
        /* the array's last n % kVec elements, in its last chunk */
        size_t tail = from + npack * kVec + threadIdx.x;
        if (tail < to) dst[tail] = cast_one<Dst, Src>(src[tail], scale);
        return;
    }
    for (size_t i = from + threadIdx.x; i < to; i += blockDim.x)
        dst[i] = cast_one<Dst, Src>(src[i], scale);
}

template <typename Dst, typename Src>
ddpc_status cast_many_launch(const ManyArgs &a, cudaStream_t stream) {
    unsigned grid = a.start[a.count];
    cast_many_kernel<Dst, Src><<<grid, kBlock, 0, stream>>>(a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return ddpc_error(DDPC_ERR_CUDA,
                          "launching a cast of %d arrays (grid %u x %d) failed: %s (%s); the "
                          "stream must belong to the current device (%s:%d)",
                          a.count, grid, kBlock, cudaGetErrorName(e), cudaGetErrorString(e),
                          __FILE__, __LINE__);
    return DDPC_OK;
}

/* The (float32 or float64) <-> (bfloat16 or float16) pairs of the reducer's wire format, and
 * same-dtype copies. */
template <typename Dst>
ddpc_status cast_many_from(const ManyArgs &a, ddpc_dtype src_dt, cudaStream_t stream) {
    switch (src_dt) {
    case DDPC_FLOAT32: return cast_many_launch<Dst, float>(a, stream);
    case DDPC_FLOAT64: return cast_many_launch<Dst, double>(a, stream);
    case DDPC_FLOAT16: return cast_many_launch<Dst, __half>(a, stream);
    case DDPC_BFLOAT16: return cast_many_launch<Dst, __nv_bfloat16>(a, stream);
    default: break;
    }
    return ddpc_error(DDPC_ERR_INVALID, "device cast of many arrays: unsupported source dtype");
}

bool is_float_dtype(ddpc_dtype dt) {
    return dt == DDPC_FLOAT32 || dt == DDPC_FLOAT64 || dt == DDPC_FLOAT16 || dt == DDPC_BFLOAT16;
}

} // namespace

ddpc_status ddpc_device_zero(void *ptr, size_t bytes, uintptr_t stream) {
    if (bytes == 0) return DDPC_OK;
    if (!ptr)
        return ddpc_error(DDPC_ERR_INVALID, "ddpc_device_zero: NULL pointer for %zu bytes", bytes);
    DDPC_CUDACHECK(cudaMemsetAsync(ptr, 0, bytes, reinterpret_cast<cudaStream_t>(stream)));
    return DDPC_OK;
}

ddpc_status ddpc_device_stream_wait(uintptr_t waiter, uintptr_t signaler) {
    if (waiter == signaler) return DDPC_OK;
    cudaEvent_t ev;
    DDPC_CUDACHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cudaError_t e = cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(signaler));
    if (e == cudaSuccess) e = cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(waiter), ev, 0);
    /* Destroying an event that a wait has captured is allowed: the wait still completes. */
    cudaError_t d = cudaEventDestroy(ev);
    if (e != cudaSuccess)
        return ddpc_error(DDPC_ERR_CUDA, "ordering stream %#lx after stream %#lx failed: %s",
                          (unsigned long)waiter, (unsigned long)signaler, cudaGetErrorString(e));
    DDPC_CUDACHECK(d);
    return DDPC_OK;
}

ddpc_status ddpc_device_stream_create(uintptr_t *out) {
    *out = 0;
    int least = 0, greatest = 0;
    DDPC_CUDACHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t s = nullptr;
    DDPC_CUDACHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
    *out = reinterpret_cast<uintptr_t>(s);
    return DDPC_OK;
}

void ddpc_device_stream_destroy(uintptr_t stream) {
    cudaError_t e = cudaStreamDestroy(reinterpret_cast<cudaStream_t>(stream));
    if (e != cudaSuccess)
        DDPC_INFO("CUDA", "cudaStreamDestroy failed: %s", cudaGetErrorString(e));
}

ddpc_status ddpc_device_stream_finish(uintptr_t stream, int64_t timeout_ms) {
    int64_t deadline = ddpc_deadline(timeout_ms), next_check = ddpc_now_ms() + DDPC_SLICE_MS;
    unsigned pause_us = 20;
    for (;;) {
        cudaError_t e = cudaStreamQuery(reinterpret_cast<cudaStream_t>(stream));
        if (e == cudaSuccess) return DDPC_OK;
        if (e != cudaErrorNotReady)
            return ddpc_error(DDPC_ERR_CUDA, "waiting for the work on stream %#lx failed: %s",
                              (unsigned long)stream, cudaGetErrorString(e));
        if (ddpc_now_ms() >= deadline)
            return ddpc_error(DDPC_ERR_TIMEOUT, "the work on stream %#lx was not done after %lld "
                              "ms", (unsigned long)stream, (long long)timeout_ms);
        if (ddpc_now_ms() >= next_check) { /* (Ctrl-C, once a slice) */
            DDPC_CHECK(ddpc_check_interrupt());
            next_check = ddpc_now_ms() + DDPC_SLICE_MS;
        }
        struct timespec ts = {0, (long)pause_us * 1000L};
        nanosleep(&ts, nullptr);
        if (pause_us < 1000) pause_us *= 2;
    }
}

ddpc_status ddpc_device_cast(void *dst, ddpc_dtype dst_dt, const void *src, ddpc_dtype src_dt,
                             size_t n, float scale, uintptr_t stream) {
    char what[64];
    snprintf(what, sizeof what, "%s -> %s", ddpc_dtype_name(src_dt), ddpc_dtype_name(dst_dt));
    if (!is_float_dtype(dst_dt) || !is_float_dtype(src_dt))
        return ddpc_error(DDPC_ERR_INVALID,
                          "device cast %s: only float32, float64, float16 and bfloat16 are "
                          "supported",
                          what);
    if (n == 0) return DDPC_OK;
    if (!dst || !src)
        return ddpc_error(DDPC_ERR_INVALID, "device cast %s of %zu elements: %s pointer is NULL",
                          what, n, !dst ? "the destination" : "the source");
    size_t dst_bytes = n * ddpc_dtype_size(dst_dt), src_bytes = n * ddpc_dtype_size(src_dt);
    uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
    /* In place is fine when every element stays where it is; any other overlap would let one
     * thread overwrite an element another thread has not read yet. */
    if (d == s ? dst_bytes != src_bytes : (d < s + src_bytes && s < d + dst_bytes))
        return ddpc_error(DDPC_ERR_INVALID,
                          "device cast %s of %zu elements: source and destination overlap; they "
                          "must be the same array of an equally wide dtype, or disjoint",
                          what, n);
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    if (dst_dt == src_dt && scale == 1.0f) {
        if (d != s) DDPC_CUDACHECK(cudaMemcpyAsync(dst, src, dst_bytes, cudaMemcpyDeviceToDevice, st));
        return DDPC_OK;
    }
    switch (dst_dt) {
    case DDPC_FLOAT32: return cast_from<float>(dst, src, src_dt, n, scale, st, what);
    case DDPC_FLOAT64: return cast_from<double>(dst, src, src_dt, n, scale, st, what);
    case DDPC_FLOAT16: return cast_from<__half>(dst, src, src_dt, n, scale, st, what);
    case DDPC_BFLOAT16: return cast_from<__nv_bfloat16>(dst, src, src_dt, n, scale, st, what);
    default: break;
    }
    return ddpc_error(DDPC_ERR_INVALID, "device cast %s: unsupported destination dtype", what);
}

ddpc_status ddpc_device_reduce_into(void *dst, const void *const *srcs, int nsrc, ddpc_dtype dt,
                                    size_t n, int div, uintptr_t stream) {
    if (nsrc < 0 || nsrc > DDPC_DEVICE_REDUCE_MAX_SRCS || div < 1)
        return ddpc_error(DDPC_ERR_INVALID, "device reduce: %d sources (at most %d) and divisor %d "
                          "(at least 1)", nsrc, DDPC_DEVICE_REDUCE_MAX_SRCS, div);
    if (!is_float_dtype(dt))
        return ddpc_error(DDPC_ERR_INVALID, "device reduce of %s: only float32, float64, float16 "
                          "and bfloat16 are supported", ddpc_dtype_name(dt));
    if (n == 0 || (nsrc == 0 && div == 1)) return DDPC_OK;
    Srcs s = {};
    for (int i = 0; i < nsrc; i++) {
        if (!srcs[i] || !dst)
            return ddpc_error(DDPC_ERR_INVALID, "device reduce of %zu elements: a NULL pointer", n);
        s.p[i] = srcs[i];
    }
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    switch (dt) {
    case DDPC_FLOAT32: return reduce_launch<float>(dst, s, nsrc, n, div, st, dt);
    case DDPC_FLOAT64: return reduce_launch<double>(dst, s, nsrc, n, div, st, dt);
    case DDPC_FLOAT16: return reduce_launch<__half>(dst, s, nsrc, n, div, st, dt);
    case DDPC_BFLOAT16: return reduce_launch<__nv_bfloat16>(dst, s, nsrc, n, div, st, dt);
    default: break;
    }
    return ddpc_error(DDPC_ERR_INVALID, "device reduce: unsupported dtype");
}

ddpc_status ddpc_device_cast_many(int n, void *const *dsts, ddpc_dtype dst_dt,
                                  const void *const *srcs, ddpc_dtype src_dt,
                                  const size_t *counts, uintptr_t stream) {
    return ddpc_device_cast_many_scaled(n, dsts, dst_dt, srcs, src_dt, counts, 1.0f, stream);
}

ddpc_status ddpc_device_cast_many_scaled(int n, void *const *dsts, ddpc_dtype dst_dt,
                                         const void *const *srcs, ddpc_dtype src_dt,
                                         const size_t *counts, float scale, uintptr_t stream) {
    if (!is_float_dtype(dst_dt) || !is_float_dtype(src_dt))
        return ddpc_error(DDPC_ERR_INVALID,
                          "device cast of many arrays, %s -> %s: only float32, float64, float16 "
                          "and bfloat16 are supported",
                          ddpc_dtype_name(src_dt), ddpc_dtype_name(dst_dt));
    if (n < 0 || (n > 0 && (!dsts || !srcs || !counts)))
        return ddpc_error(DDPC_ERR_INVALID, "device cast of many arrays: %d arrays, NULL lists", n);
    size_t dsz = ddpc_dtype_size(dst_dt), ssz = ddpc_dtype_size(src_dt);
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    ManyArgs a = {};
    a.scale = scale;
    for (int k = 0; k <= n; k++) {
        /* Flush when the table is full, the grid would grow past what one launch takes, or at
         * the end. */
        size_t blocks = k < n ? ceil_div(counts[k], kManyChunk) : 0;
        if (a.count && (k == n || a.count == kMany || a.start[a.count] + blocks > (1u << 30))) {
            ddpc_status r;
            switch (dst_dt) {
            case DDPC_FLOAT32: r = cast_many_from<float>(a, src_dt, st); break;
            case DDPC_FLOAT64: r = cast_many_from<double>(a, src_dt, st); break;
            case DDPC_FLOAT16: r = cast_many_from<__half>(a, src_dt, st); break;
            default: r = cast_many_from<__nv_bfloat16>(a, src_dt, st); break;
            }
            if (r != DDPC_OK) return r;
            a = ManyArgs{};
            a.scale = scale;
        }
        if (k == n) break;
        if (!counts[k]) continue;
        uintptr_t d = reinterpret_cast<uintptr_t>(dsts[k]);
        uintptr_t s = reinterpret_cast<uintptr_t>(srcs[k]);
        if (!d || !s)
            return ddpc_error(DDPC_ERR_INVALID, "device cast of many arrays: array %d (%zu "
                              "elements) has a NULL %s", k, counts[k],
                              !d ? "destination" : "source");
        if (d < s + counts[k] * ssz && s < d + counts[k] * dsz)
            return ddpc_error(DDPC_ERR_INVALID, "device cast of many arrays: array %d's source and "
                              "destination overlap", k);
        if (blocks > (1u << 30))
            return ddpc_error(DDPC_ERR_INVALID, "device cast of many arrays: array %d has %zu "
                              "elements, too many for one launch", k, counts[k]);
        a.dst[a.count] = dsts[k];
        a.src[a.count] = srcs[k];
        a.n[a.count] = counts[k];
        a.start[a.count + 1] = a.start[a.count] + (unsigned)blocks;
        a.count++;
    }
    return DDPC_OK;
}

ddpc_status ddpc_device_rows_accumulate(void *grad, ddpc_dtype grad_dt, size_t num_rows,
                                        size_t width, const int64_t *sorted_ids,
                                        const int64_t *perm, size_t n, const void *rows,
                                        ddpc_dtype rows_dt, int64_t skip, double scale,
                                        uintptr_t stream) {
    if (!is_float_dtype(grad_dt) || !is_float_dtype(rows_dt))
        return ddpc_error(DDPC_ERR_INVALID,
                          "device rows accumulation, %s rows into a %s gradient: only float32, "
                          "float64, float16 and bfloat16 are supported",
                          ddpc_dtype_name(rows_dt), ddpc_dtype_name(grad_dt));
    if (n == 0 || width == 0) return DDPC_OK;
    if (!grad || !sorted_ids || !rows)
        return ddpc_error(DDPC_ERR_INVALID, "device rows accumulation of %zu rows: a NULL pointer",
                          n);
    if (n > 0x7fffffffu)
        return ddpc_error(DDPC_ERR_INVALID, "device rows accumulation: %zu rows, more than one "
                          "launch takes (2^31 - 1)", n);
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    return with_float_type(grad_dt, [&](auto g) {
        return with_float_type(rows_dt, [&](auto r) {
            return rows_accumulate_launch<typename decltype(g)::type, typename decltype(r)::type>(
                grad, num_rows, width, sorted_ids, perm, n, rows, skip, scale, st);
        });
    });
}

ddpc_status ddpc_device_rows_pack(void *ids_out, void *rows_out, ddpc_dtype wire_dt, size_t cap,
                                  size_t width, const int64_t *sorted_ids, const int64_t *perm,
                                  size_t n, const void *src, ddpc_dtype src_dt,
                                  uintptr_t stream) {
    if (!is_float_dtype(wire_dt) || !is_float_dtype(src_dt))
        return ddpc_error(DDPC_ERR_INVALID,
                          "device rows packing, %s rows into %s slots: only float32, float64, "
                          "float16 and bfloat16 are supported",
                          ddpc_dtype_name(src_dt), ddpc_dtype_name(wire_dt));
    if (n > cap)
        return ddpc_error(DDPC_ERR_INVALID, "device rows packing: %zu rows do not fit %zu slots",
                          n, cap);
    if (cap == 0 || width == 0) return DDPC_OK;
    if (!ids_out || !rows_out || (n && !sorted_ids))
        return ddpc_error(DDPC_ERR_INVALID, "device rows packing of %zu rows: a NULL pointer", n);
    if (cap > 0x7fffffffu)
        return ddpc_error(DDPC_ERR_INVALID, "device rows packing: %zu slots, more than one launch "
                          "takes (2^31 - 1)", cap);
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    return with_float_type(wire_dt, [&](auto w) {
        return with_float_type(src_dt, [&](auto r) {
            return rows_pack_launch<typename decltype(w)::type, typename decltype(r)::type>(
                ids_out, rows_out, cap, width, sorted_ids, perm, n, src, st);
        });
    });
}

ddpc_status ddpc_device_sort_ids(const int64_t *ids, size_t n, size_t num_rows, int64_t *sorted,
                                 int64_t *perm, uintptr_t stream) {
    if (n > DDPC_DEVICE_SORT_IDS_MAX)
        return ddpc_error(DDPC_ERR_INVALID, "device sort of %zu indices: one launch sorts at most "
                          "%d", n, DDPC_DEVICE_SORT_IDS_MAX);
    if (num_rows == 0 || num_rows > 0x80000000u)
        return ddpc_error(DDPC_ERR_INVALID, "device sort of indices into %zu rows: 1 to 2^31 rows "
                          "are supported", num_rows);
    if (n == 0) return DDPC_OK;
    if (!ids || !sorted || !perm)
        return ddpc_error(DDPC_ERR_INVALID, "device sort of %zu indices: a NULL pointer", n);
    int end_bit = 1;
    while (end_bit < 32 && ((size_t)1 << end_bit) < num_rows) end_bit++;
    sort_ids_kernel<<<1, kSortThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        ids, (unsigned)n, end_bit, sorted, perm);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return ddpc_error(DDPC_ERR_CUDA,
                          "launching the sort of %zu embedding indices failed: %s (%s); the stream "
                          "must belong to the current device (%s:%d)",
                          n, cudaGetErrorName(e), cudaGetErrorString(e), __FILE__, __LINE__);
    return DDPC_OK;
}
