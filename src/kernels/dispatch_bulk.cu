// kernels/dispatch_bulk.cu: the dispatch kernel with bulk stores (HEP_BULK_STORES in
// dispatch.cu: each row pass staged in the warp's shared memory, one cp.async.bulk per
// destination). Its kernel and entry points are dispatch.cu's with the suffix _bulk; the
// GPU backend takes them where no node-mate shares this rank's GPU (backend_gpu.c).
#ifndef HEP_BULK_STORES
#define HEP_BULK_STORES 1
#endif
#define HEP_DISPATCH_NAME(x) x##_bulk
#include "kernels/dispatch.cu"
