"""LoRA critics (peft): low-rank adapters on the backbone's linear layers, the value head trained in full.

`apply_lora` wraps a value model in a `peft.PeftModel`; only the adapters and the value head require grad.
`merged_model` folds the adapters into the base weights, for an HF export that loads without peft.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ppo_critic.models.hf import find_value_head


def _peft():
    try:
        import peft
    except ImportError as err:
        raise ImportError(
            "model.lora_rank > 0 needs peft: pip install 'ppo-critic[lora]' (or pip install 'peft>=0.13')"
        ) from err
    return peft


def apply_lora(model: nn.Module, rank: int, alpha: float, target_modules: Any = "all-linear") -> nn.Module:
    """`model` with rank-`rank` LoRA adapters (scale `alpha / rank`, no dropout) on `target_modules` — module
    names or name suffixes as peft takes them, or `all-linear`: every `nn.Linear` except the value head. Every
    base weight is frozen; the value head stays fully trainable (it is new to the model, so it cannot be low-rank)."""
    peft = _peft()
    parent, name = find_value_head(model)
    head = getattr(parent, name)
    head_names = [n for n, m in model.named_modules() if m is head]
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]
    if target_modules == "all-linear":
        targets: Any = linear
    else:
        targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        hits = [t for t in targets for h in head_names if h == t or h.endswith("." + t)]
        if hits:
            raise ValueError(
                f"model.target_modules={target_modules!r} includes the value head ({head_names[0]}); the head is "
                "always trained in full, leave it out"
            )
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    wrapped = peft.get_peft_model(model, config)
    head.requires_grad_(True)
    return wrapped


def merged_model(lora_model: nn.Module) -> nn.Module:
    """The plain model with every adapter folded into its base weight (`W + (alpha/r)·B·A`); `lora_model` must be
    an unwrapped peft model that may be consumed (merging happens in place)."""
    return lora_model.merge_and_unload()
