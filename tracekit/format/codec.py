"""How one chunk of tensor bytes becomes zstd frames and back: the byte-shuffle filter, the
compression parameters, and the checks made while decoding untrusted frames.

Why shuffle: in a float tensor the high byte of each element (sign and exponent) repeats a
handful of values while the low mantissa bytes are close to random. Splitting a chunk into
byte planes (all byte 0s, then all byte 1s, ...) and giving each plane its own zstd frame lets
zstd compress the exponent plane well and store the noise planes as raw blocks, which zstd
detects and emits at several GB/s. Measured numbers are in docs/FORMAT.md.
"""

import hashlib
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import zstandard

from tracekit.format.layout import FILTER_NONE, FILTER_SHUFFLE, chunk_prefix
from tracekit.format.limits import MAX_ZSTD_EXPANSION

# Smaller tensors are not shuffled: k frames per chunk would cost more than they save.
SHUFFLE_MIN_BYTES = 64 * 1024
DEFAULT_CHUNK_BYTES = 8 << 20
MAX_WINDOW_BYTES = 1 << 27


class FrameDamage(Exception):
    """A chunk or metadata frame does not decode to what the index promises; the reader turns
    this into a BundleError naming the part."""


def choose_filter(itemsize: int, nbytes: int) -> str:
    return FILTER_SHUFFLE if itemsize > 1 and nbytes >= SHUFFLE_MIN_BYTES else FILTER_NONE


def compression_parameters(level: int | None) -> zstandard.ZstdCompressionParameters:
    """`None`: tracekit's default, zstd's fast strategy with a tiny hash table and long
    minimum matches, which on KV data is ~3x faster than level 1 at an equal or better ratio
    (float planes have few long repeats; literals are what compress). An int: zstd's level."""
    if level is None:
        return zstandard.ZstdCompressionParameters(
            strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6,
            search_log=1, min_match=7, target_length=0, write_checksum=True, write_content_size=True,
        )
    return zstandard.ZstdCompressionParameters.from_level(level, write_checksum=True, write_content_size=True)


def frame_spans(prefix_nbytes: int, nbytes: int, filter_name: str, itemsize: int) -> list[tuple[int, int]]:
    """(start, end) of each frame's content within the chunk's decompressed content
    (prefix followed by the filtered bytes): one frame, or one frame per byte plane."""
    if filter_name == FILTER_NONE:
        return [(0, prefix_nbytes + nbytes)]
    plane = nbytes // itemsize
    starts = [0] + [prefix_nbytes + plane * j for j in range(1, itemsize)]
    return list(zip(starts, starts[1:] + [prefix_nbytes + nbytes]))


@dataclass(frozen=True)
class EncodedChunk:
    sha256: bytes
    frames: list[bytes]
    content_nbytes: list[int]
    crc32: list[int]  # of each stored frame, computed here on the worker thread


class ChunkEncoder:
    """Encodes chunks from several threads at once (one zstd context per thread)."""

    def __init__(self, level: int | None):
        self._parameters = compression_parameters(level)
        self._local = threading.local()

    def compress(self, content) -> bytes:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = zstandard.ZstdCompressor(compression_params=self._parameters)
        return compressor.compress(content)

    def encode(self, tensor_name: str, chunk_number: int, raw: np.ndarray, filter_name: str, itemsize: int) -> EncodedChunk:
        prefix = chunk_prefix(tensor_name, chunk_number, raw.nbytes)
        content = np.empty(len(prefix) + raw.nbytes, dtype=np.uint8)
        content[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        if filter_name == FILTER_SHUFFLE:
            np.copyto(content[len(prefix):].reshape(itemsize, -1), raw.reshape(-1, itemsize).T)
        else:
            content[len(prefix):] = raw
        spans = frame_spans(len(prefix), raw.nbytes, filter_name, itemsize)
        frames = [self.compress(content[start:end]) for start, end in spans]
        return EncodedChunk(
            sha256=hashlib.sha256(raw).digest(),
            frames=frames,
            content_nbytes=[end - start for start, end in spans],
            crc32=[zlib.crc32(frame) for frame in frames],
        )


def check_stored(frame: bytes | memoryview, crc32: int) -> None:
    if zlib.crc32(frame) != crc32:
        raise FrameDamage("is altered on disk (its stored bytes fail their CRC-32)")


def decompress_frame(frame: bytes | memoryview, content_nbytes: int) -> bytes:
    """Decompress one zstd frame whose content the index says is `content_nbytes` long. The
    size is checked from the frame header before anything is allocated (a bomb stops here)."""
    if content_nbytes > len(frame) * MAX_ZSTD_EXPANSION:
        raise FrameDamage(f"claims {content_nbytes} bytes in a {len(frame)}-byte frame")
    try:
        parameters = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError:
        raise FrameDamage("is not a zstd frame") from None
    if parameters.content_size != content_nbytes:
        raise FrameDamage(f"frame declares {parameters.content_size} bytes where the index says {content_nbytes}")
    if not parameters.has_checksum:
        raise FrameDamage("frame has no content checksum")
    try:
        content = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).decompress(frame)
    except zstandard.ZstdError as error:
        raise FrameDamage(f"does not decompress ({error})") from None
    if len(content) != content_nbytes:
        raise FrameDamage(f"decompresses to {len(content)} bytes where the index says {content_nbytes}")
    return content


def decode_chunk(frames: list[memoryview], tensor_name: str, chunk_number: int, expected_sha256: bytes | None,
                 filter_name: str, itemsize: int, out: np.ndarray) -> None:
    """Decode a chunk's frames into `out` (a uint8 array of the chunk's size). zstd checks each
    frame's content checksum on the way; the sha256 content hash is checked when given."""
    prefix = chunk_prefix(tensor_name, chunk_number, out.nbytes)
    spans = frame_spans(len(prefix), out.nbytes, filter_name, itemsize)
    planes = out.reshape(-1, itemsize) if filter_name == FILTER_SHUFFLE else None
    for plane_number, (frame, (start, end)) in enumerate(zip(frames, spans)):
        content = memoryview(decompress_frame(frame, end - start))
        if plane_number == 0:
            if content[: len(prefix)] != prefix:
                raise FrameDamage("does not start with its chunk header")
            content = content[len(prefix):]
        data = np.frombuffer(content, dtype=np.uint8)
        if planes is None:
            out[:] = data
        else:
            planes[:, plane_number] = data
    if expected_sha256 is not None and hashlib.sha256(out).digest() != expected_sha256:
        raise FrameDamage("fails its hash")
