"""critic.value_norm: running statistics, PopArt's output preservation, raw-space metrics, checkpoint and export."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import exported_values, make_batch, tiny_config
from ppo_critic import CriticConfig, DataParallelPPOCritic, cli
from ppo_critic.algos import explained_variance
from ppo_critic.critics.value_norm import ValueNormalizer, preserve_outputs
from ppo_critic.worker import CriticWorker
from test_train import SHORT, write_rollout_file


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
    """A step with learning rate 0: only the statistics (and PopArt's head rescaling) change, once they have started
    (the first merge moves the outputs' mean: the test above)."""
    critic = critic_with(tiny_qwen2, "popart")
    critic.update_critic(shifted_batch(5, shift=5.0))
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


def test_popart_under_ema_decay_preserves_the_averages_values_and_the_live_ones(tiny_qwen2):
    """PopArt rescales the average's head as well as the live one: with learning rate 0 only the statistics move, so
    the values served (the average's) and the live weights' stay where they were through every update."""
    critic = critic_with(tiny_qwen2, "popart", ema_decay=0.9)
    critic.update_critic(shifted_batch(5, shift=5.0))  # the statistics start (the outputs' mean moves)
    batch = shifted_batch()
    before = critic.compute_values(batch)
    for seed in range(3):
        critic.update_critic(shifted_batch(seed, scale=3.0 * (seed + 1), shift=-20.0 * seed))
        # the bound of the test above (the same rescalings, once more for the average's head): a head left
        # unrescaled moves the values by ~σ (2.5 to 15 here)
        torch.testing.assert_close(critic.compute_values(batch), before, rtol=1e-5, atol=1e-5)
        with critic.live_weights():
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
    # PopArt's rescaling carries into normalised space, moved by its first shift; `running` leaves the output in place
    popart = norm.normalise(batch["values"].double() + norm.start_shift)
    vpred = (popart if mode == "popart" else batch["values"].double())[mask]
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


@pytest.mark.parametrize("ema_decay", [0.0, 0.9])
def test_popart_moves_the_outputs_mean_to_the_returns_at_the_first_merge(tiny_qwen2, ema_decay):
    """A fresh head's outputs of order 1 against returns around 50 ± 10: the first merge keeps their deviations and
    moves their mean to μ (kept at ~0, the critic spent tens of updates learning the scale), the average's and the
    live weights' alike; every later merge keeps the outputs."""
    critic = critic_with(tiny_qwen2, "popart", ema_decay=ema_decay)
    batch = shifted_batch()
    mask = batch["attention_mask"][:, -5:].bool()
    batch["values"] = critic.compute_values(batch)
    critic.update_critic(batch)
    norm = critic.value_norm
    shift = norm.mean - batch["values"][mask].double().mean()
    assert shift.item() > 40
    expected = torch.where(mask, batch["values"] + shift.float(), 0.0)
    # PopArt's rescaling, then the bias moved by shift/σ: a few float32 roundings of values ~50 (u·50 ~ 3e-6 each),
    # inside atol 1e-4 (measured ~4e-6); outputs kept where they were are ~50 away, moved as `running` does ~σ
    torch.testing.assert_close(critic.compute_values(batch), expected, rtol=1e-5, atol=1e-4)
    with critic.live_weights():
        torch.testing.assert_close(critic.compute_values(batch), expected, rtol=1e-5, atol=1e-4)
    critic.update_critic(shifted_batch(1, scale=3.0, shift=-20.0))
    assert norm.start_shift.item() == 0
    # the rescaling of both heads once more (Δμ ~ 35 in the bias): the bound above; a lost one moves them by ~σ
    torch.testing.assert_close(critic.compute_values(batch), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("offset", [0.1, 1.5])
def test_popart_keeps_outputs_within_two_sigma_at_the_first_merge(tiny_qwen2, offset):
    """Outputs whose mean lies within FAR_STD = 2σ of the returns' (a value-pretrained export; any head the suite
    starts from, 0.2–1.0σ off) are kept at the first merge, as PopArt always keeps them; moving their mean by
    `offset`·σ was slower on the suite's dense rewards."""
    critic = critic_with(tiny_qwen2, "popart")
    with critic._value_head() as head, torch.no_grad():
        head.weight.mul_(10.0)
        head.bias.fill_(50.0)
    batch = shifted_batch()
    mask = batch["attention_mask"][:, -5:].bool()
    batch["values"] = critic.compute_values(batch)
    noise = torch.randn(batch["values"].shape, generator=torch.Generator().manual_seed(0))
    sigma = batch["values"][mask].std().item()
    batch["returns"] = batch["values"] + noise + offset * sigma
    critic.update_critic(batch)
    norm = critic.value_norm
    off_by = (norm.mean - batch["values"][mask].double().mean()) / norm.std  # in σ: ~offset (the noise is ~0.03σ)
    assert norm.start_shift.item() == 0 and 0.5 * offset < off_by.item() < 2.0
    # PopArt's preservation (values ~50, a bias carrying Δμ ~ 50: a few float32 roundings of u·50 ~ 3e-6); moved to
    # the returns' mean they would be `offset`·σ (>= 0.1·~10) away
    torch.testing.assert_close(critic.compute_values(batch)[mask], batch["values"][mask], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", ["running", "popart"])
def test_the_loss_sees_current_returns_and_the_outputs_the_old_values_came_from(tiny_qwen2, mode):
    """Returns normalised by the statistics after the merge; old values by those that served them under `running`
    (the model's outputs did not move, only their meaning), by the new ones under PopArt (it kept the outputs, and
    moved them by `start_shift` at the first merge)."""
    critic = critic_with(tiny_qwen2, mode)
    seen = []
    original = critic._train_mini_batch
    critic._train_mini_batch = lambda mini, *args: (seen.append(mini), original(mini, *args))
    for seed in (0, 1):
        batch = shifted_batch(seed, shift=50.0 * (seed + 1))
        mask = batch["attention_mask"][:, -5:].bool()
        batch["values"] = torch.where(mask, batch["values"] * 7.0 + 30.0, torch.nan)  # NaN at padding stays harmless
        served = critic.value_norm.snapshot()
        critic.update_critic(batch)
        norm = critic.value_norm
        old = served if mode == "running" else norm
        moved = norm.start_shift if mode == "popart" else 0.0  # PopArt's first merge moves the outputs' mean
        for key, stats, shift in (("returns", norm, 0.0), ("values", old, moved)):
            expected = ((batch[key].double() + shift - stats.mean) / stats.std).float()
            # the same float64 formula rounded once to float32: equal up to one ulp (assert_close's float32 default)
            torch.testing.assert_close(seen[-1][key][mask], expected[mask])
        assert not torch.equal(served.mean, norm.mean)  # the statistics moved in each call


@pytest.mark.parametrize("mode", ["running", "popart"])
def test_a_move_of_the_statistics_clips_no_token_of_an_unchanged_model(tiny_qwen2, mode):
    """Learning rate 0: the model gives the old values' outputs, so no token may be clipped, however far μ jumps
    (returns around 50, first call: μ 0 -> ~50 in units of σ ~10; mapped by the new statistics, every old value sat
    ~5σ below the model's output and the loss had no gradient)."""
    critic = critic_with(tiny_qwen2, mode, cliprange_value=0.5)
    batch = shifted_batch()
    batch["values"] = critic.compute_values(batch)
    metrics = critic.update_critic(batch)
    assert metrics["critic/vf_clipfrac"] == 0.0 and metrics["critic/grad_norm"] > 0


def test_old_values_served_before_popart_moved_the_outputs_are_clipped_around_the_moved_ones(tiny_qwen2):
    """Values of two batches served before the first update (verl's engine: the mini-batches of one call): the
    second update's old values came from the unmoved outputs too, so they are compared at their value + the
    first merge's shift (~50 here, ~5σ: without it every token is clipped, as on the first batch before issue 39)."""
    critic = critic_with(tiny_qwen2, "popart", cliprange_value=0.5)
    first, second = shifted_batch(0), shifted_batch(1)
    for batch in (first, second):
        batch["values"] = critic.compute_values(batch)
    metrics = [critic.update_critic(batch) for batch in (first, second)]
    assert critic.value_norm.start_shift.item() > 40
    assert [m["critic/vf_clipfrac"] for m in metrics] == [0.0, 0.0]
    critic.compute_values(first)  # values served from the moved outputs: no shift for them
    assert critic.value_norm.start_shift.item() == 0


def test_running_normalisation_fits_large_returns_where_raw_regression_cannot(tiny_qwen2):
    """Returns around 1000 ± 100: normalised, the model's outputs of order 1 map onto them at once; raw, 30 Adam
    steps of lr 3e-3 move the outputs by far less than 1000. (PopArt would move their mean there: ~10σ off.)"""
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


def test_megatron_takes_popart_and_an_unknown_value_norm_is_refused():
    assert CriticConfig.from_any({"strategy": "megatron", "value_norm": "popart"}).value_norm == "popart"
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


def no_spread_batches():
    """Returns with no spread (issue 39): the all-zero first batch of a sparse-reward run, a constant reward, one
    valid token, and constant returns as fp32 GAE leaves them (rounded in their last bits)."""
    zeros, constant, single, rounded = (make_batch(8, 6, 5, seed=s) for s in range(4))
    zeros["returns"] = torch.zeros_like(zeros["returns"])
    constant["returns"] = torch.full_like(constant["returns"], 3.0)
    single["attention_mask"][:, -5:] = 0
    single["attention_mask"][0, -5] = 1  # one valid response token in the batch
    values = rounded["values"]
    rounded["returns"] = (0.7 - values) + values  # ~1e-8 of rounding around 0.7, as GAE's advantages + values
    return {"zeros": zeros, "constant": constant, "single": single, "rounded": rounded}


@pytest.mark.parametrize("mode", ["running", "popart"])
@pytest.mark.parametrize("name", list(no_spread_batches()))
def test_returns_without_spread_leave_the_update_as_without_normalisation(tiny_qwen2, mode, name):
    """Their σ of ~0 used to floor at 1e-4: old values thousands of σ away, every token clipped, no gradient (running;
    vf_loss ~1e6), or a head rescaled x1e4 (popart, grad norm ~5e7). They must not start the statistics at all."""
    batch = no_spread_batches()[name]
    results = {}
    for norm in ("off", mode):
        torch.manual_seed(0)
        critic = critic_with(tiny_qwen2, norm, lr=1e-3, cliprange_value=0.5)
        batch["values"] = critic.compute_values(batch)
        metrics = critic.update_critic(batch)
        results[norm] = (metrics, critic.compute_values(batch), critic.value_norm)
    (off, off_values, _), (got, values, stats) = results["off"], results[mode]
    assert stats.count.item() == 0 and stats.mean.item() == 0.0 and stats.std.item() == 1.0
    assert got["critic/grad_norm"] > 0 and got["critic/vf_clipfrac"] == off["critic/vf_clipfrac"]
    # the identity statistics: the same float32 computation as without normalisation, bit for bit
    assert got["critic/vf_loss"] == off["critic/vf_loss"] and got["critic/grad_norm"] == off["critic/grad_norm"]
    assert torch.equal(values, off_values)


@pytest.mark.parametrize("mode", ["running", "popart"])
def test_the_statistics_start_at_the_first_batch_with_spread_and_then_take_every_batch(tiny_qwen2, mode):
    critic = critic_with(tiny_qwen2, mode, lr=1e-3)
    batches = no_spread_batches()
    for name in ("zeros", "constant"):
        critic.update_critic(batches[name])
    varied = shifted_batch(seed=5)
    mask = varied["attention_mask"][:, -5:].bool()
    critic.update_critic(varied)
    norm = critic.value_norm
    assert norm.count.item() == mask.sum().item()  # the batches without spread are not in the statistics
    # float64 statistics of 8 x 5 returns vs computed directly: ~n·2**-53, inside assert_close's float64 default
    torch.testing.assert_close(norm.mean, varied["returns"][mask].double().mean())
    critic.update_critic(batches["zeros"])  # once started, a batch without spread is merged like any other
    assert norm.count.item() == mask.sum().item() + batches["zeros"]["attention_mask"][:, -5:].sum().item()


def test_spread_is_measured_over_every_rank():
    """Two ranks each holding constant returns (0 and 2) see spread together: the decision uses the reduced sums."""
    norm = ValueNormalizer("running")
    returns, mask = torch.zeros(4, 3), torch.ones(4, 3)
    other_rank = torch.stack([mask.sum(), torch.tensor(24.0), torch.tensor(48.0)]).double()  # twelve returns of 2
    norm.update(returns, mask, all_reduce=lambda local: local + other_rank)
    assert norm.count.item() == 24 and norm.mean.item() == 1.0 and norm.std.item() == 1.0


@pytest.mark.parametrize("mode", ["running", "popart"])
def test_a_sparse_reward_run_through_the_command_learns_from_its_first_batch(tmp_path, mode):
    """`ppo-critic train` on a rollout file whose every reward is 0 (Monte-Carlo returns, λ = 1): each update's
    loss is the plain regression's (the head's outputs are ~0.1-0.5 here: a loss of order 0.1, against ~1e6 when σ
    floored at 1e-4), its gradient is not zero, and the statistics stay the identity."""
    data = tmp_path / "zeros.jsonl"
    rows = write_rollout_file(data, 12)
    data.write_text("".join(json.dumps({**row, "reward": 0.0}) + "\n" for row in rows))
    run = tmp_path / "run"
    args = [
        *SHORT,
        "trainer.steps=2",
        f"trainer.run_dir={run}",
        f"data={data}",
        f"critic.value_norm={mode}",
        "critic.ema_decay=0",
    ]
    assert cli.main(["train", *args, "trainer.length_adaptive_alpha=null", "trainer.logger=[jsonl]"]) == 0
    for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        assert row["critic/vf_loss"] < 1.0 and row["critic/grad_norm"] > 0 and row["critic/vf_clipfrac"] < 1.0
        assert row["critic/value_norm_mean"] == 0.0 and row["critic/value_norm_std"] == 1.0


def test_a_decay_weights_the_statistics_held_before_each_merge():
    """value_norm_decay β: the statistics are the mean and variance of every return seen, a return of k updates ago
    weighted β^k (an exponentially weighted window), computed here directly."""
    decay, norm, seen, weights = 0.5, ValueNormalizer("running", decay=0.5), [], []
    for seed in range(4):
        batch = shifted_batch(seed, scale=1.0 + seed, shift=3.0 * seed)
        mask = batch["attention_mask"][:, -5:]
        norm.update(batch["returns"], mask)
        weights = [w * decay for w in weights] + [torch.ones(int(mask.sum()), dtype=torch.float64)]
        seen.append(batch["returns"][mask.bool()].double())
    x, w = torch.cat(seen), torch.cat(weights)
    mean = (w * x).sum() / w.sum()
    assert norm.count.item() == pytest.approx(w.sum().item(), rel=1e-12)
    assert norm.mean.item() == pytest.approx(mean.item(), rel=1e-12)
    assert norm.var.item() == pytest.approx(((w * (x - mean) ** 2).sum() / w.sum()).item(), rel=1e-12)
    assert norm.snapshot().decay == decay


def test_a_decaying_normaliser_follows_returns_that_move_and_the_default_keeps_them_all():
    kept, forgetting = ValueNormalizer("running"), ValueNormalizer("running", decay=0.8)
    for seed in range(20):
        batch = shifted_batch(seed, scale=1.0, shift=10.0 * seed)
        for norm in (kept, forgetting):
            norm.update(batch["returns"], batch["attention_mask"][:, -5:])
    # the returns' mean rises by 10 per update: a window of 1 / (1 − 0.8) = 5 updates lags ~10·0.8/0.2 = 40 behind
    # the last batch's ~190, the whole history ~95
    assert forgetting.mean.item() > 140 > 100 > kept.mean.item()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"value_norm": "running", "value_norm_decay": 0}, r"value_norm_decay=0(\.0)? must be a number in \(0, 1\]"),
        ({"value_norm": "running", "value_norm_decay": 1.5}, r"value_norm_decay=1.5 must be a number in \(0, 1\]"),
        ({"value_norm": "running", "value_norm_decay": True}, r"value_norm_decay=True must be a number"),
        ({"value_norm": "off", "value_norm_decay": 0.9}, "value_norm_decay=0.9 needs value_norm=running or popart"),
    ],
)
def test_a_bad_value_norm_decay_is_named(changes, message):
    with pytest.raises(ValueError, match=message):
        CriticConfig.from_any({"ppo_mini_batch_size": 4, **changes})


def test_a_critic_takes_its_decay_from_the_config(tiny_qwen2):
    critic = critic_with(tiny_qwen2, "popart", value_norm_decay=0.9)
    assert (critic.value_norm.mode, critic.value_norm.decay) == ("popart", 0.9)
