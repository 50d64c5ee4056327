"""End-to-end training runs against what users would pick instead (``make bench-e2e``).

For PPO and SAC on MuJoCo HalfCheetah-v5 (``examples/ppo_mujoco.py``, ``examples/sac_mujoco.py``), the same
hyperparameters, env frames and gradient steps for every contender: ours through ``Trainer.fit``, the same
learner in a loop by hand over ``ThreadedCollector``, that loop over TorchRL's ``Collector`` (the control),
Stable-Baselines3, and the learners alone. Modules: :mod:`.common` (what the contenders share: run specs,
the examples' configs, evaluation at fixed frame counts), :mod:`.contenders` (one function each),
:mod:`.report` (tables, ratios, targets, plot; pure), :mod:`.cli` (the runner); :mod:`.lightning_step` times
Lightning's cost per optimiser step alone, both ways interleaved in one ``Trainer.fit``.
"""
