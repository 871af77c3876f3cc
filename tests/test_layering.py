"""The house rules no review should have to enforce by eye:

* each layer of `tracekit.LAYERS` imports only from its own layer and those below, lazy imports
  (inside functions) included, and no module imports itself back through others (the release
  modules `releases/` loads with importlib included);
* vLLM is imported only inside `tracekit/integrations/vllm/`, and the vLLM attributes tracekit
  touches — listed by the release and adapter classes, vcrpy-style — are touched only there;
* `tracekit/replay/` reaches vLLM through one seam (`integrations/vllm/replay_engine.py`),
  `tracekit/record/` through another (`integrations/vllm/recording.py`), and
  neither it nor the environment fingerprint names a vLLM fact (an engine argument, a graph mode,
  a vLLM environment variable).
"""

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import tracekit

PACKAGE = Path(tracekit.__file__).parent
VLLM_INTEGRATION = PACKAGE / "integrations" / "vllm"


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _layer(module: str) -> int | None:
    found = None
    for index, names in enumerate(tracekit.LAYERS):
        if any(module == name or module.startswith(name + ".") for name in names):
            found = index
    return found


def _imports(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level] if not module.endswith("__init__") else module.split(".")
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names)
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = [str(path.relative_to(PACKAGE)) for path in SOURCES
                if path != PACKAGE / "__init__.py" and _layer(_module_name(path)) is None]
    assert not unplaced, f"modules in no layer of tracekit.LAYERS: {unplaced}"


def test_no_import_runs_up_the_layers():
    upward = []
    for path in SOURCES:
        module = _module_name(path)
        here = _layer(module)
        if here is None:
            continue
        for line, target in _imports(ast.parse(path.read_text()), module):
            there = _layer(target)
            if there is not None and there > here:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not upward, "imports that run up the layers:\n" + "\n".join(sorted(set(upward)))


def test_vllm_is_imported_only_by_its_integration():
    outside = []
    for path in SOURCES:
        if VLLM_INTEGRATION in path.parents:
            continue
        for line, target in _imports(ast.parse(path.read_text()), _module_name(path)):
            if target == "vllm" or target.startswith("vllm.") or target.startswith("vllm_ascend"):
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not outside, "\n".join(outside)


def _foreign_attributes() -> dict[str, str]:
    """Every vLLM attribute name the integration declares it touches, with who declares it."""
    from tracekit.integrations.vllm.engines import build as engine
    from tracekit.integrations.vllm.releases import release_classes

    declared = {name: "engine" for name in engine.FOREIGN_ATTRIBUTES}
    for release_class in release_classes().values():
        declared.update({name: release_class.__module__ for name in release_class.foreign_attributes})
        for adapter in release_class.adapters:
            declared.update({name: adapter.__name__ for name in adapter.foreign_attributes})
    return declared


# Names tracekit also gives its own things (a Step's requests, an ObservedStep's input ids, a
# handle's device, a bundle's engine config, ...): they may appear anywhere.
SHARED_NAMES = {
    "device", "model", "requests", "input_ids", "positions", "req_ids", "sampler", "seeds", "generator",
    "prompt_token_ids", "output_token_ids", "block_ids", "sampling_params", "num_scheduled_tokens", "gpu", "np",
    "dispatch", "shutdown", "get_output", "sampled_token_ids", "prefill_len", "worker", "kv_cache", "batch_descriptor",
    "req_id_to_index", "engine_core", "num_blocks", "block_size", "finished_req_ids", "add_request", "compilation_config",
    "mode", "cudagraph_mode", "num_reqs", "num_prompt_tokens", "num_tokens", "num_computed_tokens", "seed",
    # a step's grammar record and the feature named after it
    "grammar_bitmask", "num_acceptable_drafts", "structured_outputs",
    # every dict's values(), and vLLM 0.34's draft logits cache
    "values",
    # fields of the scheduler output's records (format/schema), named as vLLM names them
    "scheduled_new_reqs", "preempted_req_ids", "resumed_req_ids", "new_block_ids",
}


def _attribute_uses(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)  # getattr(obj, "name")
    return names


def test_declared_foreign_attributes_are_the_ones_the_integration_uses():
    used = set().union(*(_attribute_uses(path) for path in SOURCES if VLLM_INTEGRATION in path.parents))
    unused = sorted(name for name in _foreign_attributes() if name not in used)
    assert not unused, f"declared as touched but never used by the integration: {unused}"


def test_vllm_attributes_are_touched_only_by_its_integration():
    declared = _foreign_attributes()
    outside = []
    for path in SOURCES:
        if VLLM_INTEGRATION in path.parents:
            continue
        for name in sorted(_attribute_uses(path) & (declared.keys() - SHARED_NAMES)):
            outside.append(f"{path.relative_to(PACKAGE.parent)} uses {name} (declared by {declared[name]})")
    assert not outside, "vLLM attributes touched outside tracekit/integrations/vllm:\n" + "\n".join(outside)


def test_recorded_vllm_objects_are_read_by_attribute_outside_their_records():
    """vLLM's recorded objects (the scheduler output and its parts) and the request states are
    typed once, when a bundle is read (format/schema): outside the schema, and
    integrations/vllm/records/ and releases/, which convert them to and from vLLM's, nothing reads
    their fields, or vLLM's set and tuple tags, by string key from a plain map (`x["field"]`,
    `x.get("field")`). (`req_id`, `prompt_token_ids` and `structured_outputs` also key plain data
    that is no recorded object: a check's rows, a workload's lines and sampling settings; a
    request's `RunnerState` is a typed map.)"""
    from tracekit.format.schema import RecordedObject, RequestState, RunnerState
    from tracekit.format.typecheck import record_fields

    kinds = [RequestState, *RecordedObject.__subclasses__()]
    keys = {name for kind in kinds for name in record_fields(kind)} - {"req_id", "prompt_token_ids", "structured_outputs",
                                                                     *RunnerState.__annotations__}
    keys |= {"$set", "$tuple", "$items", "$type"}
    allowed = (VLLM_INTEGRATION / "records", VLLM_INTEGRATION / "releases")
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} reads {key!r}"
             for path in SOURCES if not any(folder in path.parents for folder in allowed)
             and path != PACKAGE / "format" / "schema.py"
             for node in ast.walk(ast.parse(path.read_text())) if (key := _string_key(node)) in keys]
    assert not found, "recorded vLLM objects read by string key:\n" + "\n".join(found)


def _string_key(node: ast.AST) -> str | None:
    """The constant string key a subscript, or a map's get/pop/setdefault, reads (None: none)."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        key = node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
            and node.func.attr in ("get", "pop", "setdefault"):
        key = node.args[0]
    else:
        return None
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def test_each_release_module_is_registered_under_its_series():
    import importlib

    from tracekit.integrations.vllm.releases import RELEASE_MODULES, SUPPORTED_SERIES, module_series

    found = sorted(path.stem for path in (VLLM_INTEGRATION / "releases").glob("v*.py"))
    assert found == sorted(RELEASE_MODULES), "a release module that is not registered (or the reverse)"
    for name in RELEASE_MODULES:
        series = importlib.import_module(f"tracekit.integrations.vllm.releases.{name}").Release.series
        assert series == module_series(name) and series in SUPPORTED_SERIES


MODULES = {_module_name(path): path for path in SOURCES}


def _module_of(target: str) -> str | None:
    """The tracekit module an import target names (`pkg.module.Name` -> `pkg.module`)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _imported_modules(module: str) -> set[str]:
    """The tracekit modules `module` imports, lazily too; `from pkg import submodule` imports the
    submodule (its package's `__init__` runs first anyway, without importing back)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom):
            (_, base), *names = _imports(ast.Module(body=[node], type_ignores=[]), module)
            submodules = [name for _, name in names if name in MODULES]
            targets = submodules if len(submodules) == len(names) else [base, *submodules]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in map(_module_of, targets) if name is not None and name != module)
    return found


def _import_graph() -> dict[str, set[str]]:
    """Every tracekit module's imports, with the release modules `releases/__init__` loads by name."""
    from tracekit.integrations.vllm import releases

    graph = {module: _imported_modules(module) for module in MODULES}
    graph[releases.__name__] |= {f"{releases.__name__}.{name}" for name in releases.RELEASE_MODULES}
    return graph


def test_no_module_imports_itself_back():
    graph = _import_graph()
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import loops:\n" + "\n".join(cycles)


# What `tracekit/replay/` and `tracekit/record/` may import from the integrations: each its one
# facade to vLLM, and the torch-free runner types both speak.
SEAMS = {
    "tracekit.replay": {"tracekit.integrations.vllm.replay_engine", "tracekit.integrations.seam"},
    "tracekit.record": {"tracekit.integrations.vllm.recording", "tracekit.integrations.seam"},
}


@pytest.mark.parametrize("package", sorted(SEAMS))
def test_a_layer_reaches_vllm_through_one_seam(package):
    graph = _import_graph()
    reached = sorted(
        f"{module} imports {target}" for module in graph if module.startswith(package)
        for target in graph[module] if target.startswith("tracekit.integrations") and target not in SEAMS[package]
    )
    assert not reached, f"{package.replace('.', '/')} reaches the integrations past its seam:\n" + "\n".join(reached)


def _vllm_vocabulary() -> set[str]:
    """Names only vLLM gives meaning to: the engine arguments and compilation fields every
    release records, the variable that picks its model runner, its graph runtime modes — less
    the names tracekit's own schema and replay options also use for their own things."""
    from tracekit.format import schema
    from tracekit.integrations.vllm.engines.lean_build import GRAPH_RUNTIME_MODES
    from tracekit.integrations.vllm.releases import RELEASE_MODULES, release_for
    from tracekit.replay.replayer import ReplayOptions

    vocabulary = set(GRAPH_RUNTIME_MODES) | {"compilation_config"}
    for module in RELEASE_MODULES:
        support = release_for(module.removeprefix("v").replace("_", ".") + ".0")
        vocabulary |= {setting.name for setting in support.settings} | set(support.compilation_fields)
        vocabulary.add(support.runner_variable)
    own = {item.name for item in dataclasses.fields(ReplayOptions)}
    for _, cls in inspect.getmembers(schema, dataclasses.is_dataclass):
        own |= {item.name for item in dataclasses.fields(cls)}
    return vocabulary - own


# A vLLM environment variable named in full (the bare family prefix `VLLM_` in the environment
# fingerprint's list of prefixes it records names no variable).
VLLM_VARIABLE = re.compile(r"\bVLLM_[A-Z0-9_]+")


def test_replay_and_the_environment_name_no_vllm_fact():
    vocabulary = _vllm_vocabulary()
    found = []
    for path in [*sorted((PACKAGE / "replay").rglob("*.py")), PACKAGE / "environment.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                continue
            if node.value in vocabulary or VLLM_VARIABLE.search(node.value):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.value[:60]!r}")
    assert not found, "vLLM facts outside tracekit/integrations/vllm:\n" + "\n".join(found)


def test_one_module_per_name():
    """Two modules of one name read alike at an import site and in a traceback; each name is one module's."""
    names: dict[str, list[str]] = {}
    for path in SOURCES:
        if path.name != "__init__.py":
            names.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1}
