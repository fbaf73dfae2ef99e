"""Headless rendering of policy rollouts to MP4 and GIF.

Pipeline::

    policy_fn, env --(jit: vmapped reset, lax.scan of env.step)--> joint positions [T+1, N, ...]
      --(host: the environment's own ``env.render``, MuJoCo's renderer)--> frames [F, H, N*W, 3]
      --(mediapy / ffmpeg: .mp4; Pillow: .gif)--> files

* **GL backend.** MuJoCo renders off-screen through OSMesa on CPU (Debian package
  ``libosmesa6``; software rasterisation) and EGL on a GPU. `setup_gl` picks one from
  ``$MUJOCO_GL`` or the JAX backend, and switches MuJoCo to it even if ``mujoco`` was
  imported first (the environment registry imports it).
* **Side by side.** ``num_envs`` environments, reset from different keys, are rendered
  separately and concatenated along the width.
* **Episodes.** The unwrapped environment runs ``episode_length`` control steps; once an
  environment reports ``done`` its frame is frozen (no auto-reset in a video).
* **Frame rate.** Frames are taken every ``stride`` control steps so that the video
  runs in real time at no more than ``max_fps`` (GIF players treat frame delays under
  20 ms as 100 ms, so 50 fps is the default ceiling).
* **Encoders.** MP4 (H.264) needs the ``ffmpeg`` binary (Debian ``ffmpeg``); GIF only
  needs Pillow.

Example::

    from rljax.control import render
    render.render_policy("runs/cartpole", "runs/cartpole/videos/rollout", num_envs=2)
    # -> rollout.mp4, rollout.gif

    # In a training loop: compiled once, called after each evaluation.
    video = render.EvalVideo(env, lambda p, obs: policy(p, obs), episode_length=500,
                             formats=("mp4",))
    video(params, f"{logdir}/videos/eval_{step:04d}")
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import time
import types
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
PolicyFn = Callable[[Array], Array]  # obs [N, D] -> actions [N, A]
ParamPolicyFn = Callable[[Any, Array], Array]  # (policy params, obs [N, D]) -> actions [N, A]

VIDEO_FORMATS = ("mp4", "gif")
_GL_BACKENDS = ("osmesa", "egl", "glfw")


def check_video_options(formats: Sequence[str], height: int, width: int) -> tuple[str, ...]:
  """Checks video settings before anything is built; returns ``formats`` as a tuple.

  Args:
    formats: a non-empty subset of `VIDEO_FORMATS` (``"mp4"``, ``"gif"``).
    height, width: pixels of each environment's view (ints; even for MP4, as H.264 needs).

  Raises:
    ValueError: another format, no format, or an odd ``height``/``width`` with MP4; the message
      names the value.
  """
  formats = _check_formats(formats)
  if "mp4" in formats and (height % 2 or width % 2):
    raise ValueError(f"MP4 needs even height and width, got {height}x{width}.")
  return formats


def _video_ext(path: str) -> str:
  """``path``'s extension, lower case, without the dot (``"mp4"`` for ``a/b.MP4``)."""
  return os.path.splitext(path)[1].lower().lstrip(".")


def _check_formats(formats: Sequence[str]) -> tuple[str, ...]:
  """``formats`` as a tuple; ValueError unless a non-empty subset of `VIDEO_FORMATS`."""
  formats = tuple(formats)
  if not formats or any(f not in VIDEO_FORMATS for f in formats):
    raise ValueError(
        f"video formats must be a non-empty subset of {VIDEO_FORMATS}, got {formats}.")
  return formats


class RenderError(RuntimeError):
  """Rendering cannot run here (no GL backend, no ffmpeg); the message says what to install."""


# -- GL set-up ---------------------------------------------------------------------------


def default_gl_backend() -> str:
  """``$MUJOCO_GL`` if set, else ``"egl"`` when JAX runs on a GPU, else ``"osmesa"``."""
  env = os.environ.get("MUJOCO_GL", "").strip().lower()
  if env:
    return env
  return "egl" if jax.default_backend() == "gpu" else "osmesa"


def setup_gl(backend: str | None = None) -> str:
  """Makes MuJoCo's renderer use a headless GL backend; returns the backend's name.

  Sets ``$MUJOCO_GL`` and ``$PYOPENGL_PLATFORM``. MuJoCo reads ``$MUJOCO_GL`` once, when
  ``mujoco`` is imported; if it was imported already with another backend, its GL
  context class (``mujoco.rendering.classic.gl_context.GLContext``, which
  ``mujoco.Renderer`` reads at construction) is replaced with the chosen backend's.
  Idempotent.

  Args:
    backend: ``"osmesa"``, ``"egl"`` or ``"glfw"`` (needs a display); default
      `default_gl_backend`.

  Raises:
    ValueError: an unknown backend name.
    RenderError: the backend's library cannot be loaded (e.g. OSMesa without the
      ``libosmesa6`` package), or PyOpenGL was already set up for another platform.
  """
  backend = (backend or default_gl_backend()).lower()
  if backend not in _GL_BACKENDS:
    raise ValueError(f"GL backend must be one of {_GL_BACKENDS}, got {backend!r}.")
  os.environ["MUJOCO_GL"] = backend
  if backend in ("osmesa", "egl"):
    platform = os.environ.get("PYOPENGL_PLATFORM")
    if platform and platform != backend and "OpenGL" in sys.modules:
      raise RenderError(
          f"PyOpenGL was already initialised for PYOPENGL_PLATFORM={platform!r}; set "
          f"MUJOCO_GL={backend} and PYOPENGL_PLATFORM={backend} before starting Python."
      )
    os.environ["PYOPENGL_PLATFORM"] = backend
  if "mujoco" in sys.modules:
    from mujoco.rendering.classic import gl_context

    if getattr(gl_context, "_MUJOCO_GL", None) != backend:
      gl_context.GLContext = _gl_context_class(backend)
      gl_context._MUJOCO_GL = backend
  return backend


def _gl_context_class(backend: str):
  hints = {
      "osmesa": "install OSMesa (Debian/Ubuntu: apt-get install libosmesa6)",
      "egl": "EGL needs a GPU driver with libEGL (NVIDIA: libnvidia-egl; Mesa: libegl1)",
      "glfw": "GLFW needs a display and the glfw package",
  }
  try:
    if backend == "osmesa":
      from mujoco.osmesa import GLContext
    elif backend == "egl":
      from mujoco.egl import GLContext
    else:
      from mujoco.glfw import GLContext
  except (ImportError, OSError, AttributeError) as e:
    raise RenderError(
        f"MuJoCo cannot use the {backend!r} GL backend ({e}); {hints[backend]}.") from e
  return GLContext


# -- rollout -----------------------------------------------------------------------------


def _is_playground(env) -> bool:
  from mujoco_playground._src import mjx_env

  return isinstance(env, mjx_env.MjxEnv)


def _render_fields(env, state) -> dict[str, Array]:
  """The arrays the environment's ``render`` reads: joint positions, velocities, mocap."""
  if _is_playground(env):
    d = state.data
    return dict(qpos=d.qpos, qvel=d.qvel, mocap_pos=d.mocap_pos, mocap_quat=d.mocap_quat,
                xfrc_applied=d.xfrc_applied)
  ps = state.pipeline_state
  fields = dict(q=ps.q, qd=ps.qd)
  if hasattr(ps, "mocap_pos") and hasattr(ps, "mocap_quat"):
    fields.update(mocap_pos=ps.mocap_pos, mocap_quat=ps.mocap_quat)
  return fields


def make_rollout_fn(env, policy_fn: ParamPolicyFn, *, num_envs: int, num_steps: int,
                    action_repeat: int = 1) -> Callable[[Any, Array], tuple[dict, Array, Array]]:
  """``jit(policy_params, key) -> (fields, dones, rewards)``: ``num_envs`` episodes.

  The policy's parameters are an argument, so one compiled rollout serves every
  evaluation of a training run.

  Args:
    env: an unwrapped environment from ``rljax.envs.make``.
    policy_fn: ``(policy_params, obs [N, D]) -> actions [N, A]`` in ``[-1, 1]``, jittable.
    num_envs: ``N``, episodes rolled out in parallel (``jax.vmap``).
    num_steps: control steps ``T``.
    action_repeat: physics steps per action, as in training.

  Returns:
    A jitted function of the policy's parameters (any pytree) and a PRNG key, returning
    ``fields`` (dict of ``[T+1, N, ...]``
    arrays that `render_frames` needs, frozen after each environment's first ``done``),
    ``dones [T+1, N]`` bool (done at or before that step) and ``rewards [T, N]``
    float32 (zero after ``done``).
  """
  reset = jax.vmap(env.reset)

  def step_one(state, action):
    def repeat(s, _):
      return env.step(s, action), ()
    state, _ = jax.lax.scan(repeat, state, None, length=action_repeat)
    return state

  step = jax.vmap(step_one)

  def rollout(policy_params, key):
    state = reset(jax.random.split(key, num_envs))
    fields0 = _render_fields(env, state)
    done0 = jnp.zeros((num_envs,), bool)

    def body(carry, _):
      state, fields, done = carry
      state = step(state, policy_fn(policy_params, state.obs))
      reward = jnp.where(done, 0.0, state.reward)
      new_done = done | (state.done > 0)
      keep = lambda old, new: jnp.where(
          done.reshape(done.shape + (1,) * (new.ndim - 1)), old, new)
      fields = jax.tree.map(keep, fields, _render_fields(env, state))
      return (state, fields, new_done), (fields, new_done, reward)

    _, (fields, dones, rewards) = jax.lax.scan(
        body, (state, fields0, done0), None, length=num_steps)
    stack0 = lambda x0, xs: jnp.concatenate([x0[None], xs], axis=0)
    return (jax.tree.map(stack0, fields0, fields), stack0(done0, dones), rewards)

  return jax.jit(rollout)


# -- frames and files ----------------------------------------------------------------------


def _mj_model(env):
  return env.mj_model if _is_playground(env) else env.sys.mj_model


def check_camera(env, camera: str | int | None) -> str | int | None:
  """Returns ``camera`` if the model has it (``None``/``-1``: the free camera).

  Raises:
    ValueError: naming the model's cameras, for an unknown name or index.
  """
  model = _mj_model(env)
  names = [model.camera(i).name for i in range(model.ncam)]
  if camera is None or camera == -1:
    return camera
  if isinstance(camera, str) and camera.lstrip("-").isdigit():
    camera = int(camera)
  if (isinstance(camera, int) and 0 <= camera < model.ncam) or camera in names:
    return camera
  raise ValueError(
      f"camera {camera!r} is not in this model; its cameras are {names or 'none'} "
      f"(or indices 0..{model.ncam - 1}); -1 or None is the free camera."
  )


@contextlib.contextmanager
def _no_playground_progress_bar():
  """Playground's ``render_array`` wraps the frames in its own ``tqdm`` bar, which printed a
  ``0/501`` line per video into training logs (also under ``--noprogress``) and broke the
  run's own bar. Inside this context that module's ``tqdm.tqdm`` passes the frames through."""
  try:
    from mujoco_playground._src import mjx_env
  except ImportError:  # not a Playground install: nothing to silence
    yield
    return
  saved = getattr(mjx_env, "tqdm", None)
  if saved is None:
    yield
    return
  mjx_env.tqdm = types.SimpleNamespace(tqdm=lambda iterable, *args, **kwargs: iterable)
  try:
    yield
  finally:
    mjx_env.tqdm = saved


def render_frames(env, fields: dict[str, np.ndarray], *, camera: str | int | None = None,
                  height: int = 240, width: int = 320, stride: int = 1,
                  gl_backend: str | None = None) -> np.ndarray:
  """Renders rollout ``fields`` (``[T+1, N, ...]``) with the environment's own ``render``.

  Args:
    env: the unwrapped environment (Playground ``MjxEnv`` or Brax ``PipelineEnv``).
    fields: from `make_rollout_fn` (host or device arrays).
    camera: camera name or index (`check_camera`); ``None`` is the default camera.
    height, width: pixels per environment.
    stride: render every ``stride``-th step (the first and last are always included).
    gl_backend: see `setup_gl` (called here).

  Returns:
    ``uint8 [F, height, N * width, 3]``, environments left to right.

  Raises:
    RenderError: no usable GL backend.
  """
  setup_gl(gl_backend)
  fields = jax.device_get(fields)
  num_steps, num_envs = next(iter(fields.values())).shape[:2]
  steps = list(range(0, num_steps, stride))
  if steps[-1] != num_steps - 1:
    steps.append(num_steps - 1)
  playground = _is_playground(env)
  columns = []
  for i in range(num_envs):
    if playground:
      traj = [types.SimpleNamespace(data=types.SimpleNamespace(
          **{k: v[t, i] for k, v in fields.items()})) for t in steps]
    else:
      traj = [types.SimpleNamespace(**{k: v[t, i] for k, v in fields.items()}) for t in steps]
    with _no_playground_progress_bar():
      columns.append(np.stack(env.render(traj, height=height, width=width, camera=camera)))
  return np.concatenate(columns, axis=2)


def _gif_images(frames: np.ndarray, palette_frames: int = 16) -> list:
  """``uint8 [F, H, W, 3]`` frames as Pillow ``P`` images that share one 256-colour palette.

  The palette is Pillow's octree quantisation of ``palette_frames`` evenly spaced frames, and
  every frame is mapped to it without dithering: unchanged pixels keep their index from frame
  to frame, so the GIF stores mostly the moving bodies: about a tenth of the size and time of a
  palette per frame, within 12/255 per channel (octree keeps small bright bodies such as the
  pole, which median cut merges into the floor).
  """
  from PIL import Image

  pick = np.linspace(0, len(frames) - 1, min(palette_frames, len(frames))).astype(int)
  palette = Image.fromarray(np.concatenate(frames[pick], axis=0)).quantize(
      colors=256, method=Image.Quantize.FASTOCTREE)
  return [Image.fromarray(f).quantize(palette=palette, dither=Image.Dither.NONE) for f in frames]


def write_video(frames: np.ndarray, path: str, *, fps: float) -> str:
  """Writes ``uint8 [F, H, W, 3]`` frames to ``path`` (``.mp4`` or ``.gif``); returns it.

  Raises:
    ValueError: another extension, or odd ``H``/``W`` for MP4 (H.264 needs even sizes).
    RenderError: MP4 without an ``ffmpeg`` binary.
  """
  ext = _video_ext(path)
  if ext not in VIDEO_FORMATS:
    raise ValueError(f"video path must end in .mp4 or .gif, got {path!r}.")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  if ext == "gif":
    images = _gif_images(frames)
    images[0].save(path, save_all=True, append_images=images[1:],
                   duration=max(int(round(1000.0 / fps)), 20), loop=0)
    return path
  if frames.shape[1] % 2 or frames.shape[2] % 2:
    raise ValueError(
        f"MP4 (H.264) needs even frame sizes, got {frames.shape[1]}x{frames.shape[2]}.")
  if shutil.which("ffmpeg") is None:
    raise RenderError(
        "writing MP4 needs the ffmpeg binary (Debian/Ubuntu: apt-get install ffmpeg).")
  import mediapy

  mediapy.write_video(path, frames, fps=fps)
  return path


# -- one call --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RenderResult:
  """What `render_rollout` wrote.

  Attributes:
    paths: the video files.
    frames_shape: ``(F, H, N * W, 3)``.
    fps: frames per second (real time).
    episode_rewards: ``[N]`` return of each rendered episode.
    episode_lengths: ``[N]`` steps before ``done`` (``num_steps`` if never done).
  """

  paths: tuple[str, ...]
  frames_shape: tuple[int, ...]
  fps: float
  episode_rewards: np.ndarray
  episode_lengths: np.ndarray


def _video_paths(path: str, formats: Sequence[str]) -> list[str]:
  """The files a call with ``path`` writes: ``path`` itself when it ends in ``.mp4``/``.gif``,
  else ``path.<f>`` for each of ``formats`` (checked)."""
  if _video_ext(path) in VIDEO_FORMATS:
    return [path]
  return [f"{path}.{f}" for f in _check_formats(formats)]


class EvalVideo:
  """Writes videos of a policy's episodes; compiled once, called at every evaluation.

  ``EvalVideo(env, policy_fn, ...)(policy_params, path, key)`` rolls out
  ``policy_fn(policy_params, obs)``, renders and writes the video(s). The rollout is
  jitted with the parameters as an argument, so only the first call compiles.

  Args:
    env: an unwrapped environment (``rljax.envs.make``), e.g. the one a trainer wraps.
    policy_fn: ``(policy_params, obs [N, D]) -> actions [N, A]`` in ``[-1, 1]``, jittable.
    num_envs: episodes shown side by side.
    episode_length: environment steps (after action repeat) per episode.
    action_repeat: physics steps per action (the run's ``action_repeat``).
    camera: camera name or index; ``None`` is the environment's default camera.
    height, width: pixels of each environment's view (even numbers for MP4).
    max_fps: frame-rate ceiling; steps are skipped to stay under it in real time.
    formats: written when a call's ``path`` has no video extension.
    gl_backend: see `setup_gl`.

  Raises:
    ValueError: bad sizes or camera (at construction, before anything compiles).
    RenderError: (on call) no usable GL backend or ffmpeg.
  """

  def __init__(self, env, policy_fn: ParamPolicyFn, *, num_envs: int = 1,
               episode_length: int = 1000, action_repeat: int = 1,
               camera: str | int | None = None, height: int = 240, width: int = 320,
               max_fps: float = 50.0, formats: Sequence[str] = VIDEO_FORMATS,
               gl_backend: str | None = None):
    for name, value in (("num_envs", num_envs), ("episode_length", episode_length),
                        ("action_repeat", action_repeat), ("height", height), ("width", width)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if not max_fps > 0:
      raise ValueError(f"max_fps must be > 0, got {max_fps!r}.")
    _check_formats(formats)
    self.env = env
    self.camera = check_camera(env, camera)
    self.height, self.width = height, width
    self.formats = tuple(formats)
    self.gl_backend = gl_backend
    self.num_steps = max(episode_length // action_repeat, 1)
    step_s = float(env.dt) * action_repeat
    self.stride = max(1, math.ceil(1.0 / (step_s * max_fps)))
    self.fps = 1.0 / (step_s * self.stride)
    self.rollout = make_rollout_fn(env, policy_fn, num_envs=num_envs, num_steps=self.num_steps,
                                   action_repeat=action_repeat)

  def __call__(self, policy_params, path: str, key: Array | None = None, *,
               log: Callable[[str], None] | None = None) -> RenderResult:
    """Renders episodes from ``key`` (default ``PRNGKey(0)``) to ``path``; see `render_rollout`.
    ``log``, if given, receives one line as each phase starts and one with its time when the
    whole call ends."""
    paths = _video_paths(path, self.formats)
    check_video_options([_video_ext(p) for p in paths], self.height, self.width)
    say = log or (lambda _: None)
    t0 = time.perf_counter()
    backend = setup_gl(self.gl_backend)
    key = jax.random.PRNGKey(0) if key is None else key
    say(f"rolling out {self.num_steps} steps (compiled at the first call)")
    fields, dones, rewards = jax.device_get(self.rollout(policy_params, key))
    t1 = time.perf_counter()
    say(f"rendering {math.ceil(self.num_steps / self.stride) + 1} frames per environment with "
        f"{backend}")
    frames = render_frames(self.env, fields, camera=self.camera, height=self.height,
                           width=self.width, stride=self.stride, gl_backend=self.gl_backend)
    t2 = time.perf_counter()
    say(f"encoding {', '.join(paths)}")
    written = tuple(write_video(frames, p, fps=self.fps) for p in paths)
    say(f"rollout {t1 - t0:.1f} s, rendering {t2 - t1:.1f} s, encoding "
        f"{time.perf_counter() - t2:.1f} s")
    lengths = np.where(dones[-1], np.argmax(dones, axis=0), self.num_steps)
    return RenderResult(written, frames.shape, self.fps, rewards.sum(axis=0), lengths)


def render_rollout(
    env: Any,
    policy_fn: PolicyFn,
    path: str,
    *,
    key: Array | None = None,
    env_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    **options: Any,
) -> RenderResult:
  """Rolls out ``policy_fn`` once and writes the video(s).

  Args:
    env: a registry name (``"playground/CartpoleBalance"``) or an unwrapped environment.
    policy_fn: ``obs [N, D] -> actions [N, A]`` in ``[-1, 1]``, jittable (e.g. from
      ``trainer.load_policy`` or ``export.make_inference_fn``).
    path: ``*.mp4`` or ``*.gif`` for one file, or a stem to which ``.mp4``/``.gif``
      (``formats``) are appended.
    key: PRNG key of the resets; default ``PRNGKey(0)``.
    env_kwargs: for ``rljax.envs.make`` when ``env`` is a name.
    log: receives a line as each phase (build, rollout, rendering, encoding) starts.
    **options: `EvalVideo`'s keyword arguments (``num_envs``, ``episode_length``,
      ``action_repeat``, ``camera``, ``height``, ``width``, ``max_fps``, ``formats``,
      ``gl_backend``).

  Returns:
    `RenderResult`.

  Raises:
    ValueError: bad sizes, camera or formats (before anything compiles).
    RenderError: no usable GL backend or ffmpeg.
  """
  _video_paths(path, options.get("formats", VIDEO_FORMATS))
  if isinstance(env, str):
    from rljax import envs

    if log is not None:
      log(f"building {env}")
    env = envs.make(env, **(env_kwargs or {}))
  video = EvalVideo(env, lambda _, obs: policy_fn(obs), **options)
  return video((), path, key, log=log)


def _run_config(saved: dict) -> dict:
  return saved.get("control") or saved.get("apg") or {}


def render_policy(logdir: str, path: str | None = None, *, step: int | None = None,
                  episode_length: int | None = None, **kwargs: Any) -> RenderResult:
  """Renders the policy saved in ``logdir`` (PPO or APG run) on its training environment.

  Args:
    logdir: run folder with ``checkpoints/config.json``.
    path: output path or stem; default ``<logdir>/videos/rollout`` (``.mp4`` + ``.gif``).
    step: checkpoint step; default the latest.
    episode_length: default the run's episode length (or the environment's default).
    **kwargs: the rest of `render_rollout`'s options (``num_envs``, ``camera``, ...).

  Raises:
    FileNotFoundError: no checkpoint under ``logdir``.
  """
  from rljax import checkpoint as ckpt
  from rljax import envs
  from rljax.control.policy import load_policy

  run = _run_config(ckpt.read_config(logdir))
  if not run.get("env"):
    raise FileNotFoundError(f"{logdir!r} has no environment name in checkpoints/config.json.")
  policy = load_policy(logdir, step=step, deterministic=True)
  episode_length = (episode_length or run.get("episode_length")
                    or envs.default_episode_length(run["env"]))
  kwargs.setdefault("action_repeat", int(run.get("action_repeat", 1)))
  kwargs.setdefault("env_kwargs", dict(run.get("env_kwargs") or ()))
  return render_rollout(
      run["env"], lambda obs: policy(obs), path or os.path.join(logdir, "videos", "rollout"),
      episode_length=int(episode_length), **kwargs,
  )


__all__ = [
    "EvalVideo",
    "RenderError",
    "RenderResult",
    "check_camera",
    "default_gl_backend",
    "make_rollout_fn",
    "render_frames",
    "render_policy",
    "render_rollout",
    "setup_gl",
    "write_video",
]
