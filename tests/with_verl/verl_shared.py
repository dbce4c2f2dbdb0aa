"""What both verl suites share (tests/with_verl/run.sh runs each in its own environment): a tiny critic on disk,
verl's own config composed by hydra, one gloo process, rollout batches in verl's layout, parameter comparisons."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
import verl  # the suites run against the real verl: a missing one is an error, never a skip
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from tensordict import TensorDict
from verl import DataProto

VERL_CONFIG_DIR = Path(verl.__file__).resolve().parent / "trainer" / "config"
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
VOCAB = 128
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def save_tiny_critic(path: Path) -> Path:
    """The examples' tiny random critic (Qwen2 token classification + a word-level tokenizer) in `path`."""
    spec = importlib.util.spec_from_file_location("verl_common", EXAMPLES / "verl_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_critic_dir(path, VOCAB)


def composed(overrides: list[str], config_name: str = "ppo_trainer") -> DictConfig:
    """verl's own trainer config, composed by hydra from the yaml files verl ships, with `overrides`."""
    with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def hydra_value(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def init_single_process() -> None:
    """torch.distributed with one gloo rank, and the environment verl's `Worker` reads."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")


def rollout(batch_size: int, prompt_len: int = 6, response_len: int = 5, seed: int = 0, meta=None) -> DataProto:
    """A rollout batch as verl's trainer builds it: left-padded prompts, right-padded responses (every row has at
    least one prompt and one response token), position ids, response mask, old values and returns."""
    g = torch.Generator().manual_seed(seed)
    t = prompt_len + response_len
    input_ids = torch.randint(3, VOCAB, (batch_size, t), generator=g)
    attention_mask = torch.ones(batch_size, t, dtype=torch.long)
    for i in range(batch_size):
        attention_mask[i, : int(torch.randint(0, prompt_len, (1,), generator=g))] = 0
        attention_mask[i, prompt_len + int(torch.randint(1, response_len + 1, (1,), generator=g)) :] = 0
    tensors = {
        "prompts": input_ids[:, :prompt_len],
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, -response_len:],
        "response_mask": attention_mask[:, -response_len:].float(),
        "values": torch.randn(batch_size, response_len, generator=g) * 0.5,
        "returns": torch.randn(batch_size, response_len, generator=g),
    }
    info = {"global_token_num": attention_mask.sum(-1).tolist(), **(meta or {})}
    return DataProto(batch=TensorDict(tensors, batch_size=[batch_size]), meta_info=info)


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters of a plain or FSDP2 module, as CPU copies."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def rel_change(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    """|Δa − Δb| / |Δb| over all parameters: how far one update is from another, from the same start."""
    da = torch.cat([(a[k] - before[k]).flatten().double() for k in before])
    db = torch.cat([(b[k] - before[k]).flatten().double() for k in before])
    return float((da - db).norm() / db.norm())


def run_example(name: str, runs: str) -> list[str]:
    """`examples/<name> --steps 3` in a fresh process: it must say that verl runs `runs` (the critic or engine class),
    print verl's metrics at steps 1 and 3 and end with the explained variance of the true values; its lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(29600 + os.getpid() % 300)}
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--steps", "3"], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()  # verl prints lines of its own in between
    assert any(line.endswith(f" runs {runs}") for line in lines), lines
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 1", "step 3"]
    assert lines[-1].startswith("explained variance of the true values on 256 held-out rollouts: ")
    return steps
