# The capture rule's C-level door, for the compiled parts (the allocator's lane): `forbid_c` is
# `forbid_during_capture` with the calling thread's flag at hand.

cdef int forbid_c(object flag, str what) except -1
