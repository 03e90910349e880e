/* cast_bandwidth.c: how fast ddpc_device_cast_many (csrc/kernels.cu) moves a GPT-2 step's
 * gradients between float32 and bfloat16, the reducer's casts to the wire and back. Built and run
 * by cast_bandwidth.py. The 148 arrays have GPT-2's parameter sizes (12 layers, width 768,
 * vocabulary 50304, 1024 positions), laid out one after another on 16-byte boundaries, as the
 * reducer's slots are. "offset" runs the same arrays one element past those boundaries, which
 * takes the kernel's element-wise path. A device-to-device cudaMemcpy of the same bytes read and
 * written is the reference. Prints one line per case: median ms over the timed calls and GB/s of
 * bytes read plus written. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "ddpc.h"

#define N_PARAMS 148
#define ITERS 30

#define CUDA_OK(x)                                                                           \
    do {                                                                                     \
        cudaError_t e_ = (x);                                                                \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s failed: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, \
                    __LINE__);                                                               \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

static size_t gpt2_sizes(size_t *n) {
    const size_t w = 768, v = 50304, pos = 1024;
    int k = 0;
    n[k++] = v * w;
    n[k++] = pos * w;
    for (int l = 0; l < 12; l++) {
        size_t layer[12] = {w, w, w * 3 * w, 3 * w, w * w, w, w, w, w * 4 * w, 4 * w, 4 * w * w, w};
        for (int j = 0; j < 12; j++) n[k++] = layer[j];
    }
    n[k++] = w;
    n[k++] = w;
    size_t total = 0;
    for (int j = 0; j < k; j++) total += n[j];
    return total;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Times ITERS calls of one case after 3 warm-up calls; returns the median in ms. */
static float time_case(int memcpy_ref, char *dst, ddpc_dtype dt_dst, const char *src,
                       ddpc_dtype dt_src, const size_t *n, size_t offset, size_t bytes) {
    void *dsts[N_PARAMS];
    const void *srcs[N_PARAMS];
    size_t at = 0;
    for (int k = 0; k < N_PARAMS; k++) {
        dsts[k] = dst + (at + offset) * ddpc_dtype_size(dt_dst);
        srcs[k] = src + (at + offset) * ddpc_dtype_size(dt_src);
        at += (n[k] + 3) / 4 * 4 + 4;
    }
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    float ms[ITERS];
    for (int i = -3; i < ITERS; i++) {
        CUDA_OK(cudaEventRecord(a, 0));
        if (memcpy_ref) {
            CUDA_OK(cudaMemcpyAsync(dst, src, bytes / 2, cudaMemcpyDeviceToDevice, 0));
        } else if (ddpc_device_cast_many(N_PARAMS, dsts, dt_dst, srcs, dt_src, n, 0) != DDPC_OK) {
            fprintf(stderr, "cast_many failed: %s\n", ddpc_last_error());
            exit(1);
        }
        CUDA_OK(cudaEventRecord(b, 0));
        CUDA_OK(cudaEventSynchronize(b));
        if (i >= 0) CUDA_OK(cudaEventElapsedTime(&ms[i], a, b));
    }
    CUDA_OK(cudaEventDestroy(a));
    CUDA_OK(cudaEventDestroy(b));
    qsort(ms, ITERS, sizeof ms[0], cmp_float);
    return ms[ITERS / 2];
}

int main(void) {
    size_t n[N_PARAMS];
    size_t elems = gpt2_sizes(n), room = 0;
    for (int k = 0; k < N_PARAMS; k++) room += (n[k] + 3) / 4 * 4 + 4;
    room += 8;
    char *f32 = NULL, *b16 = NULL;
    CUDA_OK(cudaMalloc((void **)&f32, room * 4));
    CUDA_OK(cudaMalloc((void **)&b16, room * 4)); /* room for the float32 -> float32 copy */
    CUDA_OK(cudaMemset(f32, 0x3F, room * 4));
    CUDA_OK(cudaMemset(b16, 0x3F, room * 4));
    size_t cast_bytes = elems * 6, copy_bytes = elems * 8;
    struct {
        const char *name;
        int ref;
        ddpc_dtype dst, src;
        size_t offset, bytes;
    } cases[] = {
        {"float32 -> bfloat16 (to the wire)", 0, DDPC_BFLOAT16, DDPC_FLOAT32, 0, cast_bytes},
        {"float32 -> bfloat16, offset", 0, DDPC_BFLOAT16, DDPC_FLOAT32, 1, cast_bytes},
        {"bfloat16 -> float32 (back)", 0, DDPC_FLOAT32, DDPC_BFLOAT16, 0, cast_bytes},
        {"bfloat16 -> float32, offset", 0, DDPC_FLOAT32, DDPC_BFLOAT16, 1, cast_bytes},
        {"float32 -> float32 (into slots)", 0, DDPC_FLOAT32, DDPC_FLOAT32, 0, copy_bytes},
        {"float32 -> float32, offset", 0, DDPC_FLOAT32, DDPC_FLOAT32, 1, copy_bytes},
        {"cudaMemcpy, float32 bytes", 1, DDPC_FLOAT32, DDPC_FLOAT32, 0, copy_bytes},
    };
    printf("%zu elements in %d arrays (GPT-2's parameters); median of %d calls\n", elems, N_PARAMS,
           ITERS);
    printf("%-36s %9s %9s\n", "case", "ms", "GB/s");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        /* float32 sources and destinations live in f32, bfloat16 ones in b16 */
        char *dst = cases[c].dst == DDPC_FLOAT32 && cases[c].src != DDPC_FLOAT32 ? f32 : b16;
        const char *src = cases[c].src == DDPC_FLOAT32 ? f32 : b16;
        float ms = time_case(cases[c].ref, dst, cases[c].dst, src, cases[c].src, n,
                             cases[c].offset, cases[c].bytes);
        printf("%-36s %9.3f %9.0f\n", cases[c].name, ms, cases[c].bytes / (ms * 1e-3) / 1e9);
    }
    CUDA_OK(cudaFree(f32));
    CUDA_OK(cudaFree(b16));
    return 0;
}
