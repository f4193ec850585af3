// metrale's shipped vector kernels. The PTX beside this file is what metrale loads:
//   nvcc -ptx -arch=compute_75 -o vector.ptx vector.cu
// (regenerate with `python3 -m metrale_core.kernels` on a machine with nvcc).

// out[i] = a[i] + b[i] for i < n.
extern "C" __global__ void vector_add(const float* a, const float* b, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = a[i] + b[i];
    }
}

// p[i] = value for i < n: with n one past the buffer's length it writes one element too far,
// into the red zone (the red-zone tests plant overruns with it).
extern "C" __global__ void fill_u32(unsigned int* p, unsigned int n, unsigned int value) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        p[i] = value;
    }
}
