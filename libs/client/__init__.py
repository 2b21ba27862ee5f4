"""The engine SDK: leased memory from the node's gpu_manager (memory.py), safetensors loading (safetensors_io.py)."""
