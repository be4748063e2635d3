// The block timeline, compiled in only where KDA_TRACE is defined (benchmarks/timeline.py builds
// such a kernel set; the package's own build has none of it). Thread 0 of every block of a traced
// entry writes one record of four words: the launch's tag (a pointer the launch writes, which names
// it) with the block's SM in the top 16 bits, and the global timer (ns) at the block's start, after
// its wait on the previous kernel (0 if it never waited; with KDA_TRACE_WAITED_HERE, the wait of the
// one thread that moves the data waited for) and at its end.
#ifndef KDA_COMMON_TRACE_CUH
#define KDA_COMMON_TRACE_CUH

#ifdef KDA_TRACE
#define KDA_TRACE_RECORDS 65536
__device__ unsigned long long kda_trace_records[KDA_TRACE_RECORDS][4];
__device__ unsigned int kda_trace_count;
__shared__ unsigned long long kda_trace_waited;

__device__ __forceinline__ unsigned long long kda_global_time()
{
    unsigned long long time;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(time));
    return time;
}

struct KdaTraceScope {
    unsigned long long tag;
    unsigned long long start;
    __device__ explicit KdaTraceScope(const void* launch_tag)
        : tag(reinterpret_cast<unsigned long long>(launch_tag)), start(0ull)
    {
        if (threadIdx.x == 0) {
            start = kda_global_time();
            kda_trace_waited = 0ull;
        }
    }
    __device__ ~KdaTraceScope()
    {
        if (threadIdx.x == 0) {
            const unsigned long long end = kda_global_time();
            unsigned int sm;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
            const unsigned int slot = atomicAdd(&kda_trace_count, 1u);
            if (slot < KDA_TRACE_RECORDS) {
                kda_trace_records[slot][0] = (tag & 0xFFFFFFFFFFFFull) | (static_cast<unsigned long long>(sm) << 48);
                kda_trace_records[slot][1] = start;
                kda_trace_records[slot][2] = kda_trace_waited;
                kda_trace_records[slot][3] = end;
            }
        }
    }
};
#define KDA_TRACE_SCOPE(launch_tag) KdaTraceScope kda_trace_scope(launch_tag)
#define KDA_TRACE_WAITED()                      \
    do {                                        \
        if (threadIdx.x == 0) {                 \
            kda_trace_waited = kda_global_time(); \
        }                                       \
    } while (0)
// The same stamp by whichever thread calls it (one thread of the block: a copy warp's lane).
#define KDA_TRACE_WAITED_HERE() (kda_trace_waited = kda_global_time())
#else
#define KDA_TRACE_SCOPE(launch_tag)
#define KDA_TRACE_WAITED()
#define KDA_TRACE_WAITED_HERE()
#endif

#endif  // KDA_COMMON_TRACE_CUH
