"""absl flags shared by the alignment scripts (``experiments/train_{sft,reward_model,rlhf}.py``).

Each ``define_*`` function defines its flags once, in the calling script's process, and returns
a small object that turns the parsed values into the keyword arguments the library takes, so the
three scripts accept the same names with the same meanings.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from absl import flags

from rljax import cli, run_info
from rljax.sharding import distributed

# The flags the functions below define belong to the script that calls them, so absl lists
# them in that script's --help beside its own.
flags.disclaim_key_flags()


def checked(holder: flags.FlagHolder, *, at_least: float | None = None,
            above: float | None = None) -> Any:
  """The value of flag ``holder`` (None when it was not given), checked against its bound.

  ``at_least``: the smallest allowed value (``--num_steps``: 1, ``--pretrain_steps``: 0);
  ``above``: an exclusive lower bound (``--pretrain_lr``: 0; also refuses NaN). Every stage flag of
  the alignment scripts is checked here, so their errors read alike.

  Raises:
    ValueError: "--NAME must be >= N, got V" (or "> N"), naming the flag and its value.
  """
  value = holder.value
  if value is None:
    return None
  if at_least is not None and not value >= at_least:
    raise ValueError(f"--{holder.name} must be >= {at_least}, got {value}")
  if above is not None and not value > above:
    raise ValueError(f"--{holder.name} must be > {above}, got {value}")
  return value


# The stage sizes of rljax.alignment.pipeline's two configs (EmbeddedConfig: the embedded task;
# PreferenceConfig: --preference_data), named in the flags' help. They are written out here
# because the scripts define their flags before importing the pipeline (and JAX);
# tests/test_bad_input.py (test_step_defaults_in_the_help_are_the_configs) checks them against
# the configs.
STEP_DEFAULTS = {
    "embedded": {"pretrain_steps": 800, "sft_steps": 150, "rl.num_steps": 200},
    "preference": {"pretrain_steps": 150, "sft_steps": 100, "rm_steps": 150,
                   "rl.num_steps": 100},
}


def default_steps(field: str, *, embedded: bool = True) -> str:
  """``"default: 800 on the embedded task, 150 with --preference_data"`` for a `STEP_DEFAULTS`
  field, for flag help; only the ``--preference_data`` one where ``embedded`` is False (a script
  that needs the data) or where the embedded task has no such stage (``rm_steps``)."""
  pref = STEP_DEFAULTS["preference"][field]
  if not embedded or field not in STEP_DEFAULTS["embedded"]:
    return f"default: {pref}"
  return f"default: {STEP_DEFAULTS['embedded'][field]} on the embedded task, {pref} with " \
         "--preference_data"


def define_sft_steps_flag(help_text: str) -> flags.FlagHolder:
  """``--sft_steps`` (default None: the pipeline's), for the scripts that run SFT before their
  own stage (``train_reward_model.py``, ``train_rlhf.py``); ``train_sft.py`` takes
  ``--num_steps``."""
  return flags.DEFINE_integer("sft_steps", None, help_text)


# Old spellings kept for one release (`rljax.cli.run` rewrites them): old -> current.
DEPRECATED_ALIASES = {"--lr": "--pretrain_lr"}


@dataclasses.dataclass(frozen=True)
class DataFlags:
  """The preference-data flags: prompt budget, tokenizer, pretrained model."""

  max_prompt_len: Any
  overlong_prompts: Any
  tokenizer: Any
  vocab_size: Any
  model: Any
  pretrain_lr: Any
  sft_lr: Any
  rm_lr: Any  # None where the script trains no reward model (train_sft.py)

  def _given(self, name: str):
    """Flag ``name``'s value; None if not given or not defined by this script."""
    holder = getattr(self, name)
    return None if holder is None else holder.value

  def overrides(self) -> dict[str, Any]:
    """``rljax.alignment.pipeline.PreferenceConfig`` fields set on the command line.

    Raises:
      ValueError: ``--model`` with ``--tokenizer`` or ``--vocab_size`` (both come from the
        model folder); ``--pretrain_lr``, ``--sft_lr`` or ``--rm_lr`` not > 0;
        ``--pretrain_lr`` with both
        ``--model`` and ``--sft_lr`` (it would set nothing: ``--model`` skips pre-training).
    """
    if self.model.value is not None:
      for name in ("tokenizer", "vocab_size"):
        if getattr(self, name).value is not None:
          raise ValueError(f"--{name} cannot be combined with --model: the tokenizer and the "
                           f"vocabulary come from the model folder {self.model.value!r}")
      if self.pretrain_lr.value is not None and self.sft_lr.value is not None:
        raise ValueError(f"--pretrain_lr={self.pretrain_lr.value} would set nothing: it is the "
                         f"pre-training "
                         f"learning rate, --model skips pre-training, and --sft_lr="
                         f"{self.sft_lr.value} sets SFT's; drop --pretrain_lr")
    out = {"overlong_prompts": self.overlong_prompts.value}
    rates = ("pretrain_lr", "sft_lr", "rm_lr")
    for key in ("max_prompt_len", "tokenizer", "vocab_size", "model", *rates):
      holder = getattr(self, key)
      value = None if holder is None else (
          checked(holder, above=0) if key in rates else holder.value)
      if value is not None:
        out[key] = value
    return out

  def base_config(self):
    """``rljax.alignment.pipeline.preference_defaults`` for ``--model``: with a pretrained
    model its lower learning rates, before :meth:`overrides` (e.g. ``--pretrain_lr``) apply."""
    from rljax.alignment import pipeline

    return pipeline.preference_defaults(self.model.value)

  def check_data(self, preference_data: str | None) -> None:
    """Raises ValueError for ``--model``, ``--pretrain_lr``, ``--sft_lr``, ``--rm_lr``,
    ``--max_prompt_len``, ``--overlong_prompts``, ``--tokenizer`` or ``--vocab_size`` without
    ``--preference_data`` (the embedded task trains its own tiny model on its own character
    tokenizer, so they would be silently ignored)."""
    if preference_data is not None:
      return
    if self.model.value is not None:
      raise ValueError(f"--model {self.model.value!r} needs --preference_data=PATH (the "
                       f"embedded addition task trains its own tiny model)")
    for name in ("pretrain_lr", "sft_lr", "rm_lr"):
      if self._given(name) is not None:
        raise ValueError(f"--{name} applies to --preference_data runs only (the embedded "
                         f"addition task keeps its own learning rates)")
    for name in ("max_prompt_len", "tokenizer", "vocab_size", "overlong_prompts"):
      if getattr(self, name).present:
        raise ValueError(f"--{name} applies to --preference_data runs only (the embedded "
                         f"addition task has its own character tokenizer and short prompts)")


def define_data_flags(*, reward_model: bool = True) -> DataFlags:
  """``--max_prompt_len``, ``--overlong_prompts``, ``--tokenizer``, ``--vocab_size``, ``--model``,
  ``--pretrain_lr`` (``--lr``, its old spelling), ``--sft_lr``, and ``--rm_lr`` where
  ``reward_model`` (the script trains a reward
  model; not ``train_sft.py``, whose ``--help`` then does not list it and absl rejects it as
  unknown)."""
  data = DataFlags(
      max_prompt_len=flags.DEFINE_integer(
          "max_prompt_len", None, "Prompt length limit in tokens."),
      overlong_prompts=flags.DEFINE_enum(
          "overlong_prompts", "truncate", ["truncate", "reject"],
          "Prompts longer than --max_prompt_len (or the model's context minus the response "
          "length): keep their last tokens, or stop with an error."),
      tokenizer=flags.DEFINE_string(
          "tokenizer", None, "Tokenizer folder (tokenizer.json) instead of training a BPE one."),
      vocab_size=flags.DEFINE_integer(
          "vocab_size", None, "Model vocabulary (with --tokenizer)."),
      model=flags.DEFINE_string(
          "model", None, "Pretrained Hugging Face model folder (config.json, model.safetensors, "
          "tokenizer.json; Llama or Qwen2), as OpenRLHF's --pretrain: the tokenizer and the "
          "initial weights of every model come from it and pre-training is skipped. With "
          "--preference_data; not with --tokenizer or --vocab_size. Its learning rates default "
          "to OpenRLHF's for pretrained models (rljax.alignment.pipeline."
          "PRETRAINED_LEARNING_RATES: SFT 5e-6, reward model 9e-6, actor 5e-7, critic 9e-6)."),
      pretrain_lr=flags.DEFINE_float(
          "pretrain_lr", None, "--preference_data: pre-training learning rate; SFT runs at "
          "half of it unless --sft_lr is given (default 2e-3 from scratch, 1e-5 with --model)."),
      sft_lr=flags.DEFINE_float(
          "sft_lr", None, "--preference_data: SFT learning rate (default --pretrain_lr / 2: "
          "1e-3 from scratch, 5e-6 with --model, OpenRLHF's for pretrained models)."),
      rm_lr=flags.DEFINE_float(
          "rm_lr", None, "--preference_data: reward-model learning rate (default 5e-4 from "
          "scratch, 9e-6 with --model).") if reward_model else None,
  )
  return data


@dataclasses.dataclass(frozen=True)
class MeshFlags:
  """``--mesh`` and ``--sharding_rules`` (see ``rljax.alignment.pipeline.make_placement``)."""

  mesh: Any
  sharding_rules: Any


def define_mesh_flags(mesh_help: str = "Device mesh D,F,T (data, fsdp, tensor sizes); default: "
                      "all devices on data.",
                      rules_help: str = "Sharding preset: fsdp, fsdp_tp, dp or tp "
                      "(rljax.sharding.rules).") -> MeshFlags:
  """``--mesh=D,F,T`` and ``--sharding_rules=PRESET`` (default ``fsdp``)."""
  return MeshFlags(
      mesh=flags.DEFINE_string("mesh", None, mesh_help),
      sharding_rules=flags.DEFINE_string("sharding_rules", "fsdp", rules_help),
  )


@dataclasses.dataclass(frozen=True)
class StageFlags:
  """The flags every alignment script shares (``train_sft.py``, ``train_reward_model.py``,
  ``train_rlhf.py``): data, output folder, step counts, pair limit, seed, ``--verbose``, devices,
  ``--wandb`` and `DataFlags`.

  ``--coordinator_address`` and the other process flags are defined too
  (``rljax.sharding.distributed.define_flags``).
  """

  preference_data: Any
  logdir: Any
  num_steps: Any
  pretrain_steps: Any
  limit: Any
  seed: Any
  verbose: Any
  wandb: Any
  resume: Any
  stage_checkpoint_every: Any
  compilation_cache: cli.CompilationCacheFlags
  mesh: MeshFlags
  data: DataFlags
  logdir_prefix: str

  def check_data(self, preference_data: str | None) -> None:
    """`DataFlags.check_data`, and ``--limit`` without ``--preference_data`` (the embedded
    task reads no pairs).

    Raises:
      ValueError: naming the flag that the embedded task would ignore.
    """
    if preference_data is None and self.limit.value is not None:
      raise ValueError(f"--limit applies to --preference_data runs only (the embedded addition "
                       f"task reads no preference pairs); got --limit={self.limit.value}")
    self.data.check_data(preference_data)

  def resolved_logdir(self, now: str, prefix: str | None = None) -> str:
    """``--logdir``, or ``runs/<prefix>-<now>`` (``now`` e.g. ``"20261202-101500"``; ``prefix``
    defaults to ``logdir_prefix``)."""
    return self.logdir.value or os.path.join("runs", f"{prefix or self.logdir_prefix}-{now}")

  def start(self, placement: str = "colocated", *, offload_frozen: bool = False):
    """Joins the processes (the process flags; a no-op for one process outside SLURM) and
    returns the placement of ``--mesh`` by ``--sharding_rules``
    (``rljax.alignment.pipeline.make_placement``, which takes ``placement`` and
    ``offload_frozen``), checked before anything compiles.

    Raises:
      ValueError: an unknown ``--sharding_rules`` preset or ``placement``.
      rljax.sharding.mesh.MeshError: a ``--mesh`` that does not fit the devices.
    """
    from rljax.alignment import pipeline

    distributed.initialize_from_flags()
    return pipeline.make_placement(self.mesh.mesh.value, self.mesh.sharding_rules.value,
                                   placement, offload_frozen=offload_frozen)

  def start_disaggregated(self, *, offload_frozen: bool = False):
    """``--placement=disaggregated`` over 2 processes: joins the trainer (process 0) and the
    generator (process 1) by `rljax.sharding.link` instead of ``jax.distributed.initialize``.

    Returns:
      ``(link, placement)``: on the trainer, the placement of ``--mesh`` over its own devices
      with a `rljax.alignment.remote_generation.RemoteSampler`; on the generator
      ``(link, None)`` (it then runs `rljax.alignment.remote_generation.serve`). ``None`` when
      the process flags describe a single process (then use `start`).

    Raises:
      ValueError: more than 2 processes, or a bad ``--sharding_rules``.
      rljax.sharding.mesh.MeshError: a ``--mesh`` that does not fit the trainer's devices.
    """
    from rljax.alignment import pipeline, remote_generation
    from rljax.sharding import link as link_lib

    config = distributed.config_from_flags()
    n = distributed.num_processes_of(config)
    if n == 1:
      return None
    if n != 2:
      raise ValueError(f"--placement=disaggregated over processes runs 2 processes (process 0 "
                       f"trains, process 1 generates), got {n}")
    link = link_lib.connect(config, peer_names=remote_generation.PEER_NAMES,
                            peer_timeout_s=config.heartbeat_timeout_s or 10)
    if link.process_id == 1:
      return link, None
    remote = remote_generation.RemoteSampler(link)
    return link, pipeline.make_placement(
        self.mesh.mesh.value, self.mesh.sharding_rules.value, "disaggregated",
        offload_frozen=offload_frozen, remote_generator=remote)

  def checkpoint_kwargs(self) -> dict[str, Any]:
    """``resume`` and ``stage_checkpoint_every`` for ``rljax.alignment.pipeline.run_embedded``
    / ``run_preference``, from ``--resume`` and ``--stage_checkpoint_every``.

    Raises:
      ValueError: ``--stage_checkpoint_every`` < 0.
    """
    return dict(resume=self.resume.value,
                stage_checkpoint_every=checked(self.stage_checkpoint_every, at_least=0))

  def checked_num_steps(self) -> int | None:
    """``--num_steps`` (None when not given).

    Raises:
      ValueError: ``--num_steps`` < 1.
    """
    return checked(self.num_steps, at_least=1)

  def with_pretrain_steps(self, config):
    """``config`` (an ``EmbeddedConfig`` or ``PreferenceConfig``) with ``--pretrain_steps``
    applied when given.

    Raises:
      ValueError: ``--pretrain_steps`` < 0.
    """
    steps = checked(self.pretrain_steps, at_least=0)
    return config if steps is None else dataclasses.replace(config, pretrain_steps=steps)

  def preference_config(self, **changes):
    """The ``--preference_data`` run's ``rljax.alignment.pipeline.PreferenceConfig``: the
    defaults for ``--model`` (`DataFlags.base_config`) with ``--limit``, ``--seed``, the data
    flags (`DataFlags.overrides`), ``changes`` (a script's own fields, e.g. ``sft_steps``; one
    given as None keeps its default) and ``--pretrain_steps`` applied.

    Raises:
      ValueError: a flag out of range (`checked`), a bad flag combination, or a field the
        config refuses.
    """
    return self.with_pretrain_steps(dataclasses.replace(
        self.data.base_config(), limit=checked(self.limit, at_least=1), seed=self.seed.value,
        **self.data.overrides(), **{k: v for k, v in changes.items() if v is not None}))


def define_stage_flags(*, logdir_prefix: str, data_help: str, steps_help: str,
                       reward_model: bool = True, embedded: bool = True,
                       mesh_help: str | None = None,
                       rules_help: str | None = None) -> StageFlags:
  """Defines ``--preference_data`` (help ``data_help``), ``--logdir`` (default
  ``runs/<logdir_prefix>-<time>``), ``--num_steps`` (help ``steps_help``), ``--pretrain_steps``,
  ``--limit``, ``--seed``, ``--verbose``, ``--resume``, ``--stage_checkpoint_every``, the
  compilation-cache flags (`rljax.cli`), the mesh flags (`define_mesh_flags`, with
  ``mesh_help`` and ``rules_help`` where given), the process flags, ``--wandb`` and the data flags
  (`define_data_flags`, ``--rm_lr`` only where ``reward_model``); call once, at a script's
  module level. ``embedded``: the script runs the embedded task without ``--preference_data``
  (the help then names both configs' default stage sizes)."""
  mesh_kw = {k: v for k, v in (("mesh_help", mesh_help), ("rules_help", rules_help)) if v}
  out = StageFlags(
      preference_data=flags.DEFINE_string("preference_data", None, data_help),
      logdir=flags.DEFINE_string(
          "logdir", None, f"Output directory (default runs/{logdir_prefix}-<time>)."),
      num_steps=flags.DEFINE_integer("num_steps", None, steps_help),
      pretrain_steps=flags.DEFINE_integer(
          "pretrain_steps", None, "Pre-training steps before SFT "
          f"({default_steps('pretrain_steps', embedded=embedded)}; 0 skips it; unused with "
          "--model, whose weights are pretrained)."),
      limit=flags.DEFINE_integer("limit", None, "Read at most this many preference pairs."),
      seed=flags.DEFINE_integer("seed", 0, "Seed."),
      verbose=flags.DEFINE_bool("verbose", False, "Print tracebacks for user errors."),
      # Devices (rljax.alignment.pipeline.make_placement): the model trains on --mesh by
      # --sharding_rules.
      mesh=define_mesh_flags(**mesh_kw),
      wandb=run_info.define_wandb_flag(),
      # Checkpoints and resume (rljax.alignment.checkpointing): the stages before RL.
      resume=flags.DEFINE_bool(
          "resume", True, "Continue the run in --logdir when it holds one (its saved stages; "
          "for train_rlhf.py also its RL checkpoints)."),
      stage_checkpoint_every=flags.DEFINE_integer(
          "stage_checkpoint_every", 100, "Steps of pre-training, SFT and reward-model training "
          "between saves of their state under <logdir>/stages, which a rerun after a SIGKILL or "
          "a lost node continues from (0: only on SIGTERM and at each stage's end)."),
      compilation_cache=cli.define_compilation_cache_flags(),
      # Preference data: prompt budget, tokenizer, --model.
      data=define_data_flags(reward_model=reward_model),
      logdir_prefix=logdir_prefix,
  )
  distributed.define_flags()
  return out
