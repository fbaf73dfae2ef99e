"""rljax.sharding on 1 device, plus the 8-fake-device cases run in a subprocess.

The 8-device cases live in tests/_sharding_8dev_cases.py; XLA_FLAGS must be set before jax is
imported, so they run in a child pytest and this suite keeps its 1 device.
"""

import os
import subprocess
import sys

import jax
import pytest

from rljax.sharding import mesh as mesh_lib, rules


def test_parse_mesh_flag():
  assert mesh_lib.parse_mesh_flag(None) == mesh_lib.MeshConfig(data=-1, fsdp=1, tensor=1)
  assert mesh_lib.parse_mesh_flag("2, 4,1") == mesh_lib.MeshConfig(data=2, fsdp=4, tensor=1)
  with pytest.raises(mesh_lib.MeshError, match=r"3 sizes .* got 2 in '2,4'"):
    mesh_lib.parse_mesh_flag("2,4")
  with pytest.raises(mesh_lib.MeshError, match="comma-separated integers D,F,T, got 'a,b,c'"):
    mesh_lib.parse_mesh_flag("a,b,c")
  with pytest.raises(mesh_lib.MeshError, match="'fsdp' must be >= 1 .* got 0"):
    mesh_lib.MeshConfig(fsdp=0)


def test_one_device_mesh_and_size_error():
  m = mesh_lib.make_mesh()
  assert dict(m.shape) == {"data": jax.device_count(), "fsdp": 1, "tensor": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
  with pytest.raises(mesh_lib.MeshError, match=r"= 8 devices, but 1 device is available; "
                     r"on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8 \(set before "
                     r"Python starts\) makes 8 host devices$"):
    mesh_lib.make_mesh(mesh_lib.parse_mesh_flag("2,2,2"))
  assert mesh_lib.check_batch_divisible(6, m) == 6


def test_rules_table_and_activation_rules():
  assert dict(rules.param_rules("fsdp"))["embed"] == "fsdp"
  assert dict(rules.activation_rules("fsdp"))["embed"] is None      # fsdp is a data axis for activations
  assert dict(rules.activation_rules("fsdp_tp"))["mlp"] == "tensor"
  assert dict(rules.activation_rules("dp"))["batch"] == ("data", "fsdp")
  with pytest.raises(ValueError, match="unknown sharding rules preset 'zero'"):
    rules.as_preset("zero")
  with pytest.raises(ValueError, match=r"2 logical names .* shape \(4,\)"):
    rules.spec_for((4,), ("embed", "mlp"), mesh_lib.make_mesh(), rules.param_rules("fsdp"))


@pytest.mark.slow
def test_eight_fake_devices_subprocess():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  path = os.path.join(os.path.dirname(__file__), "_sharding_8dev_cases.py")
  out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "no:xdist", path], capture_output=True, text=True, timeout=540, env=env)
  assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
  assert "15 passed" in out.stdout, out.stdout[-2000:]
