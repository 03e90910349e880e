/* rows.c: the embedding rows' end of backward on the nccl backend (python/ddpc/_rows.py says
 * why): one rank's part packed, one in-place all-gather, one accumulation per rank, all queued on
 * the caller's stream by one call, so the host spends a few launches on it rather than a dozen
 * torch operations. */
#include "common.h"
#include "group.h"

size_t ddpc_rows_stride(size_t cap, size_t width, ddpc_dtype wire_dt) {
    size_t row_bytes = cap * width * ddpc_dtype_size(wire_dt);
    return cap * sizeof(int64_t) + (row_bytes + 7) / 8 * 8;
}

static ddpc_status check(const DdpcGroup *g, const DdpcRowsExchange *x) {
    if (x->device < 0)
        return ddpc_error(DDPC_ERR_INVALID, "embedding rows exchange: the gradient is in host "
                          "memory; this path is for device memory (the nccl backend)");
    if (x->n > x->cap)
        return ddpc_error(DDPC_ERR_INVALID, "embedding rows exchange: this rank has %zu rows but "
                          "every rank's part has %zu slots", x->n, x->cap);
    if (!ddpc_dtype_size(x->wire_dtype) || !ddpc_dtype_size(x->grad_dtype) ||
        (x->src && !ddpc_dtype_size(x->src_dtype)))
        return ddpc_error(DDPC_ERR_INVALID, "embedding rows exchange: an unknown dtype code");
    /* (cap * width * 8 bytes must not wrap: the table's rows bound width, the tokens cap) */
    if (x->width && x->cap > (SIZE_MAX / 16) / x->width)
        return ddpc_error(DDPC_ERR_INVALID, "embedding rows exchange: %zu slots of width %zu are "
                          "too many", x->cap, x->width);
    size_t stride = ddpc_rows_stride(x->cap, x->width, x->wire_dtype);
    size_t world = (size_t)ddpc_group_size(g);
    if (x->buf_bytes != stride * world || (x->cap && !x->buf))
        return ddpc_error(DDPC_ERR_INVALID, "embedding rows exchange: the buffer has %zu bytes; "
                          "%d ranks' parts of %zu slots of width %zu need %zu",
                          x->buf_bytes, (int)world, x->cap, x->width, stride * world);
    if (((uintptr_t)x->buf & 7) != 0)
        return ddpc_error(DDPC_ERR_INVALID, "embedding rows exchange: the buffer is not 8-byte "
                          "aligned");
    return DDPC_OK;
}

ddpc_status ddpc_rows_exchange(DdpcGroup *g, const DdpcRowsExchange *x, DdpcWork **out) {
    *out = NULL;
    DDPC_CHECK(check(g, x));
    if (x->cap == 0 || x->width == 0) return DDPC_OK; /* no rank looked anything up */
    int world = ddpc_group_size(g), rank = ddpc_group_rank(g);
    size_t stride = ddpc_rows_stride(x->cap, x->width, x->wire_dtype);
    size_t idx_bytes = x->cap * sizeof(int64_t);
    uint8_t *base = x->buf;
    uint8_t *mine = base + (size_t)rank * stride;
    DDPC_CHECK(ddpc_device_rows_pack(mine, mine + idx_bytes, x->wire_dtype, x->cap, x->width,
                                     x->sorted_ids, x->perm, x->n, x->src, x->src_dtype,
                                     x->stream));
    DdpcCollArgs a = {
        .op = DDPC_COLL_ALLGATHER, .send = mine, .recv = base, .count = stride,
        .dtype = DDPC_UINT8, .device = x->device, .stream = x->stream,
    };
    DDPC_CHECK(ddpc_group_post(g, &a, out));
    DDPC_CHECK(ddpc_work_wait_stream(*out, x->stream));
    for (int r = 0; r < world; r++) {
        const uint8_t *part = base + (size_t)r * stride;
        DDPC_CHECK(ddpc_device_rows_accumulate(x->grad, x->grad_dtype, x->num_rows, x->width,
                                               (const int64_t *)part, NULL, x->cap,
                                               part + idx_bytes, x->wire_dtype, x->skip,
                                               1.0 / world, x->stream));
    }
    return DDPC_OK;
}
