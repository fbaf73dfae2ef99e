"""Text datasets for alignment: preference pairs, prompt sets, SFT data, and the data position.

Formats read (JSON lines, ``.jsonl`` or gzip-compressed ``.jsonl.gz``, one object per line):

* **HH-RLHF** (Bai et al. 2022, arXiv:2204.05862): ``{"chosen": D1, "rejected": D2}`` where
  ``D1`` and ``D2`` are whole dialogues ``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` that share
  every turn but the last assistant reply. The shared part up to and including the last common
  ``"\\n\\nAssistant:"`` is the prompt; the rest of each is the response.
* **prompt/chosen/rejected**: ``{"prompt": P, "chosen": C, "rejected": R}`` with the responses
  already split off.
* **prompts**: ``{"prompt": P}`` (extra keys are ignored) for RL prompt sets.
* **SFT**: ``{"prompt": P, "response": R}`` (or ``"completion"``), or HH-RLHF/preference lines,
  whose ``chosen`` side is used.

Files are read as users save them: gzip is recognised by its content (whatever the name), a
UTF-8 byte-order mark is skipped, and Windows (``\\r\\n``) line endings read as ``\\n``.
Errors are :class:`DataError` (a ``ValueError``) naming the file and 1-based line number: bad
JSON, invalid UTF-8, a missing key (named), a dialogue without a shared assistant prefix, and
an empty file.

The data position (:class:`DataPosition`: epoch, index, shuffle seed) is a NamedTuple stored
in the train state; :func:`next_batch_indices` is a pure function of it, so a resumed run
continues with exactly the batch the interrupted one would have drawn next.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from rljax.models.tokenizer import Tokenizer

ASSISTANT_MARKER = "\n\nAssistant:"
_TURN_RE = re.compile(r"\n\n(Human|Assistant):")


class DataError(ValueError):
  """A dataset file is malformed; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class PreferencePair:
  """One human preference: a prompt and two responses, ``chosen`` preferred.

  ``messages`` is the prompt as chat turns (``[{"role": "user"|"assistant", "content"}]``) when
  it could be parsed from an HH-RLHF dialogue, else ``None``.
  """

  prompt: str
  chosen: str
  rejected: str
  messages: tuple[dict[str, str], ...] | None = None


@dataclasses.dataclass(frozen=True)
class SFTExample:
  """A prompt and its target response (text)."""

  prompt: str
  response: str
  messages: tuple[dict[str, str], ...] | None = None


# ----------------------------------------------------------------------------------------------
# Reading JSON lines
# ----------------------------------------------------------------------------------------------


_GZIP_MAGIC = b"\x1f\x8b"
_UTF8_BOM = b"\xef\xbb\xbf"


def _is_gzip(path: str) -> bool:
  """Whether ``path`` starts with gzip's magic bytes (a ``.gz`` name is not needed)."""
  with open(path, "rb") as f:
    return f.read(2) == _GZIP_MAGIC


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
  """Yields ``(line_number, object)`` from a JSON-lines file; blank lines skip.

  The file may be gzip-compressed (recognised by its first bytes, with or without a ``.gz``
  name), start with a UTF-8 byte-order mark, and end its lines with ``\\r\\n``: each reads as
  the same objects as the plain ``\\n``-terminated UTF-8 file.

  Raises:
    FileNotFoundError: the file does not exist.
    DataError: ``path`` is a directory (the message lists its JSONL files); ``"{path}:{line}:
      ..."`` for invalid UTF-8, bad JSON or a non-object line.
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"dataset file not found: {path}")
  if os.path.isdir(path):
    found = sorted(f for f in os.listdir(path) if f.endswith((".jsonl", ".jsonl.gz")))
    raise DataError(f"{path} is a directory; expected a .jsonl or .jsonl.gz file"
                    + (f" (it holds {', '.join(found[:5])})" if found else ""))
  opener = gzip.open if _is_gzip(path) else open
  with opener(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      if lineno == 1 and raw.startswith(_UTF8_BOM):
        raw = raw[len(_UTF8_BOM):]
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: invalid UTF-8 at byte {e.start}") from None
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: malformed JSON: {e.msg} (column {e.colno})") from None
      if not isinstance(obj, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
      yield lineno, obj


def _get(obj: dict[str, Any], key: str, path: str, lineno: int) -> str:
  if key not in obj:
    raise DataError(f"{path}:{lineno}: missing key {key!r} (keys present: {sorted(obj)})")
  value = obj[key]
  if not isinstance(value, str):
    raise DataError(f"{path}:{lineno}: key {key!r} must be a string, got {type(value).__name__}")
  return value


def parse_dialogue(prompt: str) -> tuple[dict[str, str], ...]:
  """Splits an HH-RLHF prompt ``"\\n\\nHuman: a\\n\\nAssistant: b\\n\\nHuman: c\\n\\nAssistant:"``
  into chat turns ``({"role": "user", "content": "a"}, {"role": "assistant", ...}, ...)``.

  The trailing empty assistant opener is dropped.
  """
  parts = _TURN_RE.split(prompt)
  messages = []
  # parts = [prefix, role, text, role, text, ...]
  for role, text in zip(parts[1::2], parts[2::2]):
    text = text.strip()
    if role == "Assistant" and not text and len(messages) == len(parts[1::2]) - 1:
      break
    messages.append({"role": "user" if role == "Human" else "assistant", "content": text})
  return tuple(messages)


def split_hh_pair(chosen: str, rejected: str) -> tuple[str, str, str] | None:
  """``(prompt, chosen_response, rejected_response)`` from two HH-RLHF dialogues, or ``None``.

  The prompt ends with the last ``"\\n\\nAssistant:"`` lying wholly inside the dialogues'
  common prefix; responses have leading whitespace stripped.
  """
  n = 0
  limit = min(len(chosen), len(rejected))
  while n < limit and chosen[n] == rejected[n]:
    n += 1
  idx = chosen[:n].rfind(ASSISTANT_MARKER)
  if idx < 0:
    return None
  cut = idx + len(ASSISTANT_MARKER)
  return chosen[:cut], chosen[cut:].strip(), rejected[cut:].strip()


def load_preference_pairs(path: str | os.PathLike, *, limit: int | None = None
                          ) -> list[PreferencePair]:
  """Reads HH-RLHF (``chosen``/``rejected`` dialogues) or ``{prompt, chosen, rejected}`` lines.

  The format is decided per line: a ``prompt`` key means the split format.

  Raises:
    FileNotFoundError: no such file.
    DataError: a directory, a malformed line (file:line), a missing key (named), a dialogue pair
      without a shared assistant prefix, or no pairs at all.
    ValueError: ``limit`` < 1.
  """
  path = os.fspath(path)
  if limit is not None and limit < 1:
    raise ValueError(f"limit must be >= 1 pairs (or None for all), got {limit}")
  pairs = []
  for lineno, obj in read_jsonl(path):
    if "prompt" in obj:
      prompt = _get(obj, "prompt", path, lineno)
      pairs.append(PreferencePair(prompt, _get(obj, "chosen", path, lineno),
                                  _get(obj, "rejected", path, lineno)))
    else:
      chosen = _get(obj, "chosen", path, lineno)
      rejected = _get(obj, "rejected", path, lineno)
      split = split_hh_pair(chosen, rejected)
      if split is None:
        raise DataError(
            f"{path}:{lineno}: 'chosen' and 'rejected' share no prefix ending in "
            f"{ASSISTANT_MARKER!r}; not an HH-RLHF dialogue pair")
      prompt, c, r = split
      pairs.append(PreferencePair(prompt, c, r, parse_dialogue(prompt)))
    if limit is not None and len(pairs) >= limit:
      break
  if not pairs:
    raise DataError(f"{path}: empty dataset (no preference pairs)")
  return pairs


def load_prompts(path: str | os.PathLike) -> list[str]:
  """Reads a prompt set: ``{"prompt": ...}`` lines, or HH-RLHF lines (their shared prompt).

  Raises:
    DataError: as :func:`load_preference_pairs`; missing ``'prompt'`` is named.
  """
  path = os.fspath(path)
  prompts = []
  for lineno, obj in read_jsonl(path):
    if "prompt" not in obj and "chosen" in obj:
      split = split_hh_pair(_get(obj, "chosen", path, lineno), _get(obj, "rejected", path, lineno))
      if split is None:
        raise DataError(f"{path}:{lineno}: no shared {ASSISTANT_MARKER!r} prefix")
      prompts.append(split[0])
    else:
      prompts.append(_get(obj, "prompt", path, lineno))
  if not prompts:
    raise DataError(f"{path}: empty dataset (no prompts)")
  return prompts


def load_sft_examples(path: str | os.PathLike) -> list[SFTExample]:
  """Reads SFT data: ``{prompt, response|completion}`` lines, or preference lines (chosen side).

  Raises:
    DataError: as :func:`load_preference_pairs`.
  """
  path = os.fspath(path)
  out = []
  for lineno, obj in read_jsonl(path):
    if "chosen" in obj:
      continue
    key = "completion" if "completion" in obj and "response" not in obj else "response"
    out.append(SFTExample(_get(obj, "prompt", path, lineno), _get(obj, key, path, lineno)))
  if out:
    return out
  pairs = load_preference_pairs(path)  # every line was a preference pair
  return [SFTExample(p.prompt, p.chosen, p.messages) for p in pairs]


def sft_from_pairs(pairs: Iterable[PreferencePair]) -> list[SFTExample]:
  """SFT examples from the chosen side of preference pairs."""
  return [SFTExample(p.prompt, p.chosen, p.messages) for p in pairs]


# ----------------------------------------------------------------------------------------------
# Tokenization
# ----------------------------------------------------------------------------------------------


def encode_prompt(tokenizer, prompt: str, messages: Sequence[dict[str, str]] | None = None,
                  ) -> list[int]:
  """Prompt token ids: the chat template (with the assistant opener) when the tokenizer has one
  and the prompt is known as chat turns, else the raw text with the tokenizer's special tokens.
  """
  if getattr(tokenizer, "chat_template", None) and messages is not None:
    return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True))
  return list(tokenizer.encode(prompt))


def encode_response(tokenizer, response: str, *, eos_id: int | None) -> list[int]:
  """Response ids (no special tokens added) followed by ``eos_id`` when given."""
  ids = list(tokenizer.encode(" " + response if response else "", add_special_tokens=False))
  return ids + ([eos_id] if eos_id is not None else [])


def truncate(prompt_ids: Sequence[int], response_ids: Sequence[int], *, max_prompt_len: int,
             max_response_len: int) -> tuple[list[int], list[int]]:
  """Keeps the *last* ``max_prompt_len`` prompt tokens and the *first* ``max_response_len``
  response tokens (a truncated response loses its EOS, as it should)."""
  return list(prompt_ids)[-max_prompt_len:], list(response_ids)[:max_response_len]


# ----------------------------------------------------------------------------------------------
# Data position: part of the train state
# ----------------------------------------------------------------------------------------------


class DataPosition(NamedTuple):
  """Where a run is in its data: ``epoch``, ``index`` (next example within the epoch's order)
  and the shuffle ``seed``. Ints; stored in checkpoints with the rest of the train state."""

  epoch: int
  index: int
  seed: int


def init_data_position(seed: int) -> DataPosition:
  """The start of epoch 0 of the order shuffled by ``seed``."""
  return DataPosition(0, 0, int(seed))


def epoch_order(num_examples: int, epoch: int, seed: int, *,
                lengths: np.ndarray | None = None, group_size: int = 0) -> np.ndarray:
  """The example order of one epoch: a permutation determined by ``(seed, epoch)`` alone.

  With ``lengths`` and ``group_size > 1``, each consecutive window of ``group_size`` examples of
  the permutation is sorted by length (length grouping), so a batch drawn from it holds
  similar lengths and padding to the batch's bucket stays small; the order is still a pure
  function of ``(seed, epoch)``.
  """
  order = np.random.default_rng([int(seed), int(epoch)]).permutation(num_examples)
  if lengths is not None and group_size > 1:
    lengths = np.asarray(lengths)
    for s in range(0, num_examples, group_size):
      w = order[s:s + group_size]
      order[s:s + group_size] = w[np.argsort(lengths[w], kind="stable")]
  return order


def next_batch_indices(position: DataPosition, num_examples: int, batch_size: int, *,
                       lengths: np.ndarray | None = None, group_size: int = 0
                       ) -> tuple[np.ndarray, DataPosition]:
  """The next ``batch_size`` example indices and the advanced position.

  A batch that runs past the end of an epoch continues at the start of the next epoch's
  (fresh) order, so every batch is full. ``lengths``/``group_size``: see :func:`epoch_order`.

  Raises:
    ValueError: ``num_examples`` or ``batch_size`` is < 1.
  """
  if num_examples < 1:
    raise ValueError("empty dataset: no examples to draw batches from")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  epoch, index, seed = (int(x) for x in position)
  out = []
  while len(out) < batch_size:
    order = epoch_order(num_examples, epoch, seed, lengths=lengths, group_size=group_size)
    take = min(batch_size - len(out), num_examples - index)
    out.extend(order[index:index + take].tolist())
    index += take
    if index >= num_examples:
      epoch, index = epoch + 1, 0
  return np.asarray(out, np.int64), DataPosition(epoch, index, seed)


# ----------------------------------------------------------------------------------------------
# Tokenizers trained on the data (tests and the real-data pipeline; no downloads)
# ----------------------------------------------------------------------------------------------

PAD, BOS, EOS, USER, ASSISTANT = "<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<|user|>' + m['content'] }}"
    "{% else %}{{ '<|assistant|>' + m['content'] + '<eos>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int = 2048,
                        chat_template: bool = True):
  """Trains a byte-level BPE tokenizer on ``texts`` with the ``tokenizers`` library.

  Special tokens: ``<pad>`` (id 0), ``<bos>`` (1), ``<eos>`` (2), ``<|user|>``,
  ``<|assistant|>``. ``encode`` prepends ``<bos>``. With ``chat_template`` a small template is
  attached (user turns ``<|user|>text``, assistant turns ``<|assistant|>text<eos>``).

  Returns:
    a :class:`rljax.models.tokenizer.Tokenizer`.
  """
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS, USER, ASSISTANT],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  backend.train_from_iterator(texts, trainer=trainer)
  backend.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", special_tokens=[(BOS, backend.token_to_id(BOS))])
  return Tokenizer(
      backend,
      special_tokens={"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None},
      chat_template=CHAT_TEMPLATE if chat_template else None)


def save_tokenizer(tokenizer, path: str | os.PathLike) -> None:
  """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat template) so
  :func:`rljax.models.tokenizer.load_tokenizer` reads it back."""
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
  cfg = {k: v for k, v in tokenizer.special_tokens.items() if v is not None}
  if tokenizer.chat_template:
    cfg["chat_template"] = tokenizer.chat_template
  with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(cfg, f, indent=2)
