"""torchrun (2 processes): `ppo-critic train backend=megatron megatron.tensor_model_parallel_size=2` straight for
4 steps, and again with a crash after step 3 (checkpoint at step 2) followed by `trainer.resume=auto`; then
`ppo-critic export` of the resumed run. argv: the root directory of the runs."""

from __future__ import annotations

import sys

from megatron_cpu import redirect_cuda_to_cpu

redirect_cuda_to_cpu()

from ppo_critic import cli  # noqa: E402
from ppo_critic import train as train_module  # noqa: E402

OPTIONS = [
    "backend=megatron",
    "megatron.tensor_model_parallel_size=2",
    "trainer.steps=4",
    "trainer.save_every=2",
    "trainer.rollout_batch_size=16",
    "trainer.eval_size=16",
    "trainer.eval_every=2",
    "trainer.progress=false",
    "trainer.logger=[console,jsonl]",
    "critic.ppo_mini_batch_size=8",
    "critic.ppo_micro_batch_size_per_gpu=4",
]


def main() -> None:
    root = sys.argv[1]
    assert cli.main(["train", *OPTIONS, f"trainer.run_dir={root}/straight"]) == 0
    iteration, calls = train_module._iteration, []

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        return iteration(*args, **kwargs)

    train_module._iteration = crash_on_third
    try:
        cli.main(["train", *OPTIONS, f"trainer.run_dir={root}/resumed"])
        raise AssertionError("the crash did not happen")
    except RuntimeError as err:
        assert "simulated crash" in str(err)
    train_module._iteration = iteration
    assert cli.main(["train", *OPTIONS, f"trainer.run_dir={root}/resumed"]) == 0
    assert cli.main(["export", f"{root}/resumed", f"{root}/exported"]) == 0


if __name__ == "__main__":
    main()
