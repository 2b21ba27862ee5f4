"""Which GPU records a gpu_manager deletes at start (pure: `gone_gpu_keys`): only its own node's, of GPUs it lacks."""

from __future__ import annotations

from services.gpu_manager.gpu_publisher import gone_gpu_keys


def test_only_this_nodes_records_of_gpus_it_lacks_are_named() -> None:
    keys = ["gpus/n1/0", "gpus/n1/1", "gpus/n1/2", "gpus/n10/1", "gpus/n2/1", "gpus/n1/x", "nodes/n1"]
    assert gone_gpu_keys("n1", keys, [0, 2]) == ["gpus/n1/1"]
    assert gone_gpu_keys("n1", keys, [0, 1, 2]) == []
