/* comm_nccl.c: collectives on device memory through NCCL (placeholder until implemented). */
#include "group.h"
static ddpc_status nccl_init(DdpcGroup *g) { (void)g; return ddpc_error(DDPC_ERR_UNAVAILABLE, "nccl backend not implemented"); }
static ddpc_status nccl_post(DdpcGroup *g, DdpcWork *w) { (void)g;(void)w; return DDPC_ERR_UNAVAILABLE; }
static void nccl_destroy(DdpcGroup *g) { (void)g; }
const DdpcBackendOps ddpc_backend_nccl = { "nccl", nccl_init, nccl_post, NULL, NULL, nccl_destroy, NULL };
int ddpc_cuda_built(void) { return 0; }
int ddpc_cuda_device_count(void) { return 0; }
ddpc_status ddpc_cuda_set_device(int d) { (void)d; return ddpc_error(DDPC_ERR_UNAVAILABLE, "no CUDA"); }
ddpc_status ddpc_nccl_load(char *v, size_t l) { (void)v;(void)l; return ddpc_error(DDPC_ERR_UNAVAILABLE, "no NCCL"); }
ddpc_status ddpc_device_zero(void *p, size_t b, uintptr_t s) { (void)p;(void)b;(void)s; return ddpc_error(DDPC_ERR_UNAVAILABLE, "no CUDA"); }
ddpc_status ddpc_device_cast(void *d, ddpc_dtype dd, const void *s, ddpc_dtype sd, size_t n, float sc, uintptr_t st) { (void)d;(void)dd;(void)s;(void)sd;(void)n;(void)sc;(void)st; return ddpc_error(DDPC_ERR_UNAVAILABLE, "no CUDA"); }
