r"""Exact-match rewards for math answers, as GSM8K and MATH recipes score them.

    python experiments/train_rlhf.py --prompts=P.jsonl --reward_fn=rewards.math_answers:exact_match

``P.jsonl`` holds ``{"prompt": ..., "answer": ...}`` lines. The answer may be a bare number
(``"72"``) or a GSM8K solution ending in ``#### 72``. A response is read, in this order, from
its last ``\boxed{...}``, its last ``#### ...`` line, or else its last number (the "flexible"
extraction of common GSM8K evaluations); both sides are normalised (commas, ``$``, spaces and a
trailing ``.0`` dropped) before they are compared.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*([^\n]*)")


def _boxed(text: str) -> str | None:
  """The contents of the last ``\\boxed{...}`` in ``text`` (nested braces kept), or None."""
  start = text.rfind("\\boxed{")
  if start < 0:
    return None
  depth, i = 1, start + len("\\boxed{")
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None  # unbalanced: no answer


def normalize(answer: str) -> str:
  """``" $1,234.0 "`` -> ``"1234"``: commas, dollar signs and spaces dropped, a trailing
  ``.0`` (or ``.00``) removed, a trailing full stop removed."""
  s = answer.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
  return re.sub(r"^(-?\d+)\.0+$", r"\1", s)


def extract_answer(text: str) -> str | None:
  """The final answer in ``text``: the last ``\\boxed{}``, else the last ``####``, else the
  last number; None when there is none. Normalised by :func:`normalize`."""
  boxed = _boxed(text)
  if boxed is not None:
    return normalize(boxed)
  hashes = _HASHES.findall(text)
  if hashes and hashes[-1].strip():
    return normalize(hashes[-1])
  numbers = _NUMBER.findall(text)
  return normalize(numbers[-1]) if numbers else None


def exact_match(responses: Sequence[str], answer: Sequence[str | int | float],
                **unused_fields) -> list[float]:
  """1.0 where a response's final answer equals the reference ``answer``, else 0.0.

  Args:
    responses: the decoded responses (``B`` strings).
    answer: the prompt file's ``answer`` column for the same rows: bare numbers or GSM8K
      solutions ending in ``#### N``.
    **unused_fields: the prompt file's other columns (ignored).

  Returns:
    ``B`` floats in ``{0.0, 1.0}``.

  Raises:
    ValueError: a reference answer with no number in it (names the row).
  """
  del unused_fields
  out = []
  for row, (response, ref) in enumerate(zip(responses, answer, strict=True)):
    target = extract_answer(str(ref))
    if target is None:
      raise ValueError(f"row {row}: the reference answer {ref!r} holds no answer")
    out.append(float(extract_answer(response) == target))
  return out
