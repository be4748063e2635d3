// Asks L2 for the first bytes of a weight ahead of the kernel that streams it: in a stack's decode,
// the next layer's q|k|v weight while this layer's fused step runs, which leaves the memory idle.
// Launch: 256 threads, any grid; thread t asks for the 128-byte lines t, t + gridDim.x * 256, ...
// of [w, w + bytes), kept in L2 before the lines streamed past them (evict_last). No register
// result, no wait, no write: no bit of any output depends on it.
extern "C" __global__ void __launch_bounds__(256) kda_prefetch_l2(const char* __restrict__ w, long long bytes)
{
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x * 128;
    for (long long at = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * 128; at < bytes;
         at += stride) {
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(w + at));
    }
}
