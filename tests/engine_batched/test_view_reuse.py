"""A takeover reuses a tensor built before (a prepared standby's) only when it is exactly the view the lease's
tensor would get: its address, shape, strides, dtype and device; anything else gets a new view of the lease."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engines.batched.memory import _view


class _Lease:
    """A lease's mapping over a CPU buffer, as a takeover sees it (mapping.ptr, mapping.device, torch())."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.mapping = SimpleNamespace(ptr=buf.data_ptr(), device="cpu")
        self.made = 0

    def torch(self, dtype: str, shape: tuple[int, ...], offset: int, stride: object) -> torch.Tensor:
        self.made += 1
        n = 1
        for d in shape:
            n *= d
        return self.buf[offset:offset + n * 2].view(getattr(torch, dtype)).view(shape)


def test_a_known_view_is_reused_only_where_it_is_the_same_view() -> None:
    lease = _Lease(torch.zeros(4096, dtype=torch.uint8))
    same = lease.buf[256:256 + 2 * 64].view(torch.bfloat16).view(8, 8)
    assert _view(lease, "w", 256, [8, 8], "bfloat16", None, same) is same and lease.made == 0
    for other in (lease.buf[512:512 + 128].view(torch.bfloat16).view(8, 8),  # another address
                  same.view(4, 16),  # another shape
                  same.view(torch.float16),  # another dtype
                  same.t()):  # other strides
        got = _view(lease, "w", 256, [8, 8], "bfloat16", None, other)
        assert got is not other and got.data_ptr() == same.data_ptr() and got.dtype == torch.bfloat16
    assert _view(lease, "w", 256, [8, 8], "bfloat16", None, None).shape == (8, 8) and lease.made == 5
