"""tools/make_tiny_mtp.py: the embedded model as MiMo with one MTP layer, the same bytes every
run (the MTP end-to-end tests in tests/e2e/test_spec_decode.py load it into real engines)."""

import json
import subprocess
import sys
from pathlib import Path

from safetensors.numpy import load_file

from tracekit.models import tiny_model_path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "make_tiny_mtp.py"


def make(folder: Path, *args: str) -> Path:
    subprocess.run([sys.executable, str(TOOL), str(folder), *args], check=True, capture_output=True)
    return folder


def test_the_same_seed_writes_the_same_bytes_and_another_seed_another_mtp_layer(tmp_path):
    first, again, other = make(tmp_path / "a"), make(tmp_path / "b"), make(tmp_path / "c", "--seed", "1")
    for name in ("config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_the_target_is_the_embedded_model_and_one_mtp_layer_follows_it(tmp_path):
    folder = make(tmp_path / "mtp")
    config = json.loads((folder / "config.json").read_text())
    embedded = load_file(str(Path(tiny_model_path()) / "model.safetensors"))
    tensors = load_file(str(folder / "model.safetensors"))
    assert config["architectures"] == ["MiMoForCausalLM"] and config["num_nextn_predict_layers"] == 1
    for name, weight in embedded.items():  # the target's weights unchanged, under the same names
        assert (tensors[name] == weight).all(), name
    mtp = {name for name in tensors if name.startswith("model.mtp_layers.0.")}
    # one decoder layer's tensors (Qwen2: 7 projections, 2 norms, 3 q/k/v biases) and the MTP
    # layer's own: 3 norms and the input projection
    per_layer = {name.removeprefix("model.layers.0.") for name in tensors if name.startswith("model.layers.0.")}
    assert len(per_layer) == 7 + 2 + 3
    assert {name.removeprefix("model.mtp_layers.0.") for name in mtp} == per_layer | {
        "token_layernorm.weight", "hidden_layernorm.weight", "final_layernorm.weight", "input_proj.weight"}
    hidden = config["hidden_size"]
    assert tensors["model.mtp_layers.0.input_proj.weight"].shape == (hidden, 2 * hidden)
