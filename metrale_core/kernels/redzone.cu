// metrale's device-side red-zone checks.
//   nvcc -ptx -arch=compute_75 -o redzone.ptx redzone.cu
// A zone is (address, length) of u64: any address, any length >= 1. Both kernels read the bytes
// before the first 16-byte boundary and after the last one singly, and the aligned middle with
// 16-byte loads compared against the fill byte replicated into a word.

// The first changed byte of the zone as seen by this thread (0xffffffff: none), or, with
// any_only, 0 for "some byte changed" as soon as one is seen.
__device__ static unsigned int zone_first(const unsigned char* p, unsigned long long length, unsigned char fill,
                                          bool any_only) {
    unsigned int first = 0xffffffffu;
    unsigned long long addr = reinterpret_cast<unsigned long long>(p);
    unsigned long long head = ((16u - (addr & 15u)) & 15u);
    if (head > length) {
        head = length;
    }
    unsigned long long words = (length - head) / 16u;
    unsigned long long tail_start = head + words * 16u;
    // head and tail bytes: at most 15 each
    for (unsigned long long i = threadIdx.x; i < head; i += blockDim.x) {
        if (p[i] != fill) {
            first = min(first, static_cast<unsigned int>(i));
        }
    }
    for (unsigned long long i = tail_start + threadIdx.x; i < length; i += blockDim.x) {
        if (p[i] != fill) {
            first = min(first, static_cast<unsigned int>(i));
        }
    }
    unsigned int f = fill * 0x01010101u;
    const uint4* middle = reinterpret_cast<const uint4*>(p + head);
    for (unsigned long long w = threadIdx.x; w < words; w += blockDim.x) {
        uint4 v = middle[w];
        if (v.x != f || v.y != f || v.z != f || v.w != f) {
            if (any_only) {
                return 0u;
            }
            const unsigned char* b = p + head + w * 16u;
            for (unsigned int k = 0; k < 16u; ++k) {
                if (b[k] != fill) {
                    first = min(first, static_cast<unsigned int>(head + w * 16u + k));
                    break;
                }
            }
            break;  // later words of this thread lie further on
        }
    }
    return first;
}

// zones holds n pairs (address, length); block z checks zone z and writes result[z]:
// 0 when every byte equals fill, else the first changed offset plus one. Grid (n), block (256).
extern "C" __global__ void redzone_scan(const unsigned long long* zones, unsigned int n, unsigned int fill,
                                        unsigned int* result) {
    unsigned int z = blockIdx.x;
    if (z >= n) {
        return;
    }
    const unsigned char* p = reinterpret_cast<const unsigned char*>(zones[2 * z]);
    unsigned long long length = zones[2 * z + 1];
    __shared__ unsigned int first;
    if (threadIdx.x == 0) {
        first = 0xffffffffu;
    }
    __syncthreads();
    unsigned int mine = zone_first(p, length, static_cast<unsigned char>(fill), false);
    if (mine != 0xffffffffu) {
        atomicMin(&first, mine);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        result[z] = first == 0xffffffffu ? 0u : first + 1u;
    }
}

// Whether any byte of the zone differs from fill, as seen by lane `lane` of `lanes` threads walking it
// together (the caller combines the lanes). The aligned middle is read with 16-byte loads whose
// results are OR-ed together without a branch, so a thread's loads are all in flight at once.
__device__ static bool zone_changed(const unsigned char* p, unsigned long long length, unsigned char fill,
                                    unsigned int lane, unsigned int lanes) {
    unsigned long long addr = reinterpret_cast<unsigned long long>(p);
    unsigned long long head = ((16u - (addr & 15u)) & 15u);
    if (head > length) {
        head = length;
    }
    unsigned long long words = (length - head) / 16u;
    unsigned long long tail_start = head + words * 16u;
    unsigned int f = fill * 0x01010101u;
    unsigned int diff = 0u;
    for (unsigned long long i = lane; i < head; i += lanes) {
        diff |= p[i] ^ fill;
    }
    for (unsigned long long i = tail_start + lane; i < length; i += lanes) {
        diff |= p[i] ^ fill;
    }
    const uint4* middle = reinterpret_cast<const uint4*>(p + head);
#pragma unroll 8
    for (unsigned long long w = lane; w < words; w += lanes) {
        uint4 v = middle[w];
        diff |= (v.x ^ f) | (v.y ^ f) | (v.z ^ f) | (v.w ^ f);
    }
    return diff != 0u;
}

// The in-graph check, captured as a graph's last node: its parameters never change.
// desc (device): table address, zone count, table version, fill byte (u64 each).
// state (device, zeroed once): u64 arrivals (low 32 bits: blocks finished; high 32 bits: bad zones they
//   found), u64 verdict sequence number. Each warp checks one zone at a time; the blocks that take part
//   are as many as hold a warp per zone, at most the grid, at least one (the others return at once).
//   Each adds its arrival and its bad zones in one atomic, so the last to arrive knows the total from
//   that atomic's result; it writes the verdict and sets the arrivals back to 0. The sequence number
//   and the version are read as a block starts, behind the zones' loads. (Both hold still while a check
//   runs: metrale never writes the table while a check may run, and launches of one executable graph
//   never overlap.)
// slot (mapped host memory): u64 bad zones, u64 version scanned, then (after a system fence) u64
//   sequence number. Any grid; a block of whole warps (metrale launches (1024) x (256)).
extern "C" __global__ void redzone_verdict(const unsigned long long* desc, unsigned long long* state,
                                           unsigned long long* slot) {
    unsigned long long n = desc[1];
    unsigned int warps = blockDim.x / 32u;
    if (warps == 0u) {
        warps = 1u;
    }
    unsigned long long wanted = (n + warps - 1u) / warps;
    unsigned int blocks = wanted < gridDim.x ? static_cast<unsigned int>(wanted) : gridDim.x;
    if (blocks == 0u) {
        blocks = 1u;
    }
    if (blockIdx.x >= blocks) {
        return;
    }
    const unsigned long long* table = reinterpret_cast<const unsigned long long*>(desc[0]);
    unsigned char fill = static_cast<unsigned char>(desc[3]);
    __shared__ unsigned int block_bad;
    unsigned long long seq = 0u;
    unsigned long long version = 0u;
    if (threadIdx.x == 0) {
        block_bad = 0u;
        seq = *reinterpret_cast<volatile unsigned long long*>(state + 1);
        version = desc[2];
    }
    __syncthreads();
    unsigned int lane = threadIdx.x & 31u;
    unsigned int warp = threadIdx.x / 32u;
    unsigned long long stride = static_cast<unsigned long long>(blocks) * warps;
    if (warp < warps) {
        for (unsigned long long z = static_cast<unsigned long long>(blockIdx.x) * warps + warp; z < n; z += stride) {
            const unsigned char* p = reinterpret_cast<const unsigned char*>(table[2 * z]);
            unsigned long long length = table[2 * z + 1];
            bool changed = zone_changed(p, length, fill, lane, 32u);
            if (__any_sync(0xffffffffu, changed) && lane == 0u) {
                atomicAdd(&block_bad, 1u);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long mine = 1ull | (static_cast<unsigned long long>(block_bad) << 32);
        unsigned long long before = atomicAdd(state, mine);
        if ((before & 0xffffffffull) + 1u == blocks) {  // the last block of this launch
            unsigned long long total = (before >> 32) + block_bad;
            volatile unsigned long long* words = state;
            words[0] = 0u;
            words[1] = seq + 1u;
            volatile unsigned long long* out = slot;
            out[0] = total;
            out[1] = version;
            __threadfence_system();
            out[2] = seq + 1u;
        }
    }
}
