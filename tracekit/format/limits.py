"""Caps that a reader enforces before it trusts a number read from a file: a forged header,
index, frame (a zip bomb) or metadata object is a BundleError, never an out-of-memory kill or a
hang. docs/FORMAT.md lists them; docs/FORMAT-RATIONALE.md ("Caps") says why each is where it is.
"""

MiB = 1 << 20
GiB = 1 << 30

MAX_HEADER_BYTES = 64 * 1024
MAX_INDEX_BYTES = 64 * MiB
MAX_INDEX_ITEMS = 8_000_000  # map entries plus array elements (see below)
MAX_INDEX_CONTAINERS = 4_000_000
MAX_TENSORS = 200_000
MAX_FRAMES = 1 << 18  # data frames in one bundle: bounds index parsing and verify time
MAX_DIMS = 64
MAX_CHUNK_BYTES = 64 * MiB  # decompressed bytes of one chunk; writers use far less
MAX_TENSOR_BYTES = 256 * GiB
MAX_TOTAL_TENSOR_BYTES = 4096 * GiB
MAX_NAME_CHARS = 1024

MAX_METADATA_BYTES = 64 * MiB  # decompressed
# Python objects cost up to ~70x their msgpack bytes, so entries (map entries plus array
# elements) and maps and arrays are capped too.
MAX_METADATA_ITEMS = 4_000_000
MAX_METADATA_CONTAINERS = 200_000
MAX_METADATA_DEPTH = 64  # maps and arrays nested in one another
MAX_TENSOR_REFERENCES = 100_000  # {"$tensor": ...} maps in the metadata

# zstd cannot encode more than one 128 KiB block per 3-byte block header plus one byte, so a
# frame that claims more content than this per stored byte is forged.
MAX_ZSTD_EXPANSION = (128 * 1024) // 4
