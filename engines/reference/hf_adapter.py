"""Hugging Face transformers over Holdfast leases: a model built from its config, parameters from leases.

The recipe works for any `transformers` model whose weights come in a safetensors file:
1. build the model on the `meta` device (no memory for parameters is allocated);
2. get the tensors by name from leases: `load_safetensors_into_leases` on a first start, `attach()` or
   `takeover()` after a crash (no disk read);
3. bind each parameter to its leased tensor (`bind_parameters`: zero copy, the module's parameters ARE the
   leased memory), then materialize the few non-parameter buffers (rotary tables) on the device.

`transformers` is optional (not a dependency of Holdfast); this module imports it only when called.
For the reference engine's own weights, `HF_NAMES` maps them to Llama's names, so the same leases serve
both implementations (tests/engine/test_hf_adapter.py checks the logits agree).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engines.reference.config import ModelConfig

_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}


def hf_name(name: str) -> str:
    """The Llama (transformers) name of a reference-engine tensor."""
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, idx, rest = name.split(".", 2)
    return f"model.layers.{idx}.{_LAYER[rest]}"


def llama_config(cfg: ModelConfig) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                       num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                       num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq,
                       rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, hidden_act="silu",
                       tie_word_embeddings=False, attention_bias=False, mlp_bias=False)


def build_on_meta(config: Any, model_class: Any = None) -> Any:
    """The model's modules with parameters on the `meta` device: nothing allocated yet."""
    if model_class is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        return model_class(config)


def bind_parameters(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Make every parameter of `model` the tensor of the same name (zero copy). Raises on a missing or
    mis-shaped tensor, so a model never runs half over leases and half over garbage."""
    for full, param in list(model.named_parameters()):
        if full not in tensors:
            raise KeyError(f"no leased tensor for parameter {full}")
        t = tensors[full]
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"{full}: leased shape {tuple(t.shape)}, model wants {tuple(param.shape)}")
        owner_name, _, leaf = full.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        owner._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
    return model


def materialize_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inverse frequencies) are not in the file: rebuild them on the device."""
    for name, module in model.named_modules():
        if any(b is not None and b.is_meta for b in module._buffers.values()):
            # Rotary embeddings are built from the model config (transformers 4.x keeps `rope_init_fn`,
            # 5.x does not; both take `(config=..., device=...)`).
            config = getattr(module, "config", None)
            try:
                fresh = type(module)(config=config, device=device) if config is not None else None
            except TypeError:
                fresh = None
            if fresh is None:
                raise RuntimeError(f"buffer of {name} is on meta and cannot be rebuilt")
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, fresh)


def model_over_tensors(config: Any, tensors: dict[str, torch.Tensor], model_class: Any = None) -> Any:
    model = build_on_meta(config, model_class)
    bind_parameters(model, tensors)
    device = next(iter(tensors.values())).device
    materialize_buffers(model, device)
    return model.eval()


def model_from_leases(client: Any, config: Any, safetensors_path: str | Path, *, gpu: int = 0,
                      model_class: Any = None) -> Any:
    """A transformers model whose parameters live in Holdfast leases: reattached if leases wait for this
    engine (no disk read), else loaded from the safetensors file into new leases."""
    if client.pending():
        tensors = client.attach().tensors(framework="torch")
    else:
        from libs.client.safetensors_io import load_safetensors_into_leases

        tensors = load_safetensors_into_leases(client, str(safetensors_path), gpu=gpu, framework="torch")
    return model_over_tensors(config, tensors, model_class)


def export_llama_safetensors(reference_weights: Path, out: Path) -> Path:
    """The reference engine's weights file under Llama's tensor names (for the adapter's checks)."""
    from safetensors.torch import load_file, save_file

    tensors = {hf_name(k): v for k, v in load_file(str(reference_weights)).items()}
    save_file(tensors, str(out))
    return out
