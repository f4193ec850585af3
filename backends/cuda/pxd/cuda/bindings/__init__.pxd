# Build-only: makes this folder the package cuda.bindings for Cython (see cydriver.pxd beside it).
