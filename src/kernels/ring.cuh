// kernels/ring.cuh: the inter-node slots as rings of chunks (N > 1), the words of both
// phases. A slot holds P = a.P positions of C = a.C tokens, the launched phase's (a.ST >= P x
// C rows: combine may cut the GPU's whole slot into more chunks than dispatch, plan.cchunk);
// chunk k of a call (the slot's tokens [kC, kC + C)) sits in position k % P. Included by the
// .cu files of kernels/ only.
//
// Sender side (dispatch: the send staging; combine: the partial sums), ring to node m:
//  - chunk k goes into position k % P once the credit word (its flags buffer, word B + m)
//    says the receiver freed chunk k - P (chunks 0..P-1 need none: a sender starts call
//    e + 1 of a ring only after call e ended wherever it was read);
//  - its producers (all blocks of dispatch, the reducing warps of combine) each write their
//    share, then count themselves in the position's producer counter; the last one
//    publishes the chunk: the flag source of the position (device, B + N + m P + p) =
//    HEP_RING_VAL(e, k + 1), then the proxy's extent and ready words (host-mapped). The
//    proxy posts the data and then, fenced, the flag into the receiver's landed word.
//  - a position's words are rewritten (for chunk k + P) only after credit k came, so after
//    the proxy had read them for chunk k.
// Receiver side, ring from node m (its slot s here):
//  - chunk k may be read once the landed word (B + s) holds HEP_RING_VAL(e, k + 1);
//  - its consumers count themselves in the position's consumer counter; the one that
//    completes chunk k frees it: after chunk k - 1's credit was published (credits go out in
//    chunk order), the credit source (device, B + N + s) = HEP_RING_VAL(e, k + 1), then the
//    proxy's credit ready word, then the published count.
// Counters are per call (zeroed: dispatch's by the pack kernel before it, combine's by the
// last block of the combine before), values in the flags buffers carry the call.
#ifndef HEP_KERNELS_RING_CUH
#define HEP_KERNELS_RING_CUH

#include "kernels/lists.cuh"

enum { RING_PRODUCED = 0, RING_CONSUMED = 1, RING_PUBLISHED = 2, RING_TAKEN = 3 };

__device__ __forceinline__ int ring_chunks(int tokens, int C)
{
    return (tokens + C - 1) / C;
}

// The row within its slot of the slot's q-th token (q itself where the ring holds the
// whole slot, P x C >= T: no division then).
__device__ __forceinline__ int ring_row(const hep_kargs &a, int q)
{
    return a.ST >= a.T ? q : q / a.C % a.P * a.C + q % a.C;
}

__device__ __forceinline__ size_t ring_base_word(const hep_kargs &a)
{
    return HEP_RING_WORD((size_t)a.N, HEP_COUNT_BLOCK_WORDS((size_t)a.R, (size_t)a.El));
}

__device__ __forceinline__ int *ring_ctr(const hep_kargs &a, int phase, int which, int m)
{
    return a.ring_ctr + (((size_t)phase * HEP_RING_CTR_KINDS + which) * a.N + m) * HEP_RING_DEPTH;
}

__device__ __forceinline__ unsigned long long *px_node(const hep_kargs &a, int phase, int m)
{
    return a.px + HEP_PX_WORD(a.N, phase, m);
}

// One thread, after its producers' writes were fenced at system scope: chunk k of `rows`
// rows of the ring to node m is in place. `words`: this rank's sender-side flags buffer.
__device__ __forceinline__ void ring_publish(const hep_kargs &a, int phase,
                                             unsigned long long *words, int m, int k, int rows,
                                             unsigned long long e)
{
    const int p = k % a.P;
    unsigned long long *w = px_node(a, phase, m) + HEP_PX_RING + 3 * p;
    words[ring_base_word(a) + a.N + (size_t)m * a.P + p] = HEP_RING_VAL(e, k + 1);
    w[1] = 0;
    w[2] = (unsigned long long)rows;
    __threadfence_system();
    st_release(w, HEP_RING_VAL(e, k + 1));
}

// One thread, once a producer's share of chunk k of the ring to node m is written (and
// fenced): counts it; true for the one that completes the chunk (`producers` in all).
__device__ __forceinline__ bool ring_produced(const hep_kargs &a, int phase, int m, int k,
                                              int producers)
{
    const int want = producers * (k / a.P + 1);
    return atomicAdd(ring_ctr(a, phase, RING_PRODUCED, m) + k % a.P, 1) == want - 1;
}

// One thread: the skip words of phase `phase` for node m: the ring to m has `out` chunks
// this call, and the ring from m `in` chunks (its credits past in - P are not wanted).
__device__ __forceinline__ void ring_skips(const hep_kargs &a, int phase, int m, int out, int in,
                                           unsigned long long e)
{
    unsigned long long *w = px_node(a, phase, m);
    if (out >= 0)
        st_release(w + HEP_PX_RING_SKIP, HEP_RING_SKIP(e, out));
    if (in >= 0)
        st_release(w + HEP_PX_CREDIT_SKIP, HEP_RING_SKIP(e, in > a.P ? in - a.P : 0));
}

// One thread: wait (bounded) until the receiver at node m freed chunk k - P (k >= P), the
// position chunk k takes. `words`: this rank's sender-side flags buffer.
__device__ __forceinline__ bool ring_wait_credit(const hep_kargs &a,
                                                 const unsigned long long *words, int m, int k,
                                                 unsigned long long e, int phase)
{
    const int stage = phase ? HEP_STAGE_RING_COMBINE_CREDIT : HEP_STAGE_RING_DISPATCH_CREDIT;
    if (k < a.P)
        return true;
    return wait_geq(a, words + ring_base_word(a) + m, HEP_RING_VAL(e, k - a.P + 1), stage,
                    m * a.R + a.local);
}

// One thread: wait (bounded) until chunk k of slot s (node L's) landed here.
__device__ __forceinline__ bool ring_wait_landed(const hep_kargs &a,
                                                 const unsigned long long *words, int s, int L,
                                                 int k, unsigned long long e, int phase)
{
    const int stage = phase ? HEP_STAGE_RING_COMBINE_CHUNK : HEP_STAGE_RING_DISPATCH_CHUNK;
    return wait_geq(a, words + ring_base_word(a) + s, HEP_RING_VAL(e, k + 1), stage,
                    L * a.R + a.local);
}

// One thread, after its reads of chunk k of slot s (node L's) are done: counts `n` consumed
// units against `per_chunk` a chunk (blocks, or tokens); the one that completes the chunk
// publishes its credit, after chunk k - 1's (whose last consumer is past all its waits), and
// (dispatch) first clears the position's count of rows taken, for the chunk that the credit
// lets in. false when that wait gave up.
__device__ __forceinline__ bool ring_consumed(const hep_kargs &a, int phase,
                                              unsigned long long *words, int s, int L, int k,
                                              int n, int per_chunk, unsigned long long e)
{
    const int want = per_chunk * (k / a.P + 1);
    const int old = atomicAdd(ring_ctr(a, phase, RING_CONSUMED, s) + k % a.P, n);
    if (old >= want || old + n < want)
        return true;
    int *pub = ring_ctr(a, phase, RING_PUBLISHED, s);
    if (k > 0) { /* chunk k - 1's credit first: its last consumer publishes it now */
        const unsigned long long start = now_ns();
        while (*(volatile int *)pub < k) {
            __nanosleep(64);
            if (aborted(a))
                return false;
            if (now_ns() - start > 2 * a.timeout_ns) {
                give_up(a.abort, a.diag, a.flags[a.local] + HEP_FLAG_BLAME, HEP_STAGE_PREPROCESS,
                        a.rank0 + a.local, 0, (unsigned long long)k,
                        (unsigned long long)*(volatile int *)pub, now_ns() - start);
                return false;
            }
        }
        __threadfence();
    }
    if (phase == 0) /* every consumer's takes came before its count */
        ring_ctr(a, 0, RING_TAKEN, s)[k % a.P] = 0;
    words[ring_base_word(a) + a.N + s] = HEP_RING_VAL(e, k + 1);
    __threadfence_system();
    st_release(px_node(a, phase, L) + HEP_PX_CREDIT, HEP_RING_VAL(e, k + 1));
    __threadfence();
    atomicExch(pub, k + 1);
    return true;
}

// HEP_NODE_TRACE (a measurement build only, bench/NOTES.md): the global timer (ns) at the
// steps of a phase across nodes, per rank and call, the first or the last of each event over
// the rank's blocks (warps). Calls are kept in a ring of NT_CALLS; the kernel of a call
// e = 0 mod NT_CALLS prints the previous NT_CALLS - 1 calls' lines and clears them (this
// rank's kernels of those calls are done by then, in stream order), so that a print delays
// one call in NT_CALLS, whose own stamps are not kept. Each .cu file has its own copy.
// "First" events are kept as the largest complement, so that zeroed words need no other
// start value. Chunks past 1 count as chunk 1.
#ifdef HEP_NODE_TRACE /* (<cstdio> included by the .cu file, outside its namespace) */
enum { NT_WORDS = 16, NT_CALLS = 16 };
static __device__ unsigned long long hep_ntrace[NT_CALLS][64][NT_WORDS];
#define NT_AT_RANK(rank, e) hep_ntrace[(e) % NT_CALLS][(rank) & 63]
#define NT_AT(a, e) NT_AT_RANK((a).rank0 + (a).local, e)
#define NT_FIRST(a, e, i)                                                                  \
    ((e) % NT_CALLS ? (void)atomicMax(&NT_AT(a, e)[i], ~now_ns()) : (void)0)
#define NT_LAST(a, e, i) ((e) % NT_CALLS ? (void)atomicMax(&NT_AT(a, e)[i], now_ns()) : (void)0)
#define NT_SPAN(a, e, i) (NT_FIRST(a, e, i), NT_LAST(a, e, (i) + 1)) /* first at i, last at i + 1 */
// One thread: print and clear the kept calls of `rank`; bit i of `first`: word i is a first
// event. (Scalars only: a kernel-parameter struct passed by reference to a function that is
// not inlined is copied to local memory in every thread, and that made the trace build
// spill.)
static __device__ __noinline__ void ntrace_flush(int rank, unsigned long long e, char phase,
                                                 unsigned first)
{
    for (unsigned long long c = e - NT_CALLS + 1; c < e; c++) {
        unsigned long long *w = NT_AT_RANK(rank, c), v[NT_WORDS];
        for (int i = 0; i < NT_WORDS; i++) {
            v[i] = w[i] && (first >> i & 1) ? ~w[i] : w[i];
            w[i] = 0;
        }
        if (v[0])
            printf("NTRACE %c %llu %d %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu "
                   "%llu %llu %llu %llu %llu\n",
                   phase, c, rank, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9],
                   v[10], v[11], v[12], v[13], v[14], v[15]);
    }
}
#define NT_FLUSH(a, e, phase, first)                                                        \
    do {                                                                                   \
        if ((e) % NT_CALLS == 0 && (e) >= NT_CALLS && blockIdx.x == 0 && threadIdx.x == 0) \
            ntrace_flush((a).rank0 + (a).local, e, phase, first);                          \
    } while (0)
#else
#define NT_FIRST(a, e, i) ((void)0)
#define NT_LAST(a, e, i) ((void)0)
#define NT_SPAN(a, e, i) ((void)0)
#define NT_FLUSH(a, e, phase, first) ((void)0)
#endif

#endif
