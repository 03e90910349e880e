/* comm_cpu.c: collectives on host memory (placeholder until implemented). */
#include "group.h"
static ddpc_status cpu_init(DdpcGroup *g) { (void)g; return ddpc_error(DDPC_ERR_UNAVAILABLE, "cpu backend not implemented"); }
static ddpc_status cpu_post(DdpcGroup *g, DdpcWork *w) { (void)g;(void)w; return DDPC_ERR_UNAVAILABLE; }
static void cpu_destroy(DdpcGroup *g) { (void)g; }
const DdpcBackendOps ddpc_backend_cpu = { "cpu", cpu_init, cpu_post, NULL, NULL, cpu_destroy, NULL };
