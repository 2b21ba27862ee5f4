"""The name a class's weights copy is written under (the gpu_manager's policy and `snapshot` default) and the one
an engine's cold start asks to restore are the same, for any engine class (pure)."""

from __future__ import annotations

import pytest

from libs.client.safetensors_io import copy_name
from services.gpu_manager.artifact import check_name, default_name


@pytest.mark.parametrize("engine_class", ["batched", "llama 70b", "org/model:v2", "._x", "a" * 250])
def test_the_engine_asks_for_the_copy_the_manager_writes(engine_class: str):
    assert copy_name(engine_class) == default_name(engine_class, "weights")
    assert check_name(copy_name(engine_class))  # a name the gpu_manager takes, never a malformed request
