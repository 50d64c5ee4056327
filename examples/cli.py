"""Train the examples' modules from a config file, the Lightning way (LightningCLI).

    python examples/cli.py fit --config examples/configs/ppo_cartpole.yaml
    python examples/cli.py fit --config examples/configs/ppo_cartpole.yaml --print_config > my_run.yaml
    python examples/cli.py fit --config my_run.yaml --data.total_frames 500000 --model.init_args.lr 3e-4
    python examples/cli.py fit --config examples/configs/dqn_cartpole.yaml

`--data.*` are `RolloutDataModule`'s arguments (env id, envs, frames, evaluation
schedule, seed); `--model` picks any LightningModule by its import path (the
examples' `ppo_cartpole.PPO` and `dqn_cartpole.DQN`, or your own) with its
keyword arguments; `--trainer.*` is the Trainer, callbacks and logger included.
`--print_config` prints the full configuration, which trains the same run again.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # so the config can name ppo_cartpole.PPO

from lightning_rollout.lightning import RolloutDataModule  # noqa: E402


def main(args: list[str] | None = None) -> LightningCLI:
    torch.set_num_threads(1)  # tiny networks: intra-op threads only fight the env threads for the cores
    return LightningCLI(datamodule_class=RolloutDataModule, subclass_mode_model=True, args=args,
                        save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
