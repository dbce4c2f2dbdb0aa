"""Value objectives (DESIGN §3): what the value head outputs per token, how those outputs become values and the loss
that trains them, chosen by name (`critic.vf_loss_type`) and built in one place, `objective_of`.

An objective is a module of this package named as its `vf_loss_type` (listed in `config/modes.py: VF_LOSS_TYPES`)
whose `build(config)` returns a `ValueObjective`; one defined elsewhere (a research script) is `register`ed instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import Tensor

from ppo_critic.config.critic import CriticConfig
from ppo_critic.config.modes import BUILT_IN_VF_LOSS_TYPES, VALUE_NORM_MODES, VF_LOSS_TYPES


class ValueObjective:
    """An objective: `outputs` per token from the head; `values` maps them into the model's output space (which
    `value_norm` de-normalises); `loss` is the clipped value loss with its clipped fraction."""

    outputs: int = 1
    """the head's outputs per token"""
    value_norms: tuple[str, ...] = VALUE_NORM_MODES
    """the `critic.value_norm` modes it works with"""
    identity: bool = True
    """whether a value is the head's one output, as PopArt and verl's engine (whose own loss is the squared error)
    assume (an HF export names its objective in its config either way: `ppo_critic_vf_loss_type`)"""

    def values(self, outputs: Tensor) -> Tensor:
        """Outputs [..., outputs] ([...] when there is one) → values [...]."""
        return outputs

    def check_returns(self, returns: Tensor, response_mask: Tensor) -> None:
        """Refuse returns [B, R] (at valid positions) the objective cannot model, before any step; any finite
        return by default."""

    def loss(
        self,
        outputs: Tensor,
        returns: Tensor,
        old_values: Tensor,
        response_mask: Tensor,
        cliprange_value: float | None,
        loss_agg_mode: str = "token-mean",
        **norm,
    ) -> tuple[Tensor, Tensor]:
        """(loss over the global denominators `norm` of `agg_loss`, clipped fraction) of outputs [b, R(, outputs)]
        against returns and old values [b, R], both in the model's output space."""
        raise NotImplementedError


Builder = Callable[[CriticConfig], ValueObjective]
_REGISTERED: dict[str, Builder] = {}


def register(name: str, build: Builder) -> None:
    """Make `critic.vf_loss_type=name` select `build(config)`: an objective defined outside this package, under a
    name of its own (a built-in name is refused: it would change what every run of this process trains)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register: the objective's name must be an identifier (a vf_loss_type), got {name!r}")
    if name in BUILT_IN_VF_LOSS_TYPES:
        raise ValueError(f"register: vf_loss_type={name!r} is built in; register your objective under another name")
    if not callable(build):
        raise TypeError(f"register: build must be a function of the critic config, got {type(build).__name__}")
    _REGISTERED[name] = build
    VF_LOSS_TYPES.setdefault(name, "registered at run time")


def objective_of(config: CriticConfig) -> ValueObjective:
    """The objective `config.vf_loss_type` names: a registered one, else the module of that name here; what a build
    returns is checked to be an objective whose head gives at least one output per token."""
    name = config.vf_loss_type
    if name not in VF_LOSS_TYPES:
        raise ValueError(f"vf_loss_type={name!r} is unknown; expected one of {tuple(VF_LOSS_TYPES)}")
    build = _REGISTERED.get(name) or importlib.import_module(f"{__name__}.{name}").build
    return _checked(name, build(config))


def check_saved(saved: object, config: CriticConfig, where: str) -> None:
    """A model saved with its objective's name (`ppo_critic_vf_loss_type` in an export's config.json) is read as that
    objective: another `vf_loss_type` would misread its head (bce's logits as values). Objectives whose one output is
    the value (mse, huber) read each other's models alike."""
    name = config.vf_loss_type
    if saved is None or saved == name or (_reads_values(saved) and _reads_values(name)):
        return
    raise ValueError(
        f"{where} holds a critic of vf_loss_type={saved!r} (ppo_critic_vf_loss_type in its config.json), whose "
        f"outputs vf_loss_type={name!r} would misread; set vf_loss_type={saved}"
    )


def _reads_values(name: object) -> bool:
    """Whether the built-in objective `name` gives one output per token, the value itself."""
    if name not in BUILT_IN_VF_LOSS_TYPES:
        return False
    objective = objective_of(CriticConfig(vf_loss_type=name))
    return objective.identity and objective.outputs == 1


def _checked(name: str, objective: object) -> ValueObjective:
    """`objective` when it is a `ValueObjective` of a positive integer number of outputs, else a one-line refusal
    naming the objective (0 outputs would train a NaN loss; None would fail deep in the update)."""
    if not isinstance(objective, ValueObjective):
        raise TypeError(
            f"vf_loss_type={name!r}: its build returned {type(objective).__name__}, not a ValueObjective; return one"
        )
    outputs = objective.outputs
    if isinstance(outputs, bool) or not isinstance(outputs, int) or outputs < 1:
        raise ValueError(
            f"vf_loss_type={name!r}: its objective has outputs={outputs!r}; a value head gives a positive integer "
            "number of outputs per token"
        )
    return objective
