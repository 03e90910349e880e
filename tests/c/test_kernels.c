/* test_kernels.c: csrc/kernels.cu on a real GPU: ddpc_device_cast for every pair of float dtypes,
 * vectorized and scalar paths, odd lengths, in place, against the host conversion of reduce.c bit
 * for bit; ddpc_device_cast_many; ddpc_device_zero; and the argument checks. Prints "ok: ..." and
 * exits 0 on success. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "check.h"

#define CUDA_OK(call)                                                                  \
    do {                                                                               \
        cudaError_t e_ = (call);                                                       \
        if (e_ != cudaSuccess) {                                                       \
            fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_),  \
                    __FILE__, __LINE__);                                               \
            exit(2);                                                                   \
        }                                                                              \
    } while (0)

static const ddpc_dtype k_float_types[] = {DDPC_FLOAT32, DDPC_FLOAT64, DDPC_FLOAT16,
                                           DDPC_BFLOAT16};

/* Deterministic values spanning signs, magnitudes and (for the half types) rounding cases. */
static void fill_f32(float *x, size_t n, unsigned seed) {
    unsigned s = seed * 2654435761u + 12345u;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        float u = (float)(s >> 8) / (float)(1u << 24);           /* [0, 1) */
        float mag = powf(10.0f, 6.0f * u - 3.0f);                 /* 1e-3 .. 1e3 */
        x[i] = (s & 1u) ? -mag : mag;
    }
}

static int is_half(ddpc_dtype dt) { return dt == DDPC_FLOAT16 || dt == DDPC_BFLOAT16; }

static double half_to_double(uint16_t bits, ddpc_dtype dt) {
    double d = 0;
    ddpc_convert_host(&d, DDPC_FLOAT64, &bits, dt, 1);
    return d;
}

/* Is `got` a half value nearest to `exact` (no neighbor, one bit pattern away, is closer)?
 * The host converts double to a half type through float, rounding twice; the kernel rounds once,
 * so for those casts this is the property to check, not equality with the host. */
static int is_nearest_half(uint16_t got, ddpc_dtype dt, double exact) {
    double v = half_to_double(got, dt);
    if (isnan(v)) return 0;
    double dist = fabs(v - exact);
    for (int step = -1; step <= 1; step += 2) {
        uint16_t nb = (uint16_t)(got + step);
        if ((nb ^ got) & 0x8000u) continue; /* wrapped across the sign */
        double n = half_to_double(nb, dt);
        if (!isnan(n) && fabs(n - exact) < dist) return 0;
    }
    return 1;
}

/* The value the kernel must produce: scale applied in double when either side is float64, else
 * in float, then one rounding to the destination (the rule kernels.cu documents). */
static void reference(void *dst, ddpc_dtype dst_dt, const void *src, ddpc_dtype src_dt, size_t n,
                      float scale) {
    double *wide = malloc(n * sizeof(double) + 1);
    ddpc_convert_host(wide, DDPC_FLOAT64, src, src_dt, n);
    if (dst_dt == DDPC_FLOAT64 || src_dt == DDPC_FLOAT64) {
        for (size_t i = 0; i < n; i++) wide[i] *= (double)scale;
        ddpc_convert_host(dst, dst_dt, wide, DDPC_FLOAT64, n);
    } else {
        float *f = malloc(n * sizeof(float) + 1);
        for (size_t i = 0; i < n; i++) f[i] = (float)wide[i] * scale;
        ddpc_convert_host(dst, dst_dt, f, DDPC_FLOAT32, n);
        free(f);
    }
    free(wide);
}

static void check_cast(ddpc_dtype dst_dt, ddpc_dtype src_dt, size_t n, size_t offset,
                       float scale) {
    size_t ss = ddpc_dtype_size(src_dt), ds = ddpc_dtype_size(dst_dt);
    float *f = malloc(n * sizeof(float) + 1);
    char *src = malloc(n * ss + 1), *want = malloc(n * ds + 1), *got = malloc(n * ds + 1);
    fill_f32(f, n, (unsigned)(n + 31 * src_dt + 7 * dst_dt));
    ddpc_convert_host(src, src_dt, f, DDPC_FLOAT32, n);
    reference(want, dst_dt, src, src_dt, n, scale);
    char *d_src = NULL, *d_dst = NULL;
    /* offset elements in: a misaligned start takes the scalar kernel. */
    CUDA_OK(cudaMalloc((void **)&d_src, (n + offset) * ss + 16));
    CUDA_OK(cudaMalloc((void **)&d_dst, (n + offset) * ds + 16));
    CUDA_OK(cudaMemcpy(d_src + offset * ss, src, n * ss, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_dst, 0xAB, (n + offset) * ds + 16));
    ddpc_status st = ddpc_device_cast(d_dst + offset * ds, dst_dt, d_src + offset * ss, src_dt, n,
                                      scale, 0);
    EXPECT(st == DDPC_OK, "cast %s->%s n=%zu: %s", ddpc_dtype_name(src_dt),
           ddpc_dtype_name(dst_dt), n, ddpc_last_error());
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(got, d_dst + offset * ds, n * ds, cudaMemcpyDeviceToHost));
    size_t bad = n;
    if (is_half(dst_dt) && src_dt == DDPC_FLOAT64) {
        double *exact = malloc(n * sizeof(double) + 1);
        ddpc_convert_host(exact, DDPC_FLOAT64, src, src_dt, n);
        for (size_t i = 0; i < n && bad == n; i++) {
            uint16_t bits;
            memcpy(&bits, got + i * 2, 2);
            if (!is_nearest_half(bits, dst_dt, exact[i] * (double)scale)) bad = i;
        }
        free(exact);
    } else {
        for (size_t i = 0; i < n && bad == n; i++)
            if (memcmp(got + i * ds, want + i * ds, ds)) bad = i;
    }
    EXPECT(bad == n, "cast %s->%s n=%zu offset=%zu scale=%g: element %zu differs from the host "
           "reference", ddpc_dtype_name(src_dt), ddpc_dtype_name(dst_dt), n, offset,
           (double)scale, bad);
    /* Nothing past the end was written. */
    unsigned char tail[16];
    CUDA_OK(cudaMemcpy(tail, d_dst + (offset + n) * ds, sizeof tail, cudaMemcpyDeviceToHost));
    int clean = 1;
    for (size_t i = 0; i < sizeof tail; i++) clean &= tail[i] == 0xAB;
    EXPECT(clean, "cast %s->%s n=%zu wrote past the end", ddpc_dtype_name(src_dt),
           ddpc_dtype_name(dst_dt), n);
    CUDA_OK(cudaFree(d_src));
    CUDA_OK(cudaFree(d_dst));
    free(f);
    free(src);
    free(want);
    free(got);
}

static void check_in_place(void) {
    size_t n = 1001;
    float host[1001], want[1001];
    fill_f32(host, n, 99);
    for (size_t i = 0; i < n; i++) want[i] = host[i] * 0.25f;
    float *d = NULL;
    CUDA_OK(cudaMalloc((void **)&d, n * sizeof(float)));
    CUDA_OK(cudaMemcpy(d, host, sizeof host, cudaMemcpyHostToDevice));
    EXPECT(ddpc_device_cast(d, DDPC_FLOAT32, d, DDPC_FLOAT32, n, 0.25f, 0) == DDPC_OK,
           "in-place scale: %s", ddpc_last_error());
    CUDA_OK(cudaMemcpy(host, d, sizeof host, cudaMemcpyDeviceToHost));
    EXPECT(!memcmp(host, want, sizeof host), "in-place scale gave wrong values");
    /* Overlapping but not identical, or identical with a narrower destination: refused. */
    EXPECT(ddpc_device_cast(d + 1, DDPC_FLOAT32, d, DDPC_FLOAT32, 10, 2.0f, 0) == DDPC_ERR_INVALID,
           "a shifted overlap was accepted");
    EXPECT(strstr(ddpc_last_error(), "overlap") != NULL, "message: %s", ddpc_last_error());
    EXPECT(ddpc_device_cast(d, DDPC_BFLOAT16, d, DDPC_FLOAT32, 10, 1.0f, 0) == DDPC_ERR_INVALID,
           "an in-place narrowing was accepted");
    CUDA_OK(cudaFree(d));
}

static void check_zero_and_args(void) {
    unsigned char host[4096];
    unsigned char *d = NULL;
    CUDA_OK(cudaMalloc((void **)&d, sizeof host));
    CUDA_OK(cudaMemset(d, 0xFF, sizeof host));
    EXPECT(ddpc_device_zero(d + 100, 1000, 0) == DDPC_OK, "zero: %s", ddpc_last_error());
    CUDA_OK(cudaMemcpy(host, d, sizeof host, cudaMemcpyDeviceToHost));
    int ok = 1;
    for (size_t i = 0; i < sizeof host; i++) ok &= host[i] == ((i >= 100 && i < 1100) ? 0 : 0xFF);
    EXPECT(ok, "ddpc_device_zero touched the wrong bytes");
    EXPECT(ddpc_device_zero(NULL, 0, 0) == DDPC_OK, "zero bytes at NULL must be a no-op");
    EXPECT(ddpc_device_zero(NULL, 8, 0) == DDPC_ERR_INVALID, "NULL with bytes was accepted");
    EXPECT(ddpc_device_cast(d, DDPC_INT32, d + 64, DDPC_FLOAT32, 4, 1.0f, 0) == DDPC_ERR_INVALID,
           "an integer destination was accepted");
    EXPECT(strstr(ddpc_last_error(), "float32 -> int32") != NULL, "message: %s",
           ddpc_last_error());
    EXPECT(ddpc_device_cast(NULL, DDPC_FLOAT32, d, DDPC_FLOAT16, 4, 1.0f, 0) == DDPC_ERR_INVALID,
           "a NULL destination was accepted");
    EXPECT(ddpc_device_cast(NULL, DDPC_FLOAT32, NULL, DDPC_FLOAT16, 0, 1.0f, 0) == DDPC_OK,
           "zero elements must be a no-op");
    CUDA_OK(cudaFree(d));
}

/* ddpc_device_cast_many: 60 arrays (more than one launch's table) of lengths from 0 to past a
 * block's chunk, bfloat16 <-> float32 both ways, each against the host conversion bit for bit,
 * with the bytes between the arrays untouched; then the argument checks. Even arrays start on a
 * 4-element boundary (the kernel's vectorized path), odd ones one element past it (its
 * element-wise path). */
static void check_cast_many(ddpc_dtype dst_dt, ddpc_dtype src_dt) {
    enum { N = 60 };
    size_t ss = ddpc_dtype_size(src_dt), ds = ddpc_dtype_size(dst_dt);
    size_t counts[N], at[N], total = 0;
    for (int k = 0; k < N; k++) {
        counts[k] = k == 7 ? 0 : (size_t)(k * k * 37 % 9001) + (k % 3 == 0 ? 4096 : 1);
        total += 5; /* a gap the kernel must not write */
        total = (total + 3) / 4 * 4 + (size_t)(k % 2);
        at[k] = total;
        total += counts[k];
    }
    total += 5;
    float *f = malloc(total * sizeof(float));
    fill_f32(f, total, 7);
    unsigned char *src = malloc(total * ss), *want = malloc(total * ds), *got = malloc(total * ds);
    ddpc_convert_host(src, src_dt, f, DDPC_FLOAT32, total);
    memset(want, 0x5A, total * ds);
    for (int k = 0; k < N; k++)
        reference(want + at[k] * ds, dst_dt, src + at[k] * ss, src_dt, counts[k], 1.0f);
    unsigned char *d_src = NULL, *d_dst = NULL;
    CUDA_OK(cudaMalloc((void **)&d_src, total * ss));
    CUDA_OK(cudaMalloc((void **)&d_dst, total * ds));
    CUDA_OK(cudaMemcpy(d_src, src, total * ss, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_dst, 0x5A, total * ds));
    void *dsts[N];
    const void *srcs[N];
    for (int k = 0; k < N; k++) {
        dsts[k] = d_dst + at[k] * ds;
        srcs[k] = d_src + at[k] * ss;
    }
    EXPECT(ddpc_device_cast_many(N, dsts, dst_dt, srcs, src_dt, counts, 0) == DDPC_OK,
           "cast_many %s -> %s: %s", ddpc_dtype_name(src_dt), ddpc_dtype_name(dst_dt),
           ddpc_last_error());
    CUDA_OK(cudaMemcpy(got, d_dst, total * ds, cudaMemcpyDeviceToHost));
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < total * ds; i++)
        if (got[i] != want[i] && bad++ == 0) first = i;
    EXPECT(bad == 0, "cast_many %s -> %s: %zu wrong bytes, the first at byte %zu",
           ddpc_dtype_name(src_dt), ddpc_dtype_name(dst_dt), bad, first);
    /* an overlapping pair, a NULL array with elements, and integer dtypes are refused */
    dsts[3] = (void *)srcs[3];
    EXPECT(ddpc_device_cast_many(N, dsts, dst_dt, srcs, src_dt, counts, 0) == DDPC_ERR_INVALID &&
               strstr(ddpc_last_error(), "overlap"), "an overlap was accepted: %s",
           ddpc_last_error());
    dsts[3] = NULL;
    EXPECT(ddpc_device_cast_many(N, dsts, dst_dt, srcs, src_dt, counts, 0) == DDPC_ERR_INVALID,
           "a NULL destination was accepted");
    EXPECT(ddpc_device_cast_many(1, dsts, DDPC_INT32, srcs, src_dt, counts, 0) ==
               DDPC_ERR_INVALID, "an integer destination was accepted");
    EXPECT(ddpc_device_cast_many(0, NULL, dst_dt, NULL, src_dt, NULL, 0) == DDPC_OK,
           "no arrays must be a no-op");
    CUDA_OK(cudaFree(d_src));
    CUDA_OK(cudaFree(d_dst));
    free(f);
    free(src);
    free(want);
    free(got);
}

int main(void) {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("skip: no CUDA device\n");
        return 0;
    }
    static const size_t sizes[] = {1, 3, 4, 5, 1000, 4099, 1u << 20, (1u << 20) + 3};
    static const float scales[] = {1.0f, 0.5f, 1.0f / 3.0f};
    for (size_t a = 0; a < 4; a++)
        for (size_t b = 0; b < 4; b++)
            for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
                for (size_t k = 0; k < sizeof scales / sizeof *scales; k++) {
                    check_cast(k_float_types[a], k_float_types[b], sizes[s], 0, scales[k]);
                    check_cast(k_float_types[a], k_float_types[b], sizes[s], 1, scales[k]);
                }
    check_in_place();
    check_zero_and_args();
    check_cast_many(DDPC_BFLOAT16, DDPC_FLOAT32);
    check_cast_many(DDPC_FLOAT32, DDPC_BFLOAT16);
    check_cast_many(DDPC_FLOAT16, DDPC_FLOAT64);
    check_cast_many(DDPC_FLOAT32, DDPC_FLOAT32); /* the reducer's copies into bucket slots */
    return check_summary("test_kernels");
}
