"""MetaWorld's manipulation tasks as gymnasium envs seen from a camera: `env.id: metaworld/<task>` (any of MetaWorld's
50 MT1 tasks, e.g. metaworld/reach-v3) or `metaworld/MT10` (its ten MT10 tasks, one chosen at each reset).

The observation is a Dict: `image` (uint8 [height, width, 3] from one of the scene's cameras), `state` (the robot's
own: the hand's position and how far the gripper is open, float32 [4]) and `instruction` (gymnasium `Text`: the
task's sentence from INSTRUCTIONS, which the env rank turns into token ids, envs/text.py). The step's info has
`success` (bool); `metaworld_observation` holds MetaWorld's own 39-value vector (object and goal positions
included), which the scripted experts act on (spmd_rl.collect) and a policy should not see; `task`, the task's
name (an evaluation over MT10 reports success per task from it); a reset's info also names its configuration's
`task_index`.

Resets are reproducible: MetaWorld draws every initial state from a task configuration (50 per task), so
reset(seed=s) sets configuration s % n (n = 50; for MT10 n = 500, task s % 10 in MT10's order, its configuration
(s // 10) % 50) with MetaWorld's own sampling on reset off, and
seeds the generator that picks the configuration of each later reset without a seed. Envs given the same seed
(an episode group, env.group_size) start from the same state.

The gymnasium backend registers an id of this namespace when it probes it (`register`), after choosing how MuJoCo
renders without a display: EGL, else OSMesa (or MUJOCO_GL where it is set), each tried once per process in a
child interpreter, as a failing GL platform cannot be swapped in the process that loaded it.
"""

from __future__ import annotations

import difflib
import functools
import os
import subprocess
import sys
import warnings
from typing import Any

import gymnasium as gym
import numpy as np

from spmd_rl.config.excerpts import clip
from spmd_rl.runtime.errors import UserError

NAMESPACE = "metaworld"
MULTI_TASK = {"MT10": "MT10"}  # the env id's name -> MetaWorld's benchmark class
REWARDS = ("dense", "success")
# Why "success" exists: with terminate_on_success, MetaWorld's dense reward (up to 10 a step) pays more for an
# episode that hovers short of success until the step limit than for one that succeeds and ends: PPO from a
# reach-v3 SFT policy raised its return 272 -> 800 while its success fell to 0 (benchmarks/README.md, MetaWorld).
REWARDS_WHY = (
    '"dense" is MetaWorld\'s shaped reward, "success" pays 1 on a success step (with terminate_on_success, '
    "an earlier success is worth more; the return then measures success)"
)
RENDERERS = ("egl", "osmesa")  # MUJOCO_GL values tried in this order where MUJOCO_GL is not set
STATE_SIZE = 4  # the hand's x, y, z and the gripper's opening: the first four of MetaWorld's vector
# How async workers start (env.start_method=auto): the parent makes one env before they start (the probe, and
# gymnasium's AsyncVectorEnv to read its spaces), which starts the GL renderer's threads (Mesa's llvmpipe); a forked
# worker inherits the renderer's state without its threads and waits for them forever when it makes its own context.
WORKER_START_METHOD = "spawn"

# What each task asks, as an instruction a person would give.
INSTRUCTIONS = {
    "assembly-v3": "put the ring on the peg",
    "basketball-v3": "put the ball into the hoop",
    "bin-picking-v3": "move the cube from one bin to the other",
    "box-close-v3": "put the lid on the box",
    "button-press-topdown-v3": "press the button from the top",
    "button-press-topdown-wall-v3": "press the button behind the wall from the top",
    "button-press-v3": "press the button",
    "button-press-wall-v3": "press the button behind the wall",
    "coffee-button-v3": "press the button on the coffee machine",
    "coffee-pull-v3": "pull the mug away from the coffee machine",
    "coffee-push-v3": "push the mug under the coffee machine",
    "dial-turn-v3": "turn the dial",
    "disassemble-v3": "take the ring off the peg",
    "door-close-v3": "close the door",
    "door-lock-v3": "lock the door",
    "door-open-v3": "open the door",
    "door-unlock-v3": "unlock the door",
    "hand-insert-v3": "put the hand into the hole",
    "drawer-close-v3": "close the drawer",
    "drawer-open-v3": "open the drawer",
    "faucet-open-v3": "turn the faucet on",
    "faucet-close-v3": "turn the faucet off",
    "hammer-v3": "hammer the nail into the wall",
    "handle-press-side-v3": "press the handle down from the side",
    "handle-press-v3": "press the handle down",
    "handle-pull-side-v3": "pull the handle up from the side",
    "handle-pull-v3": "pull the handle up",
    "lever-pull-v3": "pull the lever up",
    "pick-place-wall-v3": "pick up the puck and place it behind the wall",
    "pick-out-of-hole-v3": "pick the puck out of the hole",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "plate-slide-v3": "slide the plate into the goal",
    "plate-slide-side-v3": "slide the plate into the goal from the side",
    "plate-slide-back-v3": "slide the plate back out of the goal",
    "plate-slide-back-side-v3": "slide the plate back out of the goal from the side",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "peg-unplug-side-v3": "unplug the peg from the side",
    "soccer-v3": "kick the ball into the goal",
    "stick-push-v3": "push the bottle with the stick",
    "stick-pull-v3": "pull the bottle with the stick",
    "push-v3": "push the puck to the goal",
    "push-wall-v3": "push the puck past the wall to the goal",
    "push-back-v3": "push the puck back to the goal",
    "reach-v3": "reach the goal",
    "reach-wall-v3": "reach the goal behind the wall",
    "shelf-place-v3": "place the puck on the shelf",
    "sweep-into-v3": "sweep the puck into the hole",
    "sweep-v3": "sweep the puck off the table",
    "window-open-v3": "open the window",
    "window-close-v3": "close the window",
}


def is_metaworld_id(env_id: str) -> bool:
    return env_id.partition("/")[0] == NAMESPACE


def register(env_id: str) -> str:
    """Register `env_id` (metaworld/<task> or metaworld/MT10) with gymnasium, after checking that MetaWorld is
    installed, the task exists and MuJoCo can render; returns the line saying which renderer was chosen. Every
    failure is a UserError of one line."""
    name = env_id.partition("/")[2]
    if name not in INSTRUCTIONS and name not in MULTI_TASK:
        known = [*MULTI_TASK, *INSTRUCTIONS]
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(f'{NAMESPACE}/{c}' for c in close)}?" if close else "MetaWorld's tasks are"
        listed = "" if close else f" {', '.join(known)}"
        raise UserError(f"env.id '{clip(env_id)}': MetaWorld has no task '{clip(name)}'; {hint}{listed}")
    try:
        import metaworld  # noqa: F401  (only to say how to install it; the envs import it when they are made)
    except ImportError as exc:
        raise UserError(
            f"env.id '{clip(env_id)}' needs MetaWorld ({clip(str(exc))}): pip install -e \".[metaworld]\""
        ) from None
    renderer = choose_renderer()
    if env_id not in gym.registry:
        gym.register(id=env_id, entry_point=f"{__name__}:MetaWorldEnv", kwargs={"task": name})
    return f"MetaWorld renders with MUJOCO_GL={renderer}"


@functools.cache
def choose_renderer() -> str:
    """MUJOCO_GL's value where it is set, else the first of RENDERERS that makes a GL context here; set in
    os.environ for gymnasium's MuJoCo renderer (and inherited by async workers). Each is tried in a child
    interpreter: a platform that fails to load cannot be replaced by another in the same process."""
    given = os.environ.get("MUJOCO_GL")
    failures = []
    for name in (given,) if given else RENDERERS:
        error = _renderer_error(name)
        if error is None:
            os.environ["MUJOCO_GL"] = name
            return name
        failures.append(f"{name}: {error}")
    platform = os.environ.get("PYOPENGL_PLATFORM")
    if given:
        advice = f"MUJOCO_GL={given} is set: unset it to let EGL or OSMesa be tried, or set another"
    elif platform and platform.lower() not in RENDERERS:
        advice = f"PYOPENGL_PLATFORM={clip(platform)} is set, which rules out both: unset it"
    else:
        advice = "install EGL (Debian: libegl1 libegl-mesa0) or OSMesa (libosmesa6), or set MUJOCO_GL"
    raise UserError(
        f"MetaWorld's camera images need headless rendering, and none works here ({'; '.join(failures)}): {advice}"
    )


def _renderer_error(name: str) -> str | None:
    """None when MuJoCo makes a GL context with MUJOCO_GL=name in a child interpreter, else its last error line."""
    probe = "import mujoco\ncontext = mujoco.GLContext(8, 8)\ncontext.make_current()\ncontext.free()\n"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe],
            env={**os.environ, "MUJOCO_GL": name},
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return "making a GL context took over 120 s"
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return clip(lines[-1] if lines else f"exit code {done.returncode}", 160)


def scripted_expert(task: str):
    """MetaWorld's scripted policy for `task` (metaworld.policies): get_action(MetaWorld's 39-value observation)."""
    from metaworld.policies import ENV_POLICY_MAP

    # Its controllers warn, at every step where it happens, that a response exceeds [-1, 1] and will be clipped:
    # spmd_rl.collect clips each action to the action space, so the warning says nothing to do.
    warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high", category=UserWarning)
    expert: Any = ENV_POLICY_MAP[task]  # typed as MetaWorld's abstract base; each entry is a task's concrete class
    return expert()


@functools.cache
def metaworld_benchmark(name: str, seed: int):
    """MetaWorld's benchmark object (its classes and task configurations) for a task or MT10; built once per
    process (MT10's takes seconds)."""
    import metaworld

    return getattr(metaworld, MULTI_TASK[name])(seed=seed) if name in MULTI_TASK else metaworld.MT1(name, seed=seed)


class MetaWorldEnv(gym.Env):
    """One MetaWorld task (or MT10's ten) from a camera: see the module's docstring for the observation and resets.

    task: a task name (reach-v3) or MT10; camera, width, height: the image; cheap_scene: no shadows, reflections or
    skybox (several times cheaper to render on a CPU); terminate_on_success: end the episode at the first success
    step (MetaWorld's own envs never terminate); reward: "dense" (MetaWorld's shaped reward, 0-10 a step) or
    "success" (1 on a success step, else 0); benchmark_seed: the seed MetaWorld draws the task configurations with."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 80}

    def __init__(
        self,
        task: str,
        camera: str = "corner2",
        width: int = 64,
        height: int = 64,
        cheap_scene: bool = True,
        terminate_on_success: bool = True,
        reward: str = "dense",
        benchmark_seed: int = 0,
        render_mode: str | None = None,
    ):
        if reward not in REWARDS:
            named = f"env.kwargs.reward={clip(str(reward))!r}"
            raise UserError(f"{named} is not one of {', '.join(REWARDS)}: {REWARDS_WHY}")
        self.reward = reward
        benchmark = metaworld_benchmark(task, benchmark_seed)
        self._classes = benchmark.train_classes
        self._tasks = interleaved_tasks(benchmark.train_tasks, list(self._classes))
        self._settings: dict[str, Any] = {
            "camera": camera,
            "width": width,
            "height": height,
            "cheap_scene": cheap_scene,
        }
        self._envs: dict[str, Any] = {}  # task name -> its MetaWorld env, made when a reset first needs it
        self.terminate_on_success = terminate_on_success
        self.render_mode = render_mode
        sentences = [INSTRUCTIONS[name] for name in self._classes]
        self.observation_space = gym.spaces.Dict(
            {
                "image": gym.spaces.Box(0, 255, (height, width, 3), dtype=np.uint8),
                "state": gym.spaces.Box(-np.inf, np.inf, (STATE_SIZE,), dtype=np.float32),
                "instruction": gym.spaces.Text(
                    max_length=max(map(len, sentences)), min_length=1, charset="".join(sorted(set("".join(sentences))))
                ),
            }
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, (4,), dtype=np.float32)
        self._active = self._env_for(self._tasks[0].env_name)  # made now: a wrong camera is said at once
        self._task_name = self._tasks[0].env_name
        self._image = np.zeros((height, width, 3), dtype=np.uint8)

    def _env_for(self, name: str):
        if name not in self._envs:
            self._envs[name] = make_task_env(self._classes[name], **self._settings)
        return self._envs[name]

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        import mujoco  # here, as in make_task_env: this module is imported where MuJoCo may not be installed

        super().reset(seed=seed)
        index = seed % len(self._tasks) if seed is not None else int(self.np_random.integers(len(self._tasks)))
        task = self._tasks[index]
        self._task_name, self._active = task.env_name, self._env_for(task.env_name)
        self._active.set_task(task)  # MetaWorld's own sampling on reset stays off: the configuration is this one
        raw, _ = self._active.reset()
        # Some tasks (push-v3) place their goal marker after MetaWorld's last kinematics pass of the reset, at a
        # height read from where the last episode left the puck: the first frame would show the marker there, and
        # a group's members (one seed, different pasts) would see different first images. One pass fixes it.
        mujoco.mj_forward(self._active.model, self._active.data)
        return self._observation(raw), {"metaworld_observation": raw, "task": task.env_name, "task_index": index}

    def step(self, action):
        raw, reward, terminated, truncated, info = self._active.step(np.asarray(action, dtype=np.float32))
        success = bool(info["success"])
        terminated = bool(terminated) or (self.terminate_on_success and success)
        return (
            self._observation(raw),
            float(success) if self.reward == "success" else float(reward),
            terminated,
            bool(truncated),
            {"success": success, "metaworld_observation": raw, "task": self._task_name},  # an episode's last step
        )  # names its task: evaluations of MT10 report per task

    def _observation(self, raw: np.ndarray) -> dict:
        # This env's GL context made current for every frame: another env of this process closing (an evaluation's
        # envs) leaves none current, and MuJoCo then renders black frames without an error.
        self._active.mujoco_renderer._get_viewer("rgb_array").make_context_current()
        self._image = np.ascontiguousarray(self._active.render()[::-1])  # MetaWorld's cameras see it upside down
        return {
            "image": self._image,
            "state": raw[:STATE_SIZE].astype(np.float32),
            "instruction": INSTRUCTIONS[self._task_name],
        }

    def render(self):
        return self._image  # the last observation's image (render_mode rgb_array: videos of what the policy saw)

    def close(self):
        for env in self._envs.values():
            env.close()
        self._envs.clear()


def interleaved_tasks(tasks: list, names: list[str]) -> list:
    """MetaWorld lists a benchmark's configurations task by task (MT10: 50 of reach-v3, then 50 of push-v3, ...);
    interleaved, configuration i is task i mod len(names), so consecutive seeds (an env rank's envs) play different
    tasks. One task's list is unchanged."""
    by_task: dict[str, list] = {name: [] for name in names}
    for task in tasks:
        by_task[task.env_name].append(task)
    return [column for row in zip(*by_task.values()) for column in row]


def make_task_env(env_class, camera: str, width: int, height: int, cheap_scene: bool):
    """One MetaWorld env rendering `camera` at width x height; a camera the scene lacks is a ValueError naming the
    ones it has."""
    import mujoco

    env = env_class(render_mode="rgb_array", camera_name=camera, width=width, height=height)
    model = env.model
    if mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera) < 0:
        names = [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)]
        env.close()
        raise ValueError(f"MetaWorld's scene has no camera '{clip(camera)}'; its cameras are {', '.join(names)}")
    if cheap_scene:
        scene = env.mujoco_renderer._get_viewer("rgb_array").scn  # the offscreen viewer gymnasium renders with
        for flag in (
            mujoco.mjtRndFlag.mjRND_SHADOW,
            mujoco.mjtRndFlag.mjRND_REFLECTION,
            mujoco.mjtRndFlag.mjRND_SKYBOX,
        ):
            scene.flags[flag] = 0
    return env
