"""Where the KV cache a parted step of a sequence read came from: did the difference arise in
the step's own forward, or come in with the KV an earlier step wrote (docs/GUIDE.md, "Where the
KV came from")?

A step with no digest of its KV writes (the first, whose written blocks are compared whole, or a
bundle recorded before the digest) is taken to have written the recorded KV where its writing rows
were bit-exact: each layer's KV is computed from that layer's input, which bit-exact hidden states
follow from. Where the KV went is the runner's: a block table carried wrong shows as a step that
parts "in itself".
"""

from dataclasses import dataclass

from tracekit.format.schema import RequestState, Step, blocks_covering
from tracekit.replay.checks import KV_DIGEST_ITEM
from tracekit.replay.result import ReplayResult

# Per-token items whose rows feed the KV a step writes: a request whose rows part here may write
# other KV (its logits and sampled ids come after the KV is written, and do not count).
KV_FEEDING_ITEMS = ("input_ids", "positions", "hidden_states")

Writer = tuple[int, str]  # (window step, request) that wrote into a block


@dataclass(frozen=True)
class KVSource:
    """For one request of a parted step: the window steps whose KV writes it read, and those
    among them where the writing request had parted (`other_kv_writers`)."""

    written_at: list[int]
    parted_at: list[int]

    def to_plain(self) -> dict[str, list[int]]:
        return {"written_at": self.written_at, "parted_at": self.parted_at}


def parted_rows(result: ReplayResult) -> set[str] | None:
    """The requests whose KV-feeding rows or KV writes parted in a replayed step; None when the
    step parted there without naming them (every request of the step may have written other KV)."""
    moved: set[str] = set()
    for item in result.checks:
        if not item.decides or item.bit_exact:
            continue
        if item.name.startswith("kv_written/"):
            return None
        if item.name in (*KV_FEEDING_ITEMS, KV_DIGEST_ITEM):
            if "requests_moved" not in item.details:
                return None
            moved.update(item.details["requests_moved"])
    return moved


def other_kv_writers(result: ReplayResult) -> set[str] | None:
    """The requests of a replayed step that may have written other KV than recorded: where the
    step checked a digest of its KV writes, those whose digest parted; else those whose rows
    parted (`parted_rows`)."""
    digest = next((item for item in result.checks if item.name == KV_DIGEST_ITEM and item.decides), None)
    if digest is not None:
        return set(digest.details.get("requests_moved", {}))
    return parted_rows(result)


def kv_sources(steps: list[Step], results: list[ReplayResult]) -> dict[int, dict[str, KVSource]]:
    """For each replayed step that parted, per request whose rows parted there (every request of
    the step where the checks name none), where the KV it read came from. `steps`: the window's
    steps in order (later ones with their derived request states), `results`: those that ran."""
    ran = {result.step_index: result for result in results}
    writers: dict[tuple[int, int], set[Writer]] = {}  # (KV cache group, block id) -> its writers
    parted: dict[int, set[str] | None] = {}
    found: dict[int, dict[str, KVSource]] = {}
    for step in steps:
        result = ran.get(step.index)
        if result is None:
            break
        _put_back(step, writers)
        parted[step.index] = other_kv_writers(result)
        if not result.bit_exact:
            moved = parted_rows(result)
            readers = [r for r in step.requests if moved is None or r.req_id in moved]
            sources = {r.req_id: _sources(step, r, writers, parted) for r in readers}
            if sources:
                found[step.index] = sources
        _written(step, writers)
    return found


def _block_sizes(step: Step) -> list[int]:
    return [group.layout.block_size for group in step.kv.groups]


def _put_back(step: Step, writers: dict[tuple[int, int], set[Writer]]) -> None:
    """Blocks the step's replay puts back from the recording hold the recorded KV again."""
    for group_index, group in enumerate(step.kv.groups):
        for block in group.saved_block_ids:
            writers.pop((group_index, block), None)


def _group_blocks(request: RequestState, group_index: int) -> list[int]:
    return request.block_ids[group_index] if group_index < len(request.block_ids) else []


def _sources(step: Step, request: RequestState, writers: dict[tuple[int, int], set[Writer]],
             parted: dict[int, set[str] | None]) -> KVSource:
    """The window steps whose writes `request` reads in `step` (its tokens before this step's)."""
    read: set[Writer] = set()
    for group_index, block_size in enumerate(_block_sizes(step)):
        for block in _group_blocks(request, group_index)[: blocks_covering(request.num_computed_tokens, block_size)]:
            read |= writers.get((group_index, block), set())
    parted_writers = {index for index, req_id in read if parted.get(index) is None or req_id in parted[index]}
    return KVSource(sorted({index for index, _ in read}), sorted(parted_writers))


def _written(step: Step, writers: dict[tuple[int, int], set[Writer]]) -> None:
    """Record the step's KV writes: each request's scheduled tokens, at the slots after its
    computed ones. A write from a block's first slot on makes the step its only writer (the
    slots past it are read by nobody before they are written again)."""
    for group_index, block_size in enumerate(_block_sizes(step)):
        for request in step.requests:
            start = request.num_computed_tokens
            end = start + request.num_scheduled_tokens
            ids = _group_blocks(request, group_index)
            for number in range(start // block_size, min(blocks_covering(end, block_size), len(ids))):
                key = (group_index, ids[number])
                writer = (step.index, request.req_id)
                if start <= number * block_size:
                    writers[key] = {writer}
                else:
                    writers.setdefault(key, set()).add(writer)


def describe(index: int, req_id: str, source: KVSource) -> str:
    """One line a report prints for a request of a parted step."""
    if source.parted_at:
        steps = ", ".join(map(str, source.parted_at))
        return (f"step {index}: request {req_id} reads KV that step(s) {steps} wrote where the writing request "
                f"parted (its rows, or the KV it wrote): the difference may have come in with the KV cache")
    written = ", ".join(map(str, source.written_at))
    read = f"KV written by step(s) {written}, bit-exact there, and " if written else "only "
    return (f"step {index}: request {req_id} reads {read}KV the replay put back from the bundle: "
            f"it parts in step {index} itself (its forward, or the blocks its block table points it to)")
