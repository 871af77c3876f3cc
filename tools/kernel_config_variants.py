"""Write copies of a bundle whose recorded kernel choices are changed, to replay each in a fresh
process: which launch configuration did the recording really run a kernel with?

Why this exists: a step that parts from its replay although its report says every Inductor
kernel ran with its recorded configuration may have recorded the wrong one (issue 28: on the
H100 a float32 recording that loaded its graphs from vLLM's compile cache recorded XBLOCK=32 for
`triton_per_fused_fused_add_rms_norm_0`; its replay forced to XBLOCK=1 reproduced layer 1's KV,
which the recorded configuration did not). Each variant changes block sizes of the kernels named
by a prefix of their lookup hash, in every copy of each (a bundle keeps each compiled graph's
copy with its own configuration); every other byte of the step stays as recorded.

    python tools/kernel_config_variants.py BUNDLE OUT_DIR NAME=HASH_PREFIX:FIELD=VALUE[,...] ...
    e.g. add1=9ccba1:XBLOCK=1  both1=9ccba1:XBLOCK=1,211b9b:XBLOCK=1

then, on the GPU, `python -m tracekit replay OUT_DIR/NAME.zst --no-timing --json ...` per variant
(one process each: a process builds each kernel source once).
"""

import sys
from pathlib import Path

from tracekit.format.rewrite import rewrite_bundle


def parse_variant(text: str) -> tuple[str, dict[str, dict[str, int]]]:
    """`NAME=PREFIX:FIELD=VALUE,...` -> (name, {hash prefix: {field: value}})."""
    name, _, changes = text.partition("=")
    if not name or not changes:
        raise ValueError(f"'{text}' is not NAME=HASH_PREFIX:FIELD=VALUE[,...]")
    by_prefix: dict[str, dict[str, int]] = {}
    for change in changes.split(","):
        prefix, _, assignment = change.partition(":")
        field, _, value = assignment.partition("=")
        if not prefix or not field or not value.isdigit():
            raise ValueError(f"'{change}' in '{text}' is not HASH_PREFIX:FIELD=VALUE")
        by_prefix.setdefault(prefix, {})[field] = int(value)
    return name, by_prefix


def write_variant(bundle: Path, target: Path, by_prefix: dict[str, dict[str, int]]) -> list[str]:
    """The bundle with the named kernels' configurations changed; returns what was changed."""
    changed: list[str] = []
    matched: set[str] = set()

    def edit(metadata, tensors):
        for choice in metadata["engine"].get("kernel_choices", []):
            for prefix, fields in by_prefix.items():
                if choice["source_hash"].startswith(prefix):
                    for config in (choice["config"], *(copy["config"] for copy in choice.get("copies", []))):
                        config.update(fields)
                    changed.append(f"{choice['kernel']}@{prefix}: {fields}")
                    matched.add(prefix)

    rewrite_bundle(bundle, target, edit)
    unmatched = sorted(by_prefix.keys() - matched)
    if unmatched:
        target.unlink()
        raise ValueError(f"no recorded kernel choice has a lookup hash starting with {', '.join(unmatched)}")
    return changed


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    bundle, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    try:
        for text in argv[2:]:
            name, by_prefix = parse_variant(text)
            print(f"{name}: {'; '.join(write_variant(bundle, out / f'{name}.zst', by_prefix))}")
    except ValueError as problem:
        print(f"kernel_config_variants: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
