"""The bundle file format: one zstd stream of msgpack holding tensors, metadata and an index.

docs/FORMAT.md is the specification; `BundleWriter` streams a bundle to disk atomically and
`BundleReader` reads its parts on demand, treating the file as hostile: every number is capped,
every byte returned is proven to be the byte written. This package never imports torch (it uses
it only when the caller asks for torch tensors) or vLLM.

The file: `layout` (byte layout, versions), `codec` (tensor bytes to zstd frames and back),
`dtypes` (the element types), `index` (the table of contents), `limits` and `untrusted` (caps on
what a file may claim; msgpack unpacked under them), `writer` (with `writeback`, disk writeback
overlapping the encoding, and `leftovers`, the temporary files of dead writers), `reader`. The
content: `schema` (what a recorded step holds), `typecheck` (plain data checked against it),
`content` (typed content to and from a file), `rankset` (the parts of a multi-rank step).
Comparing and editing: `compare` (two tensors), `diff` (two bundles), `rewrite` (a bundle with
edits, for tests).
"""

from tracekit.format.layout import FORMAT_VERSION
from tracekit.format.reader import BundleReader, open_bundle
from tracekit.format.writer import BundleWriter

__all__ = ["FORMAT_VERSION", "BundleReader", "BundleWriter", "open_bundle"]
