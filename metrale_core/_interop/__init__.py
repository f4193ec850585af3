"""Other libraries' protocols, read and made with no backend state.

- `dlpack`: DLPack capsules with ctypes, made for exports and read for imports, both protocol versions;
- `foreign`: what a CUDA-array-interface, DLPack or buffer-protocol exporter holds, as `ForeignMemory`.

``foreign`` reads capsules through ``dlpack``; the backend's export table (``_memory.exports``) uses both.
"""
