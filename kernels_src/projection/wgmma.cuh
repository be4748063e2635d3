// Hopper's warpgroup MMA (sm_90a) for the bulk-copy sweep (gemm_rows_bulk.cu): operand descriptors, the
// fences and waits of the asynchronous MMA. The mbarrier and bulk-copy steps that feed it: common/mbarrier.cuh.
#pragma once

// The 32 FP32 accumulators of a 64 x 64 wgmma (operands %0 .. %31) as the instruction names them,
// and their read-write operand list: the first operands of every m64n64 wgmma asm.
#define WGMMA_D32                                                                                          \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                              \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WGMMA_D32_OPERANDS(d)                                                                              \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),       \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),          \
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),          \
        "+f"(d[30]), "+f"(d[31])

// Shared-memory descriptor of a K-major operand without swizzle (sm_90 wgmma): start address,
// leading byte offset (between core matrices along k), stride byte offset (along the rows).
__device__ __forceinline__ unsigned long long wgmma_descriptor(unsigned int address, unsigned int leading,
                                                               unsigned int stride)
{
    return static_cast<unsigned long long>((address & 0x3FFFF) >> 4) |
           (static_cast<unsigned long long>(leading >> 4) << 16) |
           (static_cast<unsigned long long>(stride >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Registers an asynchronous wgmma reads or writes: after wgmma_wait_all, this keeps the compiler
// from moving their other uses across the wait.
template <int COUNT>
__device__ __forceinline__ void wgmma_hold(float (&registers)[COUNT])
{
#pragma unroll
    for (int i = 0; i < COUNT; ++i) {
        asm volatile("" : "+f"(registers[i])::"memory");
    }
}
