"""A step's structured-output grammar: vLLM's `GrammarOutput` as a `GrammarRecord` and back, and
the mask as it reached the logits, the check that the replayed runner masked the same tokens of
the same rows (docs/GUIDE.md, "Structured outputs"; the layout: docs/FORMAT.md, `grammar`).

The runner sorts the bitmask rows into its batch order and sets the logits of disallowed tokens
to -inf in place, just before sampling. In process the bitmask is a view of the scheduler's
persistent buffer, so a record copies it.
"""

import dataclasses
from typing import Any

import numpy as np
import torch

from tracekit.errors import BundleError
from tracekit.format.schema import GrammarRecord
from tracekit.integrations.vllm.records.serialize import SerializationError

TOKENS_PER_WORD = 32


def grammar_record(grammar_output: Any, scheduler_output: Any, fixed_stride: bool = False) -> GrammarRecord:
    """`grammar_output` (vLLM's `GrammarOutput`) as a record, its bitmask copied to a host tensor.
    Each request owns `1 + its drafts` rows (the drafts the scheduler output schedules), or, with
    `fixed_stride` (the release says: `Release.grammar_record`), a block of `1 +
    num_speculative_tokens` rows whatever its drafts (the rows past its drafts allow every token)."""
    request_ids = [str(req_id) for req_id in grammar_output.structured_output_request_ids]
    bitmask = torch.from_numpy(np.array(grammar_output.grammar_bitmask, dtype=np.int32, copy=True))
    if fixed_stride and request_ids and bitmask.dim() == 2 and bitmask.shape[0] % len(request_ids) == 0:
        rows_per_request = [bitmask.shape[0] // len(request_ids)] * len(request_ids)
    else:
        drafts = scheduler_output.scheduled_spec_decode_tokens or {}
        rows_per_request = [1 + len(drafts.get(req_id, ())) for req_id in request_ids]
    if bitmask.dim() != 2 or bitmask.shape[0] != sum(rows_per_request):
        raise SerializationError(
            f"the grammar bitmask has shape {tuple(bitmask.shape)}, not one row per sampled position of its "
            f"{len(request_ids)} request(s) ({sum(rows_per_request)}): a layout this tracekit does not know"
        )
    acceptable = getattr(grammar_output, "num_acceptable_drafts", None)
    return GrammarRecord(
        request_ids=request_ids,
        rows_per_request=rows_per_request,
        bitmask=bitmask,
        num_acceptable_drafts=[int(n) for n in acceptable] if acceptable is not None else None,
    )


def grammar_output(record: GrammarRecord, output_class: type) -> Any:
    """The `GrammarOutput` (of `output_class`, the release's) a record was taken from; a field
    the class lacks (`num_acceptable_drafts` in an older release) is left out."""
    bitmask = record.bitmask
    if not (isinstance(bitmask, torch.Tensor) and bitmask.dtype == torch.int32 and bitmask.dim() == 2
            and bitmask.shape[0] == sum(record.rows_per_request)):
        raise BundleError("bundle content: grammar.bitmask should be an int32 tensor with one row per sampled "
                          "position of its requests (the sum of rows_per_request)")
    fields = {
        "structured_output_request_ids": list(record.request_ids),
        "grammar_bitmask": bitmask.contiguous().numpy().copy(),
        "num_acceptable_drafts": list(record.num_acceptable_drafts) if record.num_acceptable_drafts is not None else None,
    }
    known = {item.name for item in dataclasses.fields(output_class)}
    return output_class(**{name: value for name, value in fields.items() if name in known})


def applied_mask(logits: torch.Tensor) -> torch.Tensor:
    """Which tokens of each logits row are not at -inf, packed like vLLM's bitmask (bit j of
    int32 word i = token 32i+j; bits past the vocabulary are 0), on the logits' device. Eight
    tokens to a byte, four bytes viewed as one little-endian word: one byte of scratch per logit."""
    rows, vocab = logits.shape
    words = -(-vocab // TOKENS_PER_WORD)
    allowed = torch.zeros(rows, words * TOKENS_PER_WORD, dtype=torch.uint8, device=logits.device)
    allowed[:, :vocab] = ~torch.isneginf(logits)
    weights = torch.tensor([1 << bit for bit in range(8)], dtype=torch.uint8, device=logits.device)
    packed = (allowed.view(rows, words * 4, 8) * weights).sum(dim=-1, dtype=torch.uint8)
    return packed.view(torch.int32)


def unpack_mask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: the tokens a packed mask allows (the inverse of `applied_mask`)."""
    rows = words.shape[0]
    as_bytes = words.contiguous().view(torch.uint8).view(rows, -1, 1)
    bits = (as_bytes >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.view(rows, -1)[:, :vocab].bool()
