"""Tokenizers and generation defaults from a Hugging Face model folder, without ``transformers``.

:func:`load_tokenizer` reads ``tokenizer.json`` with the ``tokenizers`` library and the special
tokens and chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``, where newer
``transformers`` versions put it). :meth:`Tokenizer.apply_chat_template` renders the template with
``jinja2`` the way ``transformers`` does (a sandboxed environment with ``trim_blocks`` and
``lstrip_blocks``, the ``tojson`` filter, ``raise_exception``, ``strftime_now``, the
``{% generation %}`` tag), so prompts match token for token.

:func:`load_generation_config` reads ``generation_config.json``; every id in its ``eos_token_id``
(an int or a list) ends a response, see :func:`eos_token_ids`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
CONFIG_FILE = "config.json"

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _token_text(value: Any) -> str | None:
  """A special token given as a string or as an ``AddedToken`` dict ``{"content": ...}``."""
  if value is None:
    return None
  if isinstance(value, Mapping):
    return value.get("content")
  return str(value)


def _ids(value: Any) -> tuple[int, ...]:
  if value is None:
    return ()
  if isinstance(value, int):
    return (value,)
  return tuple(int(v) for v in value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationConfig:
  """The fields of ``generation_config.json`` that the sampler uses.

  Attributes:
    eos_token_ids: every id that ends a response (``eos_token_id`` may be an int or a list).
    bos_token_id, pad_token_id: ``None`` when absent.
    do_sample, temperature, top_k, top_p: the checkpoint's recommended sampling settings
      (``None`` when absent).
  """

  eos_token_ids: tuple[int, ...] = ()
  bos_token_id: int | None = None
  pad_token_id: int | None = None
  do_sample: bool | None = None
  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None


def load_generation_config(path: str | os.PathLike) -> GenerationConfig:
  """Reads ``generation_config.json``, falling back to ``config.json``'s token ids.

  Returns an empty :class:`GenerationConfig` when neither file names them.
  """
  path = os.fspath(path)
  gen = _read_json(os.path.join(path, GENERATION_CONFIG_FILE))
  cfg = _read_json(os.path.join(path, CONFIG_FILE))

  def pick(key):
    return gen[key] if gen.get(key) is not None else cfg.get(key)

  return GenerationConfig(
      eos_token_ids=_ids(pick("eos_token_id")),
      bos_token_id=pick("bos_token_id"),
      pad_token_id=pick("pad_token_id"),
      do_sample=gen.get("do_sample"),
      temperature=gen.get("temperature"),
      top_k=gen.get("top_k"),
      top_p=gen.get("top_p"),
  )


class Tokenizer:
  """A ``tokenizers.Tokenizer`` with the special tokens and chat template of its model folder.

  Build it with :func:`load_tokenizer`. Encoding applies the ``tokenizer.json`` post-processor
  (e.g. a BOS token) when ``add_special_tokens=True``, exactly like ``transformers``.
  """

  def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str | None],
               chat_template: str | Mapping[str, str] | None = None):
    self.backend = backend
    self.special_tokens = {k: special_tokens.get(k) for k in _SPECIAL}
    self.chat_templates: dict[str, str] = {}
    if isinstance(chat_template, str):
      self.chat_templates["default"] = chat_template
    elif chat_template:
      self.chat_templates.update(chat_template)

  # ---- special tokens --------------------------------------------------------------------

  def _id(self, name: str) -> int | None:
    text = self.special_tokens.get(name)
    return None if text is None else self.backend.token_to_id(text)

  @property
  def bos_token(self) -> str | None:
    return self.special_tokens["bos_token"]

  @property
  def eos_token(self) -> str | None:
    return self.special_tokens["eos_token"]

  @property
  def pad_token(self) -> str | None:
    return self.special_tokens["pad_token"]

  @property
  def bos_token_id(self) -> int | None:
    return self._id("bos_token")

  @property
  def eos_token_id(self) -> int | None:
    return self._id("eos_token")

  @property
  def pad_token_id(self) -> int | None:
    return self._id("pad_token")

  @property
  def vocab_size(self) -> int:
    """Vocabulary size including added tokens."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  @property
  def chat_template(self) -> str | None:
    """The default Jinja chat template from ``tokenizer_config.json``, or None."""
    return self.chat_templates.get("default")

  # ---- text <-> ids ----------------------------------------------------------------------

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``, with the post-processor's special tokens (e.g. BOS) unless
    ``add_special_tokens=False``; as ``transformers``' ``tokenizer(text)["input_ids"]``."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True
                   ) -> list[list[int]]:
    """`encode` of each text (the backend's batch encoder; no padding)."""
    return [e.ids for e in self.backend.encode_batch(list(texts),
                                                      add_special_tokens=add_special_tokens)]

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of ``ids`` (ints or numpy ints), special tokens dropped unless
    ``skip_special_tokens=False``."""
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def decode_batch(self, batch: Sequence[Sequence[int]], *, skip_special_tokens: bool = True
                   ) -> list[str]:
    """`decode` of each row (e.g. ``SampleOutput.tokens [B, R]``)."""
    return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

  # ---- chat ------------------------------------------------------------------------------

  def apply_chat_template(
      self,
      messages: Sequence[Mapping[str, Any]],
      *,
      add_generation_prompt: bool = False,
      tokenize: bool = True,
      tools: Sequence[Mapping[str, Any]] | None = None,
      documents: Sequence[Mapping[str, Any]] | None = None,
      chat_template: str | None = None,
      **template_kwargs: Any,
  ) -> list[int] | str:
    """Renders ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

    Args:
      messages: the conversation.
      add_generation_prompt: append the template's assistant-turn opener.
      tokenize: return token ids (encoded without adding special tokens again, as
        ``transformers`` does), else the rendered string.
      tools, documents: passed to the template as JSON-schema dicts, as in ``transformers``.
      chat_template: a template string, or the name of one of the folder's named templates;
        default the folder's default template.
      **template_kwargs: extra variables for the template.

    Raises:
      ValueError: the folder has no chat template and none was given.
      jinja2.TemplateError: the template called ``raise_exception``.
    """
    template = self._resolve_template(chat_template, tools)
    variables = {k: v for k, v in self.special_tokens.items() if v is not None}
    variables.update(template_kwargs)
    text = _compile(template).render(
        messages=[dict(m) for m in messages],
        tools=None if tools is None else [dict(t) for t in tools],
        documents=None if documents is None else [dict(d) for d in documents],
        add_generation_prompt=add_generation_prompt,
        **variables)
    return self.encode(text, add_special_tokens=False) if tokenize else text

  def _resolve_template(self, chat_template: str | None, tools) -> str:
    if chat_template is not None:
      return self.chat_templates.get(chat_template, chat_template)
    if tools is not None and "tool_use" in self.chat_templates:
      return self.chat_templates["tool_use"]
    if "default" in self.chat_templates:
      return self.chat_templates["default"]
    raise ValueError("this tokenizer has no chat template; pass chat_template=")


def _compile(template: str):
  """A jinja2 template compiled like ``transformers`` compiles chat templates."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text): rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env.from_string(template)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """Loads ``tokenizer.json`` plus special tokens and chat template(s) from a model folder.

  Special tokens come from ``tokenizer_config.json`` (then ``special_tokens_map.json``); the chat
  template from ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` (a string
  or a list of ``{"name", "template"}``).

  Raises:
    FileNotFoundError: the folder has no ``tokenizer.json``.
  """
  path = os.fspath(path)
  tok_file = os.path.join(path, TOKENIZER_FILE)
  if not os.path.exists(tok_file):
    raise FileNotFoundError(f"{path}: no {TOKENIZER_FILE} (only fast tokenizers are supported)")
  backend = tokenizers.Tokenizer.from_file(tok_file)
  cfg = _read_json(os.path.join(path, TOKENIZER_CONFIG_FILE))
  smap = _read_json(os.path.join(path, SPECIAL_TOKENS_MAP_FILE))
  special = {k: _token_text(cfg.get(k, smap.get(k))) for k in _SPECIAL}

  template: Any = cfg.get("chat_template")
  jinja_file = os.path.join(path, CHAT_TEMPLATE_FILE)
  if os.path.exists(jinja_file):
    with open(jinja_file) as f:
      template = f.read()
  if isinstance(template, list):
    template = {t["name"]: t["template"] for t in template}
  return Tokenizer(backend, special_tokens=special, chat_template=template)


def eos_token_ids(path: str | os.PathLike, tokenizer: Tokenizer | None = None) -> tuple[int, ...]:
  """All ids that end a response: ``generation_config.json``'s ``eos_token_id`` (all of them),
  then the tokenizer's ``eos_token`` if it is not already listed. Order-preserving, no repeats.
  """
  ids = list(load_generation_config(path).eos_token_ids)
  if tokenizer is not None and tokenizer.eos_token_id is not None:
    ids.append(tokenizer.eos_token_id)
  return tuple(dict.fromkeys(ids))
