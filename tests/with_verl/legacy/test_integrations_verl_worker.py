"""verl's real FSDP `CriticWorker` (fsdp2, one CPU process, gloo) with ppo-critic's critic inside, built from verl's
own composed config as verl's trainer hands it over (the dataclass): init_model, compute_values, update_critic,
save_checkpoint / load_checkpoint. Values equal verl's own critic's in the same worker; so does one update with one
micro-batch per mini-batch. Patched: only what verl 0.7.1 hard-codes for CUDA (`verl_helpers.verl_on_cpu`)."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import pytest
import torch
from verl.trainer.ppo.metric_utils import reduce_metrics
from verl_helpers import OursInVerl, VerlCritic, make_worker, worker_update, worker_values

from ppo_critic.algos import compute_gae_advantage_return
from ppo_critic.config.env import OPTIONS_ENV
from verl_shared import params, rel_change, rollout

SAME = 1e-6  # see test_integrations_verl_critic.py: rounding of one fp32 gradient summed in another order
FIXED = {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 4, "forward_micro_batch_size_per_gpu": 2}


def worker(model_dir, critic=OursInVerl, **settings):
    return make_worker(model_dir, critic, **{**FIXED, **settings})


@pytest.fixture(scope="module")
def data():
    return rollout(8, seed=4)


def test_verls_worker_builds_our_critic_and_gets_verls_values(single_process, model_dir, data):
    ours, theirs = worker(model_dir), worker(model_dir, critic=VerlCritic)
    assert type(ours.critic) is OursInVerl and type(theirs.critic) is VerlCritic
    assert torch.equal(worker_values(ours, data), worker_values(theirs, data))


def test_one_update_is_verls_and_its_metrics_reach_verls_trainer(single_process, model_dir, data):
    sgd = {"optim.optimizer": "SGD", "optim.weight_decay": 0.0, "optim.lr": 0.1}
    ours, theirs = worker(model_dir, **sgd), worker(model_dir, critic=VerlCritic, **sgd)
    before = params(ours.critic_module)
    metrics, verl_metrics = worker_update(ours, data), worker_update(theirs, data)
    assert rel_change(params(ours.critic_module), params(theirs.critic_module), before) <= SAME
    reduced = reduce_metrics(metrics)  # what verl's trainer does with a critic's metrics
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"):
        assert math.isfinite(reduced[key]), key
    assert "perf/mfu/critic" in reduced and reduced["critic/lr"] == 0.1
    assert reduced["critic/grad_norm"] == pytest.approx(reduce_metrics(verl_metrics)["critic/grad_norm"], rel=SAME)


def test_the_critics_own_lambda_in_verls_worker(single_process, model_dir, data, monkeypatch):
    """`PPO_CRITIC_OPTIONS=targets_lam=...` (issue 53): verl's worker hands the critic its whole batch; the update is
    the one on the returns of that λ from the batch's token_level_rewards and old values."""
    sgd = {"optim.optimizer": "SGD", "optim.weight_decay": 0.0, "optim.lr": 0.1}
    batch = copy.deepcopy(data)
    rewards = torch.randn(batch.batch["returns"].shape, generator=torch.Generator().manual_seed(7))
    batch.batch["token_level_rewards"] = rewards
    fed = copy.deepcopy(batch)
    mask = batch.batch["response_mask"]
    fed.batch["returns"] = compute_gae_advantage_return(rewards, batch.batch["values"], mask, 0.9, 0.5)[1]
    monkeypatch.setenv(OPTIONS_ENV, "targets_lam=0.5 targets_gamma=0.9")
    own = worker(model_dir, **sgd)
    worker_update(own, batch)
    monkeypatch.setenv(OPTIONS_ENV, "")
    plain = worker(model_dir, **sgd)
    worker_update(plain, fed)
    assert all(torch.equal(p, params(plain.critic_module)[k]) for k, p in params(own.critic_module).items())


def test_checkpoint_round_trip_through_verls_checkpoint_manager(single_process, model_dir, data, tmp_path):
    trained = worker(model_dir)
    worker_update(trained, data)
    expected = worker_values(trained, data)
    trained.save_checkpoint(str(tmp_path / "global_step_1"), global_step=1)
    fresh = worker(model_dir)
    assert not torch.equal(worker_values(fresh, data), expected)
    fresh.load_checkpoint(str(tmp_path / "global_step_1"), del_local_after_load=False)
    assert torch.equal(worker_values(fresh, data), expected)
    assert fresh.critic_optimizer.state_dict()["state"].keys() == trained.critic_optimizer.state_dict()["state"].keys()


def test_dynamic_batching_with_null_micro_batch_sizes(single_process, model_dir, data):
    """verl's worker then sends meta_info micro_batch_size=None: "not set", the token budget decides."""
    dynamic = {"use_dynamic_bsz": True, "ppo_micro_batch_size_per_gpu": None, "forward_micro_batch_size_per_gpu": None}
    w = worker(model_dir, **dynamic, ppo_max_token_len_per_gpu=24, forward_max_token_len_per_gpu=24)
    assert w.config.forward_micro_batch_size_per_gpu is None
    # micro-batches of other rows: the same sums over other padded shapes, fp32 rounding apart
    torch.testing.assert_close(worker_values(w, data), worker_values(worker(model_dir), data), rtol=1e-5, atol=1e-6)
    assert math.isfinite(reduce_metrics(worker_update(w, data))["critic/vf_loss"])


def test_the_short_batch_of_verls_own_worker_test(single_process, model_dir):
    """verl's tests/workers/critic/test_special_dp_critic.py sends 2 rows with ppo_mini_batch_size=4."""
    w = worker(model_dir)
    before = params(w.critic_module)
    metrics = reduce_metrics(worker_update(w, rollout(2, seed=5)))
    assert math.isfinite(metrics["critic/vf_loss"]) and metrics["critic/skipped_steps"] == 0
    assert any(not torch.equal(before[k], v) for k, v in params(w.critic_module).items())


INTEGRATION = 'sys.modules["ppo_critic.integrations.verl"]'  # loaded by verl's own mechanism, not by the probe
PROBES = {
    # verl imports the module named by the variable inside `import verl`, in every process (driver, Ray workers)
    "VERL_USE_EXTERNAL_MODULES": f"""
import sys
import verl.workers.fsdp_workers, verl.workers.megatron_workers
from verl.workers.critic import DataParallelPPOCritic
from verl.workers.critic.megatron_critic import MegatronPPOCritic
ours = {INTEGRATION}
assert DataParallelPPOCritic is ours.DataParallelPPOCritic, DataParallelPPOCritic
assert verl.workers.megatron_workers.MegatronPPOCritic is MegatronPPOCritic is ours.MegatronPPOCritic
""",
    # verl's FSDP CriticWorker.init_model imports critic.model.external_lib, then the critic class
    "critic.model.external_lib": f"""
import sys
from verl.workers import fsdp_workers
from verl.utils.import_utils import import_external_libs
import_external_libs("ppo_critic.integrations.verl")
from verl.workers.critic import DataParallelPPOCritic
assert DataParallelPPOCritic is {INTEGRATION}.DataParallelPPOCritic, DataParallelPPOCritic
""",
}


@pytest.mark.parametrize("way", PROBES)
def test_the_one_line_a_verl_user_adds(way):
    """In a fresh process, as in each of verl's Ray workers."""
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    if way == "VERL_USE_EXTERNAL_MODULES":
        env[way] = "ppo_critic.integrations.verl"
    result = subprocess.run(
        [sys.executable, "-c", PROBES[way] + "print('ok')"], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
