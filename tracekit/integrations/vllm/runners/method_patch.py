"""Shadowing a vLLM object's methods for the length of an armed session.

An instance attribute shadows the class method of the same name, for that one object only (the
technique vLLM's own forward bench uses on its runner). Removing the attribute restores the
original exactly; nothing about the class, or any other engine in the process, changes.

Calling an object (`runner.model(**inputs)`) looks `__call__` up on its type, never on the
instance, so `call_shadowed` gives that one object a subclass of its own type for the block
(same name, same attributes, `isinstance` unchanged) and puts the original type back after.
"""

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

logger = logging.getLogger("tracekit")


@contextmanager
def shadowed(obj: Any, wrappers: dict[str, Callable[[Callable], Callable]]) -> Iterator[None]:
    """Within the block, `obj.name(...)` calls `wrapper(original)(...)` for each name."""
    installed = []
    try:
        for name, make_wrapper in wrappers.items():
            if name in vars(obj):
                raise RuntimeError(f"{type(obj).__name__}.{name} is already shadowed (armed twice?)")
            setattr(obj, name, make_wrapper(getattr(obj, name)))
            installed.append(name)
        yield
    finally:
        for name in installed:
            delattr(obj, name)


@contextmanager
def call_shadowed(obj: Any, make_wrapper: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within the block, `obj(...)` calls `make_wrapper(original)(...)`, where `original(...)`
    is the call as it was."""
    original_type = type(obj)
    if getattr(original_type, "__tracekit_call_shadow__", False):
        raise RuntimeError(f"calls of {original_type.__name__} are already shadowed (armed twice?)")
    original_call = original_type.__call__
    wrapped = make_wrapper(lambda *args, **kwargs: original_call(obj, *args, **kwargs))

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    shadow_type = type(original_type.__name__, (original_type,), {
        "__call__": __call__, "__tracekit_call_shadow__": True, "__module__": original_type.__module__,
        "__qualname__": original_type.__qualname__,
    })
    obj.__class__ = shadow_type
    try:
        yield
    finally:
        obj.__class__ = original_type


@contextmanager
def class_calls_before(cls: type, name: str, hook: Callable[[Any], None]) -> Iterator[None]:
    """Within the block, every `instance.name(...)` of `cls` first runs `hook(instance)`; a
    method `cls` does not define itself is left alone. For objects built inside the block (an
    engine's runner), which have no instance to shadow yet; a failing hook fails the call."""
    original = vars(cls).get(name)
    if original is None:
        yield
        return

    def with_hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        hook(self)
        return original(self, *args, **kwargs)

    setattr(cls, name, with_hook)
    try:
        yield
    finally:
        setattr(cls, name, original)


def call_after(cls: type, name: str, hook: Callable[[Any], None]) -> None:
    """Make every later `instance.name(...)` of `cls` (and subclasses that call it) run
    `hook(instance)` once the original returns. Used by the vLLM plugin, which has no runner
    instance to shadow until vLLM builds one inside its engine process."""
    original = getattr(cls, name)
    if getattr(original, "__tracekit_hooked__", False):
        return

    def with_hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            hook(self)
        except Exception as error:  # the hook is tracekit's: it must never stop the engine
            logger.error("tracekit: %s.%s hook failed: %s: %s", cls.__name__, name, type(error).__name__, error)
        return result

    with_hook.__tracekit_hooked__ = True  # type: ignore[attr-defined]
    with_hook.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, name, with_hook)
