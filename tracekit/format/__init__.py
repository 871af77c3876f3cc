"""The bundle file format: one zstd stream of msgpack holding tensors, metadata and an index.

docs/FORMAT.md is the specification; `BundleWriter` streams a bundle to disk atomically and
`BundleReader` reads its parts on demand, treating the file as hostile: every number is capped,
every byte returned is proven to be the byte written. This package never imports torch (it uses
it only when the caller asks for torch tensors) or vLLM.
"""

from tracekit.format.index import TensorInfo
from tracekit.format.layout import FORMAT_VERSION, READER_VERSION
from tracekit.format.reader import BundleReader, VerifyReport, open_bundle
from tracekit.format.writer import BundleWriter, tensor_ref

__all__ = [
    "FORMAT_VERSION", "READER_VERSION", "BundleReader", "BundleWriter", "TensorInfo", "VerifyReport",
    "open_bundle", "tensor_ref",
]
