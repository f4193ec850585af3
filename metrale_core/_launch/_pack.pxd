# The compiled packer's C-level door, for the launch lane: `pack_c` packs the common cases (a live buffer of
# ``ledger``'s, of the backend ``owner``, for a pointer; a scalar of a type met before) and gives ``None`` where any
# argument is not one of them.

from metrale_core._memory._ledger cimport Ledger

cdef list pack_c(object kernel, object args, Ledger ledger, object owner)
