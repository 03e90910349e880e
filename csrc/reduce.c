/* reduce.c: host reductions (sum, avg, min, max, prod; band, bor, bxor of integers) and float
 * conversions for every ddpc
 * dtype. Plain loops over restrict pointers that gcc -O3 vectorizes; float16 and bfloat16 go
 * through float in L1-sized blocks, with bit-exact round-to-nearest-even conversions. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

/* With FP exception flags assumed observable (gcc's default -ftrapping-math), gcc refuses to
 * if-convert the float selects below (NaN-propagating min/max, the half conversions) and leaves
 * those loops scalar. Nothing in ddpc reads the flags. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

/* Elements per block: float16/bfloat16 blocks are widened to two float arrays of this size on the
 * stack (16 KiB), and n-ary reductions revisit the output block once per input while it is hot. */
#define BLK 2048

size_t ddpc_dtype_size(ddpc_dtype dt) {
    static const size_t sizes[DDPC_NUM_DTYPES] = {4, 8, 2, 2, 4, 8, 1, 1};
    return (unsigned)dt < DDPC_NUM_DTYPES ? sizes[dt] : 0;
}

const char *ddpc_dtype_name(ddpc_dtype dt) {
    static const char *names[DDPC_NUM_DTYPES] = {"float32", "float64", "float16", "bfloat16",
                                                 "int32",   "int64",   "uint8",   "int8"};
    return (unsigned)dt < DDPC_NUM_DTYPES ? names[dt] : "unknown dtype";
}

const char *ddpc_redop_name(ddpc_redop op) {
    static const char *names[DDPC_NUM_REDOPS] = {"sum", "avg",  "min", "max",
                                                 "prod", "band", "bor", "bxor"};
    return (unsigned)op < DDPC_NUM_REDOPS ? names[op] : "unknown op";
}

/* ---------------------------------------------------------------- float16 / bfloat16 */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Half -> float without branches (so the block loops vectorize). Normal halves: shift the
 * exponent and mantissa into place and let one multiply by 2^-112 fix the exponent bias (inf and
 * NaN land on float's inf/NaN exponent). Subnormal halves: build 0.5 + m*2^-24... as a float
 * whose mantissa holds m, then subtract 0.5, which the FPU does exactly. */
static inline float half_to_float(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    uint32_t sign = w & 0x80000000u;
    uint32_t two_w = w + w;
    float normal = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float subnormal = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t mag = two_w < (1u << 27) ? f32_bits(subnormal) : f32_bits(normal);
    return f32_from_bits(sign | mag);
}

/* Float -> half, round to nearest even, also without branches. Scaling |f| by 2^112 then 2^-110
 * overflows exactly the values that round to half's inf and leaves the rest scaled by 4; adding
 * a power of two chosen from f's exponent (at least 2^-14 * 2^...: half's subnormal step) makes
 * the FPU's own round-to-nearest-even drop the bits half cannot hold. NaN becomes a quiet NaN of
 * the same sign. */
static inline uint16_t half_from_float(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = f32_bits(f);
    uint32_t shl1 = w + w;
    uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1 & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    uint32_t b = f32_bits(base);
    uint32_t nonsign = ((b >> 13) & 0x7C00u) + (b & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float bf16_to_float(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* Round to nearest even by adding 0x7FFF plus the lowest kept bit; NaN is kept (made quiet)
 * rather than rounded, which could carry it into inf. */
static inline uint16_t bf16_from_float(float f) {
    uint32_t x = f32_bits(f);
    uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
    uint32_t nan = (x >> 16) | 0x0040u;
    return (uint16_t)((x & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

static void half_block_to_float(float *restrict dst, const uint16_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = half_to_float(src[i]);
}
static void half_block_from_float(uint16_t *restrict dst, const float *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = half_from_float(src[i]);
}
static void bf16_block_to_float(float *restrict dst, const uint16_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
}
static void bf16_block_from_float(uint16_t *restrict dst, const float *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = bf16_from_float(src[i]);
}

/* ---------------------------------------------------------------- elementwise kernels */

/* Integer SUM and PROD wrap around like the dtype (NumPy and torch do the same); the arithmetic
 * runs in the unsigned type of the same width so that overflow is defined behaviour. Float MIN and
 * MAX propagate NaN like numpy.minimum / torch.minimum (a NaN b fails every comparison, so b
 * is picked). */
#define F_SUM(T, U, a, b) ((a) + (b))
#define F_PROD(T, U, a, b) ((a) * (b))
#define F_MIN(T, U, a, b) (((a) != (a) || (a) < (b)) ? (a) : (b))
#define F_MAX(T, U, a, b) (((a) != (a) || (a) > (b)) ? (a) : (b))
#define I_SUM(T, U, a, b) ((T)((U)(a) + (U)(b)))
#define I_PROD(T, U, a, b) ((T)((U)(a) * (U)(b)))
#define I_MIN(T, U, a, b) ((a) < (b) ? (a) : (b))
#define I_MAX(T, U, a, b) ((a) > (b) ? (a) : (b))
#define I_BAND(T, U, a, b) ((T)((U)(a) & (U)(b)))
#define I_BOR(T, U, a, b) ((T)((U)(a) | (U)(b)))
#define I_BXOR(T, U, a, b) ((T)((U)(a) ^ (U)(b)))

/* acc[i] = acc[i] op in[i] and out[i] = x[i] op y[i], for one (type, op). */
#define DEF_KERNELS(NAME, T, U, OP)                                                             \
    static void acc_##NAME(T *restrict acc, const T *restrict in, size_t n) {                  \
        for (size_t i = 0; i < n; i++) {                                                        \
            T a = acc[i], b = in[i];                                                            \
            acc[i] = OP(T, U, a, b);                                                            \
        }                                                                                       \
    }                                                                                           \
    static void two_##NAME(T *restrict out, const T *restrict x, const T *restrict y,          \
                           size_t n) {                                                          \
        for (size_t i = 0; i < n; i++) {                                                        \
            /* Loads first: a load inside a conditional arm blocks if-conversion. */            \
            T a = x[i], b = y[i];                                                               \
            out[i] = OP(T, U, a, b);                                                            \
        }                                                                                       \
    }

#define DEF_TYPE(TN, T, U, KIND)                \
    DEF_KERNELS(TN##_sum, T, U, KIND##_SUM)     \
    DEF_KERNELS(TN##_prod, T, U, KIND##_PROD)   \
    DEF_KERNELS(TN##_min, T, U, KIND##_MIN)     \
    DEF_KERNELS(TN##_max, T, U, KIND##_MAX)

#define DEF_BITS(TN, T, U)                 \
    DEF_KERNELS(TN##_band, T, U, I_BAND)   \
    DEF_KERNELS(TN##_bor, T, U, I_BOR)     \
    DEF_KERNELS(TN##_bxor, T, U, I_BXOR)

DEF_TYPE(f32, float, float, F)
DEF_TYPE(f64, double, double, F)
DEF_TYPE(i32, int32_t, uint32_t, I)
DEF_TYPE(i64, int64_t, uint64_t, I)
DEF_TYPE(u8, uint8_t, uint8_t, I)
DEF_TYPE(i8, int8_t, uint8_t, I)
DEF_BITS(i32, int32_t, uint32_t)
DEF_BITS(i64, int64_t, uint64_t)
DEF_BITS(u8, uint8_t, uint8_t)
DEF_BITS(i8, int8_t, uint8_t)

/* Function tables indexed by ddpc_redop (AVG accumulates like SUM); the float types have no
 * bitwise entries (check_dtype_op refuses those pairs first). */
typedef void (*acc_fn)(void *restrict, const void *restrict, size_t);
typedef void (*two_fn)(void *restrict, const void *restrict, const void *restrict, size_t);

#define ACC_OPS(TN) \
    (acc_fn)acc_##TN##_sum, (acc_fn)acc_##TN##_sum, (acc_fn)acc_##TN##_min, \
    (acc_fn)acc_##TN##_max, (acc_fn)acc_##TN##_prod
#define TWO_OPS(TN) \
    (two_fn)two_##TN##_sum, (two_fn)two_##TN##_sum, (two_fn)two_##TN##_min, \
    (two_fn)two_##TN##_max, (two_fn)two_##TN##_prod
#define ACC_TABLE(TN) {ACC_OPS(TN)}
#define TWO_TABLE(TN) {TWO_OPS(TN)}
#define ACC_TABLE_BITS(TN) \
    {ACC_OPS(TN), (acc_fn)acc_##TN##_band, (acc_fn)acc_##TN##_bor, (acc_fn)acc_##TN##_bxor}
#define TWO_TABLE_BITS(TN) \
    {TWO_OPS(TN), (two_fn)two_##TN##_band, (two_fn)two_##TN##_bor, (two_fn)two_##TN##_bxor}

/* Indexed by dtype; the half types use the f32 kernels on widened blocks. */
static const acc_fn ACC[DDPC_NUM_DTYPES][DDPC_NUM_REDOPS] = {
    ACC_TABLE(f32),      ACC_TABLE(f64),      ACC_TABLE(f32),     ACC_TABLE(f32),
    ACC_TABLE_BITS(i32), ACC_TABLE_BITS(i64), ACC_TABLE_BITS(u8), ACC_TABLE_BITS(i8),
};
static const two_fn TWO[DDPC_NUM_DTYPES][DDPC_NUM_REDOPS] = {
    TWO_TABLE(f32),      TWO_TABLE(f64),      TWO_TABLE(f32),     TWO_TABLE(f32),
    TWO_TABLE_BITS(i32), TWO_TABLE_BITS(i64), TWO_TABLE_BITS(u8), TWO_TABLE_BITS(i8),
};

static int is_half(ddpc_dtype dt) { return dt == DDPC_FLOAT16 || dt == DDPC_BFLOAT16; }

static void widen(float *dst, const void *src, size_t n, ddpc_dtype dt) {
    if (dt == DDPC_FLOAT16) half_block_to_float(dst, src, n);
    else bf16_block_to_float(dst, src, n);
}

static void narrow(void *dst, const float *src, size_t n, ddpc_dtype dt) {
    if (dt == DDPC_FLOAT16) half_block_from_float(dst, src, n);
    else bf16_block_from_float(dst, src, n);
}

/* ---------------------------------------------------------------- scaling */

static void scale_f32(float *buf, size_t n, float d) {
    for (size_t i = 0; i < n; i++) buf[i] = buf[i] / d;
}
static void scale_f64(double *buf, size_t n, double d) {
    for (size_t i = 0; i < n; i++) buf[i] = buf[i] / d;
}
/* C's integer division truncates toward zero: -7 / 2 == -3. */
#define DEF_ISCALE(TN, T, D) \
    static void scale_##TN(T *buf, size_t n, D d) { \
        for (size_t i = 0; i < n; i++) buf[i] = (T)(buf[i] / d); \
    }
DEF_ISCALE(i32, int32_t, int32_t)
DEF_ISCALE(i64, int64_t, int64_t)
DEF_ISCALE(u8, uint8_t, uint32_t)
DEF_ISCALE(i8, int8_t, int32_t)

static ddpc_status check_dtype_op(const char *what, ddpc_dtype dt, ddpc_redop op) {
    if (!ddpc_dtype_size(dt))
        return ddpc_error(DDPC_ERR_INVALID, "%s: unknown dtype code %d (valid: 0..%d)", what,
                          (int)dt, DDPC_NUM_DTYPES - 1);
    if ((unsigned)op >= DDPC_NUM_REDOPS)
        return ddpc_error(DDPC_ERR_INVALID, "%s: unknown reduce op code %d (valid: 0..%d)", what,
                          (int)op, DDPC_NUM_REDOPS - 1);
    if (!ACC[dt][op])
        return ddpc_error(DDPC_ERR_INVALID, "%s: op %s is for integer and bool elements, not %s",
                          what, ddpc_redop_name(op), ddpc_dtype_name(dt));
    return DDPC_OK;
}

/* Divides n elements in place; the divisor fits every dtype's arithmetic (checked by callers). */
static void scale_any(void *buf, size_t n, ddpc_dtype dt, int64_t d) {
    switch (dt) {
    case DDPC_FLOAT32: scale_f32(buf, n, (float)d); break;
    case DDPC_FLOAT64: scale_f64(buf, n, (double)d); break;
    case DDPC_INT32: scale_i32(buf, n, (int32_t)d); break;
    case DDPC_INT64: scale_i64(buf, n, d); break;
    /* A divisor beyond the 32-bit helper type would truncate (to 0 for 2^32: SIGFPE); any
     * divisor above 255 already gives 0 for every 8-bit value, so clamping changes nothing. */
    case DDPC_UINT8: scale_u8(buf, n, (uint32_t)DDPC_MIN(d, (int64_t)UINT8_MAX + 1)); break;
    case DDPC_INT8: scale_i8(buf, n, (int32_t)DDPC_MIN(d, (int64_t)INT8_MAX + 2)); break;
    case DDPC_FLOAT16:
    case DDPC_BFLOAT16: {
        float tmp[BLK];
        uint16_t *h = buf;
        for (size_t off = 0; off < n; off += BLK) {
            size_t m = DDPC_MIN((size_t)BLK, n - off);
            widen(tmp, h + off, m, dt);
            scale_f32(tmp, m, (float)d);
            narrow(h + off, tmp, m, dt);
        }
        break;
    }
    default: break;
    }
}

ddpc_status ddpc_reduce_scale(void *buf, size_t n, ddpc_dtype dt, int64_t divisor) {
    DDPC_CHECK(check_dtype_op("ddpc_reduce_scale", dt, DDPC_SUM));
    if (divisor < 1 || (dt == DDPC_INT32 && divisor > INT32_MAX))
        return ddpc_error(DDPC_ERR_INVALID,
                          "ddpc_reduce_scale: divisor must be in [1, %s], got %lld",
                          dt == DDPC_INT32 ? "2^31-1" : "2^63-1", (long long)divisor);
    if (n && !buf) return ddpc_error(DDPC_ERR_INVALID, "ddpc_reduce_scale: buffer is NULL");
    if (divisor > 1) scale_any(buf, n, dt, divisor);
    return DDPC_OK;
}

/* ---------------------------------------------------------------- reductions */

ddpc_status ddpc_reduce_host(void *acc, const void *in, size_t n, ddpc_dtype dt, ddpc_redop op) {
    DDPC_CHECK(check_dtype_op("ddpc_reduce_host", dt, op));
    if (n && (!acc || !in))
        return ddpc_error(DDPC_ERR_INVALID, "ddpc_reduce_host: %s buffer is NULL",
                          acc ? "input" : "accumulator");
    if (!is_half(dt)) {
        ACC[dt][op](acc, in, n);
        return DDPC_OK;
    }
    float a[BLK], b[BLK];
    uint16_t *ha = acc;
    const uint16_t *hb = in;
    for (size_t off = 0; off < n; off += BLK) {
        size_t m = DDPC_MIN((size_t)BLK, n - off);
        widen(a, ha + off, m, dt);
        widen(b, hb + off, m, dt);
        ACC[DDPC_FLOAT32][op](a, b, m);
        narrow(ha + off, a, m, dt);
    }
    return DDPC_OK;
}

ddpc_status ddpc_reduce_host_n(void *out, const void *const *in, int nin, size_t n,
                               ddpc_dtype dt, ddpc_redop op) {
    DDPC_CHECK(check_dtype_op("ddpc_reduce_host_n", dt, op));
    if (nin < 1 || !in)
        return ddpc_error(DDPC_ERR_INVALID, "ddpc_reduce_host_n: needs at least one input, got %d",
                          in ? nin : 0);
    if (!n) return DDPC_OK;
    if (!out) return ddpc_error(DDPC_ERR_INVALID, "ddpc_reduce_host_n: output buffer is NULL");
    for (int k = 0; k < nin; k++)
        if (!in[k]) return ddpc_error(DDPC_ERR_INVALID, "ddpc_reduce_host_n: input %d is NULL", k);
    size_t es = ddpc_dtype_size(dt);
    if (is_half(dt)) {
        /* Accumulate every input in float and round once: more accurate than pairwise rounding. */
        float a[BLK], b[BLK];
        for (size_t off = 0; off < n; off += BLK) {
            size_t m = DDPC_MIN((size_t)BLK, n - off);
            widen(a, (const uint16_t *)in[0] + off, m, dt);
            for (int k = 1; k < nin; k++) {
                widen(b, (const uint16_t *)in[k] + off, m, dt);
                ACC[DDPC_FLOAT32][op](a, b, m);
            }
            if (op == DDPC_AVG && nin > 1) scale_f32(a, m, (float)nin);
            narrow((uint16_t *)out + off, a, m, dt);
        }
        return DDPC_OK;
    }
    char *o = out;
    for (size_t off = 0; off < n; off += BLK) {
        size_t m = DDPC_MIN((size_t)BLK, n - off);
        void *ob = o + off * es;
        if (nin == 1) {
            memcpy(ob, (const char *)in[0] + off * es, m * es);
        } else {
            TWO[dt][op](ob, (const char *)in[0] + off * es, (const char *)in[1] + off * es, m);
            for (int k = 2; k < nin; k++) ACC[dt][op](ob, (const char *)in[k] + off * es, m);
        }
        if (op == DDPC_AVG && nin > 1) scale_any(ob, m, dt, nin);
    }
    return DDPC_OK;
}

/* ---------------------------------------------------------------- conversion */

static int is_float(ddpc_dtype dt) {
    return dt == DDPC_FLOAT32 || dt == DDPC_FLOAT64 || dt == DDPC_FLOAT16 || dt == DDPC_BFLOAT16;
}

/* double -> float rounded to odd (truncate, then set the last bit if anything was lost). Rounding
 * that float to half or bfloat16 (13 or 16 fewer bits) is then exactly the correctly rounded
 * double -> half: plain (float)d would round twice and sometimes land on the wrong neighbour. */
static inline float f32_round_odd(double d) {
    float f = (float)d;
    if ((double)f == d || d != d) return f;
    uint32_t b = f32_bits(f);
    if (fabs((double)f) > fabs(d)) b -= 1;
    return f32_from_bits(b | 1u);
}

/* One block of src as float32: exact for half types, rounded to odd for float64 (only used when
 * the destination is a half type). */
static void to_f32(float *restrict dst, const void *restrict src, size_t n, ddpc_dtype dt) {
    if (dt == DDPC_FLOAT32) {
        memcpy(dst, src, n * sizeof(float));
    } else if (dt == DDPC_FLOAT64) {
        const double *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = f32_round_odd(s[i]);
    } else {
        widen(dst, src, n, dt);
    }
}

ddpc_status ddpc_convert_host(void *dst, ddpc_dtype dst_dt, const void *src, ddpc_dtype src_dt,
                              size_t n) {
    if (!ddpc_dtype_size(dst_dt) || !ddpc_dtype_size(src_dt))
        return ddpc_error(DDPC_ERR_INVALID,
                          "ddpc_convert_host: unknown dtype code %d (valid: 0..%d)",
                          ddpc_dtype_size(dst_dt) ? (int)src_dt : (int)dst_dt, DDPC_NUM_DTYPES - 1);
    if (n && (!dst || !src))
        return ddpc_error(DDPC_ERR_INVALID, "ddpc_convert_host: %s buffer is NULL",
                          dst ? "source" : "destination");
    size_t ss = ddpc_dtype_size(src_dt), ds = ddpc_dtype_size(dst_dt);
    if (dst_dt == src_dt) {
        if (n && dst != src) memmove(dst, src, n * ss);
        return DDPC_OK;
    }
    if (!is_float(dst_dt) || !is_float(src_dt))
        return ddpc_error(DDPC_ERR_INVALID,
                          "ddpc_convert_host: cannot convert %s to %s: only float32, float64, "
                          "float16 and bfloat16 convert into each other",
                          ddpc_dtype_name(src_dt), ddpc_dtype_name(dst_dt));
    float tmp[BLK];
    for (size_t off = 0; off < n; off += BLK) {
        size_t m = DDPC_MIN((size_t)BLK, n - off);
        const char *s = (const char *)src + off * ss;
        char *d = (char *)dst + off * ds;
        if (dst_dt == DDPC_FLOAT64) {
            to_f32(tmp, s, m, src_dt);
            double *dd = (double *)d;
            for (size_t i = 0; i < m; i++) dd[i] = tmp[i];
        } else if (dst_dt == DDPC_FLOAT32 && src_dt == DDPC_FLOAT64) {
            const double *sd = (const double *)s;
            float *df = (float *)d;
            for (size_t i = 0; i < m; i++) df[i] = (float)sd[i];
        } else {
            to_f32(tmp, s, m, src_dt);
            if (dst_dt == DDPC_FLOAT32) memcpy(d, tmp, m * sizeof(float));
            else narrow(d, tmp, m, dst_dt);
        }
    }
    return DDPC_OK;
}
