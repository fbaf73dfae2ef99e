"""The README's Python examples run as written."""

import math
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _python_block(section):
  """The first ```python block under the README heading ``## {section}``."""
  text = open(README, encoding="utf-8").read()
  body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
  return re.search(r"```python\n(.*?)```", body, re.S).group(1)


@pytest.mark.slow
def test_rlhf_in_python_example_trains_five_grpo_steps():
  scope = {}
  exec(compile(_python_block("RLHF in Python"), "README.md", "exec"), scope)  # pylint: disable=exec-used
  history = scope["history"]
  assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
  assert all(math.isfinite(h["reward/mean"]) and math.isfinite(h["kl"]) for h in history)
  assert scope["trainer"].config.algo.value == "grpo"
