// The mbarriers and bulk copies of a shared-memory ring (sm_90 and later): one thread announces a
// slot's bytes and starts their copy, the copy engine completes them on the slot's barrier, the slot's
// readers wait for that phase and arrive on a second barrier to let the slot go.
#pragma once

// mbarrier (shared::cta, 8 bytes at `barrier`): initialise to `count` arrivals a phase.
__device__ __forceinline__ void mbarrier_init(unsigned int barrier, unsigned int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(count) : "memory");
}

// After the barriers' initialisation, before any other thread or the copy engine uses them.
__device__ __forceinline__ void mbarrier_init_fence()
{
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival, announcing `bytes` that asynchronous copies will complete on the barrier.
__device__ __forceinline__ void mbarrier_expect_bytes(unsigned int barrier, unsigned int bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(bytes) : "memory");
}

// One arrival.
__device__ __forceinline__ void mbarrier_arrive(unsigned int barrier)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
}

// Wait until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned int barrier, unsigned int parity)
{
    unsigned int ready = 0;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(ready)
            : "r"(barrier), "r"(parity)
            : "memory");
    } while (!ready);
}

// `bytes` (a multiple of 16) from global `source` to shared `destination` by the bulk copy engine,
// completing on `barrier`.
__device__ __forceinline__ void bulk_copy_to_shared(unsigned int destination, const void* source, unsigned int bytes,
                                                    unsigned int barrier)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     destination),
                 "l"(source), "r"(bytes), "r"(barrier)
                 : "memory");
}
