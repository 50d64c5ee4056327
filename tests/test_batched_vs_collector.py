"""Each form of batched env gives ``ThreadedCollector`` the data TorchRL's ``Collector`` computes from it.

A batched env is taken apart into single envs only where that is provably what ``Collector`` computes (a
``SerialEnv`` / ``ParallelEnv`` of single envs, alone or under transforms that keep no state of their own); every
other form is stepped as it is, as ``Collector`` steps it. Each form is run by both collectors on the same
env and compared leaf by leaf: keys, shapes, dtypes, values (the envs are deterministic, or seeded alike), done
flags, episode ends. Whether a form was taken apart is told by the env given: a taken-apart env is closed at
construction, a natively stepped one is not.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import gymnasium as gym
import psutil
import pytest
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDictBase
from torchrl.collectors import Collector
from torchrl.envs import (CatFrames, Compose, DoubleToFloat, DTypeCastTransform, EnvBase, GymEnv, GymWrapper,
                          InitTracker, ObservationNorm, ParallelEnv, RewardSum, SerialEnv, StepCounter,
                          TransformedEnv)
from torchrl.testing.mocking_classes import CountingEnv

from lightning_rollout import ThreadedCollector

pytestmark = pytest.mark.timeout(120)

STARTS = [0, 10, 20]  # env i counts up from 10 * i: a frame of another env is told by its value


def counting(start: int = 0, dtype: torch.dtype = torch.int32) -> EnvBase:
    """Counts ``start, start + 1, ...`` by its action (1 here); done after 5 steps; observation of ``dtype``."""
    env = CountingEnv(max_steps=start + 4, start_val=start)
    if dtype == torch.int32:
        return env
    return TransformedEnv(env, DTypeCastTransform(torch.int32, dtype, in_keys=["observation"]))


def serial(dtype: torch.dtype = torch.int32, cls: type = SerialEnv) -> EnvBase:
    return cls(len(STARTS), functools.partial(counting, dtype=dtype),
               create_env_kwargs=[{"start": s} for s in STARTS])


def ones_policy(td: TensorDictBase) -> TensorDictBase:
    return td.set("action", torch.ones((*td.shape, 1), dtype=torch.int))


def push_right(td: TensorDictBase) -> TensorDictBase:
    """CartPole's one-hot action 1, always: the pole falls in about 10 steps, the same in either collector."""
    action = torch.zeros((*td.shape, 2), dtype=torch.int64)
    action[..., 1] = 1
    return td.set("action", action)


def leaves(td: TensorDictBase) -> dict:
    return dict(td.items(include_nested=True, leaves_only=True))


def assert_same_batches(expected: list[TensorDictBase], got: list[TensorDictBase]) -> None:
    """Equal batch sizes, dim names, keys, dtypes and values (done flags and episode ends included), batch by batch."""
    assert len(got) == len(expected)
    for theirs, ours in zip(expected, got, strict=True):
        assert ours.batch_size == theirs.batch_size and ours.names == theirs.names
        want, have = leaves(theirs), leaves(ours)
        assert set(have) == set(want)
        for key, value in want.items():
            assert have[key].dtype == value.dtype, key
            assert torch.equal(have[key], value), (key, value, have[key])


def batches(collector_cls: type, env: EnvBase | Callable[[], EnvBase] | gym.vector.VectorEnv,
            policy: Callable[[TensorDictBase], TensorDictBase], *, frames_per_batch: int, count: int = 2,
            **kwargs) -> list[TensorDictBase]:
    extra = {"auto_register_policy_transforms": False} if collector_cls is Collector else {}
    collector = collector_cls(env, policy, frames_per_batch=frames_per_batch, total_frames=frames_per_batch * count,
                              **extra, **kwargs)
    try:
        return list(collector)
    finally:
        collector.shutdown()


def ours_and_closed(env: EnvBase, policy: Callable, **kwargs) -> tuple[list[TensorDictBase], bool]:
    """``ThreadedCollector``'s batches of ``env``, and whether the collector closed ``env`` at construction (it took
    it apart)."""
    collector = ThreadedCollector(env, policy, total_frames=kwargs["frames_per_batch"] * 2, **kwargs)
    try:
        closed = env.is_closed
        return list(collector), closed
    finally:
        collector.shutdown()


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchRL's FutureWarnings about its own defaults
        yield


# -- taken apart: a SerialEnv / ParallelEnv alone or under transforms that keep no state of their own -------------
def sota_td3(cls: type = ParallelEnv) -> EnvBase:
    """The train env of TorchRL's sota TD3 / SAC / DDPG scripts (``sota-implementations/td3/utils.py``)."""
    return TransformedEnv(serial(torch.float64, cls=cls),
                          Compose(StepCounter(max_steps=3), InitTracker(), DoubleToFloat(), RewardSum()))


TAKEN_APART: dict[str, Callable[[], EnvBase]] = {
    "SerialEnv": serial,
    "InitTracker": lambda: TransformedEnv(serial(), InitTracker()),
    "StepCounter(max_steps=3)": lambda: TransformedEnv(serial(), StepCounter(max_steps=3)),  # truncates episodes
    "RewardSum": lambda: TransformedEnv(serial(), RewardSum()),
    "DoubleToFloat": lambda: TransformedEnv(serial(torch.float64), DoubleToFloat()),
    "sota TD3": sota_td3,
    "two TransformedEnvs": lambda: TransformedEnv(TransformedEnv(serial(), InitTracker()), RewardSum()),
}
# TorchRL's data for a ParallelEnv form is its SerialEnv twin's (TorchRL gives both the same data; a ParallelEnv's
# worker processes take a minute to start on a loaded 2-core machine, and ours, taken apart, never start)
SERIAL_TWIN = {"sota TD3": functools.partial(sota_td3, SerialEnv)}


@pytest.mark.parametrize("form", list(TAKEN_APART))
def test_a_batched_env_under_stateless_transforms_is_taken_apart_into_torchrls_data(form):
    expected = batches(Collector, SERIAL_TWIN.get(form, TAKEN_APART[form])(), ones_policy, frames_per_batch=21)
    got, closed = ours_and_closed(TAKEN_APART[form](), ones_policy, frames_per_batch=21)
    assert closed, "taken apart into single envs: the batched env is closed"
    assert got[0]["next", "done"].any()
    assert_same_batches(expected, got)


# -- stepped as it is: transforms with state or per-row parameters, unknown transforms ----------------------------
class OwnStepCounter(StepCounter):
    """A transform of the user's own (a subclass may keep state its base class does not)."""


NATIVE: dict[str, Callable[[], EnvBase]] = {
    "CatFrames float32": lambda: TransformedEnv(serial(torch.float32), CatFrames(N=3, dim=-1, in_keys=["observation"])),
    "CatFrames int32": lambda: TransformedEnv(serial(), CatFrames(N=3, dim=-1, in_keys=["observation"])),
    "ObservationNorm loc [3, 1]": lambda: TransformedEnv(serial(torch.float32), ObservationNorm(
        loc=torch.tensor([[0.0], [10.0], [20.0]]), scale=2.0, in_keys=["observation"])),
    "a transform of its own": lambda: TransformedEnv(serial(), OwnStepCounter(max_steps=3)),
    "SerialEnv of SerialEnv": lambda: SerialEnv(2, serial),
}


@pytest.mark.parametrize("form", list(NATIVE))
def test_a_batched_env_under_a_transform_with_state_is_stepped_as_it_is_as_torchrls_collector_steps_it(form):
    expected = batches(Collector, NATIVE[form](), ones_policy, frames_per_batch=42)
    got, closed = ours_and_closed(NATIVE[form](), ones_policy, frames_per_batch=42)
    assert not closed, "stepped as it is, not taken apart"
    assert got[0]["next", "done"].any()
    assert_same_batches(expected, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32], ids=str)
def test_catframes_stacks_each_envs_own_frames(dtype):
    """Issue 46 A2: taken apart, the clones of one ``CatFrames`` shared its buffer (a float stack ``[1, 1, 2]`` where
    TorchRL has ``[0, 1, 2]``; int32 observations refused with a dtype error)."""
    make = NATIVE[f"CatFrames {str(dtype).removeprefix('torch.')}"]
    expected = batches(Collector, make(), ones_policy, frames_per_batch=21)
    got = batches(ThreadedCollector, make(), ones_policy, frames_per_batch=21)
    for batch in got:
        stacks = batch["next", "observation"]
        assert stacks.dtype == dtype and stacks.shape == (3, 7, 3)
        for row, start in enumerate(STARTS):  # "same" padding: a new episode's stack is its first frame, 3 times
            assert ((stacks[row] >= start) & (stacks[row] <= start + 5)).all(), stacks[row]
    assert_same_batches(expected, got)


# -- GymEnv(num_envs=k): stepped as it is (its VecGymEnvTransform relies on the vector env resetting itself) ---------
def cartpoles() -> EnvBase:
    env = GymEnv("CartPole-v1", num_envs=2)
    env.set_seed(5)
    return env


@pytest.fixture(scope="module")
def cartpoles_by_torchrl() -> list[TensorDictBase]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return batches(Collector, cartpoles(), push_right, frames_per_batch=60)


@pytest.mark.parametrize("given", ["instance", "lone factory"])
def test_gym_env_with_num_envs_runs_past_episode_ends_as_torchrls_collector(given, cartpoles_by_torchrl):
    """Issue 46 A1: taken apart, each single env skipped its real reset: CartPole stepped past termination with no
    episode end, then ``EnvError ... 'observation' contains NaN``."""
    got = batches(ThreadedCollector, cartpoles() if given == "instance" else cartpoles, push_right,
                  frames_per_batch=60)
    done = torch.cat([batch["next", "done"] for batch in got], dim=1)
    assert (done.sum(dim=1) >= 3).all(), "several episode ends in each env"
    assert not any(batch["next", "observation"].isnan().any() for batch in got)
    assert_same_batches(cartpoles_by_torchrl, got)


# -- gymnasium vector envs: stepped as TorchRL's GymWrapper steps them -----------------------------------------------
def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


VECTOR_FORMS: dict[str, Callable[[], gym.vector.VectorEnv]] = {
    "make_vec sync SAME_STEP": lambda: gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync",
                                                    vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP}),
    "SyncVectorEnv DISABLED": lambda: gym.vector.SyncVectorEnv([cartpole] * 3, autoreset_mode=AutoresetMode.DISABLED),
}


@pytest.mark.parametrize("form", list(VECTOR_FORMS))
def test_a_gymnasium_vector_env_gives_the_batches_of_torchrls_collector_of_its_gym_wrapper(form):
    wrapped = GymWrapper(VECTOR_FORMS[form]())
    wrapped.set_seed(3)
    expected = batches(Collector, wrapped, push_right, frames_per_batch=60)
    got = batches(ThreadedCollector, VECTOR_FORMS[form](), push_right, frames_per_batch=60, seed=3)
    assert got[0]["next", "done"].any() and (got[0]["next", "reward"] == 1).all()  # no reset step is a frame
    assert_same_batches(expected, got)


def test_gymnasiums_own_vector_cartpole_is_refused_as_torchrl_refuses_it_naming_what_to_pass():
    """Issue 46 A4: ``gym.make_vec("CartPole-v1", num_envs=4)`` is gymnasium's ``CartPoleVectorEnv``, which resets
    an env at the step after its end (``NEXT_STEP``, in its metadata only); TorchRL's ``GymWrapper`` does not take
    it (an ``AttributeError`` on its missing ``autoreset_mode``), so ``Collector`` cannot step it either."""
    with pytest.raises(AttributeError, match="autoreset_mode"):
        GymWrapper(gym.make_vec("CartPole-v1", num_envs=4))
    with pytest.raises(ValueError, match=r"CartPoleVectorEnv with autoreset_mode=NEXT_STEP.*GymWrapper.*SAME_STEP or "
                                         r"DISABLED.*vectorization_mode='sync'.*factory of one env"):
        ThreadedCollector(gym.make_vec("CartPole-v1", num_envs=4), None, frames_per_batch=8)


def test_a_gymnasium_vector_env_resetting_at_the_next_step_is_refused_with_what_to_pass():
    env = gym.vector.SyncVectorEnv([cartpole] * 2)  # gymnasium's default autoreset mode, NEXT_STEP
    with pytest.raises(RuntimeError, match="SAME_STEP or DISABLED"):
        GymWrapper(gym.vector.SyncVectorEnv([cartpole] * 2))
    with pytest.raises(ValueError, match="SyncVectorEnv with autoreset_mode=NEXT_STEP.*SAME_STEP"):
        ThreadedCollector(env, None, frames_per_batch=8)


# -- A6: a natively stepped instance runs in this process ------------------------------------------------------------
@pytest.mark.parametrize("envs_per_thread", [2, "auto"])
def test_a_natively_stepped_instance_with_num_workers_2_is_refused_naming_what_to_do(envs_per_thread):
    """Issue 46 A6: with ``envs_per_thread`` given, an ``EnvError`` claiming phase "reset" at step 0; with
    ``"auto"``, the explicit ``num_workers=2`` silently became 1."""
    env = CountingEnv(max_steps=4, batch_size=[2])  # an EnvBase built batched: stepped as it is
    with pytest.raises(ValueError, match=r"num_workers=2 with a batched env instance \(CountingEnv, "
                                         r"batch_size=\(2,\)\).*pass num_workers=1, or a factory of it with num_envs "
                                         r"a multiple of 2"):
        ThreadedCollector(env, ones_policy, frames_per_batch=4, num_workers=2, envs_per_thread=envs_per_thread)
    assert env.is_closed


# -- A5: Ctrl-C while a natively stepped ParallelEnv runs ------------------------------------------------------------
_CTRL_C_SCRIPT = """
import atexit, functools, signal, sys

if __name__ == "__main__":  # (not in the ParallelEnv's worker processes, which import this script)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit.register(lambda: print("EXITED", flush=True))  # registered first, so it runs last: not after os._exit

from torchrl.envs import GymEnv, ParallelEnv
from lightning_rollout import ThreadedCollector

if __name__ == "__main__":
    collector = ThreadedCollector(functools.partial(ParallelEnv, 2, functools.partial(GymEnv, "CartPole-v1")), None,
                                  num_envs=2, frames_per_batch=20, total_frames=-1)
    try:
        for i, batch in enumerate(collector):
            if i == 2:
                print("READY", flush=True)
    except KeyboardInterrupt:
        print("CAUGHT", flush=True)
        sys.exit(130)
"""


@pytest.mark.timeout(180)  # the script and its two worker processes each import torch
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_while_a_natively_stepped_parallel_env_runs_reaches_the_caller_in_under_a_second(tmp_path):
    """Issue 46 A5: it reached the caller after 3.6-5.1 s, with two TorchRL worker tracebacks, the process ending
    through ``os._exit``. Ctrl-C in a terminal signals the whole process group: the script and the ParallelEnv's
    worker processes."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(textwrap.dedent(_CTRL_C_SCRIPT))
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=root, env=env, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read() if proc.poll() is not None else ""
        started = psutil.Process(proc.pid).children(recursive=True)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        line = proc.stdout.readline().strip()
        caught_after = time.monotonic() - sent
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, alive = psutil.wait_procs(started, timeout=5)
    problems = [problem for problem, seen in [
        (f"KeyboardInterrupt reached the caller after {caught_after:.2f} s", line == "CAUGHT" and caught_after >= 1),
        (f"no KeyboardInterrupt reached the caller (its first line after SIGINT: {line!r})", line != "CAUGHT"),
        (f"exit status {proc.returncode}", proc.returncode != 130),
        ("the process ended without running its exit hooks (os._exit)", "EXITED" not in out),
        (f"left running: {[p.pid for p in alive]}", bool(alive)),
        (f"stderr: {err}", "Traceback" in err or "abandoned" in err),
    ] if seen]
    assert not problems, "\n".join(problems)
