"""The layout list at the top of `tracekit/__init__.py` names every package, in layer order."""

import re
from pathlib import Path

import tracekit

# The layered packages of tracekit.LAYERS, in layer order (models/, beside them, is listed after).
LAYERS = [name.split(".")[1] for layer in tracekit.LAYERS for name in layer
          if name != "tracekit.models" and (Path(tracekit.__file__).parent / name.split(".")[1] / "__init__.py").exists()]


def test_the_layout_list_names_every_package_in_layer_order():
    listed = re.findall(r"^  ([a-z_]+)/ ", tracekit.__doc__, re.MULTILINE)
    packages = {path.parent.name for path in Path(tracekit.__file__).parent.glob("*/__init__.py")}
    assert listed[:len(LAYERS)] == LAYERS
    assert sorted(listed) == sorted(packages), "a package is missing from the layout list, or a listed one is gone"
