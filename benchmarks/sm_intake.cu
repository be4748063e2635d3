// How fast one SM takes data in, alone and with every other SM doing the same (benchmarks/sm_intake.py).
// Nothing is computed: the kernels only move bytes into shared memory (or registers) and drop them.
//
// intake_bulk: one thread per block streams `chunks` chunks of `chunk_bytes` through a ring of
//   `stages` shared-memory slots by the bulk copy engine, each slot reused once its copy has landed.
//   Block b reads from src + b * block_offset on, wrapping at `region` bytes.
// intake_multicast: the same over a cluster of two blocks, each block issuing every other chunk
//   once, multicast into the same slot of both blocks: every block still receives every chunk, but
//   L2 serves each chunk once. A slot is refilled once both blocks have seen its previous chunk land
//   (an `empty` mbarrier of two arrivals in the issuing block).
// intake_loads: 256 threads, each keeping 8 sixteen-byte loads in flight, over the same bytes.
#include "wgmma.cuh"

__device__ __forceinline__ unsigned int intake_shared(const void* pointer)
{
    return static_cast<unsigned int>(__cvta_generic_to_shared(pointer));
}

// Streams `chunks` chunks of `chunk_bytes` from src + start on (wrapping at `region` bytes) through
// the ring of `stages` slots at shared address `ring`, slot s completing on the mbarrier at full + 8 s.
__device__ __forceinline__ void intake_stream(unsigned int ring, unsigned int full, int stages, int chunks,
                                              int chunk_bytes, const char* src, unsigned long long start,
                                              unsigned long long region)
{
    for (int s = 0; s < stages; ++s) {
        mbarrier_init(full + 8 * s, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int i = 0; i < chunks + stages; ++i) {
        if (i >= stages) {
            const int j = i - stages;
            mbarrier_wait(full + 8 * (j % stages), (j / stages) & 1);
        }
        if (i < chunks) {
            const int slot = i % stages;
            mbarrier_expect_bytes(full + 8 * slot, chunk_bytes);
            bulk_copy_to_shared(ring + slot * chunk_bytes,
                                src + (start + static_cast<unsigned long long>(i) * chunk_bytes) % region,
                                chunk_bytes, full + 8 * slot);
        }
    }
}

extern "C" __global__ void __launch_bounds__(32) intake_bulk(const char* src, unsigned long long region,
                                                           unsigned long long block_offset, int chunks,
                                                           int chunk_bytes, int stages)
{
    extern __shared__ __align__(128) unsigned char intake_ring[];
    if (threadIdx.x == 0) {
        const unsigned int ring = intake_shared(intake_ring);
        intake_stream(ring, ring + stages * chunk_bytes, stages, chunks, chunk_bytes, src, blockIdx.x * block_offset,
                      region);
    }
}

__device__ __forceinline__ void intake_cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void intake_remote_arrive(unsigned int barrier, unsigned int rank)
{
    asm volatile(
        "{\n\t.reg .b32 remote;\n\t"
        "mapa.shared::cluster.u32 remote, %0, %1;\n\t"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n\t}" ::"r"(barrier),
        "r"(rank)
        : "memory");
}

__device__ __forceinline__ void intake_wait_cluster(unsigned int barrier, unsigned int parity)
{
    unsigned int ready = 0;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(ready)
            : "r"(barrier), "r"(parity)
            : "memory");
    } while (!ready);
}

__device__ __forceinline__ void intake_multicast_copy(unsigned int destination, const void* source, unsigned int bytes,
                                                      unsigned int barrier)
{
    const unsigned short both = 3;
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], "
        "%4;" ::"r"(destination),
        "l"(source), "r"(bytes), "r"(barrier), "h"(both)
        : "memory");
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(32)
    intake_multicast(const char* src, unsigned long long region, unsigned long long block_offset, int chunks,
                     int chunk_bytes, int stages)
{
    extern __shared__ __align__(128) unsigned char intake_ring[];
    unsigned int rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const unsigned int ring = intake_shared(intake_ring);
    const unsigned int full = ring + stages * chunk_bytes;
    const unsigned int empty = full + 8 * stages;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbarrier_init(full + 8 * s, 1);
            mbarrier_init(empty + 8 * s, 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    intake_cluster_sync();
    if (threadIdx.x == 0) {
        // Both blocks of a cluster read the same bytes: the pair's offset.
        const unsigned long long start = (blockIdx.x / 2) * block_offset;
        const int first = min(stages, chunks);
        for (int i = 0; i < first; ++i) {
            mbarrier_expect_bytes(full + 8 * i, chunk_bytes);
        }
        for (int i = static_cast<int>(rank); i < first; i += 2) {
            intake_multicast_copy(ring + i * chunk_bytes,
                                  src + (start + static_cast<unsigned long long>(i) * chunk_bytes) % region,
                                  chunk_bytes, full + 8 * i);
        }
        for (int i = 0; i < chunks; ++i) {
            const int slot = i % stages;
            mbarrier_wait(full + 8 * slot, (i / stages) & 1);
            const int next = i + stages;
            if (next < chunks) {
                mbarrier_expect_bytes(full + 8 * slot, chunk_bytes);
                const unsigned int issuer = next & 1;
                intake_remote_arrive(empty + 8 * slot, issuer);
                if (issuer == rank) {
                    intake_wait_cluster(empty + 8 * slot, (i / stages) & 1);
                    intake_multicast_copy(ring + slot * chunk_bytes,
                                          src + (start + static_cast<unsigned long long>(next) * chunk_bytes) % region,
                                          chunk_bytes, full + 8 * slot);
                }
            }
        }
    }
    __syncwarp();
    // Neither block leaves while the other may still copy into it or arrive on its barriers.
    intake_cluster_sync();
}

extern "C" __global__ void __launch_bounds__(256) intake_loads(const uint4* src, unsigned long long region_words,
                                                             unsigned long long block_offset_words,
                                                             long long words_per_block, unsigned int* sink)
{
    unsigned int acc = 0;
    const unsigned long long start = blockIdx.x * block_offset_words;
    for (long long i = threadIdx.x; i < words_per_block; i += 8 * 256) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            v[u] = __ldcg(src + (start + i + u * 256) % region_words);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    if (acc == 0x9e3779b9u) {
        sink[blockIdx.x] = acc;
    }
}

// intake_issuers: intake_bulk with `issuers` threads of one block each streaming its own share of the
// chunks through its own ring of `stages` slots; issuer r is thread r * lane_step (lane_step 32: one
// thread in each of `issuers` warps; 1: neighbouring lanes of one warp).
extern "C" __global__ void __launch_bounds__(256) intake_issuers(const char* src, unsigned long long region,
                                                               unsigned long long block_offset, int chunks,
                                                               int chunk_bytes, int stages, int issuers, int lane_step)
{
    extern __shared__ __align__(128) unsigned char intake_ring[];
    if (threadIdx.x % lane_step != 0 || threadIdx.x / lane_step >= issuers) {
        return;
    }
    const int r = threadIdx.x / lane_step;
    const unsigned int ring = intake_shared(intake_ring);
    const int mine = chunks / issuers;
    intake_stream(ring + r * stages * chunk_bytes, ring + issuers * stages * chunk_bytes + 8 * r * stages, stages, mine,
                  chunk_bytes, src, blockIdx.x * block_offset + static_cast<unsigned long long>(r) * mine * chunk_bytes,
                  region);
}
