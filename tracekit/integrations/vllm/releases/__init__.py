"""The vLLM release series tracekit supports: one module each, or an alias of one, registered here.

A module defines `Release`, a subclass of `tracekit.integrations.vllm.releases.base.Release` for its
series (a newer series may subclass the nearest older one). A series in which nothing tracekit
touches differs from a supported one is an alias of that one's module (`ALIASES`); the diff that
shows so (`tools/release_surface.py`) is in docs/RELEASES.md. `SUPPORTED_SERIES` is derived from
both, and `release_for(version)` gives the support object of an installed version.

  `base`       the `Release` base: the hooks a series overrides and the data they share
  `installed`  which vLLM is installed, and its release support
  `v0_26`, `v0_32`, `v0_34`  the series, one module each
"""

import functools
import importlib

from tracekit.errors import CannotRunHere
from tracekit.integrations.vllm.releases.base import series_of

# Oldest first.
RELEASE_MODULES = ("v0_26", "v0_32", "v0_34")
# Series -> the series whose module serves it (docs/RELEASES.md: what was diffed, and run).
ALIASES = {"0.27": "0.26", "0.28": "0.32", "0.29": "0.32", "0.30": "0.32", "0.31": "0.32", "0.33": "0.32"}


def module_series(name: str) -> str:
    """`v0_26` -> `0.26`."""
    return name.removeprefix("v").replace("_", ".")


SUPPORTED_SERIES = tuple(sorted({*map(module_series, RELEASE_MODULES), *ALIASES},
                                key=lambda series: tuple(map(int, series.split(".")))))


@functools.lru_cache(maxsize=None)
def release_classes() -> dict[str, type]:
    """Each series' `Release` class, aliases included (they share their module's class)."""
    classes = {}
    for name in RELEASE_MODULES:
        release = importlib.import_module(f"{__name__}.{name}").Release
        classes[release.series] = release
    for alias, series in ALIASES.items():
        classes[alias] = classes[series]
    return classes


@functools.lru_cache(maxsize=None)
def release_for(version: str):
    """The support object for vLLM `version`, or a refusal (exit 3) naming what is supported."""
    release = release_classes().get(series_of(version))
    if release is None:
        raise CannotRunHere(
            f"vLLM {version} is not supported by this tracekit (supported: "
            f"{', '.join(series + '.x' for series in SUPPORTED_SERIES)})"
        )
    return release(version)
