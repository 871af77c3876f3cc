"""Byte layout of a bundle: frame magics, the trailer, versions, and the chunk prefix.

These constants are the format (docs/FORMAT.md is the prose version). Changing any of them
changes what a v1 reader accepts, so they live in one small module that both the writer and
the reader import.
"""

import struct

import msgpack

# 2: each frame's zstd content checksum in its index entry, no chunk sha256 (v1 stays readable).
FORMAT_VERSION = 2
# What this writer's bundles need: raised only for a change older readers cannot ignore.
MIN_READER_VERSION = 2
# The newest format this code reads; a bundle whose min_reader_version is above it is refused.
READER_VERSION = 2
BUNDLE_MAGIC = "tracekit.bundle"
# The header fields this version knows, with their msgpack types (others are ignored).
HEADER_FIELDS = {"magic": str, "format_version": int, "min_reader_version": int, "writer": str}

HEADER_FRAME_MAGIC = 0x184D2A50
INDEX_FRAME_MAGIC = 0x184D2A5E
TRAILER_FRAME_MAGIC = 0x184D2A5F

SKIPPABLE_HEADER = struct.Struct("<II")  # magic, payload length
TRAILER_PAYLOAD = struct.Struct("<8sQQ32s")  # magic, index frame offset, index payload length, sha256
TRAILER_MAGIC = b"TRACEKIT"
# The trailer's magic until the writer commits: a killed writer's file never reads as a bundle.
UNCOMMITTED_TRAILER_MAGIC = b"UNCOMMIT"
# A writer's temporary file is named ".<target name>.<host>-<pid>-<random>" + this suffix.
PARTIAL_SUFFIX = ".tracekit-partial"
TRAILER_BYTES = SKIPPABLE_HEADER.size + TRAILER_PAYLOAD.size

FILTER_NONE = "none"
FILTER_SHUFFLE = "shuffle"
CODEC = "zstd"


def skippable_frame(magic: int, payload: bytes) -> bytes:
    return SKIPPABLE_HEADER.pack(magic, len(payload)) + payload


def trailer(index_offset: int, index_payload_length: int, index_sha256: bytes, magic: bytes = TRAILER_MAGIC) -> bytes:
    payload = TRAILER_PAYLOAD.pack(magic, index_offset, index_payload_length, index_sha256)
    return skippable_frame(TRAILER_FRAME_MAGIC, payload)


def chunk_prefix(tensor_name: str, chunk_number: int, data_length: int) -> bytes:
    """The msgpack bytes that open a chunk's first frame: the map {"tensor": name, "chunk": n,
    "data": <bin>} up to and including the bin header, so that the chunk's decompressed frames
    read as one msgpack object whose "data" is the (filtered) chunk bytes."""
    fields = b"".join(msgpack.packb(value) for value in ("tensor", tensor_name, "chunk", chunk_number, "data"))
    return b"\x83" + fields + _msgpack_bin_header(data_length)


def _msgpack_bin_header(length: int) -> bytes:
    if length < 1 << 8:
        return b"\xc4" + struct.pack(">B", length)
    if length < 1 << 16:
        return b"\xc5" + struct.pack(">H", length)
    return b"\xc6" + struct.pack(">I", length)
