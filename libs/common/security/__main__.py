"""`python -m libs.common.security`: the credentials of a stack run by something else than `holdfast up` (the
compose stack: a one-shot container mints them into a shared volume, another sets up etcd's RBAC)."""

from __future__ import annotations

from pathlib import Path

import typer

from libs.common.security.pki import mint
from libs.common.security.policy import identities
from libs.common.security.servers import etcd_setup, write_nats_config

app = typer.Typer(add_completion=False, help=__doc__)


@app.command("mint")
def mint_cmd(dir: Path = typer.Option(..., help="the credentials directory (0700, files 0600)"),
             node: list[str] = typer.Option(["node-1"], help="a node whose agent and gpu_manager get credentials"),
             server_name: list[str] = typer.Option([], help="a host name the servers are reached by"),
             nats_config: Path | None = typer.Option(None, help="also write nats-server's config here"),
             prefix: str = "hf", stream: str = "HOLDFAST") -> None:
    """Create what is missing (the CA, certificates, nkeys); keep what exists."""
    ids = identities(node)
    mint(dir, ids, server_names=tuple(server_name))
    if nats_config is not None:
        write_nats_config(nats_config, dir, ids, prefix=prefix, stream=stream)
    typer.echo(f"credentials for {len(ids)} identities in {dir}")  # names only: never a key


@app.command("etcd-setup")
def etcd_setup_cmd(dir: Path = typer.Option(...), endpoint: str = typer.Option("127.0.0.1:2379"),
                   node: list[str] = typer.Option(["node-1"]), prefix: str = "/holdfast/",
                   timeout: float = 60.0) -> None:
    """etcd's users, roles and key ranges, then auth on (idempotent; waits for etcd up to `timeout`)."""
    etcd_setup(endpoint, dir, identities(node), prefix=prefix, timeout=timeout)
    typer.echo(f"etcd at {endpoint}: auth on")


if __name__ == "__main__":
    app()
