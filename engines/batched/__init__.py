"""The batched engine: continuous batching over a paged KV cache that lives in a Holdfast lease, with a
step journal beside it so that every in-flight sequence survives the engine's death without recompute.

A straight line, as in nano-vllm (config -> model runner -> scheduler -> server):

| module | what it holds | imports |
| --- | --- | --- |
| `config.py` | `EngineConfig`: every setting, parsed once (flags / HF_ENGINE_* env), passed down | pure |
| `sequence.py` | `Sequence`, `SeqStatus` (waiting, running, preempted, finished), `SamplingParams`, the status table | pure |
| `block_manager.py` | `BlockManager`: fixed-size KV blocks, reference counts, block tables, prefix sharing by block hash | pure |
| `scheduler.py` | `Scheduler`: which sequences run this step (decode tokens + prefill chunks within a token budget), preemption, FCFS | pure |
| `model_runner.py` | `ModelRunner`: the model over given weights and a paged KV tensor; one forward over a flat batch; sampling | torch |
| `attention.py` | paged attention: a CPU reference path and the CUDA fast path | torch |
| `journal.py` | `Journal`: per-slot committed state (tokens, lengths, block tables) in shared memory beside the KV | torch |
| `memory.py` | where weights, KV and journal come from (leases through the SDK, or local tensors) | SDK |
| `engine.py` | `LLMEngine`: the step loop (schedule -> run -> sample -> journal commit -> outputs) | all above |
| `front_link.py` | the link to the HTTP front (a process of its own): frames, the engine's end, the front's end | no torch |
| `front.py`, `server.py`, `http_state.py` | the HTTP front's process: uvicorn, the API (`/generate`, `/health`, ...), its state | no torch |
| `kv_backup.py` | the KV backup to host: what a round copies and vouches for (durable point, order of writes) | pure |
| `backup.py`, `copier.py` | the backup's writer thread, the journal mirror it reads, a successor's restore; the block copies | torch |
| `tp.py` | tensor parallelism: `ShardedRunner` (one rank's shards, all-reduces), `PlanChannel` (rank 0's step plans), `follow` | torch |
| `tp_group.py` | `--tp N`: the rank processes, each rank's leases, the gang, the group dying whole | torch, SDK via memory.py |

Shared contracts (the pure modules never import torch):
- KV cache tensor: `[units, 2 (k|v), num_blocks, block_size, kv heads a unit, head_dim]` (cache_units.py: a unit is
  a layer's kv heads, `[n_layers, 2, ...]` but on a rank of an uneven group). A token at position
  `p` of a sequence with block table `bt` lives in slot `bt[p // block_size] * block_size + p % block_size`.
- A step is a `Batch` of `Work(seq, start, num_tokens)`: the sequence's tokens `[start, start + num_tokens)` are
  fed at positions `start..`, their keys and values written, attention over positions `< start + num_tokens`.
  A work whose end reaches `len(seq.tokens)` samples one token from its last row.
- Sequence invariant: KV is valid for positions `[0, num_computed)`; tokens are known for `[0, len(tokens))`;
  a running sequence in decode has `num_computed == len(tokens) - 1`.
"""
