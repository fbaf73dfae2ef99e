"""Old command-line spellings and old saved configs: rewritten with a note, read as before."""

import dataclasses
import io
import json
import os

import pytest

from rljax import checkpoint as ckpt
from rljax import cli
from rljax.alignment import flags as alignment_flags
from rljax.alignment import pipeline_config
from rljax.control import apg, checkpointing
from rljax.control.config import PPO_FIELDS, ControlConfig, nest_ppo_fields
from test_control import TINY


def test_rewrite_deprecated_replaces_both_forms_and_notes_each_old_name_once():
  notes = io.StringIO()
  argv = ["prog", "--lr=0.1", "--seed=3", "--lr", "0.2", "--batch-sizes=1,2", "--", "--lr=9"]
  out = cli.rewrite_deprecated(argv, {"--lr": "--pretrain_lr", "--batch-sizes": "--batch_sizes"},
                               stream=notes)
  assert out == ["prog", "--pretrain_lr=0.1", "--seed=3", "--pretrain_lr", "0.2",
                 "--batch_sizes=1,2", "--", "--lr=9"]
  assert notes.getvalue().splitlines() == [
      "warning: --lr is deprecated and will be removed in the next release; use --pretrain_lr",
      "warning: --batch-sizes is deprecated and will be removed in the next release; use "
      "--batch_sizes"]
  assert cli.rewrite_deprecated(["prog", "--lrx=1"], {"--lr": "--pretrain_lr"}) == ["prog", "--lrx=1"]
  assert alignment_flags.DEPRECATED_ALIASES == {"--lr": "--pretrain_lr"}


def test_preference_config_saved_with_lr_reads_as_pretrain_lr():
  assert pipeline_config.upgrade_saved_config({"lr": 2e-3, "seed": 0}) == {
      "pretrain_lr": 2e-3, "seed": 0}
  today = {"pretrain_lr": 1e-5, "seed": 1}
  assert pipeline_config.upgrade_saved_config(today) == today


def test_rl_config_saved_with_adaptive_kl_reads_as_kl_controller(tmp_path):
  assert pipeline_config.upgrade_saved_config({"rl": {"adaptive_kl": True, "kl_coef": 0.1}}) == {
      "rl": {"kl_controller": "adaptive", "kl_coef": 0.1}}
  assert pipeline_config.upgrade_saved_config({"rl": {"adaptive_kl": False}}) == {
      "rl": {"kl_controller": "fixed"}}
  # A preference run saved before the change (adaptive_kl true, its default) resumes as the
  # same run; the same run asking for the PI controller is refused by name.
  from rljax.alignment import pipeline

  config = pipeline.PreferenceConfig()
  run = pipeline.saved_run(config, "data.jsonl")
  old = json.loads(json.dumps(run.config_json))
  old["rl"]["adaptive_kl"] = old["rl"].pop("kl_controller") == "adaptive"
  assert old["rl"]["adaptive_kl"] is True
  os.makedirs(os.path.join(ckpt.checkpoint_dir(str(tmp_path)), "1"))
  ckpt.write_json_atomic(os.path.join(ckpt.checkpoint_dir(str(tmp_path)), ckpt.CONFIG_FILE),
                         {run.section: old})
  ckpt.check_same_config(str(tmp_path), run.section, run.config_json, run.defaults,
                         upgrade=run.upgrade)
  pi = dataclasses.replace(config, rl=dataclasses.replace(config.rl, kl_controller="pi"))
  other = pipeline.saved_run(pi, "data.jsonl")
  with pytest.raises(ValueError, match="rl.kl_controller: saved 'adaptive', now 'pi'"):
    ckpt.check_same_config(str(tmp_path), other.section, other.config_json, other.defaults,
                           upgrade=other.upgrade)


def test_apg_config_saved_without_lr_schedule_keeps_how_it_decayed():
  assert apg._with_lr_schedule({"lr_decay": 0.99})["lr_schedule"] == "exponential"
  assert apg._with_lr_schedule({"lr_decay": 1.0})["lr_schedule"] == "constant"
  assert apg._with_lr_schedule({})["lr_schedule"] == "constant"
  assert apg._with_lr_schedule({"lr_schedule": "constant", "lr_decay": 0.5}) == {
      "lr_schedule": "constant", "lr_decay": 0.5}


def test_control_config_saved_with_flat_ppo_fields_resumes(tmp_path):
  """A config saved with the PPO fields at the top level binds a resume as a nested one does:
  the same config resumes, a different PPO field is refused by name."""
  config = ControlConfig().replace(**TINY)
  nested = json.loads(config.to_json())
  flat = {k: v for k, v in nested.items() if k != "ppo"} | nested["ppo"]
  assert set(nested["ppo"]) <= set(PPO_FIELDS) and "clip_eps" in flat
  assert nest_ppo_fields(flat) == nested
  os.makedirs(os.path.join(ckpt.checkpoint_dir(str(tmp_path)), "1"))  # a saved chunk
  ckpt.write_json_atomic(os.path.join(ckpt.checkpoint_dir(str(tmp_path)), ckpt.CONFIG_FILE),
                         {"control": flat})
  assert ckpt.check_logdir(str(tmp_path), checkpointing.saved_run(config), resume=True) == 1
  with pytest.raises(ValueError, match=r"different config \(ppo.clip_eps: saved 0.2, now 0.1\)"):
    ckpt.check_logdir(str(tmp_path), checkpointing.saved_run(config.replace(clip_eps=0.1)),
                      resume=True)
