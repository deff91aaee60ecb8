/* net: the inter-node transport behind one interface, with two NICs: a real one
 * (libibverbs RC queue pairs, IB or RoCE v2) and the loopback NIC (in-process, for tests
 * and virtual nodes on one host). The coordinator (coordinator.h) sits on top.
 *
 * A NIC registers memory through hep_gpu_mr_register with the ops table it supplies
 * (hep_net_mr_ops), posts RDMA WRITEs addressed by (rkey, original remote address) and
 * reports completions. Writes on one connection complete and land in posting order, so a
 * flag written after its data lands after it (RC ordering).
 */
#ifndef HEP_NET_H
#define HEP_NET_H

#include <stddef.h>
#include <stdint.h>

#include "hybridep/bootstrap.h"
#include "hybridep/gpu_mr.h"

typedef struct hep_net hep_net;

typedef struct hep_net_completion {
    uint64_t wr_id;
    int status;          /* 0 = success, else a hep_status with hep_last_error() set */
    int peer;
} hep_net_completion;

typedef struct hep_net_vtbl {
    const char *name;
    /* Connect to every other rank of the bootstrap (collective). */
    int (*connect)(hep_net *n, const hep_bootstrap *bs);
    /* RDMA WRITE len bytes from a local registered range to a remote one. */
    int (*write)(hep_net *n, int peer, uint32_t lkey, uint64_t laddr, uint32_t rkey,
                 uint64_t raddr, size_t len, uint64_t wr_id);
    /* Up to max completions; returns how many (>= 0) or a negative -hep_status. */
    int (*poll)(hep_net *n, hep_net_completion *out, int max);
    void (*destroy)(hep_net *n);
} hep_net_vtbl;

struct hep_net {
    const hep_net_vtbl *v;
    struct ibv_pd *pd;           /* what registrations go into */
    hep_gpu_mr_ops mr_ops;       /* the registration calls of this NIC */
    int rank, world;
};

/* The loopback NIC of this process. All loopback NICs of a process form one fabric: a
 * write from one reaches the memory registered by another, after the same key and bounds
 * checks a NIC makes. Device memory is copied with the CUDA copy engine on a stream of the
 * NIC's own, host memory with memcpy. */
int hep_loopback_create(int rank, int world, hep_net **out);

/* Across the processes of one host: rank r's window, the memory its registrations lie in
 * ([base, base + len) in r's own address space, a POSIX shared-memory segment), and where
 * that memory is mapped in this process (NULL: not here; writes to r are refused). */
typedef struct hep_loopback_window {
    uint64_t base, len;
    char *here;
} hep_loopback_window;

/* The loopback NIC of a rank whose peers are processes of this host (host memory only).
 * Registrations must lie in win[rank]; connect (collective) exchanges every rank's
 * registrations (key, access, original address, length) through the bootstrap, and a write
 * reaches the peer's memory through win[peer].here after the same key, access and bounds
 * checks against the peer's registration, data before any later write (the flag). Keys are
 * exchanged once: registrations must all be made before connect, and a peer's
 * deregistration is not seen (the coordinator deregisters only after its last call). `win`
 * ([world]) is copied; the mappings stay the caller's and must outlive the NIC. */
int hep_loopback_create_shared(int rank, int world, const hep_loopback_window *win,
                               hep_net **out);

/* A real RDMA device: `device_name` (NULL: the one nearest to cuda_device by PCI path,
 * or HEP_NIC_MAP), its first active port, a PD, one CQ, RC QPs to every other rank. */
int hep_verbs_create(int rank, int world, int cuda_device, hep_net **out);

/* Number of RDMA devices visible (0 when none or libibverbs is missing). */
int hep_verbs_device_count(void);

/* Loopback fabric statistics, for tests. */
typedef struct hep_loopback_stats {
    uint64_t writes, bytes, refused;
    int live_mrs;
} hep_loopback_stats;
void hep_loopback_get_stats(hep_loopback_stats *s);

#endif
