"""Per-device data-parallel gradient steps written with ``shard_map``, and the ``pmean`` trap.

The control side's update is data parallel: the global batch ``[B, ...]`` is split over the data
axes (``data`` x ``fsdp``) and each device computes the gradient of its shard; the parameters are
replicated. Written per device with ``jax.shard_map``, the reduction is explicit and yours:

**The gradient of a replicated parameter comes back already summed.** With ``check_vma=True``
(the default) ``shard_map`` tracks which values vary across devices. A replicated parameter is
*invariant*; using it in a per-device loss inserts an implicit ``pvary``, whose transpose is a
``psum``. So ``jax.grad`` of the per-device loss w.r.t. a replicated parameter returns
``sum_d grad(loss_d)``, identical on every device. The pmap-era idiom
``grads = lax.pmean(grad(local_mean_loss), axis)`` then averages N identical sums: the result is
``N`` times the true gradient of the global mean loss. The correct per-device loss divides by
the GLOBAL batch size (``sum(per_example_loss_d) / B``) and needs no collective at all (or,
equivalently, divide the local mean's gradient by ``N``). :func:`make_dp_grad` does the former;
``naive_pmean=True`` reproduces the bug so the tests can pin it (it is off by exactly ``N``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rljax.sharding.mesh import BATCH_AXES, check_batch_divisible

# per_example_loss(params, batch) -> [b] f32, the loss of each example of a (local) batch.
PerExampleLoss = Callable[[Any, Any], jax.Array]


def _batch_size(batch) -> int:
  return jax.tree.leaves(batch)[0].shape[0]


def make_dp_grad(per_example_loss: PerExampleLoss, mesh: jax.sharding.Mesh, *,
                 naive_pmean: bool = False) -> Callable[[Any, Any], tuple[jax.Array, Any]]:
  """Jitted ``(params, batch) -> (loss, grads)`` for the global mean loss, written per device.

  Args:
    per_example_loss: ``(params, batch_shard) -> [b] f32``; ``batch`` leaves are ``[B, ...]``.
    mesh: a mesh from :func:`rljax.sharding.mesh.make_mesh`; the batch is split over
      ``('data', 'fsdp')`` (and replicated over ``tensor``); ``params`` are replicated.
    naive_pmean: reproduce the pmap-era bug: ``pmean`` of the per-device gradient of the local
      mean loss. Returns ``N = data * fsdp`` times the true gradient. For tests only.

  Returns:
    ``step(params, batch)`` returning the scalar f32 loss ``mean_i loss_i`` over the global batch
    and its gradient (same tree as ``params``, replicated), equal to ``jax.grad`` on one device.

  Raises:
    MeshError: (when called) if ``B`` is not divisible by ``data * fsdp``.
  """
  axis = tuple(a for a in BATCH_AXES if a in mesh.shape)

  def per_device(params, batch, global_b):
    if naive_pmean:
      loss, grads = jax.value_and_grad(lambda p: jnp.mean(per_example_loss(p, batch)))(params)
      grads = jax.lax.pmean(grads, axis)          # WRONG: grads are already summed over devices
      return jax.lax.pmean(loss, axis), grads
    # Correct: each device's share of the global mean. Its gradient w.r.t. the replicated params
    # is psum-ed by shard_map's transpose, giving the global-mean gradient with no collective.
    loss_d, grads = jax.value_and_grad(
        lambda p: jnp.sum(per_example_loss(p, batch)) / global_b)(params)
    return jax.lax.psum(loss_d, axis), grads

  @jax.jit
  def step(params, batch):
    global_b = _batch_size(batch)
    fn = jax.shard_map(
        lambda p, b: per_device(p, b, global_b), mesh=mesh,
        in_specs=(P(), P(axis)), out_specs=(P(), P()), check_vma=True)
    return fn(params, batch)

  def checked(params, batch):
    check_batch_divisible(_batch_size(batch), mesh)  # before anything compiles
    return step(params, batch)

  checked.jitted = step
  return checked


def make_dp_sgd_step(per_example_loss: PerExampleLoss, mesh: jax.sharding.Mesh, *,
                     learning_rate: float) -> Callable[[Any, Any], tuple[Any, jax.Array]]:
  """``(params, batch) -> (new_params, loss)``: one SGD step on the global mean loss, per device
  under ``shard_map`` (see :func:`make_dp_grad`). ``learning_rate`` > 0, in parameter units per
  unit gradient.

  Raises:
    ValueError: if ``learning_rate <= 0``.
  """
  if not learning_rate > 0:
    raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
  grad_fn = make_dp_grad(per_example_loss, mesh)

  def step(params, batch):
    loss, grads = grad_fn(params, batch)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), loss

  return step


def mlp_per_example_loss(params: dict, batch: dict) -> jax.Array:
  """Squared error of a tanh MLP: ``params = {'w1' [I,H], 'b1' [H], 'w2' [H,O], 'b2' [O]}``,
  ``batch = {'x' [B,I], 'y' [B,O]}`` (f32) -> ``[B]`` f32 ``sum_o (mlp(x) - y)^2``."""
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  out = h @ params["w2"] + params["b2"]
  return jnp.sum((out - batch["y"]) ** 2, axis=-1)
