"""An independent writer of bundle files, written from docs/FORMAT.md alone (it imports nothing
from tracekit.format): the tests use it to rebuild a real bundle with edits, re-signed so that
only the edit is wrong, and to check that the spec describes the real bytes."""

import hashlib
import struct
import zlib
from pathlib import Path

import msgpack

HEADER, INDEX, TRAILER = 0x184D2A50, 0x184D2A5E, 0x184D2A5F
TRAILER_LAYOUT = struct.Struct("<8sQQ32s")


def read_parts(path) -> tuple[dict, dict, bytes]:
    """(header map, index map, whole file) of a bundle, parsed the way the spec says."""
    data = Path(path).read_bytes()
    magic, header_length = struct.unpack_from("<II", data, 0)
    assert magic == HEADER
    header = msgpack.unpackb(data[8:8 + header_length])
    trailer_magic, trailer_length = struct.unpack_from("<II", data, len(data) - 8 - TRAILER_LAYOUT.size)
    assert (trailer_magic, trailer_length) == (TRAILER, TRAILER_LAYOUT.size)
    tag, index_offset, index_length, index_sha256 = TRAILER_LAYOUT.unpack_from(data, len(data) - TRAILER_LAYOUT.size)
    assert tag == b"TRACEKIT"
    index_payload = data[index_offset + 8:index_offset + 8 + index_length]
    assert hashlib.sha256(index_payload).digest() == index_sha256
    return header, msgpack.unpackb(index_payload), data


def frame_refs(index: dict) -> dict:
    """{("metadata",) or (tensor, chunk, frame): the index's mutable frame entry
    [offset, stored, content, crc32(, content checksum in v2)]}."""
    refs = {("metadata",): index["metadata"]["frame"]}
    for tensor in index["tensors"]:
        for chunk_number, chunk in enumerate(tensor["chunks"]):
            for frame_number, frame in enumerate(chunk["frames"]):
                refs[(tensor["name"], chunk_number, frame_number)] = frame
    return refs


def forge(source, target, *, edit_header=None, pack_header=None, edit_index=None, frames=None, hidden=None) -> None:
    """Rewrite `source` into `target` with the header/index edited in place by the given
    functions and frames replaced ({key: new stored bytes}); offsets, hashes and the replaced
    frames' CRC-32s and content checksums are redone. `hidden` ({key: bytes}) puts bytes that no
    index entry covers before the frame `key`. `pack_header(header)` returns the header payload
    in place of msgpack.packb's (for values it cannot pack, such as lists nested 1000 deep)."""
    header, index, data = read_parts(source)
    refs = frame_refs(index)
    stored = {key: data[ref[0]:ref[0] + ref[1]] for key, ref in refs.items()}
    for key, frame in (frames or {}).items():
        stored[key] = frame
        refs[key][3] = zlib.crc32(frame)
        if len(refs[key]) > 4:
            refs[key][4] = int.from_bytes(frame[-4:], "little")
    if edit_header:
        edit_header(header)
    header_payload = pack_header(header) if pack_header else msgpack.packb(header)
    out = bytearray(struct.pack("<II", HEADER, len(header_payload)) + header_payload)
    for key in sorted(refs, key=lambda key: refs[key][0]):
        out += (hidden or {}).get(key, b"")
        refs[key][0], refs[key][1] = len(out), len(stored[key])
        out += stored[key]
    index["header_sha256"] = hashlib.sha256(header_payload).digest()
    if edit_index:
        edit_index(index)
    index_payload = msgpack.packb(index)
    index_offset = len(out)
    out += struct.pack("<II", INDEX, len(index_payload)) + index_payload
    out += struct.pack("<II", TRAILER, TRAILER_LAYOUT.size)
    out += TRAILER_LAYOUT.pack(b"TRACEKIT", index_offset, len(index_payload), hashlib.sha256(index_payload).digest())
    Path(target).write_bytes(bytes(out))
