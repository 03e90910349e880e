/* reduce.c: host reductions and dtype conversion (placeholder until implemented). */
#include "common.h"
size_t ddpc_dtype_size(ddpc_dtype dt) { static const size_t s[] = {4,8,2,2,4,8,1,1}; return (unsigned)dt < DDPC_NUM_DTYPES ? s[dt] : 0; }
const char *ddpc_dtype_name(ddpc_dtype dt) { static const char *n[] = {"float32","float64","float16","bfloat16","int32","int64","uint8","int8"}; return (unsigned)dt < DDPC_NUM_DTYPES ? n[dt] : "unknown"; }
const char *ddpc_redop_name(ddpc_redop op) { static const char *n[] = {"sum","avg","min","max","prod"}; return (unsigned)op < DDPC_NUM_REDOPS ? n[op] : "unknown"; }
ddpc_status ddpc_reduce_host(void *a, const void *i, size_t n, ddpc_dtype dt, ddpc_redop op) { (void)a;(void)i;(void)n;(void)dt;(void)op; return DDPC_ERR_UNAVAILABLE; }
ddpc_status ddpc_reduce_scale(void *b, size_t n, ddpc_dtype dt, int64_t d) { (void)b;(void)n;(void)dt;(void)d; return DDPC_ERR_UNAVAILABLE; }
ddpc_status ddpc_convert_host(void *d, ddpc_dtype ddt, const void *s, ddpc_dtype sdt, size_t n) { (void)d;(void)ddt;(void)s;(void)sdt;(void)n; return DDPC_ERR_UNAVAILABLE; }
