"""Negative controls beside every GPU recording: bundles edited in one way each, which a replay
must not call reproduced, and one that makes the replayed forward fail inside the device.

* `perturbed_kv`: one KV block the step reads, nudged: the KV it writes or the hidden states
  must diverge first.
* `changed_noise`: the sampling noise of a seeded request changed (V2: its seed; V1: its
  generator state dropped): only the sampled ids may diverge.
* `device_assert`: a decode's last sampled token set past the vocabulary: the embedding lookup
  on the device asserts; the replay must end with the verdict `crashed` (exit 4) and one line.
"""

from pathlib import Path

from gpu_support import bundles_by_step, of_kind

from tracekit.format.content import load_step
from tracekit.format.rewrite import rewrite_bundle


def _sampled_off_argmax(bundles, runner):
    """A step where a seeded, non-greedy request drew something other than its argmax."""
    for path in bundles.values():
        _, step = load_step(path, None)
        for row, req_id in enumerate(step.batch_order):
            request = step.request(req_id)
            params = request.sampling_params or {}
            drawn = (step.outputs.sampled_token_ids or [])[row] if step.outputs else []
            if params.get("seed") is None or params.get("temperature", 0) == 0 or not drawn:
                continue
            if row < step.outputs.logits.shape[0] and drawn[0] != int(step.outputs.logits[row].argmax()):
                # V1: a fresh generator of the same seed draws the same first token; only a
                # generator that has drawn before is changed by dropping its state
                if runner == "v1" and ("generator_state" not in request.runner_state or not request.output_token_ids):
                    continue
                return path
    return None


def make_negative_controls(steps: Path, out: Path, runner: str) -> dict[str, Path]:
    out.mkdir()
    bundles = bundles_by_step(steps)
    controls = {}
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

        controls["perturbed_kv"] = rewrite_bundle(decode, out / "perturbed_kv.zst", perturb_kv)
    seeded = _sampled_off_argmax(bundles, runner)
    if seeded is not None:
        def change_noise(metadata, tensors):
            for position, request in enumerate(metadata["steps"][0]["requests"]):
                if runner == "v2":
                    request["runner_state"]["seed"] ^= 1
                elif "generator_state" in request["runner_state"]:
                    del request["runner_state"]["generator_state"]
                    del tensors[f"steps/0/requests/{position}/runner_state/generator_state"]

        controls["changed_noise"] = rewrite_bundle(seeded, out / "changed_noise.zst", change_noise)
    if decode is not None:
        def past_the_vocabulary(metadata, tensors):
            request = metadata["steps"][0]["requests"][0]
            request["output_token_ids"][-1] = 1 << 20
            ids = tensors["steps/0/input_ids"].clone()
            ids[0] = 1 << 20
            tensors["steps/0/input_ids"] = ids

        # last: its replay poisons the device, and nothing is left for a new process to replay
        controls["device_assert"] = rewrite_bundle(decode, out / "zz_device_assert.zst", past_the_vocabulary)
    return controls
