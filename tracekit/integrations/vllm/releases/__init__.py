"""The vLLM release series tracekit supports: one module each, registered here.

A module defines `Release`, a subclass of `tracekit.integrations.vllm.release.Release` for its
series (a newer series may subclass the nearest older one). `SUPPORTED_SERIES` is derived from
the modules, and `release_for(version)` gives the support object of an installed version.
"""

import functools
import importlib

from tracekit.errors import CannotRunHere

# Oldest first.
RELEASE_MODULES = ("v0_26", "v0_32")


@functools.lru_cache(maxsize=None)
def _release_classes() -> dict[str, type]:
    classes = {}
    for name in RELEASE_MODULES:
        release = importlib.import_module(f"{__name__}.{name}").Release
        classes[release.series] = release
    return classes


SUPPORTED_SERIES = tuple(name.removeprefix("v").replace("_", ".") for name in RELEASE_MODULES)


def series_of(version: str) -> str:
    """`0.26.0+cu130` -> `0.26`."""
    return ".".join(version.split("+")[0].split(".")[:2])


@functools.lru_cache(maxsize=None)
def release_for(version: str):
    """The support object for vLLM `version`, or a refusal (exit 3) naming what is supported."""
    release = _release_classes().get(series_of(version))
    if release is None:
        raise CannotRunHere(
            f"vLLM {version} is not supported by this tracekit (supported: "
            f"{', '.join(series + '.x' for series in SUPPORTED_SERIES)})"
        )
    return release(version)
