"""The `Release` base holds the hooks a release series overrides and the defaults they share
(issue 48): each public method is overridden by a supported series, or named in the base's
docstring as a shared default; and no supported series' module sits outside `releases/`."""

import inspect
import re

from tracekit.integrations.vllm.releases import base, release_classes


def _public_methods(cls: type) -> list[str]:
    return [name for name, value in vars(cls).items()
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))]


def _overridden() -> set[str]:
    names: set[str] = set()
    for release in set(release_classes().values()):
        for cls in release.__mro__[:release.__mro__.index(base.Release)]:
            names |= set(vars(cls))
    return names


def test_every_public_method_of_the_base_is_overridden_or_named_as_a_shared_default():
    docstring = base.Release.__doc__ or ""
    shared = set(re.findall(r"`([a-z_]+)`", docstring.split("Shared defaults", 1)[-1]))
    overridden = _overridden()
    unaccounted = [name for name in _public_methods(base.Release) if name not in overridden and name not in shared]
    assert not unaccounted, (f"Release methods no series overrides and the docstring does not name as shared "
                             f"defaults: {unaccounted}")
    named_overridden = set(re.findall(r"`([a-z_]+)`", docstring.split("Shared defaults", 1)[0]))
    assert named_overridden <= overridden | {"tests"}, named_overridden - overridden
    stale = shared - set(_public_methods(base.Release))
    assert not stale, f"the docstring names methods the base no longer has: {sorted(stale)}"


def test_each_series_is_served_by_a_module_of_releases():
    for series, release in release_classes().items():
        assert release.__module__.startswith("tracekit.integrations.vllm.releases.v"), (series, release.__module__)
