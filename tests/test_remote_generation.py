"""The trainer-generator link (rljax.sharding.link) and the generator's wire format
(rljax.alignment.remote_generation), in one process: two clients of one coordination service."""

import concurrent.futures
import time

import numpy as np
import pytest
from _multiprocess import free_port

from rljax.alignment import remote_generation
from rljax.sampling import SampleOutput
from rljax.sharding import distributed
from rljax.sharding import link as link_lib


@pytest.fixture
def pair():
  """Links 0 (the trainer) and 1 (the generator), peer timeout 1 s."""
  address = f"127.0.0.1:{free_port()}"
  names = remote_generation.PEER_NAMES

  def connect(pid):
    config = distributed.DistributedConfig(coordinator_address=address, num_processes=2,
                                           process_id=pid, initialization_timeout_s=30)
    return link_lib.connect(config, peer_names=names, peer_timeout_s=1.0)

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    links = list(pool.map(connect, (0, 1)))
  yield links
  links[1].close()
  links[0].close()


def test_messages_pass_both_ways(pair):
  trainer, generator = pair
  assert (trainer.process_id, generator.process_id) == (0, 1)
  trainer.put("request/0", b"\x00prompts")
  assert generator.get("request/0", what="request 0") == b"\x00prompts"
  generator.put("output/0", bytes(range(256)) * 1000)
  assert trainer.get("output/0", what="the rollout of RL step 1") == bytes(range(256)) * 1000


def test_a_reported_failure_is_raised_naming_the_peer_and_what_was_awaited(pair):
  trainer, generator = pair
  generator.fail("ValueError: bad prompt (on the batch of RL step 3)")
  with pytest.raises(link_lib.LinkError) as e:
    trainer.get("output/2", what="the rollout of RL step 3")
  assert str(e.value) == ("the generator (process 1) failed while this process waited for the "
                          "rollout of RL step 3: ValueError: bad prompt (on the batch of RL "
                          "step 3)")


def test_a_silent_peer_is_declared_stopped_after_the_timeout(pair):
  trainer, generator = pair
  generator._stop.set()  # its heartbeat stops, as when the process is killed
  t0 = time.monotonic()
  with pytest.raises(link_lib.LinkError, match=r"^the generator \(process 1\) stopped \(no "
                     r"heartbeat for 1\.\d s; timeout 1 s\) while this process waited for the "
                     r"rollout of RL step 5$"):
    trainer.get("output/4", what="the rollout of RL step 5")
  assert 1.0 < time.monotonic() - t0 < 5.0


def test_a_value_that_never_comes_times_out(pair):
  trainer, _ = pair
  with pytest.raises(link_lib.LinkError, match=r"^the generator \(process 1\) did not send the "
                     r"sampler spec within 0\.5 s$"):
    trainer.get("spec", what="the sampler spec", timeout_s=0.5)


def test_only_two_processes_are_linked():
  config = distributed.DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=3,
                                         process_id=0)
  with pytest.raises(ValueError, match=r"joins exactly 2 processes .* got 3"):
    link_lib.connect(config, peer_names=remote_generation.PEER_NAMES)


def test_sample_output_survives_the_wire_exactly():
  rng = np.random.default_rng(0)
  out = SampleOutput(tokens=rng.integers(0, 50, (4, 6), dtype=np.int32),
                     response_mask=rng.integers(0, 2, (4, 6), dtype=np.int32),
                     log_probs=rng.standard_normal((4, 6)).astype(np.float32),
                     log_probs_t1=rng.standard_normal((4, 6)).astype(np.float32),
                     lengths=np.array([6, 1, 0, 3], np.int32),
                     prompt_tokens=rng.integers(0, 50, (4, 8), dtype=np.int32),
                     prompt_mask=np.ones((4, 8), np.int32), num_steps=6)
  back = remote_generation.decode_output(remote_generation.encode_output(out))
  assert back.num_steps == 6 and isinstance(back.num_steps, int)
  for name in SampleOutput._fields[:-1]:
    a, b = getattr(out, name), getattr(back, name)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)
