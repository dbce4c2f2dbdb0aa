"""The names of the critic's loss, normalisation and target modes, torch-free, so configs can check them without torch.

`ppo_critic.algos`, `ppo_critic.critics.objectives` and `ppo_critic.critics.value_norm` implement them;
`ppo_critic.config.critic` validates against them.
"""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# the value objectives, one module each in critics/objectives/ (a research script may `register` more at run time),
# each with what `--help` says of it
VF_LOSS_TYPES = {
    "mse": "verl's clipped squared error",
    "huber": "quadratic within huber_delta of the return, linear beyond",
    "bce": "0/1 rewards: value sigmoid(logit), loss the cross entropy against the return (which must lie in [0, 1])",
}
BUILT_IN_VF_LOSS_TYPES = tuple(VF_LOSS_TYPES)  # the names `register` may not take over
# the HF config key under which every export names its objective, which says how its outputs become values (bce:
# logits); `ppo-critic values` on the export applies the objective's map, and refuses an export that names none
EXPORTED_OBJECTIVE = "ppo_critic_vf_loss_type"
VALUE_NORM_MODES = ("off", "running", "popart")
LENGTH_ADAPTIVE_SCOPES = ("response", "batch")  # whose length sets the length-adaptive λ
