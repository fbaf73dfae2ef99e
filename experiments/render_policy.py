r"""Render a trained policy's episode to MP4 and GIF, headless.

    python experiments/render_policy.py --logdir=runs/cartpole
    python experiments/render_policy.py --logdir=runs/cartpole --num_envs=3 --camera=fixed \
        --episode_length=300 --video_size=240,320 --out=videos/cartpole          # videos/cartpole.{mp4,gif}

MuJoCo renders through OSMesa on CPU (``apt-get install libosmesa6``) and EGL on a GPU
(``--gl_backend`` overrides); MP4 needs ``ffmpeg``. Everything else is in
``rljax.control.render``.
"""

from __future__ import annotations

import sys

from absl import app, flags

from rljax import cli, runtime

_LOGDIR = flags.DEFINE_string("logdir", None, "Run folder with checkpoints/ (PPO or APG).", required=True)
_OUT = flags.DEFINE_string(
    "out", None, "Output path: *.mp4, *.gif, or a stem for both (default <logdir>/videos/rollout).")
_FORMATS = flags.DEFINE_list("formats", ["mp4", "gif"], "Formats written when --out is a stem.")
_CAMERA = flags.DEFINE_string("camera", None, "Camera name or index (default: the model's default view).")
_NUM_ENVS = flags.DEFINE_integer("num_envs", 1, "Episodes rendered side by side.")
_EPISODE_LENGTH = flags.DEFINE_integer("episode_length", None, "Steps (default: the run's episode length).")
_VIDEO_SIZE = cli.define_video_size_flag()
# Old spellings of --video_size, kept for one release.
_HEIGHT = flags.DEFINE_integer("height", None, "Deprecated: the height of --video_size.")
_WIDTH = flags.DEFINE_integer("width", None, "Deprecated: the width of --video_size.")
_MAX_FPS = flags.DEFINE_float("max_fps", 50.0, "Frame-rate ceiling; steps are skipped to stay real time.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the episodes' initial states.")
_GL = flags.DEFINE_enum("gl_backend", None, ["osmesa", "egl", "glfw"], "GL backend (default: osmesa on CPU, egl on GPU).")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Print tracebacks for user errors.")


def main(argv):
  del argv
  runtime.configure_logging(_VERBOSE.value)

  def run():
    import jax

    from rljax.control import render

    try:
      height, width = cli.video_size(_VIDEO_SIZE)
      for old, value in (("height", _HEIGHT.value), ("width", _WIDTH.value)):
        if value is not None:
          print(f"note: --{old} is deprecated and will be removed; use --video_size",
                file=sys.stderr)
      height, width = _HEIGHT.value or height, _WIDTH.value or width
      render.setup_gl(_GL.value)  # before anything creates a renderer
      result = render.render_policy(
          _LOGDIR.value, _OUT.value, step=_STEP.value, episode_length=_EPISODE_LENGTH.value,
          key=jax.random.PRNGKey(_SEED.value), num_envs=_NUM_ENVS.value, camera=_CAMERA.value,
          height=height, width=width, max_fps=_MAX_FPS.value,
          formats=tuple(_FORMATS.value), log=print,
      )
    except render.RenderError as e:  # a missing system package: one line, like user errors
      print(f"error: {e}", file=sys.stderr)
      return 2
    rewards = ", ".join(f"{r:.1f}" for r in result.episode_rewards)
    print(f"wrote {', '.join(result.paths)}: {result.frames_shape[0]} frames at "
          f"{result.fps:.0f} fps, {result.frames_shape[2]}x{result.frames_shape[1]}; "
          f"episode rewards [{rewards}]")

  runtime.run_main(run, verbose=_VERBOSE.value)


if __name__ == "__main__":
  app.run(main)
