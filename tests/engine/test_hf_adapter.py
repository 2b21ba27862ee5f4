"""A transformers Llama built from its config, its parameters bound to leased memory, gives the same logits
as the reference engine over the same weights. Skipped where transformers is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.reference.config import get_config
from engines.reference.hf_adapter import export_llama_safetensors, hf_name, llama_config, model_from_leases
from engines.reference.model import Transformer
from engines.reference.weights import load_weights, make_weights
from libs.common import tokenizer

transformers = pytest.importorskip("transformers")


def reference_logits(path: Path, ctx: list[int], device: str) -> torch.Tensor:
    cfg = get_config("tiny")
    model = Transformer(cfg, load_weights(path, device))
    kv = torch.zeros(cfg.kv_shape(1, 64), device=device)[0]
    return model.forward(torch.tensor(ctx, device=device), 0, kv)


def test_every_reference_tensor_has_a_distinct_llama_name() -> None:
    names = get_config("tiny").tensor_shapes()
    assert len({hf_name(n) for n in names}) == len(names)


def test_a_transformers_llama_over_leases_matches_the_reference_engine(
        tmp_path: Path, gpu_manager: Path) -> None:
    from libs.client.memory import MemoryClient

    cfg = get_config("tiny")
    ref = make_weights(cfg, tmp_path / "ref.safetensors")
    hf_file = export_llama_safetensors(ref, tmp_path / "llama.safetensors")
    client = MemoryClient.connect("hf-1", socket_path=str(gpu_manager), engine_class="hf")
    try:
        model = model_from_leases(client, llama_config(cfg), hf_file)
        ctx = tokenizer.encode("adapter")
        with torch.inference_mode():
            logits = model(torch.tensor([ctx])).logits[0].float()
        assert torch.allclose(logits, reference_logits(ref, ctx, "cpu"), atol=1e-3)
        leased = {lease.mapping.ptr for lease in client.leases.values()}
        assert leased and model.lm_head.weight.data_ptr() >= min(leased)  # the parameter is the lease's memory
    finally:
        client.close(unmap=False)


@pytest.mark.gpu
def test_a_transformers_llama_over_cuda_tensors_matches_the_reference_engine(tmp_path: Path) -> None:
    from engines.reference.hf_adapter import model_over_tensors

    cfg = get_config("tiny")
    ref = make_weights(cfg, tmp_path / "ref.safetensors")
    tensors = {hf_name(k): v for k, v in load_weights(ref, "cuda").items()}
    model = model_over_tensors(llama_config(cfg), tensors)
    ctx = tokenizer.encode("adapter on the GPU")
    with torch.inference_mode():
        logits = model(torch.tensor([ctx], device="cuda")).logits[0].float()
    assert torch.allclose(logits, reference_logits(ref, ctx, "cuda"), atol=1e-2)
