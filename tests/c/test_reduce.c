/* test_reduce.c: csrc/reduce.c against plain scalar references: every dtype x op (pairwise and
 * n-ary), scaling, and the float16/bfloat16 conversions, whose reference is a table of every half
 * value built with ldexp (no bit tricks shared with the code under test). Run by
 * tests/test_reduce_c.py; prints "ok" and exits 0 when everything matches. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddpc.h"
#include "check.h"

/* xorshift64*: deterministic inputs. */
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ull;
}

static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ---------------------------------------------------------------- half references */

/* Value of a half / bfloat16 bit pattern, from the format's definition. */
static double half_value(uint16_t p) {
    int e = (p >> 10) & 31, m = p & 1023;
    double v = e == 31 ? (m ? NAN : INFINITY) : e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
    return (p & 0x8000) ? -v : v;
}
static double bf16_value(uint16_t p) {
    int e = (p >> 7) & 255, m = p & 127;
    double v = e == 255 ? (m ? NAN : INFINITY) : e ? ldexp(128 + m, e - 134) : ldexp(m, -133);
    return (p & 0x8000) ? -v : v;
}

/* Round-to-nearest-even of x to the format whose largest finite positive pattern is maxp. Finite
 * positive patterns are ordered like their values, so binary search finds the neighbours; the
 * midpoint test compares 2|x| with lo+hi, which is exact in long double. Past the largest value
 * the next "pattern" is inf, placed where the unbounded format would put its next value. */
static uint16_t ref_round(long double x, uint16_t maxp, uint16_t inf, uint16_t qnan,
                          double (*value)(uint16_t)) {
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    if (x != x) return (uint16_t)(sign | qnan);
    long double a = fabsl(x);
    uint32_t lo = 0, hi = maxp;
    if (a >= value(maxp)) {
        lo = maxp;
    } else {
        while (hi - lo > 1) {
            uint32_t mid = (lo + hi) / 2;
            if (value((uint16_t)mid) <= a) lo = mid; else hi = mid;
        }
    }
    long double vlo = value((uint16_t)lo);
    if (a == vlo) return (uint16_t)(sign | lo);
    uint32_t up = lo + 1;
    long double vhi = lo == maxp ? 2.0L * value(maxp) - value((uint16_t)(maxp - 1))
                                 : value((uint16_t)up);
    if (lo == maxp) up = inf;
    long double twice = 2.0L * a, mid = vlo + vhi;
    uint32_t r = twice < mid ? lo : twice > mid ? up : ((lo & 1) ? up : lo);
    return (uint16_t)(sign | r);
}
static uint16_t ref_half(long double x) { return ref_round(x, 0x7BFF, 0x7C00, 0x7E00, half_value); }
static uint16_t ref_bf16(long double x) { return ref_round(x, 0x7F7F, 0x7F80, 0x7FC0, bf16_value); }

static int is_nan_half(uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x3FF); }
static int is_nan_bf16(uint16_t h) { return (h & 0x7F80) == 0x7F80 && (h & 0x7F); }

/* Compares a conversion result with the reference: equal bits, or both NaN of the same sign. */
static int same16(uint16_t got, uint16_t want, int (*isnan16)(uint16_t)) {
    if (isnan16(want)) return isnan16(got) && (got & 0x8000) == (want & 0x8000);
    return got == want;
}

static void test_half_to_float(void) {
    static uint16_t h[65536], b[65536];
    static float fh[65536], fb[65536];
    for (uint32_t p = 0; p < 65536; p++) h[p] = b[p] = (uint16_t)p;
    EXPECT(ddpc_convert_host(fh, DDPC_FLOAT32, h, DDPC_FLOAT16, 65536) == DDPC_OK, "convert");
    EXPECT(ddpc_convert_host(fb, DDPC_FLOAT32, b, DDPC_BFLOAT16, 65536) == DDPC_OK, "convert");
    for (uint32_t p = 0; p < 65536; p++) {
        if (is_nan_half((uint16_t)p)) {
            EXPECT(isnan(fh[p]) && !!signbit(fh[p]) == !!(p & 0x8000), "half %04x -> %a", p, fh[p]);
        } else {
            double want = half_value((uint16_t)p);
            EXPECT(fh[p] == want && !!signbit(fh[p]) == !!(p & 0x8000), "half %04x -> %a, want %a",
                   p, fh[p], want);
        }
        if (is_nan_bf16((uint16_t)p)) {
            EXPECT(isnan(fb[p]), "bf16 %04x -> %a", p, fb[p]);
        } else {
            double want = bf16_value((uint16_t)p);
            EXPECT(fb[p] == want && !!signbit(fb[p]) == !!(p & 0x8000), "bf16 %04x -> %a, want %a",
                   p, fb[p], want);
        }
    }
}

/* Float inputs that exercise rounding: every half/bfloat16 value, the exact midpoints between
 * neighbours and one float ulp either side of them, the overflow threshold, a stride through all
 * float bit patterns, and NaN/inf. */
enum { NCASE_MAX = 1 << 22 };
static float g_cases[NCASE_MAX];

static size_t float_cases(double (*value)(uint16_t), uint16_t maxp) {
    size_t n = 0;
    for (uint32_t p = 0; p <= maxp; p++) {
        double v = value((uint16_t)p), next = p < maxp ? value((uint16_t)(p + 1))
                                                        : 2.0 * v - value((uint16_t)(p - 1));
        float mid = (float)((v + next) / 2);
        float c[] = {(float)v, mid, nextafterf(mid, 0), nextafterf(mid, INFINITY)};
        for (int k = 0; k < 4; k++) {
            g_cases[n++] = c[k];
            g_cases[n++] = -c[k];
        }
    }
    for (uint64_t u = 0; u < (1ull << 32) && n < NCASE_MAX - 8; u += 4099)
        g_cases[n++] = bits_f32((uint32_t)u);
    g_cases[n++] = INFINITY;
    g_cases[n++] = -INFINITY;
    g_cases[n++] = NAN;
    g_cases[n++] = -NAN;
    g_cases[n++] = bits_f32(0x7F800001u); /* signalling NaN */
    g_cases[n++] = FLT_MAX;
    return n;
}

static void test_float_to_half(void) {
    static uint16_t out[NCASE_MAX];
    size_t n = float_cases(half_value, 0x7BFF);
    EXPECT(ddpc_convert_host(out, DDPC_FLOAT16, g_cases, DDPC_FLOAT32, n) == DDPC_OK, "convert");
    for (size_t i = 0; i < n; i++) {
        uint16_t want = ref_half(g_cases[i]);
        EXPECT(same16(out[i], want, is_nan_half), "float %a (%08x) -> half %04x, want %04x",
               g_cases[i], f32_bits(g_cases[i]), out[i], want);
    }
    n = float_cases(bf16_value, 0x7F7F);
    EXPECT(ddpc_convert_host(out, DDPC_BFLOAT16, g_cases, DDPC_FLOAT32, n) == DDPC_OK, "convert");
    for (size_t i = 0; i < n; i++) {
        uint16_t want = ref_bf16(g_cases[i]);
        EXPECT(same16(out[i], want, is_nan_bf16), "float %a (%08x) -> bf16 %04x, want %04x",
               g_cases[i], f32_bits(g_cases[i]), out[i], want);
    }
    /* A few cases spelled out, so a failure reads plainly. */
    struct { float f; uint16_t half; } fixed[] = {
        {1.0f, 0x3C00}, {65504.0f, 0x7BFF}, {65519.99f, 0x7BFF}, {65520.0f, 0x7C00},
        {0x1p-24f, 0x0001}, {0x1p-25f, 0x0000}, {0x1.8p-24f, 0x0002}, {1.0f + 0x1p-11f, 0x3C00},
        {1.0f + 0x3p-11f, 0x3C02}, {-0.0f, 0x8000}, {-INFINITY, 0xFC00},
    };
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
        uint16_t h;
        ddpc_convert_host(&h, DDPC_FLOAT16, &fixed[i].f, DDPC_FLOAT32, 1);
        EXPECT(h == fixed[i].half, "half(%a) = %04x, want %04x", fixed[i].f, h, fixed[i].half);
    }
}

/* double -> half must round once: doubles just off a half midpoint, where (float)d lands exactly
 * on the midpoint, catch double rounding. */
static void test_double_to_half(void) {
    enum { N = 200000 };
    static double d[N];
    static uint16_t h[N], b[N];
    for (int i = 0; i < N; i++) {
        uint16_t p = (uint16_t)(rnd() % 0x7BFF);
        double mid = (half_value(p) + half_value((uint16_t)(p + 1))) / 2;
        double eps = ldexp(mid ? fabs(mid) : 0x1p-40, -35);
        switch (i % 4) {
        case 0: d[i] = mid + eps; break;
        case 1: d[i] = mid - eps; break;
        case 2: d[i] = mid; break;
        default: d[i] = ldexp((double)(rnd() >> 11), (int)(rnd() % 80) - 100) * ((i & 8) ? -1 : 1);
        }
        if (i % 8 == 5) {
            uint16_t q = (uint16_t)(rnd() % 0x7F7F);
            d[i] = (bf16_value(q) + bf16_value((uint16_t)(q + 1))) / 2 + ldexp(bf16_value(q), -30);
        }
    }
    EXPECT(ddpc_convert_host(h, DDPC_FLOAT16, d, DDPC_FLOAT64, N) == DDPC_OK, "convert");
    EXPECT(ddpc_convert_host(b, DDPC_BFLOAT16, d, DDPC_FLOAT64, N) == DDPC_OK, "convert");
    for (int i = 0; i < N; i++) {
        EXPECT(h[i] == ref_half(d[i]), "double %a -> half %04x, want %04x", d[i], h[i],
               ref_half(d[i]));
        EXPECT(b[i] == ref_bf16(d[i]), "double %a -> bf16 %04x, want %04x", d[i], b[i],
               ref_bf16(d[i]));
    }
    /* And back up: half -> double is exact. */
    static double back[N];
    EXPECT(ddpc_convert_host(back, DDPC_FLOAT64, h, DDPC_FLOAT16, N) == DDPC_OK, "convert");
    for (int i = 0; i < N; i++)
        EXPECT(back[i] == half_value(h[i]), "half %04x -> double %a", h[i], back[i]);
}

/* ---------------------------------------------------------------- reductions */

static size_t esize(ddpc_dtype dt) { return ddpc_dtype_size(dt); }

/* Reads element i as long double (floats) or the exact integer (integers). */
static long double get(const void *buf, size_t i, ddpc_dtype dt) {
    switch (dt) {
    case DDPC_FLOAT32: return ((const float *)buf)[i];
    case DDPC_FLOAT64: return ((const double *)buf)[i];
    case DDPC_FLOAT16: return half_value(((const uint16_t *)buf)[i]);
    case DDPC_BFLOAT16: return bf16_value(((const uint16_t *)buf)[i]);
    case DDPC_INT32: return ((const int32_t *)buf)[i];
    case DDPC_INT64: return (long double)((const int64_t *)buf)[i];
    case DDPC_UINT8: return ((const uint8_t *)buf)[i];
    case DDPC_INT8: return ((const int8_t *)buf)[i];
    default: return 0;
    }
}
static int is_int(ddpc_dtype dt) { return dt >= DDPC_INT32; }

static int64_t geti(const void *buf, size_t i, ddpc_dtype dt) {
    switch (dt) {
    case DDPC_INT32: return ((const int32_t *)buf)[i];
    case DDPC_INT64: return ((const int64_t *)buf)[i];
    case DDPC_UINT8: return ((const uint8_t *)buf)[i];
    case DDPC_INT8: return ((const int8_t *)buf)[i];
    default: return 0;
    }
}

/* Wraps an integer to the dtype, as two's complement storage does. */
static int64_t wrap(uint64_t v, ddpc_dtype dt) {
    switch (dt) {
    case DDPC_INT32: return (int32_t)(uint32_t)v;
    case DDPC_UINT8: return (uint8_t)v;
    case DDPC_INT8: return (int8_t)(uint8_t)v;
    default: return (int64_t)v;
    }
}

static void fill(void *buf, size_t n, ddpc_dtype dt, int small, int with_nan) {
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rnd();
        /* small: values whose products stay finite in float16 and sums exact enough. */
        double x = small ? (double)((int64_t)(r % 17) - 8) / 4.0 : ldexp((double)(int64_t)r, -60);
        if (with_nan && r % 97 == 0) x = NAN;
        switch (dt) {
        case DDPC_FLOAT32: ((float *)buf)[i] = (float)x; break;
        case DDPC_FLOAT64: ((double *)buf)[i] = x; break;
        case DDPC_FLOAT16: ((uint16_t *)buf)[i] = ref_half(x); break;
        case DDPC_BFLOAT16: ((uint16_t *)buf)[i] = ref_bf16(x); break;
        case DDPC_INT32: ((int32_t *)buf)[i] = (int32_t)(uint32_t)(small ? r % 7 : r); break;
        case DDPC_INT64: ((int64_t *)buf)[i] = (int64_t)(small ? r % 7 : r); break;
        case DDPC_UINT8: ((uint8_t *)buf)[i] = (uint8_t)r; break;
        case DDPC_INT8: ((int8_t *)buf)[i] = (int8_t)(uint8_t)r; break;
        default: break;
        }
    }
}

/* Reference of acc = a op b in the dtype's arithmetic: floats in their own precision (half types
 * computed in float, then rounded), integers wrapping. Returned as the stored bits in a uint64. */
static uint64_t ref_op_float(long double a, long double b, ddpc_dtype dt, ddpc_redop op) {
    long double r;
    if (op == DDPC_MIN || op == DDPC_MAX) {
        if (a != a || b != b) r = NAN;
        else r = (op == DDPC_MIN) == (a < b) ? a : b;
    } else if (dt == DDPC_FLOAT64) {
        r = op == DDPC_PROD ? (double)a * (double)b : (double)a + (double)b;
    } else {
        r = op == DDPC_PROD ? (float)a * (float)b : (float)a + (float)b;
    }
    switch (dt) {
    case DDPC_FLOAT32: return f32_bits((float)r);
    case DDPC_FLOAT64: { double d = (double)r; uint64_t u; memcpy(&u, &d, 8); return u; }
    case DDPC_FLOAT16: return ref_half(r);
    default: return ref_bf16(r);
    }
}

static uint64_t stored_bits(const void *buf, size_t i, ddpc_dtype dt) {
    uint64_t u = 0;
    memcpy(&u, (const char *)buf + i * esize(dt), esize(dt));
    return u;
}

static int bits_nan(uint64_t u, ddpc_dtype dt) {
    switch (dt) {
    case DDPC_FLOAT32: return isnan(bits_f32((uint32_t)u));
    case DDPC_FLOAT64: { double d; memcpy(&d, &u, 8); return isnan(d); }
    case DDPC_FLOAT16: return is_nan_half((uint16_t)u);
    case DDPC_BFLOAT16: return is_nan_bf16((uint16_t)u);
    default: return 0;
    }
}

static uint64_t int_op(int64_t a, int64_t b, ddpc_dtype dt, ddpc_redop op) {
    switch (op) {
    case DDPC_MIN: return (uint64_t)(a < b ? a : b);
    case DDPC_MAX: return (uint64_t)(a > b ? a : b);
    case DDPC_PROD: return (uint64_t)wrap((uint64_t)a * (uint64_t)b, dt);
    case DDPC_BAND: return (uint64_t)wrap((uint64_t)a & (uint64_t)b, dt);
    case DDPC_BOR: return (uint64_t)wrap((uint64_t)a | (uint64_t)b, dt);
    case DDPC_BXOR: return (uint64_t)wrap((uint64_t)a ^ (uint64_t)b, dt);
    default: return (uint64_t)wrap((uint64_t)a + (uint64_t)b, dt);
    }
}

static void test_pairwise(ddpc_dtype dt, ddpc_redop op, size_t n) {
    size_t es = esize(dt);
    char *acc = malloc(n * es), *in = malloc(n * es), *orig = malloc(n * es);
    int nan = (op == DDPC_MIN || op == DDPC_MAX) && !is_int(dt);
    fill(acc, n, dt, op == DDPC_PROD, nan);
    fill(in, n, dt, op == DDPC_PROD, nan);
    memcpy(orig, acc, n * es);
    EXPECT(ddpc_reduce_host(acc, in, n, dt, op) == DDPC_OK, "reduce %s", ddpc_last_error());
    for (size_t i = 0; i < n; i++) {
        uint64_t got = stored_bits(acc, i, dt), want;
        if (is_int(dt)) {
            want = (uint64_t)wrap(int_op(geti(orig, i, dt), geti(in, i, dt), dt, op), dt);
            got = (uint64_t)geti(acc, i, dt);
        } else {
            want = ref_op_float(get(orig, i, dt), get(in, i, dt), dt, op);
            if (bits_nan(want, dt)) {
                EXPECT(bits_nan(got, dt), "%s %s [%zu]: want NaN", ddpc_dtype_name(dt),
                       ddpc_redop_name(op), i);
                continue;
            }
        }
        EXPECT(got == want, "%s %s [%zu of %zu]: got %llx want %llx", ddpc_dtype_name(dt),
               ddpc_redop_name(op), i, n, (unsigned long long)got, (unsigned long long)want);
    }
    free(acc);
    free(in);
    free(orig);
}

/* n-ary: floats (half types widened) accumulate in input order in the compute type and round
 * once; AVG divides the sum by nin (integers: truncating toward zero). */
static void test_nary(ddpc_dtype dt, ddpc_redop op, int nin, size_t n) {
    size_t es = esize(dt);
    char *in[5];
    char *out = malloc(n * es);
    for (int k = 0; k < nin; k++) {
        in[k] = malloc(n * es);
        fill(in[k], n, dt, op == DDPC_PROD || op == DDPC_AVG, 0);
    }
    EXPECT(ddpc_reduce_host_n(out, (const void *const *)in, nin, n, dt, op) == DDPC_OK, "n-ary %s",
           ddpc_last_error());
    for (size_t i = 0; i < n; i++) {
        uint64_t got = stored_bits(out, i, dt), want;
        if (is_int(dt)) {
            int64_t a = geti(in[0], i, dt);
            for (int k = 1; k < nin; k++)
                a = wrap(int_op(a, geti(in[k], i, dt), dt, op == DDPC_AVG ? DDPC_SUM : op), dt);
            if (op == DDPC_AVG) a = wrap((uint64_t)(a / nin), dt);
            want = (uint64_t)a;
            got = (uint64_t)geti(out, i, dt);
        } else {
            int wide = dt == DDPC_FLOAT64;
            long double a = get(in[0], i, dt);
            for (int k = 1; k < nin; k++) {
                long double b = get(in[k], i, dt);
                if (op == DDPC_MIN) a = b < a ? b : a;
                else if (op == DDPC_MAX) a = b > a ? b : a;
                else if (op == DDPC_PROD) a = wide ? (double)a * (double)b : (float)a * (float)b;
                else a = wide ? (double)a + (double)b : (float)a + (float)b;
            }
            if (op == DDPC_AVG) a = wide ? (double)a / nin : (float)a / (float)nin;
            switch (dt) {
            case DDPC_FLOAT32: want = f32_bits((float)a); break;
            case DDPC_FLOAT64: { double d = (double)a; memcpy(&want, &d, 8); break; }
            case DDPC_FLOAT16: want = ref_half(a); break;
            default: want = ref_bf16(a); break;
            }
        }
        EXPECT(got == want, "%s %s n-ary(%d) [%zu]: got %llx want %llx", ddpc_dtype_name(dt),
               ddpc_redop_name(op), nin, i, (unsigned long long)got, (unsigned long long)want);
    }
    for (int k = 0; k < nin; k++) free(in[k]);
    free(out);
}

static void test_scale(void) {
    int32_t i32[] = {-7, 7, -1, 0, 9, INT32_MIN};
    EXPECT(ddpc_reduce_scale(i32, 6, DDPC_INT32, 2) == DDPC_OK, "scale");
    int32_t want32[] = {-3, 3, 0, 0, 4, INT32_MIN / 2};
    EXPECT(!memcmp(i32, want32, sizeof want32), "int32 scale truncates toward zero: got %d %d %d",
           i32[0], i32[1], i32[2]);
    int8_t i8[] = {-128, 127, -5};
    ddpc_reduce_scale(i8, 3, DDPC_INT8, 3);
    EXPECT(i8[0] == -42 && i8[1] == 42 && i8[2] == -1, "int8 scale: %d %d %d", i8[0], i8[1], i8[2]);
    uint8_t u8[] = {255, 7};
    ddpc_reduce_scale(u8, 2, DDPC_UINT8, 2);
    EXPECT(u8[0] == 127 && u8[1] == 3, "uint8 scale: %d %d", u8[0], u8[1]);
    int64_t i64[] = {INT64_MIN, -9};
    ddpc_reduce_scale(i64, 2, DDPC_INT64, 4);
    EXPECT(i64[0] == INT64_MIN / 4 && i64[1] == -2, "int64 scale");
    float f[] = {1.0f, 3.0f};
    ddpc_reduce_scale(f, 2, DDPC_FLOAT32, 3);
    EXPECT(f[0] == 1.0f / 3.0f && f[1] == 1.0f, "float scale");
    uint16_t h[3000];
    for (int i = 0; i < 3000; i++) h[i] = ref_half((i % 200) - 100.0);
    ddpc_reduce_scale(h, 3000, DDPC_FLOAT16, 3);
    for (int i = 0; i < 3000; i++)
        EXPECT(h[i] == ref_half((float)((i % 200) - 100) / 3.0f), "half scale [%d]", i);
    EXPECT(ddpc_reduce_scale(f, 2, DDPC_FLOAT32, 0) == DDPC_ERR_INVALID, "divisor 0 rejected");
    /* Divisors that a 32-bit cast would turn into 0 (SIGFPE) or a negative number. */
    int8_t big8[] = {-128, 127, 5};
    uint8_t bigu8[] = {255, 1};
    EXPECT(ddpc_reduce_scale(big8, 3, DDPC_INT8, (int64_t)1 << 32) == DDPC_OK &&
               !big8[0] && !big8[1] && !big8[2], "int8 / 2^32: %d %d %d", big8[0], big8[1], big8[2]);
    EXPECT(ddpc_reduce_scale(big8, 3, DDPC_INT8, ((int64_t)1 << 32) + 1) == DDPC_OK, "int8 odd");
    EXPECT(ddpc_reduce_scale(bigu8, 2, DDPC_UINT8, (int64_t)1 << 32) == DDPC_OK &&
               !bigu8[0] && !bigu8[1], "uint8 / 2^32: %d %d", bigu8[0], bigu8[1]);
    int8_t neg8[] = {-128, 127};
    EXPECT(ddpc_reduce_scale(neg8, 2, DDPC_INT8, (int64_t)1 << 31) == DDPC_OK && !neg8[0] &&
               !neg8[1], "int8 / 2^31: %d %d", neg8[0], neg8[1]);
}

static void test_errors(void) {
    float a[2] = {0}, b[2] = {0};
    const void *ins[1] = {b};
    EXPECT(ddpc_reduce_host(a, b, 2, (ddpc_dtype)99, DDPC_SUM) == DDPC_ERR_INVALID, "bad dtype");
    EXPECT(strstr(ddpc_last_error(), "99") != NULL, "message names the code: %s",
           ddpc_last_error());
    EXPECT(ddpc_reduce_host(a, b, 2, DDPC_FLOAT32, (ddpc_redop)DDPC_NUM_REDOPS) ==
               DDPC_ERR_INVALID, "bad op");
    /* bitwise ops refuse float elements, naming both */
    for (int dt = DDPC_FLOAT32; dt <= DDPC_BFLOAT16; dt++)
        for (int op = DDPC_BAND; op <= DDPC_BXOR; op++) {
            EXPECT(ddpc_reduce_host(a, b, 1, (ddpc_dtype)dt, (ddpc_redop)op) == DDPC_ERR_INVALID &&
                       strstr(ddpc_last_error(), ddpc_redop_name((ddpc_redop)op)) &&
                       strstr(ddpc_last_error(), ddpc_dtype_name((ddpc_dtype)dt)),
                   "%s of %s: %s", ddpc_redop_name((ddpc_redop)op),
                   ddpc_dtype_name((ddpc_dtype)dt), ddpc_last_error());
            EXPECT(ddpc_reduce_host_n(a, ins, 1, 1, (ddpc_dtype)dt, (ddpc_redop)op) ==
                       DDPC_ERR_INVALID, "n-ary %s of %s accepted", ddpc_redop_name((ddpc_redop)op),
                   ddpc_dtype_name((ddpc_dtype)dt));
        }
    EXPECT(ddpc_reduce_host(NULL, b, 2, DDPC_FLOAT32, DDPC_SUM) == DDPC_ERR_INVALID, "NULL acc");
    EXPECT(ddpc_reduce_host(NULL, NULL, 0, DDPC_FLOAT32, DDPC_SUM) == DDPC_OK, "empty is fine");
    EXPECT(ddpc_convert_host(a, DDPC_INT32, b, DDPC_FLOAT32, 2) == DDPC_ERR_INVALID, "int convert");
    EXPECT(ddpc_convert_host(a, DDPC_INT32, b, DDPC_INT32, 2) == DDPC_OK, "identity convert");
    EXPECT(ddpc_reduce_host_n(a, ins, 0, 2, DDPC_FLOAT32, DDPC_SUM) == DDPC_ERR_INVALID, "nin 0");
    EXPECT(ddpc_dtype_size((ddpc_dtype)8) == 0 && ddpc_dtype_size(DDPC_BFLOAT16) == 2, "sizes");
    EXPECT(!strcmp(ddpc_dtype_name(DDPC_BFLOAT16), "bfloat16") &&
               !strcmp(ddpc_redop_name(DDPC_PROD), "prod") &&
               !strcmp(ddpc_redop_name(DDPC_BXOR), "bxor"), "names");
}

int main(void) {
    test_half_to_float();
    test_float_to_half();
    test_double_to_half();
    /* Sizes around the 2048-element block and odd tails. */
    size_t sizes[] = {1, 7, 2047, 2048, 5001};
    for (int dt = 0; dt < DDPC_NUM_DTYPES; dt++) {
        for (int op = 0; op < DDPC_NUM_REDOPS; op++) {
            /* (bitwise ops of floats are refused: test_errors) */
            if (DDPC_REDOP_BITWISE(op) && dt <= DDPC_BFLOAT16) continue;
            for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
                test_pairwise((ddpc_dtype)dt, (ddpc_redop)op, sizes[s]);
            for (int nin = 1; nin <= 5; nin += 2)
                test_nary((ddpc_dtype)dt, (ddpc_redop)op, nin, 4099);
        }
    }
    test_scale();
    test_errors();
    return check_summary("test_reduce");
}
