"""critic.value_norm: running statistics, PopArt's output preservation, raw-space metrics, checkpoint and export."""

from __future__ import annotations

import pytest
import torch

from conftest import exported_values, make_batch, tiny_config
from ppo_critic import CriticConfig, DataParallelPPOCritic
from ppo_critic.algos import explained_variance
from ppo_critic.critics.value_norm import ValueNormalizer, preserve_outputs
from ppo_critic.worker import CriticWorker


def critic_with(tiny_qwen2, mode, lr=0.0, **cfg):
    model = tiny_qwen2(value_head_init="normal:0.5")
    config = {"ppo_mini_batch_size": 8, "cliprange_value": None, "value_norm": mode, **cfg}
    return DataParallelPPOCritic(config, model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0))


def shifted_batch(seed=0, scale=10.0, shift=50.0):
    """Returns far from the model's outputs, so the statistics move a lot."""
    batch = make_batch(8, 6, 5, seed=seed)
    batch["returns"] = batch["returns"] * scale + shift
    return batch


def test_statistics_are_the_exact_mean_and_variance_of_every_valid_return_seen():
    norm = ValueNormalizer("running")
    seen = []
    for seed in range(4):
        batch = shifted_batch(seed, scale=1.0 + seed, shift=3.0 * seed)
        mask = batch["attention_mask"][:, -5:]
        norm.update(batch["returns"], mask)
        seen.append(batch["returns"][mask.bool()].double())
    everything = torch.cat(seen)
    assert norm.count.item() == everything.numel()
    # float64 (u = 2**-53) sums of n ~ 160 returns of magnitude <= ~15 merged batch by batch vs in one go:
    # <= n·u·mean|x| / |mean| ~ 2e-14 relative for the mean; the variance, from sums of squares, loses another
    # factor mean²/var (~2 here): ~1e-13. 1e-12 and 1e-10 bound them; a wrong merge formula is off by > 1e-3.
    torch.testing.assert_close(norm.mean, everything.mean(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm.var, everything.var(unbiased=False), rtol=1e-10, atol=1e-12)
    x = torch.randn(7, dtype=torch.float64)
    # 4 float64 roundings (~4·2**-53 relative): far inside assert_close's float64 default (rtol 1e-7, atol 1e-7)
    torch.testing.assert_close(norm.denormalise(norm.normalise(x)), x)


def test_off_is_the_identity_and_a_fresh_normalizer_changes_nothing():
    x = torch.randn(3, 4)
    assert ValueNormalizer("off").normalise(x) is x and ValueNormalizer("off").denormalise(x) is x
    torch.testing.assert_close(ValueNormalizer("running").denormalise(x), x, rtol=0, atol=0)  # exact: 0 + 1·x
    with pytest.raises(ValueError, match="value_norm='batch' is unknown"):
        ValueNormalizer("batch")


def test_preserve_outputs_rescales_weight_and_bias():
    head = torch.nn.Linear(16, 1)
    h = torch.randn(32, 16)
    old_mean, old_std, new_mean, new_std = (torch.tensor(v, dtype=torch.float64) for v in (1.5, 2.0, -3.0, 0.25))
    before = old_mean + old_std * head(h).double()
    preserve_outputs(head, old_mean, old_std, new_mean, new_std)
    after = new_mean + new_std * head(h).double()
    # the head runs in float32: its 16-term dot products round by <= 16·u·Σ|w·h| ~ 1.5e-6 (u = 2**-24, Σ|w·h| ~ 1.6),
    # scaled by old_std = 2 before and new_std x (old_std / new_std) = 2 after, plus one float32 rounding of each
    # rescaled weight: <= ~6e-6 in all, inside atol 1e-5 (measured 5e-7); a wrong rescaling is off by > 0.1
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-5)


def test_popart_preserves_the_values_when_the_statistics_move(tiny_qwen2):
    """A step with learning rate 0: only the statistics (and PopArt's head rescaling) change."""
    critic = critic_with(tiny_qwen2, "popart")
    batch = shifted_batch()
    before = critic.compute_values(batch)
    for seed in range(3):
        critic.update_critic(shifted_batch(seed, scale=3.0 * (seed + 1), shift=-20.0 * seed))
        assert critic.value_norm.count.item() > 0
        # in raw space (u = 2**-24) each rescaling rounds the head's 64 weights (~√64·u·|w·h| ~ 3e-7, random signs)
        # and its bias, which carries the mean shift (<= u·|Δμ| ~ 1.2e-6 for |Δμ| <= 20); the de-normalised value is
        # rounded once (u·|v| <= 5e-7 for |v| <= 8.6): <= ~5e-6 over the 3 updates, inside atol 1e-5 (measured
        # 1.8e-6); a lost rescaling moves the values by ~σ (2.5 to 15 here)
        torch.testing.assert_close(critic.compute_values(batch), before, rtol=1e-5, atol=1e-5)
    assert abs(critic.value_norm.mean.item()) > 1.0  # the statistics did move


def test_running_normalisation_moves_the_values_with_the_statistics(tiny_qwen2):
    """The control for the PopArt test: without rescaling, the de-normalised outputs follow μ and σ."""
    critic = critic_with(tiny_qwen2, "running")
    batch = shifted_batch()
    raw = critic.compute_values(batch)  # before any update μ=0, σ=1: the model's own outputs
    critic.update_critic(batch)
    norm = critic.value_norm
    mask = batch["attention_mask"][:, -5:].bool()
    expected = torch.where(mask, norm.mean.float() + norm.std.float() * raw, 0.0)
    # the same outputs de-normalised in float64 then rounded (the critic) vs in float32 (here): a few float32
    # roundings of |value| ~ |μ| = 50 (u·50 ~ 3e-6 each); rtol 1e-5 + atol 1e-4 bound them (measured 3.8e-6)
    torch.testing.assert_close(critic.compute_values(batch), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", ["running", "popart"])
def test_loss_is_in_normalised_space_and_metrics_in_raw_space(tiny_qwen2, mode):
    critic = critic_with(tiny_qwen2, mode)
    batch = shifted_batch()
    batch["values"] = critic.compute_values(batch)
    metrics = critic.update_critic(batch)
    norm = critic.value_norm
    mask = batch["attention_mask"][:, -5:].bool()
    returns = batch["returns"][mask].double()
    # float64 statistics of 8 x 5 returns, merged into a fresh normaliser vs computed directly: ~n·2**-53, far inside
    # assert_close's float64 default (rtol 1e-7, atol 1e-7)
    torch.testing.assert_close(norm.mean, returns.mean())
    torch.testing.assert_close(norm.std, returns.std(unbiased=False))
    # lr 0, so the model's output during the step is its output before: the old values (μ=0, σ=1 then), which
    # PopArt's rescaling carries into normalised space; `running` leaves the output itself in place
    vpred = (norm.normalise(batch["values"].double()) if mode == "popart" else batch["values"].double())[mask]
    target = norm.normalise(batch["returns"].double())[mask]
    # the critic computes in float32 what is recomputed here in float64: conftest.FP32_REORDERED for the loss; the
    # explained variance and the mean of the values are float64 sums of the same float32 inputs (rel 1e-6 >> 40·2**-53,
    # abs for an explained variance near 0); vpred passes through the float32 model output and its de-normalisation
    # (|vpred| ~ μ = 50: float32 roundings of ~3e-6 each, rel/abs 1e-4 bound them); the statistics are the same
    # float64 numbers (approx's default rel 1e-6)
    assert metrics["critic/vf_loss"] == pytest.approx(0.5 * ((vpred - target) ** 2).mean().item(), rel=1e-5)
    values = batch["values"][mask].double()
    ev = explained_variance(batch["values"], batch["returns"], mask).item()
    assert metrics["critic/vf_explained_var"] == pytest.approx(ev, rel=1e-6, abs=1e-9)
    assert metrics["critic/values_mean"] == pytest.approx(values.mean().item(), rel=1e-6)
    assert metrics["critic/vpred_mean"] == pytest.approx(norm.denormalise(vpred).mean().item(), rel=1e-4, abs=1e-4)
    assert metrics["critic/value_norm_mean"] == pytest.approx(norm.mean.item())
    assert metrics["critic/value_norm_std"] == pytest.approx(norm.std.item())


def test_the_loss_sees_returns_and_old_values_normalised_by_the_same_statistics(tiny_qwen2):
    """So `cliprange_value` clips around the old values in units of σ."""
    critic = critic_with(tiny_qwen2, "running")
    batch = shifted_batch()
    mask = batch["attention_mask"][:, -5:].bool()
    batch["values"] = torch.where(mask, batch["values"] * 7.0 + 30.0, torch.nan)  # NaN at padding stays harmless
    seen = []
    original = critic._train_mini_batch
    critic._train_mini_batch = lambda mini, *args: (seen.append(mini), original(mini, *args))
    critic.update_critic(batch)
    mean, std = critic.value_norm.mean, critic.value_norm.std
    for key in ("returns", "values"):
        expected = ((batch[key].double() - mean) / std).float()
        # the same float64 formula rounded once to float32: equal up to one ulp (assert_close's float32 default)
        torch.testing.assert_close(seen[0][key][mask], expected[mask])


def test_running_normalisation_fits_large_returns_where_raw_regression_cannot(tiny_qwen2):
    """Returns around 1000 ± 100: normalised, the model's outputs of order 1 map onto them at once; raw, 30 Adam
    steps of lr 3e-3 move the outputs by far less than 1000. (PopArt would first preserve the outputs near 0.)"""
    errors = {}
    for mode in ("off", "running"):
        critic = critic_with(tiny_qwen2, mode, lr=3e-3)
        batch = shifted_batch(scale=100.0, shift=1000.0)
        mask = batch["attention_mask"][:, -5:].bool()
        for _ in range(30):
            batch["values"] = critic.compute_values(batch)
            critic.update_critic(batch)
        errors[mode] = (critic.compute_values(batch) - batch["returns"])[mask].abs().mean().item()
    assert errors["running"] < 0.2 * errors["off"]


def test_popart_needs_a_head_with_a_bias(tiny_qwen2):
    model = tiny_qwen2()
    model.score = torch.nn.Linear(model.score.in_features, 1, bias=False)
    with pytest.raises(ValueError, match="popart needs a value head with a bias"):
        DataParallelPPOCritic({"value_norm": "popart"}, model, torch.optim.SGD(model.parameters(), lr=0.0))


def test_megatron_rejects_value_norm():
    with pytest.raises(ValueError, match="value_norm=popart is not supported with strategy=megatron"):
        CriticConfig.from_any({"strategy": "megatron", "value_norm": "popart"})
    with pytest.raises(ValueError, match="value_norm='batch' is unknown"):
        CriticConfig.from_any({"value_norm": "batch"})


WORKER = {
    "strategy": "none",
    "ppo_mini_batch_size": 8,
    "cliprange_value": None,
    "value_norm": "popart",
    "model": {"override_config": tiny_config("qwen2"), "value_head_init": "normal:0.2"},
    "optim": {"lr": 1e-3},
}


def test_statistics_survive_checkpoint_resume_and_the_export_predicts_raw_values(tmp_path):
    worker = CriticWorker(WORKER, device="cpu")
    for seed in range(2):
        batch = shifted_batch(seed)
        batch["values"] = worker.compute_values(batch)
        worker.update_critic(batch)
    path = worker.save_checkpoint(tmp_path / "ckpt")
    resumed = CriticWorker(WORKER, device="cpu", seed=1)  # other weights, fresh statistics
    resumed.load_checkpoint(path)
    for key, value in worker.critic.value_norm.state_dict().items():
        assert torch.equal(resumed.critic.value_norm.state_dict()[key], value), key
    batch = shifted_batch(seed=5)
    expected = worker.compute_values(batch)
    assert torch.equal(resumed.compute_values(batch), expected)
    batch["values"] = expected
    a, b = worker.update_critic(batch), resumed.update_critic(batch)
    assert a["critic/vf_loss"] == b["critic/vf_loss"] and a["critic/value_norm_std"] == b["critic/value_norm_std"]
    assert torch.equal(resumed.compute_values(batch), worker.compute_values(batch))

    worker.export_hf(tmp_path / "hf")
    got = exported_values(tmp_path / "hf", batch)
    # the HF padded forward with the statistics folded into the head (one float32 rounding per weight) vs the
    # critic's path de-normalised: the same sums in another order (conftest.FP32_REORDERED) on values of scale
    # σ ~ 10 around μ ~ 50; atol 1e-4 ~ 1e-5·σ for values near 0 (measured 2.9e-6)
    torch.testing.assert_close(got, worker.compute_values(batch), rtol=1e-5, atol=1e-4)


def test_a_bare_off_on_the_command_line_means_off():
    """YAML (and so OmegaConf's key=value parsing) reads `off` as false."""
    from ppo_critic.cli import load_config

    assert load_config(None, ["critic.value_norm=off"]).critic.value_norm == "off"
    assert load_config(None, ["critic.value_norm=popart", "critic.ema_decay=0"]).critic.value_norm == "popart"
    with pytest.raises(ValueError, match="value_norm=True is unknown"):
        CriticConfig.from_any({"value_norm": True})


def test_a_generic_critic_exports_raw_values_too(tmp_path):
    from ppo_critic import build_value_model

    config = {**WORKER, "value_norm": "running", "model": {**WORKER["model"], "head": "generic"}}
    worker = CriticWorker(config, device="cpu")
    batch = shifted_batch()
    batch["values"] = worker.compute_values(batch)
    worker.update_critic(batch)
    worker.export_hf(tmp_path / "hf")
    reloaded = build_value_model(tmp_path / "hf")
    assert type(reloaded).__name__ == "ValueModel"
    plain = DataParallelPPOCritic({"ppo_mini_batch_size": 8}, reloaded, None)  # no statistics: raw outputs
    # as above: folded statistics, the same sums in another order, values of scale σ ~ 10 (measured 7.6e-6)
    torch.testing.assert_close(plain.compute_values(batch), worker.compute_values(batch), rtol=1e-5, atol=1e-4)
