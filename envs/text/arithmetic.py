"""A code-generated text task with a checkable answer: integer addition ``"a+b="`` -> ``"c"``.

It is the embedded default of ``experiments/train_rlhf.py``: a tiny LM is pre-trained briefly
on ``"a+b=c"`` lines, fine-tuned on prompt/answer pairs, then trained with PPO against
:func:`addition_reward`. The reward is honest about learning: it checks the printed sum.

:class:`CharTokenizer` has one id per character (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, digits,
``+``, ``=``) and the subset of :class:`rljax.models.tokenizer.Tokenizer`'s interface the
trainers use (``encode``, ``decode``, ``eos_token_id``, ``pad_token_id``, ``vocab_size``,
``chat_template = None``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rljax.envs.text.data import SFTExample


class CharTokenizer:
  """Character-level tokenizer over ``"0123456789+= "``; ``encode`` prepends ``<bos>``."""

  chat_template = None
  PAD, BOS, EOS = 0, 1, 2
  ALPHABET = "0123456789+= "

  def __init__(self):
    self._to_id = {c: i + 3 for i, c in enumerate(self.ALPHABET)}
    self._to_char = {i: c for c, i in self._to_id.items()}

  @property
  def vocab_size(self) -> int:
    return 3 + len(self.ALPHABET)

  @property
  def eos_token_id(self) -> int:
    return self.EOS

  @property
  def pad_token_id(self) -> int:
    return self.PAD

  @property
  def bos_token_id(self) -> int:
    return self.BOS

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Raises ``ValueError`` naming a character outside the alphabet."""
    try:
      ids = [self._to_id[c] for c in text]
    except KeyError as e:
      raise ValueError(f"CharTokenizer: character {e.args[0]!r} is not in {self.ALPHABET!r}")
    return ([self.BOS] if add_special_tokens else []) + ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    out = []
    for i in ids:
      i = int(i)
      if i in self._to_char:
        out.append(self._to_char[i])
      elif not skip_special_tokens:
        out.append({0: "<pad>", 1: "<bos>", 2: "<eos>"}.get(i, "?"))
    return "".join(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdditionTask:
  """Problems ``a + b`` with ``0 <= a, b < max_operand``.

  Attributes:
    max_operand: exclusive upper bound of both operands (> 0).
  """

  max_operand: int = 100

  def __post_init__(self):
    if self.max_operand < 1:
      raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")

  def sample(self, n: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    ab = rng.integers(0, self.max_operand, size=(n, 2))
    return [(int(a), int(b)) for a, b in ab]

  @staticmethod
  def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="

  @staticmethod
  def answer(a: int, b: int) -> str:
    return str(a + b)

  def pretraining_text(self, n: int, seed: int) -> list[str]:
    """``n`` lines ``"a+b=c"`` (the LM is trained on every token)."""
    return [self.prompt(a, b) + self.answer(a, b) for a, b in self.sample(n, seed)]

  def sft_examples(self, n: int, seed: int) -> list[SFTExample]:
    return [SFTExample(self.prompt(a, b), self.answer(a, b)) for a, b in self.sample(n, seed)]

  def prompts(self, n: int, seed: int) -> list[str]:
    return [self.prompt(a, b) for a, b in self.sample(n, seed)]


def parse_prompt(prompt: str) -> tuple[int, int]:
  """``"12+34=" -> (12, 34)``. Raises ``ValueError`` for anything else."""
  left, _, _ = prompt.partition("=")
  a, plus, b = left.partition("+")
  if not plus:
    raise ValueError(f"not an addition prompt: {prompt!r}")
  return int(a), int(b)


def addition_score(prompt: str, response: str) -> float:
  """1.0 for the exact sum; otherwise half the fraction of answer digits right in place.

  ``"12+34="``: ``"46"`` -> 1.0; ``"45"`` -> 0.5 * 1/2 = 0.25; ``"4"`` -> 0.25; ``""`` -> 0.
  """
  a, b = parse_prompt(prompt)
  answer = str(a + b)
  response = response.strip()
  if response == answer:
    return 1.0
  right = sum(1 for x, y in zip(response, answer) if x == y)
  return 0.5 * right / len(answer)


def addition_reward(samples) -> np.ndarray:
  """Programmatic reward over decoded text: ``[B]`` f32 :func:`addition_score` per sample.

  ``samples`` is an :class:`rljax.alignment.rlhf.Samples` (uses ``prompt_text`` and
  ``response_text``).
  """
  return np.asarray([addition_score(p, r) for p, r in
                     zip(samples.prompt_text, samples.response_text)], np.float32)
