"""Differentiable MJX physics: a copy of an environment whose constraint solver can be
reverse-differentiated, for analytic policy gradients (`rljax.control.apg`).

MJX's constraint solver loops with ``lax.while_loop`` until it converges, and JAX cannot
reverse-differentiate a ``while_loop``. With ``opt.iterations == 1`` MJX runs exactly one
solver iteration without the loop, and its line search is a fixed-length ``lax.scan`` of
``opt.ls_iterations`` steps, both differentiable. `make_differentiable` sets these options on
the environment's model (Playground: ``env.mjx_model``; Brax: ``env.sys``). Brax's
``generalized`` backend is differentiable as it is (its projected-gradient solver is
unrolled), and Playground's CartpoleSwingup/Balance already ship with ``iterations=1``.

One iteration leaves the convex constraint problem (Todorov 2014, "Convex and
analytically-invertible dynamics with contacts and constraints") partly unsolved whenever
several contacts or limits are active at once, so constraint forces are approximate; training
uses the modified model and evaluation the unmodified one (docs/control.md gives the measured
error on CheetahRun and HopperHop).
"""

from __future__ import annotations

import copy

from rljax import envs


def make_differentiable(env, *, solver_iterations: int | None = 1,
                        ls_iterations: int | None = None):
  """A copy of ``env`` whose MJX solver runs a fixed number of iterations.

  Args:
    env: an unwrapped environment from ``rljax.envs.make`` (Playground ``MjxEnv`` or
      Brax ``PipelineEnv``).
    solver_iterations: MJX ``opt.iterations``; with 1 the solver has no ``while_loop``
      and reverse-mode differentiation works. ``None`` keeps the model's.
    ls_iterations: MJX ``opt.ls_iterations`` (line-search steps, a fixed-length scan);
      ``None`` keeps the model's.

  Returns:
    A shallow copy of ``env`` with the changed model; ``env`` itself is unchanged.
    Brax environments on the ``generalized``, ``positional`` or ``spring`` backends
    are returned as they are (their solvers are already differentiable).

  Raises:
    TypeError: an environment whose model cannot be found.
  """
  changes = {}
  if solver_iterations is not None:
    changes["opt.iterations"] = int(solver_iterations)
  if ls_iterations is not None:
    changes["opt.ls_iterations"] = int(ls_iterations)
  if not changes:
    return env
  if envs._is_playground(env):
    new = copy.copy(env)
    # Playground's environments read their model from ``self.mjx_model``, a property
    # over this attribute; there is no public setter.
    new._mjx_model = env.mjx_model.tree_replace(changes)
    if solver_iterations is not None and new.mjx_model.opt.iterations != solver_iterations:
      raise TypeError("could not change the Playground environment's mjx_model.")
    return new
  if hasattr(env, "sys") and hasattr(env, "backend"):
    if env.backend != "mjx":
      return env
    new = copy.copy(env)
    new.sys = env.sys.tree_replace(changes)
    return new
  raise TypeError(f"make_differentiable needs a Playground or Brax environment, got {type(env)}.")


def solver_options(env) -> dict[str, int]:
  """``{"iterations": ..., "ls_iterations": ...}`` of an unwrapped MJX environment's model."""
  model = env.mjx_model if envs._is_playground(env) else env.sys
  return {"iterations": int(model.opt.iterations), "ls_iterations": int(model.opt.ls_iterations)}


def has_mjx_model(env) -> bool:
  """Whether an unwrapped environment steps MJX physics (Playground, or Brax on ``mjx``)."""
  return envs._is_playground(env) or getattr(env, "backend", None) == "mjx"
