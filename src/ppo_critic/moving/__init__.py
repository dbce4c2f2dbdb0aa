"""Levers of the built-in trainer for a policy that moves (issue 41, docs/QUALITY.md "Under a moving policy"): a
replay window of recent batches (`replay.ReplaySource`) and a schedule that reacts to a jump of the loss on fresh
rollouts (`surprise.SurpriseSchedule`). Each is an option of `trainer`, off by default; `train` builds them."""

from ppo_critic.moving.replay import ReplaySource, draw_replay
from ppo_critic.moving.surprise import SurpriseSchedule

__all__ = ["ReplaySource", "SurpriseSchedule", "draw_replay"]
