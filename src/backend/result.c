/* backend/result.c: what both backends return from a dispatch before their own fields: the
 * zero-copy view into this rank's buffers. */
#include <string.h>

#include "backend/backend.h"

void hep_fill_dispatch_result(const hep_backend_ctx *b, hep_dispatch_result *o)
{
    memset(o, 0, sizeof(*o));
    o->tokens = hep_be_buf(b, HEP_BUF_TOKEN_X);
    o->probs = (float *)hep_be_buf(b, HEP_BUF_RECV_PROB);
    o->scales = b->plan->buf[HEP_BUF_RECV_SCALE].present
                    ? (float *)hep_be_buf(b, HEP_BUF_RECV_SCALE)
                    : NULL;
    o->host_counts = (const int *)hep_be_buf(b, HEP_BUF_HOST_COUNTS);
    o->max_recv_rows = b->plan->max_recv_rows;
    o->num_recv = -1;
}
