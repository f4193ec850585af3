# The part of cuda-bindings' ``cuda/bindings/cydriver.pxd`` that metrale_cuda/_cdriver.pyx calls, declared as that
# file declares it (unchanged from cuda-bindings 12.8 to 13.5), with its types from the CUDA toolkit's cuda.h.
#
# Build-only: setup.py puts this folder first on Cython's include path, so the build needs cuda.h and not a
# cuda-bindings whose own cydriver.pxd matches that cuda.h (cuda-bindings 13.5's names types that CUDA 13.0's cuda.h
# lacks). At import, Cython checks each function's signature against the installed cuda.bindings.cydriver's: one
# that differs fails the import, and the pure path runs (metrale_cuda/_compiled.py logs why).

cdef extern from "<type_traits>":
    pass

cdef extern from "cuda.h":
    ctypedef enum CUresult "CUresult":
        CUDA_SUCCESS
        CUDA_ERROR_NOT_FOUND
    ctypedef unsigned long long CUdeviceptr "CUdeviceptr"
    cdef struct CUctx_st:
        pass
    ctypedef CUctx_st* CUcontext "CUcontext"
    cdef struct CUstream_st:
        pass
    ctypedef CUstream_st* CUstream "CUstream"
    cdef struct CUfunc_st:
        pass
    ctypedef CUfunc_st* CUfunction "CUfunction"
    cdef struct CUgraphExec_st:
        pass
    ctypedef CUgraphExec_st* CUgraphExec "CUgraphExec"

cdef CUresult cuCtxSetCurrent(CUcontext ctx) except ?CUDA_ERROR_NOT_FOUND nogil
cdef CUresult cuCtxGetCurrent(CUcontext* pctx) except ?CUDA_ERROR_NOT_FOUND nogil
cdef CUresult cuMemAlloc(CUdeviceptr* dptr, size_t bytesize) except ?CUDA_ERROR_NOT_FOUND nogil
cdef CUresult cuMemFree(CUdeviceptr dptr) except ?CUDA_ERROR_NOT_FOUND nogil
cdef CUresult cuMemAllocManaged(CUdeviceptr* dptr, size_t bytesize, unsigned int flags) except ?CUDA_ERROR_NOT_FOUND nogil
cdef CUresult cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void* srcHost, size_t ByteCount, CUstream hStream) except ?CUDA_ERROR_NOT_FOUND nogil
cdef CUresult cuMemcpyDtoHAsync(void* dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) except ?CUDA_ERROR_NOT_FOUND nogil
cdef CUresult cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) except ?CUDA_ERROR_NOT_FOUND nogil
cdef CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) except ?CUDA_ERROR_NOT_FOUND nogil
cdef CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream, void** kernelParams, void** extra) except ?CUDA_ERROR_NOT_FOUND nogil
cdef CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) except ?CUDA_ERROR_NOT_FOUND nogil
