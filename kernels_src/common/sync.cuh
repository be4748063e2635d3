// Waits between kernels: the programmatic dependent launch (sm_90 and later) and the counters a kernel
// polls while the one it waits for still runs beside it; and the shared-memory addresses of cp.async.
#pragma once

// Programmatic dependent launch (no-ops before sm_90): whatever a kernel reads or writes that the previous
// kernel may touch must come after kda_grid_dependency_wait (docs/kernels.md, 'Shared pieces').
__device__ __forceinline__ void kda_let_next_kernel_launch()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void kda_grid_dependency_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Words one kernel waits on while another, running beside it, finishes its part: a count of producers
// done and a count of the waiting blocks that have seen it. A wait past KDA_MAX_POLLS polls traps.
#define KDA_MAX_POLLS (1 << 26)

__device__ __forceinline__ int load_acquire(const int* counter)
{
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
    return value;
}

// *word += 1, released at GPU scope: whatever this thread has seen written before (its block's
// writes, after a block barrier) is visible to a thread that reads the new count by load_acquire.
__device__ __forceinline__ void kda_count_release(int* word)
{
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(word) : "memory");
}

// Thread 0: until counter >= target.
__device__ __forceinline__ void wait_for_counter(const int* counter, int target)
{
    int polls = 0;
    while (load_acquire(counter) < target) {
        __nanosleep(64);
        if (++polls > KDA_MAX_POLLS) {
            __trap();
        }
    }
}

// Thread 0 of every waiting block: kda_await_words until words[0] >= target, then the block counts itself
// in words[1] (the count before it is returned, for kda_clear_words_if_last at the block's end: the last
// block past the wait sets both words back to zero, so that the next launch waits again).
__device__ __forceinline__ int kda_await_words(int* words, int target)
{
    wait_for_counter(words, target);
    return atomicAdd(words + 1, 1);
}

__device__ __forceinline__ void kda_clear_words_if_last(int* words, int passed, int blocks)
{
    if (passed == blocks - 1) {
        words[1] = 0;
        words[0] = 0;
    }
}

// The shared-memory (state-space) address of a pointer into this block's shared memory, as the
// asynchronous copies and mbarriers take it.
__device__ __forceinline__ unsigned int shared_address(const void* pointer)
{
    return static_cast<unsigned int>(__cvta_generic_to_shared(pointer));
}
