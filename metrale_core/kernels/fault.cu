// A kernel that faults on purpose, for the tests of fault reporting:
//   nvcc -ptx -arch=compute_75 -o fault.ptx fault.cu
// write_to(address, value) stores value at address: given an address no allocation holds
// (0x10, say) it raises CUDA_ERROR_ILLEGAL_ADDRESS, a sticky fault.
extern "C" __global__ void write_to(unsigned long long address, unsigned int value) {
    *reinterpret_cast<volatile unsigned int*>(address) = value;
}

// write_u8(address, value) stores one byte (thread 0 of block 0): a planted one-byte overrun.
extern "C" __global__ void write_u8(unsigned long long address, unsigned int value) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        *reinterpret_cast<volatile unsigned char*>(address) = static_cast<unsigned char>(value);
    }
}
