"""The bundle's table of contents: what the writer records about each tensor and the
metadata, how it is serialized into the index frame, and how a reader validates it (every
field type- and range-checked even after the hash matched: a hash proves integrity, not a
well-behaved writer).
"""

import math
import zlib
from dataclasses import dataclass, field

import msgpack

from tracekit.errors import BundleError
from tracekit.format import limits
from tracekit.format.codec import FrameDamage, content_checksum, frame_spans
from tracekit.format.dtypes import DTYPES
from tracekit.format.layout import CODEC, FILTER_NONE, FILTER_SHUFFLE, chunk_prefix
from tracekit.format.untrusted import Refused, unpack_bounded


@dataclass(frozen=True)
class FrameRef:
    offset: int
    stored_nbytes: int
    content_nbytes: int
    crc32: int  # of the stored bytes: catches flips zstd ignores (unused header bits, padding)
    checksum: int | None = None  # v2: the zstd content checksum the frame ends with

    def check_place(self, stored, crc: bool) -> None:
        """That `stored` is the frame this entry puts here (v2: its content checksum), with `crc`
        also that none of its stored bytes changed (its CRC-32); a `FrameDamage` if not."""
        if crc and zlib.crc32(stored) != self.crc32:
            raise FrameDamage("is altered on disk (its stored bytes fail their CRC-32)")
        if self.checksum is not None and content_checksum(stored) != self.checksum:
            raise FrameDamage("is not the frame the index put there (its content checksum differs)")


@dataclass(frozen=True)
class ChunkRef:
    nbytes: int
    sha256: bytes | None  # v1 only: sha256 of the chunk's tensor bytes
    frames: tuple[FrameRef, ...]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stored_nbytes: int
    filter: str
    codec: str
    itemsize: int
    chunks: tuple[ChunkRef, ...] = field(repr=False)


@dataclass(frozen=True)
class MetadataRef:
    frame: FrameRef
    sha256: bytes


@dataclass(frozen=True)
class Index:
    header_sha256: bytes
    tensors: dict[str, TensorInfo]
    metadata: MetadataRef

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "header_sha256": self.header_sha256,
                "tensors": [_pack_tensor(info) for info in self.tensors.values()],
                "metadata": {"frame": _pack_frame(self.metadata.frame), "sha256": self.metadata.sha256},
            },
            use_bin_type=True,
        )


def _pack_frame(frame: FrameRef) -> list[int]:
    return [frame.offset, frame.stored_nbytes, frame.content_nbytes, frame.crc32, frame.checksum]


def _pack_tensor(info: TensorInfo) -> dict:
    return {
        "name": info.name, "dtype": info.dtype, "itemsize": info.itemsize, "shape": list(info.shape),
        "nbytes": info.nbytes, "filter": info.filter, "codec": info.codec,
        "chunks": [{"nbytes": chunk.nbytes, "frames": [_pack_frame(frame) for frame in chunk.frames]} for chunk in info.chunks],
    }


def _get(mapping, key: str, kind, where: str):
    if not isinstance(mapping, dict):
        raise Refused(f"{where} is not a map")
    value = mapping.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise Refused(f"{where} has no valid {key!r}")
    return value


def _count(mapping, key: str, where: str, upper: int) -> int:
    value = _get(mapping, key, int, where)
    if not 0 <= value <= upper:
        raise Refused(f"{where} {key!r} is {value}, outside 0..{upper}")
    return value


_U32 = (1 << 32) - 1


def _parse_frame(raw, where: str, version: int) -> FrameRef:
    """v1: [offset, stored, content, crc32]; v2 adds the frame's zstd content checksum."""
    numbers = 4 if version == 1 else 5
    if not (isinstance(raw, list) and len(raw) == numbers and all(type(value) is int and value >= 0 for value in raw)):
        raise Refused(f"{where} has a malformed frame entry")
    if raw[3] > _U32 or (version > 1 and raw[4] > _U32):
        raise Refused(f"{where} has a checksum wider than 32 bits")
    return FrameRef(*raw)


def _parse_sha256(mapping, where: str) -> bytes:
    digest = _get(mapping, "sha256", bytes, where)
    if len(digest) != 32:
        raise Refused(f"{where} has a malformed sha256")
    return digest


def _parse_tensor(raw, version: int, budget: list[int]) -> TensorInfo:
    name = _get(raw, "name", str, "a tensor entry")
    if not 0 < len(name) <= limits.MAX_NAME_CHARS:
        raise Refused("a tensor entry has an empty or over-long name")
    where = f"tensor {name!r}"
    dtype = _get(raw, "dtype", str, where)
    if dtype not in DTYPES:  # refused here, so that verify() and read_tensor() agree
        raise Refused(f"{where} has unknown dtype {dtype!r}")
    itemsize = _count(raw, "itemsize", where, 64)
    if DTYPES[dtype].itemsize != itemsize:
        raise Refused(f"{where} has itemsize {itemsize} for dtype {dtype}")
    shape = _get(raw, "shape", list, where)
    if len(shape) > limits.MAX_DIMS or not all(type(size) is int and size >= 0 for size in shape):
        raise Refused(f"{where} has a malformed shape")
    nbytes = _count(raw, "nbytes", where, limits.MAX_TENSOR_BYTES)
    if math.prod(shape) * itemsize != nbytes:
        raise Refused(f"{where} declares {nbytes} bytes for shape {shape} of {dtype}")
    filter_name = _get(raw, "filter", str, where)
    if filter_name not in (FILTER_NONE, FILTER_SHUFFLE) or _get(raw, "codec", str, where) != CODEC:
        raise Refused(f"{where} uses an unknown filter or codec")
    raw_chunks = _get(raw, "chunks", list, where)
    budget[0] -= len(raw_chunks)
    if budget[0] < 0:
        raise Refused(f"lists more than {limits.MAX_FRAMES} frames")
    chunks = tuple(_parse_chunk(chunk, name, number, filter_name, itemsize, version, budget) for number, chunk in enumerate(raw_chunks))
    if sum(chunk.nbytes for chunk in chunks) != nbytes:
        raise Refused(f"{where} chunks do not add up to its {nbytes} bytes")
    stored = sum(frame.stored_nbytes for chunk in chunks for frame in chunk.frames)
    return TensorInfo(name, dtype, tuple(shape), nbytes, stored, filter_name, CODEC, itemsize, chunks)


def _parse_chunk(raw, tensor_name: str, number: int, filter_name: str, itemsize: int, version: int,
                 budget: list[int]) -> ChunkRef:
    """`budget` holds the number of frames still allowed (a chunk costs at least one)."""
    where = f"tensor {tensor_name!r} chunk {number}"
    nbytes = _count(raw, "nbytes", where, limits.MAX_CHUNK_BYTES)
    if itemsize == 0 or nbytes == 0 or nbytes % itemsize:
        raise Refused(f"{where} has {nbytes} bytes, not a whole number of elements")
    raw_frames = _get(raw, "frames", list, where)
    budget[0] -= len(raw_frames) - 1
    if budget[0] < 0:
        raise Refused(f"lists more than {limits.MAX_FRAMES} frames")
    frames = tuple(_parse_frame(frame, where, version) for frame in raw_frames)
    spans = frame_spans(len(chunk_prefix(tensor_name, number, nbytes)), nbytes, filter_name, itemsize)
    if [frame.content_nbytes for frame in frames] != [end - start for start, end in spans]:
        raise Refused(f"{where} frame sizes do not match its {filter_name} layout")
    return ChunkRef(nbytes, _parse_sha256(raw, where) if version == 1 else None, frames)


def parse_index(payload: bytes, data_start: int, data_end: int, version: int) -> Index:
    """Validate and build the index of a bundle in format `version`; its frames, in index order,
    must tile the bytes between the header and the index exactly (no gap, no overlap, no
    reordering), so every byte of the file is covered by a check."""
    try:
        raw = unpack_bounded(payload, limits.MAX_INDEX_ITEMS, limits.MAX_INDEX_CONTAINERS)
        tensors: dict[str, TensorInfo] = {}
        raw_tensors = _get(raw, "tensors", list, "the index")
        if len(raw_tensors) > limits.MAX_TENSORS:
            raise Refused(f"lists {len(raw_tensors)} tensors, more than the cap of {limits.MAX_TENSORS}")
        budget = [limits.MAX_FRAMES - 1]  # the metadata frame
        for raw_tensor in raw_tensors:
            info = _parse_tensor(raw_tensor, version, budget)
            if info.name in tensors:
                raise Refused(f"lists tensor {info.name!r} twice")
            tensors[info.name] = info
        if sum(info.nbytes for info in tensors.values()) > limits.MAX_TOTAL_TENSOR_BYTES:
            raise Refused("declares more tensor bytes than the cap")
        raw_metadata = _get(raw, "metadata", dict, "the index")
        metadata = MetadataRef(_parse_frame(raw_metadata.get("frame"), "metadata", version), _parse_sha256(raw_metadata, "metadata"))
        if metadata.frame.content_nbytes > limits.MAX_METADATA_BYTES:
            raise Refused(f"metadata declares {metadata.frame.content_nbytes} bytes, more than the cap")
        index = Index(_get(raw, "header_sha256", bytes, "the index"), tensors, metadata)
        _check_tiling(index, data_start, data_end)
        return index
    except Refused as problem:
        raise BundleError(f"is malformed: {problem}") from None
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise BundleError(f"is malformed: not readable msgpack ({error})") from None


def _check_tiling(index: Index, data_start: int, data_end: int) -> None:
    position = data_start
    for frame in [*(frame for info in index.tensors.values() for chunk in info.chunks for frame in chunk.frames),
                  index.metadata.frame]:
        if frame.offset != position:
            raise Refused(f"frames leave a gap or overlap at byte {position}")
        position += frame.stored_nbytes
    if position != data_end:
        raise Refused(f"frames end at byte {position}, the index starts at {data_end}")
