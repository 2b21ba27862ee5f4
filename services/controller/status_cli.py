"""`holdfast status`: the admin API's view as rich tables (nodes, engines, leases, open and recent incidents)."""

from __future__ import annotations

from typing import Any

import httpx
from rich.console import Console
from rich.table import Table
from rich.text import Text

GIB = 1 << 30


PAGE = 1000  # the API's largest page


def _get(client: httpx.Client, path: str) -> list[dict[str, Any]]:
    """Every item of a listing, page after page (one page of 1,000 was all: a cluster past 125 nodes of 8 GPUs
    showed part of its leases and said nothing)."""
    items: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None:
        r = client.get(path, params={"limit": PAGE, "offset": offset})
        r.raise_for_status()
        page = r.json()
        items += page["items"]
        offset = page.get("next_offset")
    return items


def _newest(client: httpx.Client, path: str, n: int) -> list[dict[str, Any]]:
    r = client.get(path, params={"limit": n})
    r.raise_for_status()
    return r.json()["items"]  # type: ignore[no-any-return]


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c)
    for row in rows:
        # Text, not markup: an id or a lease name of `[/bold]` (a client's choice) is shown, not parsed (it raised)
        table.add_row(*(Text("" if v is None else str(v)) for v in row))
    if not rows:
        table.add_row(*(["(none)"] + [""] * (len(columns) - 1)))
    return table


def status(api_url: str, token: str) -> None:
    """Print the cluster as the controller at `api_url` sees it."""
    console = Console()
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {token}"}, timeout=5) as client:
        health = client.get("/healthz").json()
        nodes = _get(client, "/v1/nodes")
        engines = _get(client, "/v1/engines")
        leases = _get(client, "/v1/leases")
        incidents = _newest(client, "/v1/incidents", 20)
    console.print(f"controller [bold]{health['instance']}[/bold] leader={health['leader']} synced={health['synced']}")
    console.print(_table("nodes", ["node", "datacenter", "gpus", "engines", "drained"],
                         [[n["node"], n["datacenter"], ",".join(map(str, n["gpus"])), n["engines"], n["drained"]]
                          for n in nodes]))
    console.print(_table("engines", ["engine", "node", "gpu", "model", "class", "role", "state", "gen", "incident"],
                         [[e["engine_id"], e["node"], e["gpu"], e["model"], e["engine_class"],
                           "spare" if e.get("spare") else e["role"], e["state"],
                           e["generation"], e["open_incident"]] for e in engines]))
    console.print(_table("leases", ["lease", "node", "gpu", "owner", "tag", "state", "epoch", "GiB"],
                         [[x["id"], x["node"], x["gpu"], x["owner"], x["tag"], x["state"], x["epoch"],
                           f"{x['size'] / GIB:.1f}"] for x in leases]))
    console.print(_table("incidents (newest 20)", ["incident", "engine", "reason", "kind", "state", "total ms",
                                                   "fallback", "successor"],
                         [[i["id"], i["engine_id"], i["reason"], i["kind"], i["state"], i["total_ms"], i["fallback"],
                           i["successor_id"]] for i in incidents]))
