"""Per-layer outputs of one forward of a vLLM model, through forward hooks on its modules.

They say where a replay parts (docs/GUIDE.md, "Which layer parts"). The hooks find the decoder
layers as the model's first `nn.ModuleList` of same-typed modules (how vLLM builds every
decoder-only model), and watch each layer, its direct children, and the layers' siblings
(embedding, final norm). Outputs are copied to host in the order the forward runs them; a module
that returns a tuple (vLLM's fused add-norm returns `(normed, residual)`) gives one entry per
tensor, `name[0]`, `name[1]`.

Hooks see modules only where the model runs eagerly: inside a `torch.compile`d forward they do
not fire, so callers run the forward eagerly (`ForwardHandle.forward("eager")`, or an engine
with `enforce_eager`). A hook never changes an output; if copying fails, capture stops and the
forward goes on untouched.
"""

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("tracekit.layers")


def watched_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module whose output is captured: decoder layers, each layer's
    direct children, and the modules beside the layer list (embedding, final norm)."""
    for parent_name, parent in model.named_modules():
        for list_name, layers in parent.named_children():
            if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
                continue
            if len({type(layer) for layer in layers}) != 1:
                continue
            prefix = f"{parent_name}." if parent_name else ""
            watched = []
            for sibling_name, sibling in parent.named_children():
                if sibling is not layers:
                    watched.append((f"{prefix}{sibling_name}", sibling))
            for index, layer in enumerate(layers):
                layer_name = f"{prefix}{list_name}.{index}"
                watched.append((layer_name, layer))
                watched.extend((f"{layer_name}.{child}", module) for child, module in layer.named_children())
            return watched
    return []


class LayerCapture:
    """`with LayerCapture(model) as capture: model forward` -> `capture.outputs`, name -> host
    tensor, in the order the modules returned."""

    def __init__(self, model: nn.Module):
        self.modules = watched_modules(model)
        self.outputs: dict[str, torch.Tensor] = {}
        self.failure: str | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> "LayerCapture":
        for name, module in self.modules:
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.failure is not None:
                return
            try:
                tensors = _tensors(output)
                if len(tensors) == 1:
                    self._keep(name, tensors[0])
                else:
                    for index, tensor in enumerate(tensors):
                        self._keep(f"{name}[{index}]", tensor)
            except Exception as error:  # never let capture change or stop the forward
                self.failure = f"{type(error).__name__}: {error}"
                logger.warning("tracekit: layer capture stopped at %s: %s", name, self.failure)

        return hook

    def _keep(self, name: str, tensor: torch.Tensor) -> None:
        # A module called twice in one forward (shared weights) keeps its first output.
        if name not in self.outputs:
            self.outputs[name] = tensor.detach().to("cpu", copy=True)


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [item for item in output if isinstance(item, torch.Tensor)]
    return []


def capture_eager_forward(model: nn.Module, handle: Any) -> LayerCapture:
    """Run the step's forward once more, eagerly, from the recorded state, capturing every layer."""
    handle.restore()
    with LayerCapture(model) as capture:
        handle.forward("eager")
    return capture
