# The capture rule's C-level door, for the compiled parts (the allocator's lane): `forbid_c` is
# `forbid_during_capture` with the calling thread's flag at hand.

cdef int forbid_c(object flag, str what) except -1

# `leave_call` with the flag at hand: the calling thread left a metrale call (the gate's twin calls it).
cdef int leave_c(object flag) except -1

# `call_entered` with the flag at hand: the calling thread entered a metrale call (the gate's twin calls it).
cdef int enter_c(object flag) except -1
