"""The engine SDK on the host backend: zero-copy views, metadata round trips, safetensors loading."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from libs.client.memory import MemoryClient, TensorMeta
from libs.client.safetensors_io import load_safetensors_into_leases
from libs.common.errors import HoldfastError, MalformedMessage
from tests.gpu_manager.harness import ROOT


def test_numpy_and_torch_views_share_the_same_bytes(manager):
    with MemoryClient.connect("sdk-views", socket_path=manager.socket) as client:
        lease = client.allocate(1 << 20, name="v")
        a = lease.numpy("float32", (4, 8))
        a[:] = np.arange(32, dtype=np.float32).reshape(4, 8)
        t = lease.torch(torch.float32, (4, 8))
        assert torch.equal(t, torch.arange(32, dtype=torch.float32).reshape(4, 8))
        t.mul_(2)  # write through torch, read through numpy: one memory
        assert a[3, 7] == 62
        col = lease.numpy("float32", (4,), offset=4 * 2, stride=(8,))  # a strided column view
        assert list(col) == [4.0, 20.0, 36.0, 52.0]
        bf = lease.torch("bfloat16", (16,), offset=4096)
        bf[:] = 0.5
        assert bf.dtype == torch.bfloat16 and float(bf.sum()) == 8.0


def test_tensor_metadata_ending_past_the_lease_is_refused(manager):
    with MemoryClient.connect("sdk-bounds", socket_path=manager.socket) as client:
        lease = client.allocate(4096)
        with pytest.raises(MalformedMessage):
            client.register([lease.meta("too-big", "float32", (2048,))])
        with pytest.raises(HoldfastError):
            client.register([TensorMeta(name="x", lease_id="lease-unknown", offset=0, shape=[1], dtype="uint8")])


def test_release_frees_the_lease_and_it_is_gone_for_a_new_process(manager):
    with MemoryClient.connect("sdk-release", socket_path=manager.socket) as client:
        lease = client.allocate(8192)
        client.release(lease.id)
        assert client.leases == {}
    with MemoryClient.connect("sdk-release", socket_path=manager.socket) as again:
        assert again.pending() == [] and again.attach().leases == []


def test_safetensors_file_is_loaded_into_one_lease_and_rebuilt_after_a_crash_without_disk(manager, tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = {"embed": torch.randn(64, 32), "norm": torch.randn(32).to(torch.bfloat16),
               "ids": torch.arange(10, dtype=torch.int64), "mask": torch.tensor([True, False, True])}
    save_file(tensors, str(path))
    script = textwrap.dedent(f"""
        import os, signal
        from libs.client.memory import MemoryClient
        from libs.client.safetensors_io import load_safetensors_into_leases
        c = MemoryClient.connect("sdk-st", socket_path={manager.socket!r})
        views = load_safetensors_into_leases(c, {str(path)!r})
        assert len(c.leases) == 1
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    os.unlink(path)  # the successor must not need the file

    with MemoryClient.connect("sdk-st", socket_path=manager.socket) as client:
        att = client.attach()
        assert len(att.leases) == 1 and att.layout_hash is not None
        got = att.tensors("torch")
        assert set(got) == set(tensors)
        for name, want in tensors.items():
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_safetensors_loader_returns_numpy_views_too(manager, tmp_path):
    path = tmp_path / "n.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(path))
    with MemoryClient.connect("sdk-np", socket_path=manager.socket) as client:
        views = load_safetensors_into_leases(client, path, framework="numpy")
        assert views["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
        assert torch.equal(load_file(str(path))["a"], torch.from_numpy(np.array(views["a"])))
