"""Model sizes of the reference engine, by name, and the arithmetic that follows from them (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace

VOCAB_SIZE = 258  # 256 bytes + BOS + EOS (tokenizer.py)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq: int
    dtype: str  # default storage dtype: float32 for the small CPU sizes, bfloat16 for the GPU ones
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def kv_heads_at(self, layer: int) -> int:
        """The kv heads of layer `layer` (a tensor-parallel rank's share may differ by layer: tp.py)."""
        return self.n_kv_heads

    def heads_at(self, layer: int) -> int:
        """The query heads of layer `layer`: those that attend to its kv heads."""
        return self.kv_heads_at(layer) * (self.n_heads // self.n_kv_heads)

    def with_layers(self, n_layers: int) -> ModelConfig:
        return replace(self, n_layers=n_layers)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight by name (Llama naming, so an adapter can map them one to one)."""
        hd = self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (self.vocab_size, self.dim)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            q, kv = self.heads_at(i) * hd, self.kv_heads_at(i) * hd
            shapes[p + "attention_norm.weight"] = (self.dim,)
            shapes[p + "attention.wq.weight"] = (q, self.dim)
            shapes[p + "attention.wk.weight"] = (kv, self.dim)
            shapes[p + "attention.wv.weight"] = (kv, self.dim)
            shapes[p + "attention.wo.weight"] = (self.dim, q)
            shapes[p + "ffn_norm.weight"] = (self.dim,)
            shapes[p + "feed_forward.w1.weight"] = (self.ffn_dim, self.dim)
            shapes[p + "feed_forward.w2.weight"] = (self.dim, self.ffn_dim)
            shapes[p + "feed_forward.w3.weight"] = (self.ffn_dim, self.dim)
        shapes["norm.weight"] = (self.dim,)
        shapes["output.weight"] = (self.vocab_size, self.dim)
        return shapes

    def n_params(self) -> int:
        total = 0
        for shape in self.tensor_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def bytes_per_param(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def kv_shape(self, slots: int, max_seq: int | None = None) -> tuple[int, ...]:
        """KV cache: [slot, layer, k|v, kv_head, position, head_dim] (one slot per concurrent request)."""
        return (slots, self.n_layers, 2, self.n_kv_heads, max_seq or self.max_seq, self.head_dim)


SIZES: dict[str, ModelConfig] = {
    # ~0.8 M parameters, ~3 MB in float32: CI on two CPU cores.
    "tiny": ModelConfig("tiny", dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=344, max_seq=2048, dtype="float32"),
    # tiny with three kv heads (GQA 6/3): tensor-parallel groups of 3, and of 2 sharded unevenly, on the CPU.
    "tiny3": ModelConfig("tiny3", dim=192, n_layers=2, n_heads=6, n_kv_heads=3, ffn_dim=344, max_seq=2048,
                         dtype="float32"),
    # ~25 M parameters: a quick sanity run on CPU or a small GPU check.
    "small": ModelConfig("small", dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408, max_seq=2048, dtype="float32"),
    # ~1 B parameters (bfloat16, ~2.2 GB).
    "1b": ModelConfig("1b", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=5632, max_seq=4096, dtype="bfloat16"),
    # Llama-3-8B's body (32 layers, dim 4096, GQA 32/8, SwiGLU 14336); the byte vocabulary makes it ~7 B parameters.
    "8b": ModelConfig("8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq=4096, dtype="bfloat16"),
    # Llama-3-70B's body (80 layers, dim 8192, GQA 64/8, SwiGLU 28672): ~68 B parameters, ~128 GiB in bfloat16.
    "70b": ModelConfig("70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, max_seq=4096,
                       dtype="bfloat16"),
}


def get_config(size: str) -> ModelConfig:
    """A named size, or `<name>@<layers>`: that width with another depth (benchmarks size weights this way)."""
    name, _, layers = size.partition("@")
    try:
        cfg = SIZES[name]
    except KeyError:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)} (optionally @<layers>)") from None
    if not layers:
        return cfg
    if not layers.isdigit() or int(layers) < 1:
        raise ValueError(f"bad layer count in {size!r}")
    return replace(cfg.with_layers(int(layers)), name=size)
