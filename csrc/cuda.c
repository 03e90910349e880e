/* cuda.c: device discovery and binding for the CUDA runtime (linked statically), plus what a
 * CPU-only build (DDPC_NO_CUDA=1 or no toolkit) answers instead: no devices, and a message that
 * says how to get a build with CUDA. */
#include <stdlib.h>

#include "common.h"

#define DDPC_NO_CUDA_HINT                                                                       \
    "this build of ddpc has no CUDA support (it was built with DDPC_NO_CUDA=1 or without the "  \
    "CUDA toolkit): install the toolkit (nvcc on PATH or CUDA_HOME set), unset DDPC_NO_CUDA and " \
    "rebuild with `pip install --no-build-isolation -e .`; the cpu backend works without it"

#ifdef DDPC_WITH_CUDA

int ddpc_cuda_built(void) { return 1; }

int ddpc_cuda_device_count(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        /* No driver (cudaErrorInsufficientDriver) or no device (cudaErrorNoDevice) is a normal
         * answer on a CPU machine, not a failure; clear it so later calls do not see it. */
        (void)cudaGetLastError();
        DDPC_INFO("CUDA", "no usable CUDA device: %s (%s)", cudaGetErrorName(e),
                  cudaGetErrorString(e));
        return 0;
    }
    return n;
}

ddpc_status ddpc_cuda_set_device(int dev) {
    int n = ddpc_cuda_device_count();
    if (n == 0) {
        const char *vis = getenv("CUDA_VISIBLE_DEVICES");
        return ddpc_error(DDPC_ERR_UNAVAILABLE,
                          "no CUDA device is visible to this process (no GPU, no NVIDIA driver, or "
                          "CUDA_VISIBLE_DEVICES=%s hides them all): run `python -m ddpc.doctor`, "
                          "or use the cpu backend",
                          vis ? vis : "<unset>");
    }
    if (dev < 0 || dev >= n)
        return ddpc_error(DDPC_ERR_INVALID,
                          "CUDA device %d does not exist: %d device%s visible (ordinals 0..%d, "
                          "after CUDA_VISIBLE_DEVICES); give each process one ordinal, usually "
                          "LOCAL_RANK",
                          dev, n, n == 1 ? " is" : "s are", n - 1);
    DDPC_CUDACHECK(cudaSetDevice(dev));
    return DDPC_OK;
}

#else /* !DDPC_WITH_CUDA */

int ddpc_cuda_built(void) { return 0; }

int ddpc_cuda_device_count(void) { return 0; }

ddpc_status ddpc_cuda_set_device(int dev) {
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot bind CUDA device %d: " DDPC_NO_CUDA_HINT, dev);
}

/* In a CUDA build these live in kernels.cu. */
ddpc_status ddpc_device_zero(void *ptr, size_t bytes, uintptr_t stream) {
    (void)ptr;
    (void)stream;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot zero %zu bytes of device memory: "
                      DDPC_NO_CUDA_HINT, bytes);
}

ddpc_status ddpc_device_stream_wait(uintptr_t waiter, uintptr_t signaler) {
    if (waiter == signaler) return DDPC_OK;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot order CUDA streams: " DDPC_NO_CUDA_HINT);
}

ddpc_status ddpc_device_stream_create(uintptr_t *out) {
    *out = 0;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot make a CUDA stream: " DDPC_NO_CUDA_HINT);
}

void ddpc_device_stream_destroy(uintptr_t stream) { (void)stream; }

ddpc_status ddpc_device_stream_finish(uintptr_t stream, int64_t timeout_ms) {
    (void)stream;
    (void)timeout_ms;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot wait for a CUDA stream: " DDPC_NO_CUDA_HINT);
}

ddpc_status ddpc_device_cast(void *dst, ddpc_dtype dst_dt, const void *src, ddpc_dtype src_dt,
                             size_t n, float scale, uintptr_t stream) {
    (void)dst;
    (void)src;
    (void)scale;
    (void)stream;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot cast %zu elements from %s to %s on a device: "
                      DDPC_NO_CUDA_HINT, n, ddpc_dtype_name(src_dt), ddpc_dtype_name(dst_dt));
}

ddpc_status ddpc_device_cast_many_scaled(int n, void *const *dsts, ddpc_dtype dst_dt,
                                         const void *const *srcs, ddpc_dtype src_dt,
                                         const size_t *counts, float scale, uintptr_t stream) {
    (void)scale;
    return ddpc_device_cast_many(n, dsts, dst_dt, srcs, src_dt, counts, stream);
}

ddpc_status ddpc_device_cast_many(int n, void *const *dsts, ddpc_dtype dst_dt,
                                  const void *const *srcs, ddpc_dtype src_dt,
                                  const size_t *counts, uintptr_t stream) {
    (void)dsts;
    (void)srcs;
    (void)counts;
    (void)stream;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot cast %d arrays from %s to %s on a device: "
                      DDPC_NO_CUDA_HINT, n, ddpc_dtype_name(src_dt), ddpc_dtype_name(dst_dt));
}

ddpc_status ddpc_device_reduce_into(void *dst, const void *const *srcs, int nsrc, ddpc_dtype dt,
                                    size_t n, int div, uintptr_t stream) {
    (void)dst;
    (void)srcs;
    (void)nsrc;
    (void)div;
    (void)stream;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot reduce %zu elements of %s on a device: "
                      DDPC_NO_CUDA_HINT, n, ddpc_dtype_name(dt));
}

ddpc_status ddpc_device_rows_accumulate(void *grad, ddpc_dtype grad_dt, size_t num_rows,
                                        size_t width, const int64_t *sorted_ids,
                                        const int64_t *perm, size_t n, const void *rows,
                                        ddpc_dtype rows_dt, int64_t skip, double scale,
                                        uintptr_t stream) {
    (void)grad;
    (void)num_rows;
    (void)width;
    (void)sorted_ids;
    (void)perm;
    (void)rows;
    (void)rows_dt;
    (void)skip;
    (void)scale;
    (void)stream;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot add %zu embedding rows into a %s gradient on "
                      "a device: " DDPC_NO_CUDA_HINT, n, ddpc_dtype_name(grad_dt));
}

ddpc_status ddpc_device_sort_ids(const int64_t *ids, size_t n, size_t num_rows, int64_t *sorted,
                                 int64_t *perm, uintptr_t stream) {
    (void)ids;
    (void)num_rows;
    (void)sorted;
    (void)perm;
    (void)stream;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot sort %zu embedding indices on a device: "
                      DDPC_NO_CUDA_HINT, n);
}

ddpc_status ddpc_device_rows_pack(void *ids_out, void *rows_out, ddpc_dtype wire_dt, size_t cap,
                                  size_t width, const int64_t *sorted_ids, const int64_t *perm,
                                  size_t n, const void *src, ddpc_dtype src_dt, uintptr_t stream) {
    (void)ids_out;
    (void)rows_out;
    (void)cap;
    (void)width;
    (void)sorted_ids;
    (void)perm;
    (void)src;
    (void)src_dt;
    (void)stream;
    return ddpc_error(DDPC_ERR_UNAVAILABLE, "cannot pack %zu embedding rows as %s on a device: "
                      DDPC_NO_CUDA_HINT, n, ddpc_dtype_name(wire_dt));
}

#endif
