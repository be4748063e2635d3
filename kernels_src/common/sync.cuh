// Waits between kernels: the programmatic dependent launch (sm_90 and later) and the counters a
// kernel polls while the one it waits for still runs beside it; and the shared-memory addresses
// that the asynchronous copies and mbarriers take.
#ifndef KDA_COMMON_SYNC_CUH
#define KDA_COMMON_SYNC_CUH

// Programmatic dependent launch (no-ops before sm_90). A kernel launched with the
// programmatic-serialization attribute may start while the kernel before it in the stream still
// runs, once every block of that one has called kda_let_next_kernel_launch (or exited);
// kda_grid_dependency_wait then returns when the previous kernel has finished and its writes are
// visible (at once without the attribute). Whatever a kernel reads or writes that the previous
// kernel may touch must come after the wait.
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

// ---- Words one kernel waits on while another, running beside it, finishes its part: a count of
// producers done (each adds 1 with release once its writes are out) and a count of the waiting
// blocks that have seen it. A wait past KDA_MAX_POLLS polls (tens of seconds) is a broken schedule:
// trap instead of hanging.
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

// Thread 0 of every block of a grid of `blocks` that waits on the words: kda_await_words until
// words[0] >= target (the producers' count), then a block barrier before the block reads what the
// producers wrote, through L2. The block counts itself in words[1] as it passes (the count before
// it is returned, and read only at the block's end, so its round trip is not waited for) and, at its
// end, kda_clear_words_if_last: the last block past the wait sets both words back to zero, so the
// next launch waits again.
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

#endif  // KDA_COMMON_SYNC_CUH
