/* net/proxy.h: the CPU proxy of the inter-node path.
 *
 * One thread per rank drives the rank's NIC. A call submits a batch of chunks; each chunk
 * is a range of a registered local buffer to send to a peer, with a ready counter the
 * producer (a kernel, through host-mapped memory, or the host) raises to the call's epoch
 * when the chunk's data is in place. The proxy posts a chunk's RDMA WRITE as soon as it is
 * ready, then the chunk's flag write (8 bytes holding the epoch) on the same connection,
 * so the flag lands after the data (RC ordering). Ready chunks to the same peer whose
 * local and remote ranges are contiguous go out as one write. Nothing waits forever: when no
 * chunk became ready for HEP_TIMEOUT_MS, the batch fails with a message naming the first
 * one not ready (a batch may stream: a ring's chunks become ready as credits return).
 */
#ifndef HEP_NET_PROXY_H
#define HEP_NET_PROXY_H

#include <stddef.h>
#include <stdint.h>

#include "net/net.h"

typedef struct hep_proxy_chunk {
    const volatile uint64_t *ready; /* producer sets >= epoch when the data is in place */
    int peer;                       /* destination rank */
    uint32_t lkey, rkey;            /* data: local registration, remote key */
    uint64_t laddr, raddr;          /* original addresses */
    size_t len;                     /* 0: a flag only */
    int flag;                       /* 1: the flag write follows the data; 0: data only */
    uint32_t flag_lkey, flag_rkey;  /* the flag: a registered local u64 that holds >= epoch
                                       once the chunk is ready (the ready counter itself,
                                       when it is registered), and where it goes */
    uint64_t flag_laddr, flag_raddr;
    const char *name;               /* buffer name, for messages */
    /* A chunk whose extent the producer decides: when desc is set, desc[0] and desc[1]
     * (read once the chunk is ready) are the first unit and the number of units, so the
     * write is [laddr + first * unit, + count * unit) to raddr + first * unit; `len` is
     * then the most it may cover (more is refused as the producer's error). */
    const volatile uint64_t *desc;
    size_t unit;
    int fence;                      /* 1: posted only after every earlier chunk of the batch
                                       to the same peer (a slot's flag after all its data) */
    uint64_t want;                  /* 0: ready once *ready >= the batch's epoch; else once
                                       *ready >= want (a ring's chunk k of a call, a credit) */
    /* NULL, or: once *skip >= skip_want (read with acquire) while the chunk is not posted,
     * the call does not need it (a ring's chunk past the ones its producer has, known on
     * the device only): it counts as posted, and nothing of it is sent. */
    const volatile uint64_t *skip;
    uint64_t skip_want;
} hep_proxy_chunk;

typedef struct hep_proxy_peer_stats {
    uint64_t bytes;     /* data bytes posted (flags not counted) */
    uint64_t data_wrs;  /* data work requests posted */
    uint64_t flag_wrs;  /* flag work requests posted */
    uint64_t flags_done;/* flag writes completed, and for them the time from the chunk
                           seen ready to its flag's completion (sum, ns) */
    uint64_t ready_to_flag_ns;
} hep_proxy_peer_stats;

typedef struct hep_proxy hep_proxy;

/* Start the proxy thread of `net` (world = net->world). */
int hep_proxy_create(hep_net *net, hep_proxy **out);
/* Hand a batch to the proxy (copied). One batch at a time: a second submit before
 * hep_proxy_wait returned is HEP_ERR_INVALID. */
int hep_proxy_submit(hep_proxy *p, const hep_proxy_chunk *chunks, int n, uint64_t epoch);
/* Wait until every chunk of the batch was posted and completed: 0, or the batch's error
 * (a refused write: peer, buffer and verbs text; a chunk not ready in time: its name and
 * peer, HEP_ERR_TIMEOUT). */
int hep_proxy_wait(hep_proxy *p);
/* End the batch in flight now (its unposted chunks are dropped; posted writes are still
 * completed): the producer gave up (a timeout of its own). hep_proxy_wait then returns
 * `rc` with `why`. No batch in flight: nothing happens. */
void hep_proxy_cancel(hep_proxy *p, int rc, const char *why);
/* Bytes and work requests posted to `peer` since creation. */
void hep_proxy_stats(hep_proxy *p, int peer, hep_proxy_peer_stats *out);
/* Stop and join the thread. NULL is accepted. */
void hep_proxy_destroy(hep_proxy *p);

/* Receiver side: wait until *flag >= expect (HEP_TIMEOUT_MS), else HEP_ERR_TIMEOUT naming
 * `peer` and `what`. */
int hep_proxy_wait_flag(const volatile uint64_t *flag, uint64_t expect, int me, int peer,
                        const char *what);
/* The same, where `arrived` (or NULL) is a word the peer sent ahead of the flag, on the same
 * connection, holding the call it entered: on expiry the message says whether the peer
 * arrived at this call (so its flag was lost on the way) or did not arrive. */
int hep_proxy_wait_flag_arrived(const volatile uint64_t *flag, uint64_t expect,
                                const volatile uint64_t *arrived, int me, int peer,
                                const char *what);

#endif
