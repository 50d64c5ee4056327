"""Multi-agent: a PettingZoo parallel env (MPE's simple_spread) through TorchRL's ``PettingZooWrapper``.

The collector lays out the ``("agents", ...)`` group as TorchRL's own ``Collector`` does
(the agent dim inside the env's batch, per-agent rewards and dones, root done flags),
compared value for value; ``examples/ippo_mpe.py`` runs through ``Trainer.fit`` (smoke)
and improves on random actions (slow). Everything here needs the ``multiagent`` extra
and is skipped without it.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("pettingzoo")
pytest.importorskip("mpe2")

from tensordict import TensorDictBase  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.envs import SerialEnv  # noqa: E402
from torchrl.envs.utils import ExplorationType  # noqa: E402

from lightning_rollout import ThreadedCollector  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import ippo_mpe  # noqa: E402
from test_examples import run_example  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "PettingZoo in TorchRL is tested using version == 1.24.3"
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


class SeededSpread:
    """A picklable factory of the example's env, seeded at creation (ours and TorchRL's see the same streams)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self):
        env = ippo_mpe.make_env()
        env.set_seed(self.seed)
        return env


def shared_actor() -> torch.nn.Module:
    torch.manual_seed(0)
    return ippo_mpe.IPPO(hidden=16).actor


def test_batches_equal_torchrl_collector_over_the_same_envs_keys_shapes_dtypes_and_values():
    actor = shared_actor()
    frames = 2 * 40  # episodes of 25 steps end inside the batch
    theirs_collector = Collector(SerialEnv(2, [SeededSpread(10), SeededSpread(11)]), actor, frames_per_batch=frames,
                                 total_frames=frames, exploration_type=ExplorationType.DETERMINISTIC,
                                 auto_register_policy_transforms=False)
    theirs = next(iter(theirs_collector))
    theirs_collector.shutdown()
    ours_collector = ThreadedCollector([SeededSpread(10), SeededSpread(11)], actor, frames_per_batch=frames,
                                       total_frames=frames, envs_per_thread=1, num_workers=1,
                                       exploration_type=ExplorationType.DETERMINISTIC)
    ours = next(iter(ours_collector))
    ours_collector.shutdown()

    assert ours.batch_size == theirs.batch_size == (2, 40)
    assert ours["agents"].batch_size == theirs["agents"].batch_size == (2, 40, 3), "the agent dim inside the batch"
    assert ours["next", "agents"].batch_size == (2, 40, 3)
    assert set(ours.keys(True, True)) == set(theirs.keys(True, True))
    for key in theirs.keys(True, True):
        assert ours[key].shape == theirs[key].shape and ours[key].dtype == theirs[key].dtype, key
        if ours[key].is_floating_point():
            torch.testing.assert_close(ours[key], theirs[key], msg=str(key))
        else:
            assert torch.equal(ours[key], theirs[key]), key
    # TorchRL's layout of a group: per-agent rewards and dones [.., 3, 1], the env's own flags at the root
    assert ours["next", "agents", "reward"].shape == (2, 40, 3, 1)
    assert ours["next", "done"].shape == (2, 40, 1) and ours["next", "done"].sum() == 2
    assert torch.equal(ours["next", "agents", "done"].any(-2), ours["next", "done"])


def test_random_policy_collects_the_group_with_every_layout():
    for layout, shape in (("env_time", (2, 30, 3)), ("flat", (60, 3))):
        collector = ThreadedCollector(ippo_mpe.make_env, None, frames_per_batch=60, total_frames=60, num_envs=2,
                                      envs_per_thread=2, num_workers=1, layout=layout, seed=0)
        batch: TensorDictBase = next(iter(collector))
        collector.shutdown()
        assert batch["agents"].batch_size == shape
        assert batch["agents", "action"].dtype == torch.int64
        assert ((batch["agents", "action"] >= 0) & (batch["agents", "action"] < 5)).all()


def test_ippo_example_trains_through_trainer_fit(tmp_path: Path) -> None:
    result = run_example("ippo_mpe.py", "--frames", "1600", "--num-envs", "4", "--steps-per-env", "50",
                         "--eval-every-frames", "800", "--eval-episodes", "4", "--out", str(tmp_path))
    assert result["frames"] == 1600
    assert len(result["eval_history"]) >= 2
    assert list(Path(result["log_dir"]).glob("events.out.tfevents.*"))


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ippo_improves_on_random_actions(seed: int, tmp_path: Path) -> None:
    """The bar of the learning-results table (docs/performance.rst): the final evaluation's mean team return beats
    the random policy's (measured over 1000 episodes) by at least MARGIN."""
    random = run_example("ippo_mpe.py", "--random-baseline", "1000", "--seed", str(seed), timeout=600)
    result = run_example("ippo_mpe.py", "--seed", str(seed), "--out", str(tmp_path), timeout=3000)
    assert result["last_eval_return"] >= random["random_mean_return"] + ippo_mpe.MARGIN, (result, random)
