"""Holdfast's shared library: event catalog, NATS bus, etcd store, config, telemetry, ids, errors.

Services import from here; nothing in here imports a service or torch.
"""
