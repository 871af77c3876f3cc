"""The layout list at the top of `tracekit/__init__.py` names every package, in layer order, and
each package's docstring names every module of its folder."""

import importlib
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


# The packages whose docstring is their table of contents.
DOCUMENTED_PACKAGES = ("format", "graphs", "integrations", "integrations/vllm", "integrations/vllm/engines",
                       "integrations/vllm/records", "integrations/vllm/releases", "integrations/vllm/runners",
                       "record", "replay", "share")


def test_each_package_docstring_names_every_module_of_its_folder():
    root = Path(tracekit.__file__).parent
    unnamed = []
    for package in DOCUMENTED_PACKAGES:
        folder = root / package
        docstring = importlib.import_module("tracekit." + package.replace("/", ".")).__doc__ or ""
        unnamed += [f"tracekit/{package}/{module.name}" for module in sorted(folder.glob("*.py"))
                    if module.stem != "__init__" and f"`{module.stem}`" not in docstring]
    assert not unnamed, f"a package docstring does not name {unnamed}: say in one phrase what each is for"
