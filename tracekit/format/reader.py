"""BundleReader: opens a bundle by reading only its header, trailer and index, then decodes
single tensors or the metadata on demand (docs/FORMAT-RATIONALE.md, "Integrity", says which check
each read runs). Every failure is one BundleError line that names the bundle and the damaged part,
and nothing in the file can select code to run (no pickle, no imports, dtypes from a closed table).
"""

import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tracekit.errors import BundleError
from tracekit.format import limits
from tracekit.format.codec import FrameDamage, Scratch, decode_chunk, decompress_into
from tracekit.format.dtypes import decode
from tracekit.format.index import ChunkRef, Index, TensorInfo, parse_index
from tracekit.format.layout import (
    BUNDLE_MAGIC,
    HEADER_FIELDS,
    HEADER_FRAME_MAGIC,
    INDEX_FRAME_MAGIC,
    PARTIAL_SUFFIX,
    READER_VERSION,
    SKIPPABLE_HEADER,
    TRAILER_BYTES,
    TRAILER_FRAME_MAGIC,
    TRAILER_MAGIC,
    TRAILER_PAYLOAD,
    UNCOMMITTED_TRAILER_MAGIC,
)
from tracekit.format.untrusted import KIND_NAMES, Refused, check_plain, is_tensor_ref, kind_of, unpack_bounded


@dataclass
class VerifyReport:
    """The outcome of checking every part: `damaged` maps part names to what is wrong."""

    parts_checked: list[str] = field(default_factory=list)
    damaged: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.damaged


class BundleReader:
    def __init__(self, path):
        self.path = os.fspath(path)
        self.name = os.path.basename(self.path)
        self._threads = min(4, os.cpu_count() or 1)
        self._pool = None
        self._scratch = Scratch()
        self._metadata = None
        self._metadata_error = None
        self._metadata_loaded = False
        if self.name.endswith(PARTIAL_SUFFIX):
            raise BundleError(
                f"{self.path} is an unfinished bundle (a writer's temporary file; the writer died or is still "
                "writing): use the bundle it was meant to become"
            )
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below)
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as error:
            raise BundleError(f"cannot open bundle {self.path}: {error.strerror}") from None
        try:
            status = os.fstat(self._fd)
            if not stat.S_ISREG(status.st_mode):
                raise BundleError(f"{self.path} is not a tracekit bundle (not a regular file)")
            self._size = status.st_size
            self.header = self._read_header()
            self._index = self._read_index_checking_version()
            self._check_header_fields()
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
        self._scratch = Scratch()  # drops this thread's buffers (the pool's went with its threads)

    def _damaged(self, part: str, problem: str) -> BundleError:
        return BundleError(f"bundle {self.name} is damaged: {part} {problem}")

    def _read(self, offset: int, length: int, part: str, scratch: Scratch | None = None) -> bytearray | memoryview:
        """`length` bytes at `offset`: a new bytearray, or with `scratch` a view of that
        thread's reusable buffer (valid until the thread's next read into it)."""
        if self._fd is None:
            raise BundleError(f"bundle {self.name} is closed")
        if offset < 0 or length < 0 or offset + length > self._size:
            raise self._damaged(part, f"is cut off (the file ends at byte {self._size})")
        try:
            data = bytearray(length) if scratch is None else memoryview(scratch.buffer("stored", length))
            count = os.preadv(self._fd, [data], offset) if length else 0
        except MemoryError:
            raise BundleError(f"bundle {self.name}: reading {part} needs {length} bytes of memory; not available") from None
        except OSError as error:
            raise BundleError(f"cannot read bundle {self.path}: {error.strerror}") from None
        if count != length:
            raise self._damaged(part, f"is cut off (the file ends at byte {self._size})")
        return data

    def _read_skippable(self, offset: int, magic: int, cap: int, part: str) -> bytearray:
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
            header = unpack_bounded(payload, limits.MAX_HEADER_BYTES, limits.MAX_HEADER_BYTES)
        except Refused:
            raise self._damaged("header", "is not readable msgpack") from None
        if not isinstance(header, dict) or header.get("magic") != BUNDLE_MAGIC:
            raise BundleError(f"{self.path} is not a tracekit bundle (its header has no tracekit magic)")
        try:
            check_plain(header)  # before any code walks it (printing a value recurses)
        except Refused as problem:
            raise self._damaged("header", str(problem)) from None
        versions = [header.get("format_version"), header.get("min_reader_version")]
        if not all(type(version) is int and version >= 1 for version in versions):
            raise self._damaged("header", "has no valid format_version/min_reader_version")
        return header

    def _check_header_fields(self) -> None:
        """Every header field this reader knows has its type (an absent `writer` is fine). Run
        once the version is known to be readable: a newer format may retype a field."""
        for key, kind in HEADER_FIELDS.items():
            value = self.header.get(key)
            if key in self.header and type(value) is not kind:
                raise self._damaged("header", f"field {key!r} is {kind_of(value)}, not {KIND_NAMES[kind]}")

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
        if magic == UNCOMMITTED_TRAILER_MAGIC:
            raise self._damaged("trailer", "was never committed (a writer died before finishing this file)")
        index_end = index_offset + SKIPPABLE_HEADER.size + index_length
        if magic != TRAILER_MAGIC or index_offset < self._data_start or index_end != self._size - TRAILER_BYTES:
            raise self._damaged("trailer", "does not point at an index")
        index_payload = self._read_skippable(index_offset, INDEX_FRAME_MAGIC, limits.MAX_INDEX_BYTES, "index")
        if len(index_payload) != index_length or hashlib.sha256(index_payload).digest() != index_sha256:
            raise self._damaged("index", "fails its hash")
        try:
            index = parse_index(index_payload, self._data_start, index_offset, min(self.format_version, READER_VERSION))
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
            try:
                self._metadata = self._load_metadata()
            except BundleError as error:  # kept: a hostile metadata frame costs its decoding once
                self._metadata_error = error
            self._metadata_loaded = True
        if self._metadata_error is not None:
            raise self._metadata_error
        return self._metadata

    def _load_metadata(self):
        ref = self._index.metadata  # its size was checked against the cap with the index
        try:
            stored = self._read(ref.frame.offset, ref.frame.stored_nbytes, "metadata")
            ref.frame.check_place(stored, crc=True)  # every check, always: metadata is small
            content = bytearray(ref.frame.content_nbytes)  # at most the metadata cap
            decompress_into(stored, content)
        except FrameDamage as damage:
            raise self._damaged("metadata", str(damage)) from None
        except MemoryError:
            raise BundleError(f"bundle {self.name}: its metadata does not fit in memory") from None
        if hashlib.sha256(content).digest() != ref.sha256:
            raise self._damaged("metadata", "fails its hash")
        try:
            wrapper = unpack_bounded(content, limits.MAX_METADATA_ITEMS, limits.MAX_METADATA_CONTAINERS)
            if not isinstance(wrapper, dict) or "metadata" not in wrapper:
                raise Refused("has no 'metadata' entry")
            referenced = check_plain(wrapper["metadata"])
        except Refused as problem:
            raise BundleError(f"bundle {self.name} has unacceptable metadata: it {problem}") from None
        dangling = sorted(referenced - self._index.tensors.keys())
        if dangling:
            raise BundleError(f"bundle {self.name} has unacceptable metadata: it refers to tensor {dangling[0]!r}, which it lacks")
        self._metadata_references = referenced
        return wrapper["metadata"]

    def tensor_infos(self) -> list[TensorInfo]:
        return list(self._index.tensors.values())

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self._index.tensors[name]
        except KeyError:
            raise BundleError(f"bundle {self.name} has no tensor {name!r}") from None

    def _decode_chunks(self, infos: list[TensorInfo], out_for_chunk, verify: bool) -> dict[tuple[str, int], str]:
        """Decode every chunk of `infos` into `out_for_chunk(info, number, chunk, scratch)`, all
        in parallel (no thread waits between one tensor and the next), each frame bound to its
        index entry first; {(tensor name, chunk number): problem} for the chunks that failed, in
        the order of `infos` and their chunks."""
        check_crc = verify or self.format_version == 1

        def decode_one(job: tuple[TensorInfo, int, ChunkRef]):
            info, number, chunk = job
            first, last = chunk.frames[0], chunk.frames[-1]
            scratch = self._scratch
            try:
                stored = self._read(first.offset, last.offset + last.stored_nbytes - first.offset, f"tensor {info.name!r}", scratch)
                frames = [stored[frame.offset - first.offset:][: frame.stored_nbytes] for frame in chunk.frames]
                for frame, ref in zip(frames, chunk.frames):
                    ref.check_place(frame, check_crc)
                out = out_for_chunk(info, number, chunk, scratch)
                decode_chunk(frames, info.name, number, info.filter, info.itemsize, out, scratch)
                if verify and chunk.sha256 is not None and hashlib.sha256(out).digest() != chunk.sha256:
                    raise FrameDamage("fails its hash")
            except FrameDamage as damage:
                return str(damage)
            except MemoryError:
                raise BundleError(f"bundle {self.name}: tensor {info.name!r} does not fit in memory") from None
            return None

        jobs = [(info, number, chunk) for info in infos for number, chunk in enumerate(info.chunks)]
        for info in infos:
            _prefetch(self._fd, info)
        if len(jobs) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tracekit-bundle-reader")
            results = list(self._pool.map(decode_one, jobs))
        else:
            results = [decode_one(job) for job in jobs]
        return {(info.name, number): problem for (info, number, _), problem in zip(jobs, results) if problem}

    def read_tensor(self, name: str, to: str = "auto", *, verify_hash: bool = False):
        """The tensor as torch (to="torch"), numpy (to="numpy"), or raw little-endian bytes;
        "auto" picks torch when installed, else numpy, else bytes for dtypes numpy lacks. The
        bytes returned are the bytes written; `verify_hash` adds the checks `verify()` runs
        (which read checks which: docs/FORMAT-RATIONALE.md, "Integrity")."""
        return self.read_tensors([name], to, verify_hash=verify_hash)[name]

    def read_tensors(self, names, to: str = "auto", *, verify_hash: bool = False) -> dict:
        """{name: tensor} for several tensors, as `read_tensor` reads each, their chunks decoded
        together (what `resolve` uses: with many tensors it keeps every thread busy)."""
        infos = list({name: self.tensor_info(name) for name in names}.values())
        if not infos:
            return {}
        what = f"tensor {infos[0].name!r}" if len(infos) == 1 else f"the {len(infos)} tensors asked for"
        _check_memory_for(sum(info.nbytes for info in infos), f"bundle {self.name}: {what}")
        outs, starts = {}, {}
        for info in infos:
            try:
                outs[info.name] = np.empty(info.nbytes, dtype=np.uint8)
            except MemoryError:
                raise BundleError(f"bundle {self.name}: tensor {info.name!r} needs {info.nbytes} bytes of memory; not available") from None
            starts[info.name] = np.cumsum([0] + [chunk.nbytes for chunk in info.chunks])

        def out_for_chunk(info, number, chunk, scratch):
            start = starts[info.name][number]
            return outs[info.name][start:start + chunk.nbytes]

        failures = self._decode_chunks(infos, out_for_chunk, verify_hash)
        if failures:
            (name, number), problem = next(iter(failures.items()))  # the first tensor's first
            single = len(self._index.tensors[name].chunks) == 1
            raise self._damaged(f"tensor {name!r}", problem if single else f"(chunk {number}) {problem}")
        return {info.name: decode(outs[info.name], info.dtype, info.shape, to) for info in infos}

    def verify(self) -> VerifyReport:
        """Check every part; damaged parts are listed, never raised. Memory stays at a few
        chunks: each thread decodes into one reused scratch buffer."""
        report = VerifyReport(parts_checked=["header", "index", "trailer", "metadata"])
        try:
            self.metadata
        except BundleError as error:
            report.damaged["metadata"] = str(error).split(": metadata ", 1)[-1]
        infos = self.tensor_infos()
        report.parts_checked += [f"tensor {info.name!r}" for info in infos]
        failures = self._decode_chunks(infos, lambda info, number, chunk, scratch: scratch.buffer("verify", chunk.nbytes), True)
        for (name, number), problem in failures.items():  # each tensor's first
            report.damaged.setdefault(f"tensor {name!r}", f"chunk {number} {problem}")
        return report

    def resolve(self, obj, to: str = "auto"):
        """`obj` with every {"$tensor": name} reference replaced by the loaded tensor. Each
        tensor is read once: references to one name share one tensor object. `obj` is checked
        like the metadata (depth, reference count) before anything is read."""
        try:
            referenced = self._metadata_references if obj is self._metadata else check_plain(obj)
        except Refused as problem:
            raise BundleError(f"cannot resolve an object that {problem}") from None
        for name in referenced:
            self.tensor_info(name)  # an unknown name is refused before anything is read
        loaded = self.read_tensors([name for name in self._index.tensors if name in referenced], to)  # in file order

        def load(value):
            if is_tensor_ref(value):
                return loaded[value["$tensor"]]
            if isinstance(value, dict):
                return {key: load(item) for key, item in value.items()}
            if isinstance(value, list):
                return [load(item) for item in value]
            return value

        return load(obj)


def _prefetch(fd: int, info: TensorInfo) -> None:
    """Ask the kernel to start reading the tensor's stored bytes (they are contiguous) now, so
    that a file not in the page cache streams from disk while the first chunks decode."""
    if not info.chunks or not hasattr(os, "posix_fadvise"):
        return
    start, last = info.chunks[0].frames[0], info.chunks[-1].frames[-1]
    try:
        os.posix_fadvise(fd, start.offset, last.offset + last.stored_nbytes - start.offset, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # only a hint


def _check_memory_for(nbytes: int, what: str) -> None:
    """Refuse up front what cannot fit in memory (a few KiB of zstd can declare GiBs of zeros),
    rather than be killed halfway through decoding it; where /proc/meminfo (Linux) has no
    MemAvailable, nothing is refused."""
    if nbytes < 1 << 28:
        return
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            lines = [line for line in meminfo if line.startswith(b"MemAvailable:")]
        available = int(lines[0].split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return
    if nbytes > available:
        raise BundleError(f"{what} need(s) {nbytes} bytes of memory; only {available} are available")


def open_bundle(path) -> BundleReader:
    return BundleReader(path)
