// metrale's device-side red-zone scan: one launch checks every live zone.
//   nvcc -ptx -arch=compute_75 -o redzone.ptx redzone.cu
// zones holds n pairs (address, length); block z checks zone z and writes result[z]:
// 0 when every byte equals fill, else the first changed offset plus one.
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
    for (unsigned long long i = threadIdx.x; i < length; i += blockDim.x) {
        if (p[i] != static_cast<unsigned char>(fill)) {
            atomicMin(&first, static_cast<unsigned int>(i));
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        result[z] = first == 0xffffffffu ? 0u : first + 1u;
    }
}
