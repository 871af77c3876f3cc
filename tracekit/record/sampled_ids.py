"""The token ids the engine sampled for each request, kept by the recorder from every step's
output where the runner holds placeholders, for a `--kv recompute` replay to prefill (docs/GUIDE.md,
"Always-on"): for the requests it saw start, whose outputs it knows whole.
"""

from collections.abc import Container, Iterable, Sequence
from typing import Any

from tracekit.format.schema import RequestState


class SampledIds:
    """Per live request seen from its first step: every token id sampled for it, in order."""

    def __init__(self) -> None:
        self._ids: dict[str, list[int]] = {}

    def started(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._ids[req_id] = []

    def keep_only(self, live: Container[str]) -> None:
        """Forget the requests no longer live (finished, aborted)."""
        for req_id in [req_id for req_id in self._ids if req_id not in live]:
            del self._ids[req_id]

    def received(self, batch_order: Sequence[str], sampled: Sequence[Sequence[Any]]) -> None:
        """A step's sampled ids, one list per request of its batch (in `batch_order`)."""
        for req_id, ids in zip(batch_order, sampled):
            kept = self._ids.get(req_id)
            if kept is not None:
                kept.extend(int(token) for token in ids)

    def fill(self, requests: list[RequestState]) -> int:
        """Replace each placeholder (an id below 0) in the requests' output tokens by the id kept
        for that position; returns how many were replaced."""
        replaced = 0
        for request in requests:
            kept = self._ids.get(request.req_id)
            if not kept:
                continue
            outputs = request.output_token_ids
            for position in range(min(len(outputs), len(kept))):
                if outputs[position] < 0:
                    outputs[position] = kept[position]
                    replaced += 1
        return replaced
