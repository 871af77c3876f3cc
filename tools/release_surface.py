"""`python tools/release_surface.py OLD_VLLM_DIR NEW_VLLM_DIR`: what changed, between two vLLM
releases, in the vLLM code tracekit touches — read from their sources, without importing them.

A source tree is a `vllm/` folder: `site-packages/vllm` of an install, or a wheel unpacked
(`pip download vllm==X --no-deps`, unzip). For every vLLM class tracekit builds, reads or shadows
(`SURFACE`) it lists each field (its annotation, whether it has a default), each method's
signature, and each instance attribute a method assigns, keeping only the names tracekit touches
(every `foreign_attributes` of the integration, plus `EXTRA_NAMES`) except for the classes a
replay rebuilds field by field, whose every field counts. Then it prints a unified diff of the two
listings: an empty diff means nothing tracekit touches moved (behaviour inside a method may still
have: read those methods too). `--list DIR` prints one release's listing. docs/RELEASES.md records
what this printed for each pair of releases.
"""

import ast
import difflib
import sys
from pathlib import Path

ALL_FIELDS = "all fields"  # a class a replay rebuilds from plain data: every field counts
TOUCHED = "touched names"  # only the names tracekit touches

# vLLM source file (under vllm/) -> classes tracekit touches there, and how much of each counts.
SURFACE: dict[str, dict[str, str]] = {
    "v1/core/sched/output.py": {
        "SchedulerOutput": ALL_FIELDS, "NewRequestData": ALL_FIELDS, "CachedRequestData": ALL_FIELDS,
        "GrammarOutput": ALL_FIELDS, "ScheduledEncoderInputStats": ALL_FIELDS,
    },
    "sampling_params.py": {"SamplingParams": ALL_FIELDS, "StructuredOutputsParams": ALL_FIELDS,
                           "RequestOutputKind": ALL_FIELDS, "SamplingType": ALL_FIELDS},
    "forward_context.py": {"BatchDescriptor": ALL_FIELDS, "ForwardContext": TOUCHED},
    "v1/outputs.py": {"ModelRunnerOutput": TOUCHED, "AsyncModelRunnerOutput": TOUCHED},
    "v1/worker/gpu_model_runner.py": {"GPUModelRunner": TOUCHED, "ExecuteModelState": TOUCHED},
    "v1/worker/cpu_model_runner.py": {"CPUModelRunner": TOUCHED},
    "v1/worker/gpu_input_batch.py": {"InputBatch": TOUCHED, "CachedRequestState": ALL_FIELDS},
    "v1/cudagraph_dispatcher.py": {"CudagraphDispatcher": TOUCHED},
    "v1/worker/gpu/model_runner.py": {"GPUModelRunner": TOUCHED, "ExecuteModelState": TOUCHED},
    "v1/worker/cpu/model_runner.py": {"CPUModelRunner": TOUCHED},
    "v1/worker/gpu/states.py": {"RequestState": TOUCHED},
    "v1/worker/gpu/input_batch.py": {"InputBatch": TOUCHED, "InputBuffers": TOUCHED},
    "v1/worker/gpu/block_table.py": {"BlockTables": TOUCHED},
    "v1/worker/gpu/buffer_utils.py": {"UvaBackedTensor": TOUCHED},
    "v1/worker/gpu/cudagraph_utils.py": {"CudaGraphManager": TOUCHED, "ModelCudaGraphManager": TOUCHED,
                                         "BatchExecutionDescriptor": ALL_FIELDS},
    "v1/worker/gpu/sample/sampler.py": {"Sampler": TOUCHED},
    "v1/worker/gpu/sample/states.py": {"SamplingStates": TOUCHED},
    "v1/worker/gpu/model_states/interface.py": {"ModelState": TOUCHED},
    "v1/worker/gpu/model_states/default.py": {"DefaultModelState": TOUCHED},
    "v1/worker/gpu_worker.py": {"Worker": TOUCHED},
    "v1/worker/cpu_worker.py": {"CPUWorker": TOUCHED},
    "v1/kv_cache_interface.py": {"KVCacheConfig": TOUCHED, "KVCacheGroupSpec": TOUCHED},
    "config/model.py": {"ModelConfig": TOUCHED},
    "config/cache.py": {"CacheConfig": TOUCHED},
    "config/scheduler.py": {"SchedulerConfig": TOUCHED},
    "config/parallel.py": {"ParallelConfig": TOUCHED},
    "config/load.py": {"LoadConfig": TOUCHED},
    "config/attention.py": {"AttentionConfig": TOUCHED},
    "config/compilation.py": {"CompilationConfig": TOUCHED, "CompilationMode": ALL_FIELDS, "CUDAGraphMode": ALL_FIELDS},
    "config/vllm.py": {"VllmConfig": TOUCHED},
    "engine/arg_utils.py": {"EngineArgs": TOUCHED},
    "triton_utils/importing.py": {},
}
# Names tracekit reaches that are not attributes of a runner object (engine arguments a setting
# is recorded under, module-level functions, private class tables).
EXTRA_NAMES = {
    "get_forward_context", "is_forward_context_available", "set_forward_context", "HAS_TRITON",
    "_attention_ops", "static_forward_context", "kv_cache_groups", "layer_names", "kv_cache_spec", "__init__",
    "update_requests", "add_requests", "finish_requests", "make_empty", "max_num_batched_tokens",
    "async_scheduling", "enable_prefix_caching", "model", "tokenizer", "hf_overrides", "dtype", "seed",
    "max_model_len", "enforce_eager", "trust_remote_code", "quantization", "logprobs_mode", "max_logprobs",
    "disable_cascade_attn", "disable_sliding_window", "use_fp64_gumbel", "load_format", "cache_dtype",
    "kv_cache_memory_bytes", "num_gpu_blocks", "num_gpu_blocks_override", "kv_sharing_fast_prefill",
    "calculate_kv_scales", "max_num_seqs", "enable_chunked_prefill", "backend", "tensor_parallel_size",
    "pipeline_parallel_size", "enable_expert_parallel", "disable_custom_all_reduce", "custom_ops",
    "splitting_ops", "compile_sizes", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
    "cudagraph_num_of_warmups", "use_inductor_graph_partition", "compile_ranges_endpoints",
    "block_size", "kv_cache_dtype", "attention_backend", "is_padding",
}


def touched_names() -> set[str]:
    """Every vLLM name the integration declares it touches, plus `EXTRA_NAMES`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tracekit.integrations.vllm.engines import build as engine
    from tracekit.integrations.vllm.releases import base as release
    from tracekit.integrations.vllm.releases import release_classes

    names = set(EXTRA_NAMES) | set(engine.FOREIGN_ATTRIBUTES) | set(release.Release.foreign_attributes)
    for release_class in release_classes().values():
        names |= set(release_class.foreign_attributes)
        for adapter in release_class.adapters:
            names |= set(adapter.foreign_attributes)
    return names


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return f"def {node.name}({ast.unparse(node.args)})"


def _class_listing(node: ast.ClassDef, how: str, names: set[str]) -> list[str]:
    bases = ", ".join(ast.unparse(base) for base in node.bases)
    lines = [f"class {node.name}({bases})"]
    keep = (lambda name: True) if how == ALL_FIELDS else (lambda name: name in names)
    fields: set[str] = set()
    assigned: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and keep(item.target.id):
            default = " = ..." if item.value is not None else ""
            fields.add(item.target.id)
            lines.append(f"    {item.target.id}: {ast.unparse(item.annotation)}{default}")
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name) and keep(target.id):
                    lines.append(f"    {target.id} = {ast.unparse(item.value)[:80]}")
        elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if item.name in names:
                lines.append(f"    {_signature(item)}")
            for inner in ast.walk(item):
                target = inner.target if isinstance(inner, ast.AnnAssign) else None
                targets = inner.targets if isinstance(inner, ast.Assign) else [target] if target is not None else []
                for each in targets:
                    if (isinstance(each, ast.Attribute) and isinstance(each.value, ast.Name)
                            and each.value.id == "self" and each.attr in names):
                        assigned.add(each.attr)
    lines.extend(f"    self.{name}" for name in sorted(assigned - fields))
    return lines


def listing(root: Path, names: set[str]) -> list[str]:
    """The surface of the vLLM source tree `root` (its `vllm/` folder), one line per item."""
    lines = []
    for relative, classes in SURFACE.items():
        path = root / relative
        if not path.is_file():
            lines.append(f"{relative}: absent")
            continue
        tree = ast.parse(path.read_text())
        found = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        lines.append(f"{relative}:")
        for name, how in classes.items():
            if name not in found:
                lines.append(f"  class {name}: absent")
                continue
            lines.extend("  " + line for line in _class_listing(found[name], how, names))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
                lines.append(f"  {_signature(node)}")
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id in names:
                        lines.append(f"  {target.id} = {ast.unparse(node.value)[:80]}")
    return lines


def main(argv: list[str]) -> int:
    names = touched_names()
    if len(argv) == 2 and argv[0] == "--list":
        print("\n".join(listing(Path(argv[1]), names)))
        return 0
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    old, new = (Path(arg) for arg in argv)
    diff = difflib.unified_diff(listing(old, names), listing(new, names), str(old), str(new), lineterm="", n=1)
    print("\n".join(diff))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
