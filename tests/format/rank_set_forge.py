"""Multi-rank bundle sets made from the sample trace: each part is the sample rewritten with the
rank fields a TP/PP recording writes, so set logic and refusals are tested without an engine."""

from pathlib import Path

from tracekit.format.rewrite import rewrite_bundle

SAMPLE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"


def make_set(folder: Path, tp: int = 2, pp: int = 1, step: int = 3, set_id: str = "session-a",
             name: str = "step{step}.rank{rank}.zst", sample: Path = SAMPLE) -> list[Path]:
    """One part per rank of `sample`, as a recorder with output `step{step}.zst` names them."""
    world = tp * pp
    names = [name.format(step=step, rank=rank) for rank in range(world)]
    parts = []
    for rank in range(world):
        def give_rank(metadata, tensors, rank=rank):
            metadata["steps"][0]["index"] = step
            metadata["parallel"] = {
                "world_size": world, "rank": rank, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                "tp_rank": rank % tp, "pp_rank": rank // tp, "set_id": set_id, "parts": names,
            }

        parts.append(rewrite_bundle(sample, folder / names[rank], give_rank))
    return parts
