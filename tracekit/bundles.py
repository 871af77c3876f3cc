"""Bundles named on a command line (files, folders, globs: `tracekit replay`, `tracekit export
--shapes`), and short unique names for them in the output (summary rows, profile files, benchmark
case names): `step5` alone, or `incident1/step5` beside `incident2/step5`.
"""

import glob
import re
from collections.abc import Sequence
from pathlib import Path

from tracekit.errors import UsageError

# What a folder is searched for (`tracekit record` writes `.zst` bundles).
BUNDLE_SUFFIX = ".zst"


def find_bundles(specs: Sequence[str]) -> list[Path]:
    """Every bundle `specs` name, in the order given, each once: a file as is, a folder's
    `*.zst` files (recursively, sorted), a glob pattern's matches (sorted). A spec that names
    nothing is a usage error, raised before anything runs."""
    found: dict[Path, None] = {}
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            matches = sorted(p for p in path.rglob(f"*{BUNDLE_SUFFIX}") if p.is_file())
            if not matches:
                raise UsageError(f"no {BUNDLE_SUFFIX} bundle in folder {spec}")
        elif path.is_file():
            matches = [path]
        elif glob.has_magic(spec):
            matches = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            if not matches:
                raise UsageError(f"no bundle matches {spec}")
        else:
            raise UsageError(f"no bundle at {spec}")
        found.update(dict.fromkeys(matches))
    return list(found)


def unique_names(paths: Sequence[Path]) -> list[str]:
    """A short name per path, unique among them: the stem, widened by parent folders where stems
    collide; characters other than letters, digits and `._-` become `_` (the names end up in
    file names)."""
    parts = [Path(path).resolve().with_suffix("").parts for path in paths]
    depth = [1] * len(parts)
    while True:
        names = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
        clashing = {name for name in names if names.count(name) > 1}
        widen = [i for i, name in enumerate(names) if name in clashing and depth[i] < len(parts[i])]
        if not widen:
            break
        for i in widen:
            depth[i] += 1
    return [re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("/", "__")) for name in names]
