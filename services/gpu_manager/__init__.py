"""The per-node gpu_manager: owns leased memory, the lease table and the fd keeper (README.md)."""
