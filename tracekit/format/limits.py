"""Caps that a reader enforces before it trusts a number read from a file.

A bundle may come from anywhere, so every size it declares is checked against these before
memory is allocated or data is decompressed: a forged header, index or frame (a zip bomb)
produces a BundleError, never an out-of-memory kill. The caps are far above what a real
engine step produces (the largest real part is a layer's KV cache, a few GiB).
"""

MiB = 1 << 20
GiB = 1 << 30

MAX_HEADER_BYTES = 64 * 1024
MAX_INDEX_BYTES = 64 * MiB
MAX_METADATA_BYTES = 512 * MiB  # decompressed
MAX_TENSORS = 200_000
MAX_DIMS = 64
MAX_CHUNK_BYTES = 64 * MiB  # decompressed bytes of one chunk; writers use far less
MAX_TENSOR_BYTES = 256 * GiB
MAX_TOTAL_TENSOR_BYTES = 4096 * GiB
MAX_NAME_CHARS = 1024

# zstd cannot encode more than one 128 KiB block per 3-byte block header plus one byte, so a
# frame that claims more content than this per stored byte is forged.
MAX_ZSTD_EXPANSION = (128 * 1024) // 4
