"""Critic-quality options: LoRA critics, offload settings, the Huber loss through the critic, PPO epochs with
shuffling, and the built-in trainer's critic warmup."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import bench_script, exported_values, make_batch, tiny_config
from cuda_contract import FSDP2_POINTS, ContractError, check_collective_devices
from ppo_critic import CriticConfig, DataParallelPPOCritic
from ppo_critic.parallel.mesh import BACKEND_CUDA
from ppo_critic.worker import CriticWorker, worker_config

LORA = {
    "strategy": "none",
    "ppo_mini_batch_size": 8,
    "cliprange_value": None,
    "model": {"override_config": tiny_config("qwen2"), "value_head_init": "normal:0.3", "lora_rank": 4},
    "optim": {"lr": 1e-2},
}


def lora_config(**model):
    cfg = copy.deepcopy(LORA)
    cfg["model"].update(model)
    return cfg


def trained(worker, seeds=(0, 1)):
    for seed in seeds:
        batch = make_batch(8, 6, 5, seed=seed)
        batch["values"] = worker.compute_values(batch)
        worker.update_critic(batch)
    return worker


def expected_lora_parameters(rank, names=None):
    """rank × (in + out) per adapted Linear of the plain model, plus the value head's weight and bias."""
    from ppo_critic import build_value_model

    plain = build_value_model(tiny_config("qwen2"))
    count = 0
    for name, module in plain.named_modules():
        if isinstance(module, nn.Linear) and name != "score" and (names is None or name.rsplit(".", 1)[-1] in names):
            count += rank * (module.in_features + module.out_features)
    return count + plain.score.weight.numel() + plain.score.bias.numel()


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_lora_trains_only_the_adapters_and_the_value_head(targets):
    worker = CriticWorker(lora_config(target_modules=targets), device="cpu")
    trainable = {n: p for n, p in worker.model.named_parameters() if p.requires_grad}
    names = None if targets == "all-linear" else set(targets)
    assert sum(p.numel() for p in trainable.values()) == expected_lora_parameters(4, names)
    assert all("lora_" in n or n.endswith(("score.weight", "score.bias")) for n in trainable)
    optimized = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trainable.values()}
    frozen = {n: p.detach().clone() for n, p in worker.model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    trained(worker)
    after = dict(worker.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in frozen.items())
    assert all(not torch.equal(after[n], p) for n, p in before.items() if "lora_B" in n or "score" in n)


def test_lora_checkpoint_resumes_and_the_merged_export_gives_the_same_values(tmp_path):
    from safetensors.torch import load_file

    worker = trained(CriticWorker(LORA, device="cpu"))
    path = worker.save_checkpoint(tmp_path / "ckpt")
    resumed = CriticWorker(LORA, device="cpu", seed=1)
    resumed.load_checkpoint(path)
    batch = make_batch(8, 6, 5, seed=9)
    values = worker.compute_values(batch)
    assert torch.equal(resumed.compute_values(batch), values)

    worker.export_hf(tmp_path / "hf")
    assert torch.equal(worker.compute_values(batch), values)  # exporting did not touch the live critic
    assert not any("lora" in k for k in load_file(tmp_path / "hf" / "model.safetensors"))
    got = exported_values(tmp_path / "hf", batch)
    # merged W + B·A·scale (one float32 rounding per weight) through the HF padded forward vs the adapters applied
    # on the fly: other roundings, other sum orders (conftest.FP32_REORDERED; measured 2.6e-6)
    torch.testing.assert_close(got, values, rtol=1e-5, atol=1e-5)


def test_lora_with_gradient_checkpointing_still_trains_the_adapters():
    worker = CriticWorker(lora_config(enable_gradient_checkpointing=True), device="cpu")
    b_before = {n: p.detach().clone() for n, p in worker.model.named_parameters() if "lora_B" in n}
    trained(worker, seeds=(0,))
    params = dict(worker.model.named_parameters())
    assert all(params[n].abs().sum() > 0 and not torch.equal(params[n], p) for n, p in b_before.items())


def test_lora_settings_that_cannot_work_are_explained():
    with pytest.raises(ValueError, match="includes the value head"):
        CriticWorker(lora_config(target_modules=["q_proj", "score"]), device="cpu")
    for strategy, message in [("megatron", "not supported with strategy=megatron"), ("fsdp", "strategy=fsdp")]:
        with pytest.raises(ValueError, match=message):
            worker_config({"strategy": strategy, "model": {"lora_rank": 8}})
    with pytest.raises(ValueError, match="lora_alpha=0 must be a positive number"):
        worker_config({"model": {"lora_rank": 8, "lora_alpha": 0}})


# --- offload ---


def test_offload_settings_are_checked():
    with pytest.raises(ValueError, match=r"fsdp_config.offload_policy=true needs strategy=fsdp2"):
        worker_config({"strategy": "ddp", "model": {"fsdp_config": {"offload_policy": True}}})
    with pytest.raises(ValueError, match=r"fsdp_config.param_offload=true is not supported with strategy=fsdp;"):
        worker_config({"strategy": "fsdp", "model": {"fsdp_config": {"param_offload": True}}})
    with pytest.raises(ValueError, match=r"param_offload='yes' must be true or false"):
        worker_config({"model": {"fsdp_config": {"param_offload": "yes"}}})
    with pytest.raises(ValueError, match=r"enable_activation_offload=true is not supported.*gradient_checkpointing"):
        worker_config({"model": {"enable_activation_offload": True}})


def test_offload_policy_on_a_cpu_run_names_the_key():
    cfg = {**LORA, "strategy": "fsdp2", "model": {"override_config": tiny_config("qwen2")}}
    cfg["model"]["fsdp_config"] = {"offload_policy": True}
    with pytest.raises(ValueError, match=r"critic.model.fsdp_config.offload_policy=true needs strategy=fsdp2 on CUDA"):
        CriticWorker(cfg, device="cpu")


def one_rank_group(backend: str) -> None:
    """A one-rank process group of `backend` on this machine."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def fsdp2_config(**fsdp_config) -> dict:
    return {**LORA, "strategy": "fsdp2", "model": {"override_config": tiny_config("qwen2"), "fsdp_config": fsdp_config}}


@pytest.mark.cuda
def test_fsdp2_cpu_offload_trains_on_cuda(monkeypatch):
    """`offload_policy` (FSDP2's CPUOffloadPolicy) under a one-rank group as ppo-critic starts one (NCCL + gloo for
    the CPU gradients): parameters (and so optimizer state) live on the CPU, the update still learns."""
    import torch.distributed as dist

    one_rank_group(BACKEND_CUDA)
    try:
        checked = check_collective_devices(monkeypatch)
        worker = CriticWorker(fsdp2_config(offload_policy=True), device="cuda")
        assert all(p.to_local().device.type == "cpu" for p in worker.model.parameters())
        batch = make_batch(8, 6, 5, seed=0)
        batch["returns"] = torch.ones(8, 5)
        first = None
        for _ in range(5):
            batch["values"] = worker.compute_values(batch)
            loss = worker.update_critic(batch)["critic/vf_loss"]
            first = loss if first is None else first
        assert loss < first
        assert all(s.device.type == "cpu" for st in worker.optimizer.state.values() for s in st.values() if s.dim())
        # one rank issues no collective: FSDP2's would-be ones are checked where it skips them (DESIGN §8)
        assert set(checked) >= FSDP2_POINTS
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["gloo", "cuda:gloo"])
def test_fsdp2_at_one_rank_has_the_tensors_it_would_hand_its_backend_checked(monkeypatch, backend):
    """The CPU side of the test above: at one rank FSDP2 issues no collective, yet `check_collective_devices` checks
    each all-gather and reduce-scatter it skips, and refuses CPU tensors under a group with no CPU backend (gloo
    standing in for NCCL, for CUDA only), which a second rank would meet."""
    import torch.distributed as dist

    one_rank_group(backend)
    try:
        checked = check_collective_devices(monkeypatch)
        worker = CriticWorker(fsdp2_config(), device="cpu")
        batch = make_batch(8, 6, 5, seed=0)
        if backend == "cuda:gloo":
            with pytest.raises(ContractError, match=r"fsdp2_unshard was handed tensors on \['cpu'\]"):
                worker.compute_values(batch)
            return
        batch["values"] = worker.compute_values(batch)
        worker.update_critic(batch)
        groups = len(worker.model.model.layers) + 1  # fully_shard per decoder layer, then the root
        assert checked["fsdp2_foreach_reduce"] == groups and checked["fsdp2_unshard"] >= 2 * groups
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_fsdp2_cpu_offload_under_an_nccl_only_group_is_our_error():
    """A group someone else started with NCCL alone cannot reduce the CPU gradients: said before anything runs."""
    import torch.distributed as dist

    one_rank_group("nccl")
    try:
        with pytest.raises(ValueError, match="offload_policy=true needs a CPU backend in the process group"):
            CriticWorker(fsdp2_config(offload_policy=True), device="cuda")
    finally:
        dist.destroy_process_group()


# --- the Huber loss and PPO epochs through the critic ---


def test_the_critic_uses_the_huber_loss_when_asked(tiny_qwen2):
    batch = make_batch(8, 6, 5, seed=3)
    batch["returns"] = batch["returns"] * 5  # errors beyond δ
    losses = {}
    for loss_type in ("mse", "huber"):
        model = tiny_qwen2()
        cfg = {"ppo_mini_batch_size": 8, "cliprange_value": None, "vf_loss_type": loss_type, "huber_delta": 0.5}
        critic = DataParallelPPOCritic(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0))
        batch["values"] = critic.compute_values(batch)
        losses[loss_type] = critic.update_critic(batch)["critic/vf_loss"]
    mask = batch["attention_mask"][:, -5:].bool()
    err = (batch["values"] - batch["returns"])[mask].abs().double()
    huber = torch.where(err <= 0.5, 0.5 * err**2, 0.5 * (err - 0.25)).mean().item()
    # float32 in the critic, float64 here, over the same ~30 tokens: conftest.FP32_REORDERED
    assert losses["huber"] == pytest.approx(huber, rel=1e-5)
    assert losses["mse"] == pytest.approx(0.5 * (err**2).mean().item(), rel=1e-5)


def test_ppo_epochs_reshuffle_every_epoch_deterministically(tiny_qwen2):
    """Rows are tagged by their first token id; each epoch sees a new permutation, the same one for the same seed."""

    def orders(seed):
        model = tiny_qwen2()
        cfg = {"ppo_mini_batch_size": 4, "ppo_epochs": 3, "shuffle": True, "data_loader_seed": seed}
        critic = DataParallelPPOCritic(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0))
        seen = []
        original = critic._train_mini_batch
        critic._train_mini_batch = lambda mini, *a: (seen.append(mini["input_ids"][:, 0].tolist()), original(mini, *a))
        batch = make_batch(16, 6, 5, seed=4)
        batch["input_ids"][:, 0] = torch.arange(16)
        critic.update_critic(batch)
        return [[row for mini in seen[i : i + 4] for row in mini] for i in range(0, len(seen), 4)]  # 4 per epoch

    epochs = orders(seed=11)
    assert len(epochs) == 3 and all(sorted(e) == list(range(16)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != list(range(16))
    assert orders(seed=11) == epochs and orders(seed=12) != epochs


def test_megatron_names_the_quality_options_it_does_not_support():
    cfg = {"strategy": "megatron", "model": {"lora_rank": 4, "value_head_dtype": "bfloat16"}}
    with pytest.raises(ValueError) as info:
        worker_config(cfg)
    text = str(info.value)
    assert "lora_rank > 0 (LoRA) is not supported with strategy=megatron" in text
    assert "the megatron value head is always float32" in text
    # backend-independent, or what megatron does anyway (PopArt: tests/distributed/test_megatron.py)
    worker_config({"strategy": "megatron", "vf_loss_type": "huber", "value_norm": "running"})
    worker_config({"strategy": "megatron", "value_norm": "popart", "ema_decay": 0.9})
    worker_config({"strategy": "megatron", "model": {"value_head_dtype": "float32"}})


def _ablation():
    return bench_script("ablation.py")


def test_the_ablation_script_runs_configurations_and_tabulates_them():
    """bench/ablation.py end to end on a tiny budget: an EV curve per run, a row per configuration, the summary."""
    ablation = _ablation()
    tiny = ["trainer.rollout_batch_size=8", "trainer.eval_size=16", "critic.ppo_mini_batch_size=4"]
    tiny += ["critic.ppo_micro_batch_size_per_gpu=4", "critic.model.override_config.hidden_size=32"]
    default = ablation.DEFAULT  # the configuration of ppo-critic train's defaults
    names = ("verl_lr1e-3", "verl_lr3e-3", default)
    runs = {
        name: [ablation.run_one(name, [*ablation.overrides_of(name, "dense"), *tiny], seed=0, steps=4, eval_every=2)]
        for name in names
    }
    assert all([s for s, _, _ in r[0]["curve"]] == [2, 4] for r in runs.values())
    assert all(r[0]["best_ev"] == max(ev for _, ev, _ in r[0]["curve"]) for r in runs.values())
    # a made-up outcome: verl at 3e-3 reaches 0.95 at 4, the default at 2 -> 0.5, the bar met
    runs["verl_lr3e-3"][0]["curve"] = [(2, 0.5, 1.0), (4, 0.96, 2.0)]
    runs[default][0]["curve"] = [(2, 0.97, 1.0), (4, 0.99, 2.0)]
    runs[default][0]["best_ev"], runs["verl_lr3e-3"][0]["best_ev"] = 0.99, 0.96
    assert ablation.verl_best(runs) == "verl_lr3e-3"
    rows = ablation.task_table("dense", runs, {default: 0.5}).splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [
        "| verl_lr1e-3",
        "| **verl_lr3e-3** (verl-best)",
        f"| **{default}**",
    ]
    assert rows[2].startswith(f"| **{default}** | 1 | 2 (2) | 2 (2) | 0.990 (0.990) |") and rows[2].endswith(
        "| 0.500 |"
    )
    # the bar of issue 33: within 1.5x the exact-value ceiling, best EV >= 0.98, never worse than verl-best
    truth = [{"curve": [(2, 0.9, 1.0), (4, 0.95, 2.0)], "best_ev": 0.95, "final_ev": 0.95, "train_s": 2.0}]
    runs |= {"truth_lr1e-3": truth, "truth_lr3e-3": [{**truth[0], "curve": [(2, 0.5, 1.0), (4, 0.6, 2.0)]}]}
    assert ablation.ceiling(runs) == ("truth_lr1e-3", 4)
    work = {"dense": {default: {"seconds": 0.5}, "verl_lr3e-3": {"seconds": 0.6}}}
    (row,) = ablation.summary_table({"dense": runs}, work).splitlines()[2:]
    assert row == "| dense | verl_lr3e-3 | 4 / 0.960 | 2 / 0.990 | 4 (truth_lr1e-3) | 0.50 | 0.833 | yes |"
    work["dense"][default] = {"seconds": 0.64}  # more than 5 % more work per iteration than verl-best
    assert ablation.summary_table({"dense": runs}, work).endswith("| 1.067 | **no**: work > 1.05× verl-best's |")
    runs["truth_lr1e-3"] = [{**truth[0], "curve": [(2, 0.96, 1.0), (4, 0.99, 2.0)]}]  # a ceiling at 2 ...
    runs[default][0]["curve"] = [(2, 0.9, 1.0), (4, 0.99, 2.0)]  # ... and the default at 4: twice the ceiling
    assert ablation.summary_table({"dense": runs}, {}).endswith("| 2.00 | — | **no**: > 1.5× the ceiling |")
    runs[default][0]["best_ev"] = 0.95  # below 0.98 and below verl-best's
    assert ablation.summary_table({"dense": runs}, {}).endswith(
        "**no**: > 1.5× the ceiling, best EV < 0.98, best EV below verl-best's |"
    )
    # the second model size is its own table: its sweep, default and ceiling, never the suite model's
    larger = {f"{name}{ablation.LARGER}": rows for name, rows in runs.items()}
    assert ablation.verl_best(larger) is None and ablation.summary_table({"dense": larger}, {}).count("\n") == 1
    assert ablation.verl_best(larger, "128x4") == "verl_lr3e-3@128x4"
    assert ablation.ceiling(larger, "128x4") == ("truth_lr1e-3@128x4", 2)
    assert (
        ablation.summary_table({"dense": larger}, {}, "128x4")
        .splitlines()[2]
        .startswith("| dense | verl_lr3e-3@128x4 | 4 / 0.960 | 4 / 0.950 | 2 (truth_lr1e-3@128x4) | 2.00 |")
    )
    runs[default][0]["curve"] = [(2, 0.5, 1.0), (4, 0.9, 2.0)]  # never 0.95, where verl-best got there
    assert ablation.summary_table({"dense": runs}, {}).endswith("slower than verl-best, best EV below verl-best's |")
    runs["verl_lr3e-3"][0]["curve"] = [(2, 0.5, 1.0), (4, 0.9, 2.0)]  # neither did: not slower than verl-best
    assert "slower" not in ablation.summary_table({"dense": runs}, {})


def test_the_ablations_larger_model_and_profiled_work():
    """The `@128x4` configurations are their namesakes on hidden 128 x 4 layers; `profile_steps` sums the operator
    time of each iteration, from one `on_step` to the next."""
    from ppo_critic.cli import load_config

    ablation = _ablation()
    for name in ("verl_lr3e-4", ablation.RUNNING_DEFAULT, "truth_default"):
        small, large = (load_config(None, ablation.CONFIGS[n][1]) for n in (name, name + ablation.LARGER))
        shape = large.critic.model.override_config
        assert (shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]) == (128, 512, 4)
        assert large.trainer == small.trainer and large.critic.optim == small.critic.optim
    measured: list[dict] = []
    watch, x = ablation.profile_steps(1, 2, measured), torch.randn(256, 256)
    for step in range(3):  # after step 0 iteration 1 runs, after step 1 iteration 2; iteration 3 is not profiled
        watch(step)
        float((x @ x).sum())
    assert len(measured) == 2
    for one in measured:
        assert 0 < one["seconds"] < 10 and one["flops"] == 2 * 256**3 and one["calls"] >= 2  # the product, the sum


def test_the_ablation_baselines_are_verls_critic_whatever_ppo_critic_train_defaults_to():
    """The baselines pin every critic key, so changing the defaults of `ppo-critic train` cannot leak into them;
    the ablation's DEFAULT is what `ppo-critic train` runs; every suite task loads and all tasks are in it."""
    from ppo_critic.cli import load_config
    from ppo_critic.config.critic import OptimConfig
    from ppo_critic.tasks import TASK_CONFIGS

    ablation = _ablation()
    batches = {"strategy": "none", "ppo_mini_batch_size": 96, "ppo_micro_batch_size_per_gpu": None}
    for lr in ablation.BASELINE_LRS:
        cfg = load_config(None, ablation.CONFIGS[f"verl_lr{lr}"][1])
        assert cfg.critic == CriticConfig(**batches, optim=OptimConfig(lr=float(lr))), lr
        t = cfg.trainer
        assert (t.lam, t.length_adaptive_alpha, t.critic_warmup_steps, t.rollout_batch_size) == (1.0, None, 0, 192)
    default, train = load_config(None, ablation.CONFIGS[ablation.DEFAULT][1]), load_config(None, [])
    assert default.critic == train.critic
    assert dataclasses.replace(default.trainer, replay_rows="auto") == train.trainer  # 96 rows: what auto gives
    assert sorted(ablation.SUITE) == sorted(TASK_CONFIGS)
    for name, task in ablation.SUITE.items():
        cfg = load_config(None, ablation.overrides_of("previous", name))
        assert cfg.task["name"] == name and task.steps % task.eval_every == 0
        ours, auto = (
            load_config(None, [*ablation.overrides_of(c, name), *rows])
            for c, rows in ((ablation.DEFAULT, []), (ablation.RUNNING_DEFAULT, ["trainer.replay_rows=auto"]))
        )
        assert ours.replayed_rows() == auto.replayed_rows() == 96, name  # on every suite task


def test_the_ablations_ceiling_regresses_on_the_true_values():
    from ppo_critic.cli import load_config
    from ppo_critic.config.train import TrainerConfig
    from ppo_critic.tasks import DenseTask
    from ppo_critic.train import critic_returns

    ablation = _ablation()
    task = DenseTask()
    batch = task.sample(4, torch.Generator().manual_seed(0))
    cfg = load_config(None, [*ablation.CONFIGS["truth_default@128x4"][1], "task.name=dense"])
    targets = ablation.targets_of("truth_default@128x4", cfg)
    returns = targets(batch, torch.zeros_like(batch["token_level_rewards"]), TrainerConfig(gamma=0.9), 0)
    assert torch.equal(returns, task.true_values(batch, 0.9))
    assert not torch.equal(returns, batch["true_values"])  # those are at gamma 1
    assert ablation.targets_of(ablation.DEFAULT, cfg) is critic_returns  # what `ppo-critic train` regresses on
    truths = {f"truth_lr{lr}" for lr in ablation.BASELINE_LRS} | {"truth_default"}
    assert truths | {"truth_default" + ablation.LARGER} == ablation.TRUTH
    assert ablation.CONFIGS["truth_default"][1] == ablation.CONFIGS[ablation.RUNNING_DEFAULT][1]


def test_the_exact_bootstrap_configurations_bootstrap_from_the_true_values():
    """`exactboot_*`: the targets are GAE returns of the configuration's λ with the true values in place of the
    critic's (the critic's stay the old values of the clipped loss); at λ 0 each is r_t + γ·V*(t + 1)."""
    from ppo_critic.cli import load_config
    from ppo_critic.tasks import DenseTask

    ablation = _ablation()
    task = DenseTask()
    batch = task.sample(8, torch.Generator().manual_seed(0))
    critic = torch.full_like(batch["token_level_rewards"], 0.25)  # the old values of the clipped loss stay these
    cfg = load_config(None, [*ablation.CONFIGS["exactboot_lam0"][1], "trainer.gamma=0.9", "task.name=dense"])
    returns = ablation.targets_of("exactboot_lam0", cfg)(batch, critic, cfg.trainer, 0)
    mask, exact = batch["response_mask"].bool(), task.true_values(batch, 0.9)
    following = torch.cat([exact[:, 1:], torch.zeros_like(exact[:, :1])], 1) * mask.roll(-1, 1) * mask
    expected = torch.where(mask, batch["token_level_rewards"] + 0.9 * following, 0.0)
    torch.testing.assert_close(returns, expected, rtol=0, atol=1e-6)  # float32 sums of exact values
    cfg = load_config(None, [*ablation.CONFIGS["exactboot_default"][1], "trainer.gamma=0.9", "task.name=dense"])
    returns = ablation.targets_of("exactboot_default", cfg)(batch, critic, cfg.trainer, 0)
    from ppo_critic.train import critic_returns

    assert torch.equal(returns, critic_returns(batch, exact, cfg.trainer, 0))
    assert not torch.equal(returns, critic_returns(batch, critic, cfg.trainer, 0))


def _append_runs(ablation_dir: str, first: int) -> None:
    ablation = _ablation()
    ablation.RESULTS = Path(ablation_dir)
    for seed in range(first, first + 20):
        ablation.append("dense", {"config": "x", "seed": seed}, {})


def test_ablations_side_by_side_on_one_task_keep_each_others_runs(tmp_path):
    """Two processes appending to the same task's result file: every run of both is in it (read under a lock)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_runs, args=(str(tmp_path), first)) for first in (0, 100)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    ablation = _ablation()
    ablation.RESULTS = tmp_path
    assert sorted(r["seed"] for r in ablation.load("dense")) == [*range(20), *range(100, 120)]


def _screens():
    return bench_script("screen_levers.py")


def test_the_hl_gauss_screen_targets_a_smoothed_histogram_whose_mean_is_the_return():
    screens = _screens()
    edges = torch.linspace(-4, 4, 52)
    returns = torch.tensor([-1.3, 0.0, 0.77, 2.5, 9.0])
    probs = screens.hl_gauss_target(returns, edges, sigma=0.75 * float(edges[1] - edges[0]))
    centers = (edges[1:] + edges[:-1]) / 2
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    # inside the support the mean is the return up to the bins' discretisation (a uniform bin's spread, << width)
    torch.testing.assert_close((probs * centers).sum(-1)[:4], returns[:4], rtol=0, atol=1e-3)
    assert (probs * centers).sum(-1)[4] < 4  # beyond it: clamped to the support


def test_the_horizon_screen_lambda_never_reads_a_responses_own_length():
    from ppo_critic.tasks import LengthsTask

    screens = _screens()
    batch = LengthsTask().sample(16, torch.Generator().manual_seed(0))
    mask = batch["response_mask"]
    lam = screens.horizon_lambda(mask, 0.5, 1.0)
    shorter = mask.clone()
    shorter[0, int(mask[0].sum()) - 3 :] = 0  # row 0 ends 3 tokens earlier: its own λ must not move
    assert torch.equal(
        screens.horizon_lambda(shorter, 0.5, 1.0)[0, : int(shorter[0].sum())], lam[0, : int(shorter[0].sum())]
    )


def test_the_screens_record_keeps_every_row(tmp_path):
    screens = _screens()
    screens.RESULTS = tmp_path / "screens.jsonl"
    for i in range(3):
        screens.record({"run": i})
    lines = screens.RESULTS.read_text().splitlines()
    assert [json.loads(line)["run"] for line in lines] == [0, 1, 2]
