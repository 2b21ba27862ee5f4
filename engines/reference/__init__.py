"""The reference engine: a Llama-style transformer whose weights and KV cache live in Holdfast leases."""
