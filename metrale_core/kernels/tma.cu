// metrale's shipped TMA kernel: a 2-D tile copy through tensor maps (Hopper's Tensor Memory Accelerator).
// The PTX beside this file is what metrale loads:
//   nvcc -ptx -arch=sm_90 -o tma.ptx tma.cu
// (regenerate with `python3 -m metrale_core.kernels` on a machine with nvcc).
#include <cuda.h>  // CUtensorMap

// Block (x, y) copies the box at element (row y * box_rows, column x * box_cols) of `src` to the same place in
// `dst`: one TMA load into shared memory (elements outside `src` arrive as its out-of-bounds fill) and one TMA
// store (elements outside `dst` are not written). `tile_bytes` is the box's bytes, prod(tile_shape) * itemsize:
// the load's transaction count, which the barrier waits for. Launch with `spec.shared_bytes` of dynamic shared
// memory (the larger of the two maps'), which with a swizzle pads each row of the box to the swizzle's span and
// can exceed `tile_bytes`, and one thread a block (or more: thread 0 does the copy).
extern "C" __global__ void tma_copy_2d(const __grid_constant__ CUtensorMap src,
                                       const __grid_constant__ CUtensorMap dst,
                                       unsigned int box_cols, unsigned int box_rows, unsigned int tile_bytes) {
    extern __shared__ __align__(1024) unsigned char tile[];
    __shared__ __align__(8) unsigned long long barrier;
    if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0) {
        return;
    }
    int col = (int)(blockIdx.x * box_cols);
    int row = (int)(blockIdx.y * box_rows);
    unsigned int smem = (unsigned int)__cvta_generic_to_shared(tile);
    unsigned int bar = (unsigned int)__cvta_generic_to_shared(&barrier);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(tile_bytes) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem), "l"(reinterpret_cast<unsigned long long>(&src)), "r"(col), "r"(row), "r"(bar)
        : "memory");
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar)
        : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"(reinterpret_cast<unsigned long long>(&dst)), "r"(col), "r"(row), "r"(smem)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
