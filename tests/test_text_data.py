"""Text datasets (rljax.envs.text.data): formats, errors, chat template, data position."""

import gzip
import json

import numpy as np
import pytest

from rljax.envs.text import data


CHOSEN = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: Sure, a short one."
REJECTED = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: No."


def _write(path, lines, gz=False):
  opener = gzip.open if gz else open
  with opener(path, "wb") as f:
    for line in lines:
      f.write(line if isinstance(line, bytes) else (line + "\n").encode())


def test_hh_pair_split_and_messages(tmp_path):
  p = str(tmp_path / "hh.jsonl.gz")
  _write(p, [json.dumps({"chosen": CHOSEN, "rejected": REJECTED})], gz=True)
  (pair,) = data.load_preference_pairs(p)
  assert pair.prompt.endswith("\n\nHuman: Tell me a joke\n\nAssistant:")
  assert (pair.chosen, pair.rejected) == ("Sure, a short one.", "No.")
  assert pair.messages == ({"role": "user", "content": "Hi there"},
                           {"role": "assistant", "content": "Hello!"},
                           {"role": "user", "content": "Tell me a joke"})


def test_prompt_chosen_rejected_format(tmp_path):
  p = str(tmp_path / "pcr.jsonl")
  _write(p, [json.dumps({"prompt": "Q?", "chosen": "A", "rejected": "B"}), ""])
  (pair,) = data.load_preference_pairs(p)
  assert (pair.prompt, pair.chosen, pair.rejected, pair.messages) == ("Q?", "A", "B", None)
  assert data.load_prompts(p) == ["Q?"]
  (ex,) = data.load_sft_examples(p)
  assert (ex.prompt, ex.response) == ("Q?", "A")


def test_errors_name_file_line_and_key(tmp_path):
  p = str(tmp_path / "bad.jsonl")
  _write(p, [json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}), "{not json"])
  with pytest.raises(data.DataError, match=r"bad.jsonl:2: malformed JSON"):
    data.load_preference_pairs(p)
  _write(p, [json.dumps({"prompt": "a", "chosen": "b"})])
  with pytest.raises(data.DataError, match=r"bad.jsonl:1: missing key 'rejected'"):
    data.load_preference_pairs(p)
  _write(p, [json.dumps({"prompt": "ok"}), b"{\"prompt\": \"\xff\xfe\"}\n"])
  with pytest.raises(data.DataError, match=r"bad.jsonl:2: invalid UTF-8"):
    data.load_prompts(p)
  _write(p, ["", "   "])
  with pytest.raises(data.DataError, match=r"bad.jsonl: empty dataset"):
    data.load_preference_pairs(p)
  _write(p, [json.dumps({"chosen": "no markers", "rejected": "here"})])
  with pytest.raises(data.DataError, match=r"bad.jsonl:1: .*share no prefix"):
    data.load_preference_pairs(p)
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    data.load_prompts(str(tmp_path / "nope.jsonl"))


def test_data_position_resume_continues_with_next_batch():
  # 10 examples, batch 4: an uninterrupted run draws 5 batches (crossing two epoch ends);
  # a run "restored" from the position after batch 2 draws exactly batches 3..5.
  pos = data.init_data_position(seed=7)
  batches, positions = [], []
  for _ in range(5):
    idx, pos = data.next_batch_indices(pos, 10, 4)
    batches.append(idx)
    positions.append(pos)
  # epoch 0 is a permutation of 0..9 in the first 10 draws
  assert sorted(np.concatenate(batches)[:10].tolist()) == list(range(10))
  assert positions[1] == data.DataPosition(0, 8, 7)
  assert positions[2] == data.DataPosition(1, 2, 7)   # 8 + 4 = 12 -> epoch 1, index 2
  restored = data.DataPosition(*[int(x) for x in positions[1]])
  for expect in batches[2:]:
    idx, restored = data.next_batch_indices(restored, 10, 4)
    np.testing.assert_array_equal(idx, expect)


def test_length_grouping_keeps_a_permutation():
  lengths = np.array([5, 1, 9, 3, 7, 2, 8, 4])
  order = data.epoch_order(8, 0, 0, lengths=lengths, group_size=4)
  assert sorted(order.tolist()) == list(range(8))
  assert list(lengths[order[:4]]) == sorted(lengths[order[:4]])


def test_tokenizer_chat_template_and_eos():
  tok = data.train_bpe_tokenizer(["hello world, how are you?"] * 20 + [CHOSEN, REJECTED],
                                 vocab_size=300)
  msgs = [{"role": "user", "content": "Hi there"}]
  ids = data.encode_prompt(tok, "ignored", msgs)
  text = tok.decode(ids, skip_special_tokens=False)
  assert text == "<|user|>Hi there<|assistant|>"
  # Without messages the raw text is used (with <bos>).
  assert data.encode_prompt(tok, "hello")[0] == tok.bos_token_id
  r = data.encode_response(tok, "Hello!", eos_id=tok.eos_token_id)
  assert r[-1] == tok.eos_token_id == 2


def test_real_hh_rlhf_file(hh_rlhf_path):
  pairs = data.load_preference_pairs(hh_rlhf_path)
  assert len(pairs) == 2312
  assert all(p.prompt.endswith(data.ASSISTANT_MARKER) for p in pairs)
  assert all(p.messages and p.messages[-1]["role"] == "user" for p in pairs)
