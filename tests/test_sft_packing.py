"""SFT sequence packing (rljax.alignment.sft.pack_examples): packed == unpacked, less padding."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.alignment import pipeline, sft
from rljax.envs.text import data as text_data
from rljax.models import llm
from rljax.sampling import bucket_size



def test_segment_positions_gold():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 0], [1, 2, 2, 2, 3, 3]])
  np.testing.assert_array_equal(llm.segment_positions(seg),
                                [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 0, 1]])


def test_pack_examples_layout_gold():
  # Lengths 5, 2, 3, 4 into rows of 8, first-fit decreasing: 5 -> row 0, 4 -> row 1,
  # 3 -> row 0 (5 + 3 = 8), 2 -> row 1 (4 + 2 = 6). Within a row the original order is kept.
  ex = [([1, 2], [3, 4, 5]), ([1], [6]), ([1, 7], [8]), ([1], [9, 9, 9])]
  b = sft.pack_examples(ex, 8, pad_id=0, num_rows=3)
  np.testing.assert_array_equal(b["tokens"], [[1, 2, 3, 4, 5, 1, 7, 8],
                                              [1, 6, 1, 9, 9, 9, 0, 0],
                                              [0] * 8])
  np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 1, 1, 2, 2, 2],
                                                   [1, 1, 2, 2, 2, 2, 0, 0], [0] * 8])
  np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3, 4, 0, 1, 2],
                                                 [0, 1, 0, 1, 2, 3, 0, 0], [0] * 8])
  np.testing.assert_array_equal(b["loss_mask"], [[0, 0, 1, 1, 1, 0, 0, 1],
                                                 [0, 1, 0, 1, 1, 1, 0, 0], [0] * 8])
  with pytest.raises(ValueError, match="num_rows"):
    sft.pack_examples(ex, 8, pad_id=0, num_rows=1)
  with pytest.raises(ValueError, match="pack length"):
    sft.pack_examples(ex, 4, pad_id=0)


def _padding(batch):
  return 1.0 - float(np.mean(batch["mask"]))


@pytest.mark.slow  # about 60 s on 2 CPU cores (tokenizer training, three compiles)
def test_packed_loss_equals_unpacked_and_padding_drops_on_hh_rlhf(hh_rlhf_path):
  pairs = text_data.load_preference_pairs(hh_rlhf_path, limit=400)
  tok = text_data.train_bpe_tokenizer([p.prompt + " " + p.chosen for p in pairs], vocab_size=512)
  # Longer truncation than the default pipeline (prompt <= 256, response <= 128 tokens), where
  # the dialogues' spread of lengths makes padding dominate a padded batch.
  examples = sft.tokenize_examples(text_data.sft_from_pairs(pairs), tok, max_prompt_len=256,
                                   max_response_len=128)
  batch_ex = examples[:64]  # one SFT batch, in data order
  lens = np.asarray([len(p) + len(r) for p, r in batch_ex])

  plain = sft.make_batch(batch_ex, 384, tok.pad_token_id)  # pad to the truncation length
  bucketed = sft.make_batch(
      batch_ex, bucket_size(int(lens.max()), sft.DEFAULT_LENGTH_BUCKETS), tok.pad_token_id)
  packed = sft.pack_examples(batch_ex, 512, tok.pad_token_id)

  model = llm.DecoderLM(pipeline.tiny_lm_config(tok.vocab_size, eos=tok.eos_token_id,
                                                pad=tok.pad_token_id, bos=tok.bos_token_id),
                        rngs=nnx.Rngs(0))
  gd, params = nnx.split(model, nnx.Param)
  loss = jax.jit(lambda p, b: sft.sft_loss(gd, p, b)[0])
  ref = float(loss(params, plain))
  # Same examples, same response tokens: the packed loss is the unpacked loss.
  assert float(loss(params, packed)) == pytest.approx(ref, abs=1e-5)
  assert float(loss(params, bucketed)) == pytest.approx(ref, abs=1e-5)
  assert float(packed["loss_mask"].sum()) == float(plain["loss_mask"].sum())

  # Measured on this batch (tokenizer: 512-token BPE on the first 400 dialogues): mean length
  # 212 tokens, maximum 384, so padding to 384 wastes 0.447 and to the 512 bucket 0.586;
  # first-fit decreasing into 27 rows of 512 leaves 0.018.
  pad_plain, pad_bucket, pad_packed = _padding(plain), _padding(bucketed), _padding(packed)
  print(f"padding fraction: plain {pad_plain:.3f}, bucketed {pad_bucket:.3f}, "
        f"packed {pad_packed:.3f} ({packed['tokens'].shape[0]} rows of 512)")
  assert pad_plain > 0.4 and pad_bucket > 0.4
  assert pad_packed < 0.05


def test_train_sft_packing_runs_one_shape_and_reports_padding():
  # 40 examples of lengths 3..7 packed into 16-token rows; batch_size 8 examples per step.
  rng = np.random.default_rng(0)
  ex = [([1] + rng.integers(4, 30, n - 2).tolist(), [int(rng.integers(4, 30)), 2])
        for n in rng.integers(3, 8, 40)]
  model = llm.DecoderLM(pipeline.tiny_lm_config(32, hidden_size=32, num_heads=2, num_kv_heads=1),
                        rngs=nnx.Rngs(0))
  cfg = sft.SFTConfig(num_steps=6, batch_size=8, learning_rate=3e-3, packing=True,
                      pack_length=16, log_every=3, length_buckets=(8, 16))
  _, state, hist = sft.train_sft(model, ex, cfg, pad_id=0)
  assert state.step == 6
  assert hist[-1]["sft/loss"] < hist[0]["sft/loss"]
  assert hist[-1]["sft/padding_fraction"] < 0.2
