r"""One GRPO training step: rljax vs TRL's ``GRPOTrainer`` on the same tiny checkpoint, CPU.

    python benchmarks/rlhf_step.py --out=/tmp/rlhf_step.json
    python benchmarks/rlhf_step.py --skip_trl --steps=3     # rljax alone

Setup: a Llama-style model of ~7M parameters (hidden 256, 4 layers, 4 heads, 2 KV
heads, vocabulary 8192) made with ``transformers`` and saved to a temporary folder, loaded by
both; 8 prompts x 4 generations; 64-token prompts; 32 new tokens; a programmatic reward (the
fraction of even token ids in the completion). TRL runs with its defaults (bf16 autocast,
gradient checkpointing, beta = 0) and with fp32 and beta = 0.04; rljax runs GRPO at the same
beta (k3 in the loss, as TRL) with ``reuse_rollout_log_probs`` (one epoch, one minibatch: the old
log-probs are the sampler's, no extra forward pass, as TRL's ``num_iterations=1``), and at the
same precision: against TRL's bf16 autocast with ``compute_dtype="bfloat16"`` (bf16 matmuls,
f32 master weights and optimizer; rljax's f32 time is reported beside it), against fp32 in f32.
Step times are medians over ``--steps`` steps after warm-up. The load average is recorded in
the JSON.

``flops_floor_s`` = the step's matmul FLOPs divided by this machine's measured f32 matmul
throughput (``flops_floor_bf16_s``: divided by its bf16 matmul throughput, the floor of a bf16
step). With ``N_body`` the transformer's non-embedding parameters and ``N_head`` the LM head's,
one pass over the batch costs ``2 * N_body`` per token of the prompt + response and
``2 * N_head`` per *response* token (both trainers compute logits only where log-probs are
needed; generation needs them only for the new tokens). The step is generation (1 pass),
the reference forward (1 pass, only when beta > 0) and the policy's forward + backward (3
passes). No old-log-prob pass: with one iteration per generation TRL skips it, and rljax
runs with ``reuse_rollout_log_probs``. ``trl`` is a benchmark-only dependency
(``pip install -e ".[bench]"``).

Flags: ``--steps`` (timed steps, after 2 warm-up steps), ``--skip_trl`` (time rljax alone) and
``--out`` (the JSON file).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import numpy as np
from absl import app, flags

_OUT = flags.DEFINE_string("out", None, "Write the JSON result here.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps (after 2 warm-up steps).", lower_bound=1)
_SKIP_TRL = flags.DEFINE_bool("skip_trl", False, "Time rljax only (TRL need not be installed).")

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, INTER = 256, 4, 4, 2, 8192, 688
PROMPTS, GROUP, PROMPT_LEN, NEW = 8, 4, 64, 32


def make_checkpoint(path: str) -> None:
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                    num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
  LlamaForCausalLM(cfg).save_pretrained(path)


def make_tokenizer():
  """A word-level tokenizer with ids ``t0 .. t8191`` (``t0`` pad, ``t1`` bos, ``t2`` eos)."""
  import tokenizers
  from tokenizers import models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = {f"t{i}": i for i in range(VOCAB)}
  backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="t3"))
  backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", bos_token="t1",
                                 eos_token="t2", unk_token="t3")


def make_prompts(seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [[1] + rng.integers(4, VOCAB, PROMPT_LEN - 1).tolist() for _ in range(PROMPTS)]


def even_fraction(ids) -> float:
  ids = list(ids)
  return float(np.mean([i % 2 == 0 for i in ids])) if ids else 0.0


def matmul_flops_per_s(dtype: str = "float32") -> float:
  """This machine's 1024^3 matmul rate (FLOP/s) in ``dtype`` (f32 accumulation for bf16)."""
  import jax
  import jax.numpy as jnp

  a = jnp.ones((1024, 1024), dtype)
  f = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
  f(a).block_until_ready()
  t = time.perf_counter()
  for _ in range(10):
    f(a).block_until_ready()
  return 10 * 2 * 1024 ** 3 / (time.perf_counter() - t)


def flops_floor(beta: float, throughput: float) -> float:
  """Seconds of matmul FLOPs of one step at ``throughput`` FLOP/s (see the module docstring)."""
  head_dim = HIDDEN // HEADS
  n_body = LAYERS * (HIDDEN * HEADS * head_dim * 2 + HIDDEN * KV_HEADS * head_dim * 2
                     + 3 * HIDDEN * INTER)
  n_head = HIDDEN * VOCAB
  b = PROMPTS * GROUP
  one_pass = 2 * n_body * b * (PROMPT_LEN + NEW) + 2 * n_head * b * NEW
  passes = 1 + 3 + (1 if beta > 0 else 0)  # generation, forward + backward, reference
  return passes * one_pass / throughput


def rljax_step(path: str, beta: float, steps: int, reuse_rollout_log_probs: bool = True,
               compute_dtype: str = "float32") -> dict:
  import jax

  from rljax import ppo
  from rljax.alignment import rlhf
  from rljax.models.hf_io import load_hf_checkpoint

  model = load_hf_checkpoint(path)
  prompts = make_prompts()

  class Tok:
    eos_token_id, pad_token_id = 2, 0

    def decode(self, ids):
      return " ".join(f"t{i}" for i in ids)

  cfg = rlhf.RLHFConfig(
      algo="grpo", num_steps=steps + 2, prompts_per_step=PROMPTS, group_size=GROUP,
      max_new_tokens=NEW, actor_lr=1e-5, kl_coef=beta, kl_estimator="k3", kl_placement="loss",
      reuse_rollout_log_probs=reuse_rollout_log_probs, compute_dtype=compute_dtype,
      ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=1, normalize_advantages=False))
  reward = lambda s: np.asarray([even_fraction(r) for r in s.response_ids], np.float32)
  tr = rlhf.RLHFTrainer(cfg, actor=model, tokenizer=Tok(), prompts=prompts, reward_fn=reward)
  recs = [tr.step() for _ in range(steps + 2)][2:]  # two warm-up steps (compilation)
  med = lambda k: statistics.median(r[k] for r in recs)
  return {"step_s": med("timing/step"),
          **{k: med(k) for k in recs[0] if k.startswith("timing/")}}


def trl_step(path: str, beta: float, bf16_defaults: bool, steps: int) -> float:
  import torch
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, TrainerCallback
  from trl import GRPOConfig, GRPOTrainer

  tok = make_tokenizer()
  texts = [" ".join(f"t{i}" for i in p[1:]) for p in make_prompts()]
  ds = Dataset.from_dict({"prompt": texts * (steps + 4)})

  def reward(completions, **_):
    return [even_fraction(tok(c, add_special_tokens=False)["input_ids"]) for c in completions]

  times: list[float] = []

  class Timer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
      self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      times.append(time.perf_counter() - self.t)

  model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
  with tempfile.TemporaryDirectory() as out:
    args = GRPOConfig(
        output_dir=out, per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        max_completion_length=NEW, max_steps=steps + 2, beta=beta, use_cpu=True,
        bf16=bf16_defaults, gradient_checkpointing=bf16_defaults, report_to=[],
        logging_steps=1000, save_strategy="no", learning_rate=1e-5, temperature=1.0,
        disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[Timer()])
    trainer.train()
  return statistics.median(times[2:])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  load_start = os.getloadavg()
  throughput = {dt: matmul_flops_per_s(dt) for dt in ("float32", "bfloat16")}
  rows = []
  with tempfile.TemporaryDirectory() as path:
    make_checkpoint(path)
    for name, beta, bf16 in (("TRL defaults (bf16, grad ckpt, beta=0)", 0.0, True),
                             ("fp32, beta=0.04", 0.04, False)):
      rj = rljax_step(path, beta, _STEPS.value, compute_dtype="bfloat16" if bf16 else "float32")
      rj_f32 = rljax_step(path, beta, _STEPS.value)["step_s"] if bf16 else rj["step_s"]
      trl_s = None if _SKIP_TRL.value else trl_step(path, beta, bf16, _STEPS.value)
      rows.append(dict(setting=name, beta=beta, rljax_step_s=rj["step_s"], trl_step_s=trl_s,
                       ratio_vs_trl=None if trl_s is None else trl_s / rj["step_s"],
                       rljax_compute_dtype="bfloat16" if bf16 else "float32",
                       rljax_f32_step_s=rj_f32, rljax_phases=rj,
                       flops_floor_s=flops_floor(beta, throughput["float32"]),
                       flops_floor_bf16_s=flops_floor(beta, throughput["bfloat16"])))
  print(f"{'setting':42s} {'rljax s':>8s} {'(f32 s)':>8s} {'TRL s':>8s} {'ratio':>6s} "
        f"{'f32 floor s':>11s} {'bf16 floor s':>12s}")
  for r in rows:
    trl_txt = "-" if r["trl_step_s"] is None else f"{r['trl_step_s']:.3f}"
    ratio = "-" if r["ratio_vs_trl"] is None else f"{r['ratio_vs_trl']:.2f}"
    print(f"{r['setting']:42s} {r['rljax_step_s']:8.3f} {r['rljax_f32_step_s']:8.3f} "
          f"{trl_txt:>8s} {ratio:>6s} {r['flops_floor_s']:11.3f} {r['flops_floor_bf16_s']:12.3f}")
  # Headline: against the faster TRL setting.
  timed = [r for r in rows if r["trl_step_s"] is not None]
  head = min(timed, key=lambda r: r["trl_step_s"]) if timed else rows[0]
  result = dict(rljax_step_s=head["rljax_step_s"], trl_step_s=head["trl_step_s"],
                ratio_vs_trl=head["ratio_vs_trl"], rljax_phases=head["rljax_phases"],
                flops_floor_s=head["flops_floor_s"], flops_floor_bf16_s=head["flops_floor_bf16_s"],
                headline_setting=head["setting"], matmul_flops_per_s=throughput, rows=rows,
                load_average_start=load_start, load_average_end=os.getloadavg())
  print(f"load average (1, 5, 15 min): start {load_start}, end {result['load_average_end']}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  app.run(main)
