"""Issue 51: a model named by hub id is fingerprinted in the folder it was loaded from (its
snapshot in the Hugging Face cache), as a local folder is, so its bundle is checked on replay
like any other; one not found here gets no fingerprint, and nothing is downloaded."""

import json
import os
import shutil
import subprocess
import sys

from tracekit.integrations.vllm.records.weights import weights_fingerprint
from tracekit.models import tiny_model_path

# Run apart: huggingface_hub reads where its cache is when it is first imported.
PROBE = """
import json, sys
from tracekit.integrations.vllm.records.weights import local_model_folder, weights_fingerprint
print(json.dumps({name: [str(local_model_folder(name)), weights_fingerprint(name, None)] for name in sys.argv[1:]}))
"""


def _cache_holding_the_tiny_model(root, repo: str):
    """A Hugging Face cache (its documented layout) holding the embedded model under a hub id."""
    snapshot = root / f"models--{repo.replace('/', '--')}" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_path(), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    return snapshot


def test_a_hub_id_is_fingerprinted_in_its_cached_snapshot(tmp_path):
    snapshot = _cache_holding_the_tiny_model(tmp_path, "org/tiny")
    finished = subprocess.run([sys.executable, "-c", PROBE, "org/tiny", "org/absent"], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    found = json.loads(finished.stdout)
    assert found["org/tiny"] == [str(snapshot), weights_fingerprint(str(tiny_model_path()), None)]
    assert found["org/absent"] == ["None", None]
