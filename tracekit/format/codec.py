"""How one chunk of tensor bytes becomes zstd frames and back: the byte-shuffle filter, the
compression parameters, and the checks made while decoding untrusted frames. Why each is what it
is: docs/FORMAT-RATIONALE.md, "Compression choices"; measured numbers: docs/PERFORMANCE.md.
"""

import threading
import zlib
from dataclasses import dataclass

import numpy as np
import zstandard

from tracekit.format.layout import FILTER_NONE, FILTER_SHUFFLE, chunk_prefix
from tracekit.format.limits import MAX_ZSTD_EXPANSION

# Smaller tensors are not shuffled: k frames per chunk would cost more than they save.
SHUFFLE_MIN_BYTES = 64 * 1024
DEFAULT_CHUNK_BYTES = 2 << 20  # small enough that a few-MiB tensor decodes on several cores
MAX_WINDOW_BYTES = 1 << 27


class FrameDamage(Exception):
    """A chunk or metadata frame does not decode to what the index promises; the reader turns
    this into a BundleError naming the part."""


def choose_filter(itemsize: int, nbytes: int) -> str:
    return FILTER_SHUFFLE if itemsize > 1 and nbytes >= SHUFFLE_MIN_BYTES else FILTER_NONE


def compression_parameters(level: int | None, literals: bool = True) -> zstandard.ZstdCompressionParameters:
    """`None`: tracekit's default, `literals=False` without Huffman-coded literals (zstd drops them
    for the fast strategy when target_length > 0); an int: zstd's level."""
    if level is None:
        return zstandard.ZstdCompressionParameters(
            strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6,
            search_log=1, min_match=7, target_length=0 if literals else 1, write_checksum=True, write_content_size=True,
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


def shuffled_content(prefix: bytes, raw: np.ndarray, filter_name: str, itemsize: int) -> np.ndarray:
    """A new array holding a chunk's whole decompressed content: its prefix, then its bytes
    (split into byte planes when shuffled). This is the one copy the writer makes of a chunk."""
    content = np.empty(len(prefix) + raw.nbytes, dtype=np.uint8)
    content[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    body = content[len(prefix):]
    if filter_name == FILTER_NONE:
        body[:] = raw
    elif itemsize == 2:  # the common case (bf16/fp16): two vector passes beat a strided copy 2x
        words = raw.view("<u2")
        np.copyto(body[: words.size], words, casting="unsafe")  # low bytes
        np.right_shift(words, 8, out=body[words.size:], casting="unsafe")
    else:
        planes = body.reshape(itemsize, -1)
        for plane_number in range(itemsize):
            planes[plane_number] = raw[plane_number::itemsize]
    return content


def unshuffle_into(out: np.ndarray, planes: list, itemsize: int) -> None:
    """The inverse of the byte-plane split: `planes[j]` holds byte j of every element."""
    if itemsize == 2:
        words = out.view("<u2")
        np.left_shift(planes[1], 8, out=words, dtype=np.uint16, casting="unsafe")
        np.bitwise_or(words, planes[0], out=words, casting="unsafe")
        return
    for plane_number, plane in enumerate(planes):
        out[plane_number::itemsize] = plane


@dataclass(frozen=True)
class EncodedFrame:
    stored: bytes
    content_nbytes: int
    crc32: int  # of the stored bytes, computed here on the encoding thread
    checksum: int  # the zstd content checksum the frame ends with


# A plane this large gets a trial: a sample compressed with and without Huffman literals.
LITERALS_TRIAL_MIN_BYTES = 64 * 1024
_TRIAL_PIECES, _TRIAL_PIECE_BYTES = 8, 2048
# Huffman literals are kept where they shrink the sample by more than this fraction.
_LITERALS_MIN_GAIN = 0.05


class ChunkEncoder:
    """Encodes chunks from several threads at once (one pair of zstd contexts per thread); with
    the default parameters each large byte plane with or without Huffman literals, by trial."""

    def __init__(self, level: int | None):
        self._choose = level is None
        self._parameters = {literals: compression_parameters(level, literals) for literals in (True, False)}
        self._local = threading.local()

    def _compressor(self, literals: bool) -> zstandard.ZstdCompressor:
        compressors = getattr(self._local, "compressors", None)
        if compressors is None:
            compressors = self._local.compressors = {}
        if literals not in compressors:
            compressors[literals] = zstandard.ZstdCompressor(compression_params=self._parameters[literals])
        return compressors[literals]

    def compress(self, content, literals: bool = True) -> bytes:
        return self._compressor(literals).compress(content)

    def literals_pay(self, plane: np.ndarray) -> bool:
        """Whether Huffman literals shrink a sample of `plane` (pieces spread over it) enough."""
        if not self._choose or plane.nbytes < LITERALS_TRIAL_MIN_BYTES:
            return True
        stride = plane.nbytes // _TRIAL_PIECES
        sample = np.concatenate([plane[k * stride:k * stride + _TRIAL_PIECE_BYTES] for k in range(_TRIAL_PIECES)])
        with_literals = len(self.compress(sample, True))
        return with_literals < (1 - _LITERALS_MIN_GAIN) * len(self.compress(sample, False))

    def frame(self, content, literals: bool = True) -> EncodedFrame:
        stored = self.compress(content, literals)
        return EncodedFrame(stored, len(content), zlib.crc32(stored), content_checksum(stored))

    def encode(self, content: np.ndarray, spans: list[tuple[int, int]]) -> list[EncodedFrame]:
        """A chunk's frames, one per span of its content."""
        parts = [content[start:end] for start, end in spans]
        return [self.frame(part, self.literals_pay(part)) for part in parts]


def content_checksum(frame) -> int:
    """The zstd content checksum a frame ends with (the low 32 bits of XXH64 of its content)."""
    return int.from_bytes(frame[-4:], "little") if len(frame) >= 4 else -1


def check_frame_header(frame: bytes | memoryview, content_nbytes: int) -> None:
    """The frame header declares exactly the content size the index expects, and a content
    checksum; checked before anything is allocated (a zip bomb stops here)."""
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
    end = frame_end(frame)
    if end > len(frame):
        raise FrameDamage("is cut off (its zstd frame runs past the bytes the index gives it)")
    if end < len(frame):
        raise FrameDamage(f"has {len(frame) - end} bytes after the end of its zstd frame (frames tile the file exactly)")


def frame_end(frame: bytes | memoryview) -> int:
    """Where the zstd frame that `frame` starts with ends (zstd's ZSTD_findFrameCompressedSize):
    its header, then blocks up to the one marked last, then its 4-byte content checksum. Walks
    the 3-byte block headers (one per <= 128 KiB of content) without decompressing; zstd itself
    stops at the frame's end and ignores whatever follows it in the buffer."""
    try:
        position = zstandard.frame_header_size(frame)
    except zstandard.ZstdError:
        raise FrameDamage("is not a zstd frame") from None
    while True:
        if position + 3 > len(frame):
            raise FrameDamage("is cut off (its last zstd block is missing)")
        block = int.from_bytes(frame[position:position + 3], "little")
        kind, size = (block >> 1) & 3, block >> 3
        if kind == 3:
            raise FrameDamage("does not decompress (a zstd block of the reserved type)")
        position += 3 + (1 if kind == 1 else size)  # an RLE block stores one byte
        if block & 1:
            return position + 4  # the content checksum (check_frame_header made sure there is one)


def _decompressor() -> zstandard.ZstdDecompressor:
    decompressor = getattr(_thread_state, "decompressor", None)
    if decompressor is None:
        decompressor = _thread_state.decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)
    return decompressor


_thread_state = threading.local()


def decompress_into(frame: bytes | memoryview, *buffers) -> None:
    """Decompress a frame whose content fills `buffers` (bytearrays, uint8 arrays), one after
    the other, straight into them (no intermediate copy); zstd checks the content checksum when
    the frame ends, which the last read reaches."""
    targets = [memoryview(buffer).cast("B") for buffer in buffers]
    check_frame_header(frame, sum(target.nbytes for target in targets))
    try:
        reader = _decompressor().stream_reader(frame, read_size=len(frame), read_across_frames=False)
        for target in targets:
            filled = 0
            while filled < len(target):
                count = reader.readinto(target[filled:])
                if not count:
                    raise FrameDamage("decompresses to fewer bytes than the index says")
                filled += count
        if reader.read(1):
            raise FrameDamage("decompresses to more bytes than the index says")
    except zstandard.ZstdError as error:
        raise FrameDamage(f"does not decompress ({error})") from None


class Scratch(threading.local):
    """Buffers that one thread reuses from chunk to chunk (a fresh one per frame costs a page
    fault per 4 KiB: decoding took twice as long); each holds at most one chunk's part."""

    def __init__(self):
        self.buffers: dict[object, np.ndarray] = {}

    def buffer(self, slot, nbytes: int) -> np.ndarray:
        buffer = self.buffers.get(slot)
        if buffer is None or buffer.nbytes < nbytes:
            self.buffers[slot] = None  # the old one goes before the new one is allocated
            buffer = self.buffers[slot] = np.empty(nbytes, dtype=np.uint8)
        return buffer[:nbytes]


def decode_chunk(frames: list[memoryview], tensor_name: str, chunk_number: int, filter_name: str, itemsize: int,
                 out: np.ndarray, scratch: Scratch) -> None:
    """Decode a chunk's frames into `out` (a uint8 array of the chunk's size), byte planes by
    way of `scratch`. zstd checks each frame's content checksum on the way; the caller has bound
    each frame to its index entry."""
    prefix = chunk_prefix(tensor_name, chunk_number, out.nbytes)
    if filter_name == FILTER_NONE:
        head = bytearray(len(prefix))
        decompress_into(frames[0], head, out)
        if head != prefix:
            raise FrameDamage("does not start with its chunk header")
        return
    spans = frame_spans(len(prefix), out.nbytes, filter_name, itemsize)
    planes = []
    for plane_number, (frame, (start, end)) in enumerate(zip(frames, spans)):
        # a whole frame into one buffer: zstd then decodes in one pass, without its own window copy
        content = scratch.buffer(("plane", plane_number), end - start)
        decompress_into(frame, content)
        if plane_number == 0:
            if content[: len(prefix)].tobytes() != prefix:
                raise FrameDamage("does not start with its chunk header")
            content = content[len(prefix):]
        planes.append(content)
    unshuffle_into(out, planes, itemsize)
