"""`critic.model.use_torch_compile`: `torch.compile` applied to each decoder layer in place.

Per layer rather than whole-model: one compiled graph serves every layer, the model's Python around the layers
(packing, the value head) stays eager, and FSDP2 can still shard the layers (compile before `fully_shard`, as
torchtitan does). Shapes are dynamic: packed micro-batches change length every call.
"""

from __future__ import annotations

from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the largest `ModuleList` named `layers` / `h` / `blocks`."""
    stacks = [
        m for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] in _NAMES
    ]
    if not stacks:
        raise ValueError(
            f"critic.model.use_torch_compile: no decoder-layer list ({'/'.join(_NAMES)}) found in "
            f"{type(model).__name__}; set use_torch_compile=false for this architecture"
        )
    return max(stacks, key=len)


def compile_decoder_layers(model: nn.Module) -> int:
    """Compile every decoder layer in place (parameter names and state-dict keys stay as they are); the count."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


_NAMES = ("layers", "h", "blocks")
