"""Negative controls beside every GPU recording: bundles edited in one way each, which a replay
must not call reproduced, and one that makes the replayed forward fail inside the device.

* `perturbed_kv`: one KV block the step reads, nudged: the KV it writes or the hidden states
  must diverge first.
* `changed_noise_K`: the step's sampling noise changed (seeds, generators, the device's global
  generator: `change_noise`): the logits must stay bit-exact, and at least one of the K variants must
  diverge first at the sampled ids (a variant may draw the recorded tokens again: K is chosen
  so that all of them do with probability below `MISSED`).
* `device_assert`: a decode's last sampled token set past the vocabulary: the embedding lookup
  on the device asserts; the replay must end with the verdict `crashed` (exit 4) and one line.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gpu_support import bundles_by_step, checks_of, of_kind, sampling

from tracekit.format.content import load_step
from tracekit.format.rewrite import rewrite_bundle

# A redraw repeats row r's token with probability p_r, its softmax(logits / temperature) at the
# drawn id, so a variant misses with probability prod(p_r) over the rows it redraws, and K
# independent variants all miss with prod(p_r) ** K. The control takes the step where prod(p_r)
# is smallest and the fewest variants that bring it under MISSED; a step that needs more than
# MAX_VARIANTS is not spread enough to be a control.
MISSED = 1e-4
MAX_VARIANTS = 8

# Sampling parameters at these values leave softmax(logits / temperature), cut to the top k, as
# the distribution drawn from (top-p, penalties or masks would make p_r an underestimate: such
# rows are not counted, as if p_r = 1, which only adds variants).
NEUTRAL_SAMPLING = {
    "top_p": (None, 1.0), "min_p": (None, 0.0), "min_tokens": (None, 0),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}), "allowed_token_ids": (None, []), "bad_words": (None, []),
}


@dataclass
class Controls:
    """The control bundles by name, and why a changed-noise control is missing, if it is."""

    paths: dict[str, Path] = field(default_factory=dict)
    noise_missing: str = ""


def _counted(request) -> bool:
    """Whether a variant draws this request's token anew from a distribution known exactly
    (every non-greedy request is redrawn: each noise source is changed)."""
    params = sampling(request)
    return bool(params.get("temperature")) and all(params.get(name) in neutral
                                                   for name, neutral in NEUTRAL_SAMPLING.items())


def draw_probability(logits: torch.Tensor, params: dict, token: int) -> float:
    """The probability that sampling with `params` (temperature, top-k) draws `token`; like
    vLLM, top-k keeps every logit not below the k-th largest."""
    logits = logits.double() / params["temperature"]
    top_k = params.get("top_k") or 0
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    return float(torch.softmax(logits, dim=-1)[token])


def repeat_probability(step) -> float | None:
    """prod(p_r) over the rows a variant redraws (None: the step has no such row, or drafts, a
    grammar mask or rows its logits do not hold one-to-one)."""
    outputs = step.outputs
    if outputs is None or outputs.logits is None or outputs.grammar_bitmask is not None:
        return None
    sampled = outputs.sampled_token_ids or []
    if outputs.logits.shape[0] != len(step.batch_order) or len(sampled) != len(step.batch_order):
        return None
    repeat, redrawn = 1.0, False
    for row, req_id in enumerate(step.batch_order):
        request = step.request(req_id)
        if request.draft_token_ids or len(sampled[row]) > 1:
            return None
        if sampled[row] and _counted(request):
            redrawn = True
            repeat *= draw_probability(outputs.logits[row], sampling(request), sampled[row][0])
    return repeat if redrawn else None


def spread_step(bundles) -> tuple[Path | None, float]:
    """The step whose redraws are least likely to repeat, and that probability."""
    best, best_repeat = None, 1.0
    for path in bundles.values():
        _, step = load_step(path, None)
        repeat = repeat_probability(step)
        if repeat is not None and repeat < best_repeat:
            best, best_repeat = path, repeat
    return best, best_repeat


def variants_needed(repeat: float) -> int | None:
    """The fewest variants that all repeat with probability under MISSED (None: too many)."""
    if repeat >= 1.0:
        return None
    needed = 1 if repeat <= 0.0 else max(1, math.ceil(math.log(MISSED) / math.log(repeat)))
    return needed if needed <= MAX_VARIANTS else None


def _flip_seed_bit(state: torch.Tensor, bit: int) -> torch.Tensor:
    """A CUDA generator's state of another seed: its state is its 64-bit seed, then its Philox
    offset, little-endian, and another seed is another stream."""
    state = state.clone()
    state[0] ^= 1 << bit
    return state


def change_noise(variant: int):
    """A rewrite changing every source of the step's sampling noise: each V2 request's seed
    (bit `variant` flipped), each V1 seeded request's generator, and the device's global
    generator (V1's unseeded requests; vLLM 0.34's FlashInfer sampler, which V2 takes for a
    batch without greedy or seeded requests)."""
    def rewrite(metadata, tensors):
        step = metadata["steps"][0]
        for request in step["requests"]:
            state = request.get("runner_state", {})
            if state.get("seed") is not None:
                state["seed"] ^= 1 << variant
            if "generator_state" in state:
                name = state["generator_state"]["$tensor"]
                tensors[name] = _flip_seed_bit(tensors[name], variant)
        if "cuda" in (step.get("rng") or {}):
            name = step["rng"]["cuda"]["$tensor"]
            tensors[name] = _flip_seed_bit(tensors[name], variant)

    return rewrite


def add_noise_controls(controls: Controls, bundles: dict[int, Path], out: Path) -> None:
    """The `changed_noise_K` variants of the step least likely to draw its tokens again."""
    spread, repeat = spread_step(bundles)
    variants = variants_needed(repeat) if spread is not None else None
    if variants is None:
        controls.noise_missing = (f"no step's sampling is spread enough: the best repeats with "
                                  f"probability {repeat:.3g} (at most {MISSED ** (1 / MAX_VARIANTS):.3g} is needed)")
    for variant in range(variants or 0):
        controls.paths[f"changed_noise_{variant}"] = rewrite_bundle(
            spread, out / f"changed_noise_{variant}.zst", change_noise(variant))


def assert_noise_caught(controls: Controls, replayed: dict[str, dict]) -> None:
    """Other noise changes nothing before the sampled ids, and some variant changes those
    (`replayed`: the replay's records by bundle path)."""
    paths = [path for name, path in controls.paths.items() if name.startswith("changed_noise_")]
    assert paths, controls.noise_missing
    assert all(str(path) in replayed for path in paths), "a changed-noise variant has no replay record"
    noise = [replayed[str(path)] for path in paths]
    for record in noise:  # other noise may draw the same tokens
        assert record["first_divergence"] in (None, "sampled_token_ids"), (record["bundle"], record["first_divergence"])
        assert checks_of(record)["logits"]["bit_exact"], record["bundle"]
    assert any(record["first_divergence"] == "sampled_token_ids" for record in noise), len(noise)


def make_negative_controls(steps: Path, out: Path) -> Controls:
    out.mkdir()
    bundles = bundles_by_step(steps)
    controls = Controls()
    decode = next(iter(of_kind(bundles, "pure_decode").values()), None)
    if decode is not None:
        def perturb_kv(metadata, tensors):
            group = metadata["steps"][0]["kv"]["groups"][0]
            layer = group["layer_names"][0]
            name = f"steps/0/kv/groups/0/before/{layer}"
            tensors[name] = tensors[name].clone()
            half = tensors[name].view(-1)[: tensors[name].numel() // 2]
            if half.is_floating_point():
                half += 0.5
            else:  # an fp8 KV cache's raw bytes: each set to 1.0 in e4m3 (0.5 in e5m2), never a NaN code
                half.fill_(0x38)

        controls.paths["perturbed_kv"] = rewrite_bundle(decode, out / "perturbed_kv.zst", perturb_kv)
    add_noise_controls(controls, bundles, out)
    if decode is not None:
        def past_the_vocabulary(metadata, tensors):
            request = metadata["steps"][0]["requests"][0]
            request["output_token_ids"][-1] = 1 << 20
            ids = tensors["steps/0/input_ids"].clone()
            ids[0] = 1 << 20
            tensors["steps/0/input_ids"] = ids

        # last: its replay poisons the device, and nothing is left for a new process to replay
        controls.paths["device_assert"] = rewrite_bundle(decode, out / "zz_device_assert.zst", past_the_vocabulary)
    return controls
