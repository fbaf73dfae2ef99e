"""The decoder LMs' dots: ``einsum`` with f32 accumulation, and a bf16 backward pass for bf16.

:func:`dot` is every matmul of :mod:`rljax.models.llm` (projections, attention, LM head): f32
accumulation, the result in a chosen dtype, and for two bf16 operands a hand-written VJP whose
dots also take bf16 operands. :func:`f32_product` is the f32-accumulated product under it; on CPU
it computes a one-row matrix-vector product (:func:`is_cpu_matvec`) split along ``K``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def dot(equation: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
  """``einsum`` accumulated in f32 and returned in ``out_dtype`` (default ``x.dtype``).

  For bf16 operands this is both more accurate and, on CPU, faster than a dot with a bf16 result
  (XLA then uses the native bf16 dot-product instructions). When both operands are bf16 the
  backward pass is bf16 too (:func:`_dot_low_precision`).
  """
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  if x.dtype == w.dtype and x.dtype != jnp.float32:
    return _dot_low_precision(equation, out_dtype, x, w)
  return f32_product(equation, x, w).astype(out_dtype)


def f32_product(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """``einsum(equation, x, w)`` accumulated and returned in f32: by `_split_k_matvec` where
  `is_cpu_matvec` allows, else by one einsum."""
  if is_cpu_matvec(equation, x, w):
    return _split_k_matvec(x, w)
  return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


def is_cpu_matvec(equation: str, x: jax.Array, w: jax.Array) -> bool:
  """Whether ``einsum(equation, x, w)`` is a matrix-vector product that `_split_k_matvec` computes:
  on one CPU device (no mesh whose sharding the split could cross), ``x`` holds one row (all its
  axes but the last are 1), the contracted index is ``x``'s last axis and ``w``'s first, of even
  size, and the output is ``x``'s other axes followed by ``w``'s in order (true of the model's
  projections and untied LM head, e.g. ``"BTE,EHD->BTHD"`` and ``"...E,EV->...V"``, where a
  leading ``...`` on ``x`` and the output stands for ``x``'s leading axes; not of the tied head,
  which contracts the embedding's last axis)."""
  if (jax.default_backend() != "cpu" or jax.device_count() != 1
      or math.prod(x.shape[:-1]) != 1 or x.shape[-1] % 2):
    return False
  try:
    lhs, out = equation.replace(" ", "").split("->")
    xs, ws = lhs.split(",")
  except ValueError:
    return False
  ellipsis = xs.startswith("...") and out.startswith("...")
  if ellipsis:
    xs, out = xs[3:], out[3:]
  if not xs or "." in xs + ws + out or len(ws) != w.ndim:
    return False
  if len(xs) > x.ndim if ellipsis else len(xs) != x.ndim:
    return False
  return xs[-1] == ws[0] and out == xs[:-1] + ws[1:]


def _split_k_matvec(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x [1.., K] @ w [K, ...]`` (f32 accumulation) as two half-``K`` products summed, shaped
  like the einsum: ``[1.., *w.shape[1:]]`` f32.

  Decoding one sequence streams every weight once per token through matrix-vector products; on
  CPU such a one-row product split along ``K`` (a batched dot over the two halves, one per core)
  streams the weights faster than XLA:CPU's single ``[1, K] x [K, N]`` dot. Sums in another order
  than one dot (differences of about 1e-7 relative).
  """
  k = w.shape[0]
  halves = jnp.einsum("prk,pkn->prn", x.reshape(2, 1, k // 2), w.reshape(2, k // 2, -1),
                      preferred_element_type=jnp.float32)
  return jnp.sum(halves, axis=0).reshape(x.shape[:-1] + w.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dot_low_precision(equation: str, out_dtype, x: jax.Array, w: jax.Array) -> jax.Array:
  """:func:`dot` for two operands of one low-precision dtype (bf16), with a backward pass whose
  dots also take low-precision operands (the cotangent is cast to it; accumulation is f32), as
  PyTorch's bf16 autocast does.

  Plain autodiff would carry an f32 cotangent (of the ``astype`` or of an f32 result) into the
  backward dots, which then run in f32, more slowly. ``equation`` is ``"a,b->c"`` without
  an index that is summed inside one operand alone (true of every dot in this model), so the
  transposes are ``dx = einsum("c,b->a", g, w)`` and ``dw = einsum("a,c->b", x, g)``.
  """
  return f32_product(equation, x, w).astype(out_dtype)


def _dot_low_precision_fwd(equation, out_dtype, x, w):
  return _dot_low_precision(equation, out_dtype, x, w), (x, w)


def _dot_low_precision_bwd(equation, out_dtype, residuals, g):
  del out_dtype
  x, w = residuals
  inputs, out = equation.split("->")
  a, b = inputs.split(",")
  g = g.astype(x.dtype)
  dx = jnp.einsum(f"{out},{b}->{a}", g, w, preferred_element_type=jnp.float32)
  dw = jnp.einsum(f"{a},{out}->{b}", x, g, preferred_element_type=jnp.float32)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_dot_low_precision.defvjp(_dot_low_precision_fwd, _dot_low_precision_bwd)
