"""BundleReader: opens a bundle by reading only its header, trailer and index, then decodes
single tensors or the metadata on demand, checking every hash on the way.

Every number taken from the file is checked against `limits` before use, every failure
becomes one BundleError line that names the bundle and the damaged part, and nothing in the
file can select code to run (no pickle, no imports, dtypes from a closed table).
"""

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import numpy as np

from tracekit.errors import BundleError
from tracekit.format import limits
from tracekit.format.codec import FrameDamage, check_stored, decode_chunk, decompress_frame
from tracekit.format.dtypes import decode, dtype_spec
from tracekit.format.index import Index, TensorInfo, parse_index
from tracekit.format.layout import (
    BUNDLE_MAGIC, HEADER_FRAME_MAGIC, INDEX_FRAME_MAGIC, READER_VERSION, SKIPPABLE_HEADER, TRAILER_BYTES,
    TRAILER_FRAME_MAGIC, TRAILER_MAGIC, TRAILER_PAYLOAD,
)


@dataclass
class VerifyReport:
    """The outcome of checking every part: `damaged` maps part names to what is wrong."""

    parts_checked: list[str] = field(default_factory=list)
    damaged: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.damaged


class BundleReader:
    def __init__(self, path, *, threads: int | None = None):
        self.path = os.fspath(path)
        self.name = os.path.basename(self.path)
        self._threads = threads or min(4, os.cpu_count() or 1)
        self._pool = None
        self._metadata = None
        self._metadata_loaded = False
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as error:
            raise BundleError(f"cannot open bundle {self.path}: {error.strerror}") from None
        try:
            self._size = os.fstat(self._fd).st_size
            self.header = self._read_header()
            self._index = self._read_index_checking_version()
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _damaged(self, part: str, problem: str) -> BundleError:
        return BundleError(f"bundle {self.name} is damaged: {part} {problem}")

    def _read(self, offset: int, length: int, part: str) -> bytes:
        if self._fd is None:
            raise BundleError(f"bundle {self.name} is closed")
        data = os.pread(self._fd, length, offset) if length else b""
        if len(data) != length:
            raise self._damaged(part, f"is cut off (the file ends at byte {self._size})")
        return data

    def _read_skippable(self, offset: int, magic: int, cap: int, part: str) -> bytes:
        frame_magic, length = SKIPPABLE_HEADER.unpack(self._read(offset, SKIPPABLE_HEADER.size, part))
        if frame_magic != magic:
            raise self._damaged(part, "is missing (wrong frame magic)")
        if length > cap:
            raise self._damaged(part, f"declares {length} bytes, more than the cap of {cap}")
        return self._read(offset + SKIPPABLE_HEADER.size, length, part)

    def _read_header(self) -> dict:
        head = self._read(0, SKIPPABLE_HEADER.size, "header") if self._size >= SKIPPABLE_HEADER.size else b""
        if len(head) < SKIPPABLE_HEADER.size or SKIPPABLE_HEADER.unpack(head)[0] != HEADER_FRAME_MAGIC:
            raise BundleError(f"{self.path} is not a tracekit bundle (no bundle header at its start)")
        payload = self._read_skippable(0, HEADER_FRAME_MAGIC, limits.MAX_HEADER_BYTES, "header")
        self._header_payload = payload
        self._data_start = SKIPPABLE_HEADER.size + len(payload)
        try:
            header = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException):
            raise self._damaged("header", "is not readable msgpack") from None
        if not isinstance(header, dict) or header.get("magic") != BUNDLE_MAGIC:
            raise BundleError(f"{self.path} is not a tracekit bundle (its header has no tracekit magic)")
        versions = [header.get("format_version"), header.get("min_reader_version")]
        if not all(type(version) is int and version >= 1 for version in versions):
            raise self._damaged("header", "has no valid format_version/min_reader_version")
        return header

    def _read_index_checking_version(self) -> Index:
        """The index, once the header's versions allow reading it. A newer bundle is refused,
        unless its header fails the v1 hash check: then a flipped bit forged the version."""
        refusal = None
        if self.min_reader_version > READER_VERSION:
            refusal = BundleError(
                f"bundle {self.name} needs reader version >= {self.min_reader_version}; "
                f"this tracekit reads format <= {READER_VERSION}: upgrade tracekit"
            )
        try:
            index = self._read_index()
        except BundleError:
            if refusal:
                raise refusal from None
            raise
        if index.header_sha256 != hashlib.sha256(self._header_payload).digest():
            raise self._damaged("header", "fails its hash")
        if refusal:
            raise refusal
        return index

    def _read_index(self) -> Index:
        if self._size < self._data_start + TRAILER_BYTES:
            raise self._damaged("trailer", f"is missing: the file is cut off at byte {self._size}")
        payload = self._read_skippable(self._size - TRAILER_BYTES, TRAILER_FRAME_MAGIC, TRAILER_PAYLOAD.size, "trailer")
        if len(payload) != TRAILER_PAYLOAD.size:
            raise self._damaged("trailer", "has the wrong size")
        magic, index_offset, index_length, index_sha256 = TRAILER_PAYLOAD.unpack(payload)
        index_end = index_offset + SKIPPABLE_HEADER.size + index_length
        if magic != TRAILER_MAGIC or index_offset < self._data_start or index_end != self._size - TRAILER_BYTES:
            raise self._damaged("trailer", "does not point at an index")
        index_payload = self._read_skippable(index_offset, INDEX_FRAME_MAGIC, limits.MAX_INDEX_BYTES, "index")
        if hashlib.sha256(index_payload).digest() != index_sha256:
            raise self._damaged("index", "fails its hash")
        try:
            index = parse_index(index_payload, self._data_start, index_offset)
        except BundleError as error:
            raise self._damaged("index", str(error)) from None
        return index

    @property
    def format_version(self) -> int:
        return self.header["format_version"]

    @property
    def min_reader_version(self) -> int:
        return self.header["min_reader_version"]

    @property
    def metadata(self):
        """The metadata object, decoded and hash-checked on first access."""
        if not self._metadata_loaded:
            self._metadata = self._load_metadata(check_crc=False)
            self._metadata_loaded = True
        return self._metadata

    def _load_metadata(self, check_crc: bool):
        ref = self._index.metadata
        try:
            stored = self._read(ref.frame.offset, ref.frame.stored_nbytes, "metadata")
            if check_crc:
                check_stored(stored, ref.frame.crc32)
            content = decompress_frame(stored, ref.frame.content_nbytes)
        except FrameDamage as damage:
            raise self._damaged("metadata", str(damage)) from None
        if hashlib.sha256(content).digest() != ref.sha256:
            raise self._damaged("metadata", "fails its hash")
        try:
            wrapper = msgpack.unpackb(content, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException):
            raise self._damaged("metadata", "is not readable msgpack") from None
        if not isinstance(wrapper, dict) or "metadata" not in wrapper:
            raise self._damaged("metadata", "has no 'metadata' entry")
        return wrapper["metadata"]

    def tensor_infos(self) -> list[TensorInfo]:
        return list(self._index.tensors.values())

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self._index.tensors[name]
        except KeyError:
            raise BundleError(f"bundle {self.name} has no tensor {name!r}") from None

    def _decode_chunks(self, info: TensorInfo, out_for_chunk, verify_hash: bool) -> dict[int, str]:
        """Decode every chunk of `info` into `out_for_chunk(number, chunk)`; {chunk number:
        problem} for the chunks that failed."""

        def decode_one(number_and_chunk):
            number, chunk = number_and_chunk
            first, last = chunk.frames[0], chunk.frames[-1]
            try:
                stored = memoryview(self._read(first.offset, last.offset + last.stored_nbytes - first.offset, f"tensor {info.name!r}"))
                frames = [stored[frame.offset - first.offset:][: frame.stored_nbytes] for frame in chunk.frames]
                if verify_hash:
                    for frame, ref in zip(frames, chunk.frames):
                        check_stored(frame, ref.crc32)
                expected_sha256 = chunk.sha256 if verify_hash else None
                decode_chunk(frames, info.name, number, expected_sha256, info.filter, info.itemsize, out_for_chunk(number, chunk))
            except FrameDamage as damage:
                return number, str(damage)
            return number, None

        items = list(enumerate(info.chunks))
        if len(items) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tracekit-bundle-reader")
            results = list(self._pool.map(decode_one, items))
        else:
            results = [decode_one(item) for item in items]
        return {number: problem for number, problem in results if problem}

    def read_tensor(self, name: str, to: str = "auto", *, verify_hash: bool = False):
        """The tensor as torch (to="torch"), numpy (to="numpy"), or raw little-endian bytes;
        "auto" picks torch when installed, else numpy, else bytes for dtypes numpy lacks.

        Every frame's zstd content checksum is always checked, so the bytes returned are the
        bytes written; `verify_hash` also checks the stored bytes' CRC-32 and the sha256 content
        hash (as `verify()` does), at about half the speed."""
        info = self.tensor_info(name)
        dtype_spec(info.dtype)
        try:
            out = np.empty(info.nbytes, dtype=np.uint8)
        except MemoryError:
            raise BundleError(f"tensor {name!r} needs {info.nbytes} bytes of memory; not available") from None
        starts = np.cumsum([0] + [chunk.nbytes for chunk in info.chunks])
        failures = self._decode_chunks(info, lambda number, chunk: out[starts[number]:starts[number] + chunk.nbytes], verify_hash)
        if failures:
            number, problem = min(failures.items())
            raise self._damaged(f"tensor {name!r}", problem if len(info.chunks) == 1 else f"(chunk {number}) {problem}")
        return decode(out, info.dtype, info.shape, to)

    def verify(self) -> VerifyReport:
        """Check the hash of every part; damaged parts are listed, never raised."""
        report = VerifyReport(parts_checked=["header", "index", "trailer", "metadata"])
        try:
            self._load_metadata(check_crc=True)
        except BundleError as error:
            report.damaged["metadata"] = str(error).split(": metadata ", 1)[-1]
        for info in self.tensor_infos():
            part = f"tensor {info.name!r}"
            report.parts_checked.append(part)
            failures = self._decode_chunks(info, lambda number, chunk: np.empty(chunk.nbytes, dtype=np.uint8), True)
            if failures:
                number, problem = min(failures.items())
                report.damaged[part] = f"chunk {number} {problem}"
        return report

    def resolve(self, obj, to: str = "auto"):
        """`obj` with every {"$tensor": name} reference replaced by the loaded tensor."""
        if isinstance(obj, dict):
            if len(obj) == 1 and isinstance(obj.get("$tensor"), str):
                return self.read_tensor(obj["$tensor"], to=to)
            return {key: self.resolve(value, to) for key, value in obj.items()}
        if isinstance(obj, list):
            return [self.resolve(value, to) for value in obj]
        return obj


def open_bundle(path, **options) -> BundleReader:
    return BundleReader(path, **options)
