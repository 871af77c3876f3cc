"""BundleWriter: streams tensors into a bundle as they arrive and publishes it atomically.

A thread pool encodes chunks while the caller adds the next tensor, so memory holds a few chunks
in flight, never the whole bundle; only a clean close renames the temporary file into place, so
a killed writer leaves nothing at the target path (docs/FORMAT-RATIONALE.md, "Writer algorithm").
"""

import collections
import dataclasses
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import msgpack

from tracekit import __version__
from tracekit.errors import BundleError
from tracekit.format import limits
from tracekit.format.codec import (
    DEFAULT_CHUNK_BYTES,
    ChunkEncoder,
    EncodedFrame,
    choose_filter,
    frame_spans,
    shuffled_content,
)
from tracekit.format.dtypes import DTYPES, as_flat_bytes
from tracekit.format.index import ChunkRef, FrameRef, Index, MetadataRef, TensorInfo
from tracekit.format.layout import (
    BUNDLE_MAGIC,
    CODEC,
    FORMAT_VERSION,
    HEADER_FRAME_MAGIC,
    INDEX_FRAME_MAGIC,
    MIN_READER_VERSION,
    TRAILER_BYTES,
    TRAILER_MAGIC,
    UNCOMMITTED_TRAILER_MAGIC,
    chunk_prefix,
    skippable_frame,
    trailer,
)
from tracekit.format.leftovers import remove_stale_partials, temporary_path
from tracekit.format.untrusted import Refused, check_plain
from tracekit.format.writeback import Writeback


def pack_plain(obj) -> bytes:
    """msgpack of plain data (dict, list, str, int, float, bool, None, bytes) or a BundleError."""

    def refuse(value):
        raise TypeError(f"{type(value).__name__} is not plain data")

    try:
        return msgpack.packb(obj, use_bin_type=True, default=refuse, strict_types=False)
    except (TypeError, ValueError, OverflowError) as error:
        raise BundleError(f"metadata cannot be stored: {error}") from None


class BundleWriter:
    def __init__(self, path, *, compression_level: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 threads: int | None = None):
        if not 64 <= chunk_bytes <= limits.MAX_CHUNK_BYTES or chunk_bytes % 64:
            raise BundleError(f"chunk_bytes must be a multiple of 64 between 64 and {limits.MAX_CHUNK_BYTES}")
        self.path = os.fspath(path)
        self._chunk_bytes = chunk_bytes
        self._encoder = ChunkEncoder(compression_level)
        self._threads = threads or min(4, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tracekit-bundle-writer")
        # As added, without their chunks: those are written in the order queued, into `_chunks`
        self._tensors: dict[str, TensorInfo] = {}
        self._chunks: dict[str, list[ChunkRef]] = {}
        self._in_flight: collections.deque = collections.deque()  # (tensor name, nbytes, future)
        self._total_nbytes = 0
        self._metadata_content = pack_plain({"metadata": None})
        self._temp_path = temporary_path(self.path)
        remove_stale_partials(os.path.dirname(os.path.abspath(self.path)))
        try:
            self._file = open(self._temp_path, "xb")
        except OSError as error:
            self._pool.shutdown()
            raise BundleError(f"cannot write bundle {self.path}: {error.strerror}") from None
        self._writeback = Writeback(self._file.fileno())
        self._open = True
        header = pack_plain({
            "magic": BUNDLE_MAGIC, "format_version": FORMAT_VERSION,
            "min_reader_version": MIN_READER_VERSION, "writer": f"tracekit {__version__}",
        })
        self._header_sha256 = hashlib.sha256(header).digest()
        self._offset = 0
        self._write(skippable_frame(HEADER_FRAME_MAGIC, header))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _write(self, data) -> int:
        offset = self._offset
        self._file.write(data)
        self._offset += len(data)
        self._writeback.wrote(len(data))
        return offset

    def _check_open(self):
        if not self._open:
            raise BundleError(f"bundle writer for {self.path} is already closed")

    def add_tensor(self, name: str, tensor) -> dict:
        """Queue `tensor` for writing and return what metadata embeds in its place (`resolve` swaps
        it back). Its chunks are copied as they are queued, so the caller may reuse the tensor at
        once; encoding overlaps the next calls."""
        self._check_open()
        if not isinstance(name, str) or not 0 < len(name) <= limits.MAX_NAME_CHARS:
            raise BundleError(f"tensor name must be a non-empty string of at most {limits.MAX_NAME_CHARS} characters")
        if name in self._tensors:
            raise BundleError(f"tensor {name!r} is already in the bundle")
        if len(self._tensors) >= limits.MAX_TENSORS:
            raise BundleError(f"a bundle holds at most {limits.MAX_TENSORS} tensors")
        dtype, shape, flat = as_flat_bytes(tensor)
        if flat.nbytes > limits.MAX_TENSOR_BYTES or self._total_nbytes + flat.nbytes > limits.MAX_TOTAL_TENSOR_BYTES:
            raise BundleError(f"tensor {name!r} ({flat.nbytes} bytes) is over the size caps")
        itemsize = DTYPES[dtype].itemsize
        filter_name = choose_filter(itemsize, flat.nbytes)
        self._tensors[name] = TensorInfo(name, dtype, shape, flat.nbytes, 0, filter_name, CODEC, itemsize, ())
        self._chunks[name] = []
        self._total_nbytes += flat.nbytes
        step = self._chunk_bytes - self._chunk_bytes % itemsize
        copies = []
        try:
            for number, start in enumerate(range(0, flat.nbytes, step)):
                raw = flat[start:start + step]
                copied = threading.Event()
                future = self._pool.submit(self._encode_chunk, name, number, raw, filter_name, itemsize, copied)
                copies.append(copied)
                self._in_flight.append((name, raw.nbytes, future))
                while len(self._in_flight) > 2 * self._threads:
                    self._write_oldest()
            for copied in copies:  # the caller may reuse `tensor` once this returns
                copied.wait()
        except BaseException:
            self.abort()
            raise
        return {"$tensor": name}

    def _encode_chunk(self, name: str, number: int, raw, filter_name: str, itemsize: int,
                      copied: threading.Event) -> list[EncodedFrame]:
        """On a pool thread: copy the chunk out of the caller's tensor (split into byte planes
        when shuffled), say so, then compress it. Both cores copy, not only the caller's."""
        prefix = chunk_prefix(name, number, raw.nbytes)
        try:
            content = shuffled_content(prefix, raw, filter_name, itemsize)
        finally:
            copied.set()
        return self._encoder.encode(content, frame_spans(len(prefix), raw.nbytes, filter_name, itemsize))

    def _write_oldest(self) -> None:
        name, nbytes, future = self._in_flight.popleft()
        frames = tuple(self._write_frame(frame) for frame in future.result())
        self._chunks[name].append(ChunkRef(nbytes, None, frames))

    def _write_frame(self, frame: EncodedFrame) -> FrameRef:
        return FrameRef(self._write(frame.stored), len(frame.stored), frame.content_nbytes, frame.crc32, frame.checksum)

    def _written_tensors(self) -> dict[str, TensorInfo]:
        """Every tensor with its chunks, once all are written."""
        tensors = {}
        for name, info in self._tensors.items():
            chunks = tuple(self._chunks[name])
            stored = sum(frame.stored_nbytes for chunk in chunks for frame in chunk.frames)
            tensors[name] = dataclasses.replace(info, stored_nbytes=stored, chunks=chunks)
        return tensors

    def set_metadata(self, obj) -> None:
        """Plain data describing the bundle; packed now (errors surface here), written at close."""
        self._check_open()
        try:
            check_plain(obj)
        except Refused as problem:
            raise BundleError(f"metadata cannot be stored: it {problem} (readers refuse that)") from None
        content = pack_plain({"metadata": obj})
        if len(content) > limits.MAX_METADATA_BYTES:
            raise BundleError(f"metadata is {len(content)} bytes packed, more than the cap of {limits.MAX_METADATA_BYTES}")
        self._metadata_content = content

    def close(self) -> None:
        """Finish the bundle and move it to its path; a no-op once closed or aborted."""
        if not self._open:
            return
        try:
            while self._in_flight:
                self._write_oldest()
            frame = self._write_frame(self._encoder.frame(self._metadata_content))
            metadata = MetadataRef(frame, hashlib.sha256(self._metadata_content).digest())
            index = Index(self._header_sha256, self._written_tensors(), metadata).pack()
            index_offset = self._write(skippable_frame(INDEX_FRAME_MAGIC, index))
            index_sha256 = hashlib.sha256(index).digest()
            self._write(trailer(index_offset, len(index), index_sha256, magic=UNCOMMITTED_TRAILER_MAGIC))
            self._file.flush()
            writeback_error = self._writeback.finish()
            if writeback_error is not None:
                raise BundleError(f"cannot write bundle {self.path}: {writeback_error.strerror}")
            # The commit: only now does the file end in a trailer a reader accepts.
            os.pwrite(self._file.fileno(), trailer(index_offset, len(index), index_sha256, magic=TRAILER_MAGIC), self._offset - TRAILER_BYTES)
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._temp_path, self.path)
            _fsync_directory(os.path.dirname(os.path.abspath(self.path)))
        except BaseException:
            self.abort()
            raise
        self._open = False
        self._pool.shutdown()

    def abort(self) -> None:
        """Drop everything written so far; nothing is left at the path or beside it."""
        self._open = False
        self._pool.shutdown(cancel_futures=True)
        self._writeback.finish()
        self._file.close()
        try:
            os.unlink(self._temp_path)
        except FileNotFoundError:
            pass


def _fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

