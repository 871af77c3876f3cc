"""The command-line options of vLLM's engine, read from the installed vLLM's source without importing it.

`tracekit record` and `tracekit replay` pass every option they do not know to vLLM as an engine
argument. Importing vLLM to parse them costs seconds, so a typo (`--stpes 3`) would be found only
then, and without a suggestion. The options are instead read from `vllm/engine/arg_utils.py` as
text: the `EngineArgs` fields (each an option `--field-name`, and `--no-field-name` for a `bool` one)
and the option strings `EngineArgs.add_cli_args` declares (`-tp`, `-q`, ...). Nothing here
imports vLLM or torch; a vLLM this reader does not understand (no such file, no such class)
yields None, and vLLM's own parser judges the options later, as before.
"""

import ast
import functools
import importlib.util
from pathlib import Path

# The class whose fields are the engine arguments, in the module that defines it.
_ARGS_MODULE = Path("engine") / "arg_utils.py"
_ARGS_CLASS = "EngineArgs"
# vLLM's parser turns `-O3`, `-O.mode`, `-O=3` into `--optimization-level`: any option starting so is its.
_OPTIMIZATION_PREFIX = "-O"


@functools.cache
def engine_option_names() -> frozenset[str] | None:
    """Every option string vLLM's engine parser takes (`--max-model-len`, `-tp`, ...), or None
    where the installed vLLM cannot be read this way (absent, or laid out otherwise)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / _ARGS_MODULE
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    engine_args = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == _ARGS_CLASS), None)
    if engine_args is None:
        return None
    fields = {node.target.id: "bool" in ast.unparse(node.annotation).split(" | ") for node in engine_args.body
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
              and not node.target.id.startswith("_")}
    names = {f"--{name.replace('_', '-')}" for name in fields}
    names |= {f"--no-{name.replace('_', '-')}" for name, flag in fields.items() if flag}
    for node in ast.walk(engine_args):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names.update(argument.value for argument in node.args
                         if isinstance(argument, ast.Constant) and isinstance(argument.value, str)
                         and argument.value.startswith("-"))
    return frozenset(names)


def is_engine_option(token: str, names: frozenset[str]) -> bool:
    """Whether `token` (`--max-model-len`, `--max_model_len=8`, `--compilation-config.mode`,
    `-O3`, `--max-model` as argparse abbreviates) names one of the engine's options `names`."""
    if token.startswith(_OPTIMIZATION_PREFIX):
        return True
    name = token.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
    if name in names:
        return True
    return name.startswith("--") and any(option.startswith(name) for option in names if option.startswith("--"))
