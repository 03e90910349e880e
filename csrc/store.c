/* store.c: TCP rendezvous store (placeholder until implemented). */
#include "common.h"
ddpc_status ddpc_store_server_start(const char *h, int p, const char *t, DdpcStoreServer **o) { (void)h;(void)p;(void)t;*o=NULL; return ddpc_error(DDPC_ERR_UNAVAILABLE, "store not implemented"); }
int ddpc_store_server_port(const DdpcStoreServer *s) { (void)s; return -1; }
void ddpc_store_server_stop(DdpcStoreServer *s) { (void)s; }
ddpc_status ddpc_store_connect(const char *h, int p, const char *t, int r, int64_t to, DdpcStore **o) { (void)h;(void)p;(void)t;(void)r;(void)to;*o=NULL; return ddpc_error(DDPC_ERR_UNAVAILABLE, "store not implemented"); }
void ddpc_store_close(DdpcStore *c) { (void)c; }
ddpc_status ddpc_store_set(DdpcStore *c, const char *k, const void *v, size_t l) { (void)c;(void)k;(void)v;(void)l; return DDPC_ERR_UNAVAILABLE; }
ddpc_status ddpc_store_get(DdpcStore *c, const char *k, int64_t to, void **v, size_t *l) { (void)c;(void)k;(void)to;(void)v;(void)l; return DDPC_ERR_UNAVAILABLE; }
ddpc_status ddpc_store_add(DdpcStore *c, const char *k, int64_t d, int64_t *o) { (void)c;(void)k;(void)d;(void)o; return DDPC_ERR_UNAVAILABLE; }
ddpc_status ddpc_store_cas(DdpcStore *c, const char *k, const void *e, size_t el, const void *d, size_t dl, void **cur, size_t *cl) { (void)c;(void)k;(void)e;(void)el;(void)d;(void)dl;(void)cur;(void)cl; return DDPC_ERR_UNAVAILABLE; }
ddpc_status ddpc_store_delete(DdpcStore *c, const char *k, int *d) { (void)c;(void)k;(void)d; return DDPC_ERR_UNAVAILABLE; }
ddpc_status ddpc_store_check(DdpcStore *c, const char *const *k, int n, int *p) { (void)c;(void)k;(void)n;(void)p; return DDPC_ERR_UNAVAILABLE; }
ddpc_status ddpc_store_wait(DdpcStore *c, const char *const *k, int n, int64_t to) { (void)c;(void)k;(void)n;(void)to; return DDPC_ERR_UNAVAILABLE; }
ddpc_status ddpc_store_num_keys(DdpcStore *c, int64_t *o) { (void)c;(void)o; return DDPC_ERR_UNAVAILABLE; }
