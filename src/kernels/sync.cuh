// kernels/sync.cuh: the memory-model helpers, bounded waits and the timeout record shared by
// every kernel family. Included by the .cu files of kernels/ only.
//
// Where each word lives, and who touches it (none of it on a per-row path):
//  - a.abort (device memory, this rank's flags buffer): 0 until a wait of this rank expired.
//    Set once by the block whose wait expired; read only inside spin loops, by the one
//    thread per block that polls. A stopped rank's kernels then return at their next poll.
//  - a.diag (host-mapped): the timeout and invalid-id records, written only when such an
//    event happens, and the last dispatch's two timestamps, written once per call by one
//    thread after the layout is published. The host reads it after the stream finished.
//    No kernel ever reads it: a host-mapped read is a round trip over PCIe, and one per warp
//    made every phase slower as blocks were added.
//  - flags, counts of node-mates (device memory, peer-mapped): monotonic counters.
#ifndef HEP_KERNELS_SYNC_CUH
#define HEP_KERNELS_SYNC_CUH

#include <stdint.h>

#include "kernels/ep_kernels.h"

#define FULL 0xffffffffu

__device__ __forceinline__ void st_release(unsigned long long *p, unsigned long long v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
/* Only this kernel's blocks read it: device scope is enough and cheaper. */
__device__ __forceinline__ void st_release_gpu(unsigned long long *p, unsigned long long v)
{
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_add_release(unsigned long long *p, unsigned long long v)
{
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_add_release_gpu(unsigned long long *p, unsigned long long v)
{
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long now_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned long long ld_relaxed(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
/* An int that another block or rank wrote before a flag this thread acquired: L2, not L1. */
__device__ __forceinline__ int ld_l2(const int *p)
{
    return __ldcg(p);
}
/* The intrinsic, not inline asm: the compiler folds a row's vector offsets into the load's
 * immediate, where an asm operand needs a 64-bit address register per load in flight. */
__device__ __forceinline__ uint4 ld_cg(const uint4 *p)
{
    return __ldcg(p);
}

// Node-mates' flags and rows: system scope only when a node-mate is on another GPU; ranks
// of one GPU (virtual ranks, or processes sharing it through CUDA IPC) are all threads of
// that device, and a device-scope fence costs far less than a system-scope one.
__device__ __forceinline__ void fence_peers(const hep_kargs &a)
{
    if (a.peers_sys)
        __threadfence_system();
    else
        __threadfence();
}
__device__ __forceinline__ void st_release_peers(const hep_kargs &a, unsigned long long *p,
                                                 unsigned long long v)
{
    if (a.peers_sys)
        st_release(p, v);
    else
        st_release_gpu(p, v);
}
__device__ __forceinline__ void red_add_release_peers(const hep_kargs &a, unsigned long long *p,
                                                      unsigned long long v)
{
    if (a.peers_sys)
        red_add_release(p, v);
    else
        red_add_release_gpu(p, v);
}
// A relaxed store after a release fence of the same thread is a release pattern (PTX
// memory model): one fence that both acquires what this thread read and releases its
// writes, where a fence.sc and a st.release are a fence each (layout.cuh's arrive_publish).
__device__ __forceinline__ void fence_release_peers(const hep_kargs &a)
{
    if (a.peers_sys)
        asm volatile("fence.acq_rel.sys;" ::: "memory");
    else
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
__device__ __forceinline__ void st_relaxed_peers(const hep_kargs &a, unsigned long long *p,
                                                 unsigned long long v)
{
    if (a.peers_sys)
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
    else
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void fence_acquire(bool sys)
{
    if (sys)
        asm volatile("fence.acq_rel.sys;" ::: "memory");
    else
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

__device__ __forceinline__ bool aborted(const hep_kargs &a)
{
    return ld_relaxed(a.abort) != 0;
}

// The first waiter of this rank that gives up claims the abort word, fills the record and
// publishes whom it waited for (its blame word), so that a node-mate stuck on this rank
// names the rank that is really missing. Scalars only: a reference to the kernel's
// parameters in a call that is not inlined would copy them all to local memory.
static __device__ __noinline__ void give_up(unsigned long long *abort, hep_diag *diag,
                                            unsigned long long *my_blame, int stage, int peer,
                                            int via_plus1, unsigned long long expect,
                                            unsigned long long seen, unsigned long long waited)
{
    if (atomicCAS(abort, 0ull, 1ull) != 0ull)
        return;
    diag->stage = stage;
    diag->block = blockIdx.x;
    diag->peer = peer;
    diag->via_plus1 = via_plus1;
    diag->expected = expect;
    diag->seen = seen;
    diag->waited_ns = waited;
    __threadfence_system();
    diag->timeout_claimed = 1u;
    st_release(my_blame, (unsigned long long)peer + 1);
}

// Spin until *flag >= expect, at most timeout_ns x scale (+ an eighth for waits on a
// node-mate, so that its blame arrives before this wait gives up). Waits on this rank's own
// blocks use scale 2: when a peer is missing, the wait on the peer expires first and the
// record names it. `blame` (or NULL): the waited-for node-mate's blame word. Polls with
// relaxed loads and a short growing sleep; one acquire fence (of scope `sys`: system, else
// device) once the value is seen.
static __device__ __forceinline__ bool wait_geq_s(const hep_kargs &a, const unsigned long long *flag,
                           unsigned long long expect, int stage, int peer, unsigned scale,
                           const unsigned long long *blame, bool sys)
{
    unsigned long long seen = ld_relaxed(flag);
    if (seen >= expect) {
        fence_acquire(sys);
        return true;
    }
    const unsigned long long start = now_ns();
    const unsigned long long bound = a.timeout_ns * scale + (blame ? a.timeout_ns / 8 : 0);
    unsigned sleep_ns = 16, spins = 0;
    while (seen < expect) {
        __nanosleep(sleep_ns);
        if (sleep_ns < 256)
            sleep_ns <<= 1;
        if ((++spins & 15) == 0) {
            const unsigned long long waited = now_ns() - start;
            const unsigned long long culprit = blame ? ld_relaxed(blame) : 0;
            if (aborted(a))
                return false;
            if (culprit) {
                give_up(a.abort, a.diag, a.flags[a.local] + HEP_FLAG_BLAME, stage,
                        (int)(culprit - 1), peer + 1, expect, seen, waited);
                return false;
            }
            if (waited > bound) {
                give_up(a.abort, a.diag, a.flags[a.local] + HEP_FLAG_BLAME, stage, peer, 0,
                        expect, seen, waited);
                return false;
            }
        }
        seen = ld_relaxed(flag);
    }
    fence_acquire(sys);
    return true;
}

__device__ __forceinline__ bool wait_geq(const hep_kargs &a, const unsigned long long *flag,
                                         unsigned long long expect, int stage, int peer)
{
    return wait_geq_s(a, flag, expect, stage, peer, 1, NULL, true);
}

// A wait on node-mate `mate`'s flag word: on a timeout the record names whom that mate was
// stuck on, if it was (its blame word). The acquire is of system scope where node-mates
// are on other GPUs (peers_sys), else of device scope.
__device__ __forceinline__ bool wait_mate(const hep_kargs &a, const unsigned long long *flag,
                                          unsigned long long expect, int stage, int mate)
{
    return wait_geq_s(a, flag, expect, stage, a.rank0 + mate, 1,
                      a.flags[mate] + HEP_FLAG_BLAME, a.peers_sys != 0);
}

// Stress runs (HEP_DEBUG_JITTER_US): this block starts after a pseudo-random 0..jitter_ns,
// a different delay per (rank, block, call), so that the blocks' publications to the proxy
// and to node-mates come in orders an ordinary run never shows. Called once at kernel start
// by every thread (jitter_ns is the same for the whole grid, so the barrier is uniform);
// with jitter_ns = 0 it is one compare of a kernel parameter.
__device__ __forceinline__ void block_start_jitter(const hep_kargs &a, unsigned long long e)
{
    if (a.jitter_ns == 0)
        return;
    if (threadIdx.x == 0) {
        unsigned long long h = (e * 0x9e3779b97f4a7c15ull) ^
                               ((unsigned long long)(a.node * 64 + a.local) << 32) ^
                               (unsigned long long)blockIdx.x ^ (now_ns() >> 10);
        h = (h ^ (h >> 31)) * 0xbf58476d1ce4e5b9ull;
        h ^= h >> 29;
        unsigned long long left = h % (a.jitter_ns + 1);
        while (left) { /* __nanosleep takes at most about a millisecond at a time */
            const unsigned step = left > 1000000ull ? 1000000u : (unsigned)left;
            __nanosleep(step);
            left -= step;
        }
    }
    __syncthreads();
}

// The block's threads agree on `ok` (one flag per block in shared memory): every thread
// passes its own result, all get the AND. Costs one barrier, no global load.
__device__ __forceinline__ bool block_all(bool ok)
{
    return __syncthreads_and(ok ? 1 : 0) != 0;
}

// Each other node's word words[j] (j < N - 1, in slot order) reached e, as the NIC or the
// proxy writes it: threads 0..N-2 of the block wait one word each. false when a wait gave up.
__device__ __forceinline__ bool wait_slots(const hep_kargs &a, const unsigned long long *words,
                                           unsigned long long e, int stage)
{
    bool ok = true;
    if ((int)threadIdx.x < a.N - 1) {
        const int L = (int)threadIdx.x < a.node ? (int)threadIdx.x : (int)threadIdx.x + 1;
        ok = wait_geq(a, words + threadIdx.x, e, stage, L * a.R + a.local);
    }
    return block_all(ok);
}

// All S blocks of this kernel arrived at *ctr (the kernels of a rank fit the GPU together).
__device__ __forceinline__ bool grid_wait(const hep_kargs &a, unsigned long long *ctr,
                                          unsigned long long expect)
{
    bool ok = true;
    if (threadIdx.x == 0)
        ok = wait_geq_s(a, ctr, expect, HEP_STAGE_PREPROCESS, a.rank0 + a.local, 2, NULL, false);
    return block_all(ok);
}

// This block arrives at the grid counter *ctr (its earlier writes released to the others).
// (Without the fence, relying on the release's cumulativity over the barrier, the layout
// step was no faster: bench/NOTES.md.)
__device__ __forceinline__ void grid_arrive(unsigned long long *ctr)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        red_add_release_gpu(ctr, 1ull);
    }
}

#endif
