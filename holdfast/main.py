"""`holdfast`: the one command line. Sub-commands import their code lazily so `--help` is instant."""

from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from holdfast.certs import certs_app
from libs.common.config import DEFAULT_API_PORT, DEFAULT_ETCD_PORT, DEFAULT_NATS_PORT, DEFAULT_ROUTER_PORT


class _Lazy(TyperGroup):
    """A group whose commands named in `lazy` (name -> module: its `cli`) are imported only when one runs or the
    group's help lists them: importing them all (the gpu_manager, devstack, the security tooling...) cost every
    `holdfast` command ~1.5 s of start-up."""

    lazy: dict[str, str] = {}

    def list_commands(self, ctx: Any) -> list[str]:  # typer's own click's Context
        return [*super().list_commands(ctx), *self.lazy]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:  # its Command, or None
        if cmd_name not in self.lazy:
            return super().get_command(ctx, cmd_name)
        try:
            fn = importlib.import_module(self.lazy[cmd_name]).cli
        except ImportError:  # a command whose optional dependency this install lacks
            return None
        one = typer.Typer(add_completion=False)
        one.command(cmd_name)(fn)
        return typer.main.get_command(one)


class _LazyTop(_Lazy):
    lazy = {"chaos": "bench.chaos"}


class _LazyBenches(_Lazy):
    lazy = {name: f"bench.{name}" for name in ("attach", "detect", "controlplane", "recovery", "resume", "apiload",
                                                "serve", "restore", "sleep")}


app = typer.Typer(cls=_LazyTop, help="Holdfast: keep LLM inference engines' memory alive through failures.",
                  no_args_is_help=True, add_completion=False)
bench_app = typer.Typer(cls=_LazyBenches, help="Benchmarks (figures go to docs/benchmarks.md).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
engine_app = typer.Typer(help="One engine: sleep and wake (docs/restore.md), regroup (docs/multi_gpu.md).",
                         no_args_is_help=True)
app.add_typer(engine_app, name="engine")
app.add_typer(certs_app, name="certs")
console = Console()

PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}

SERVICE_HELP = {
    "gpu_manager": "Per-node owner of leased memory (VMM or memfd), lease table, fd keeper.",
    "agent": "Per-node engine supervisor: start, adopt, detect failures, warm standbys.",
    "dc_manager": "Per-datacenter placement and node commands.",
    "controller": "Leader-elected incident pipeline and REST admin API.",
    "router": "Reference HTTP router: endpoints from events, replay on failover.",
}


def _service_command(module: str) -> Any:
    def command(ctx: typer.Context) -> None:
        importlib.import_module(f"services.{module}.__main__").main(list(ctx.args))

    return command


for _name, _help in SERVICE_HELP.items():
    app.command(_name.replace("_", "-"), help=f"{_help} Flags: `holdfast {_name.replace('_', '-')} --help`.",
                context_settings=PASSTHROUGH)(_service_command(_name))


@app.command("engine", context_settings=PASSTHROUGH, help="The reference engine (engines/reference).")
def engine(ctx: typer.Context) -> None:
    importlib.import_module("engines.reference.__main__").main(list(ctx.args))


@app.command()
def up(
    nats_port: int = typer.Option(DEFAULT_NATS_PORT, help="NATS client port"),
    etcd_port: int = typer.Option(DEFAULT_ETCD_PORT, help="etcd client port (peer port is this + 1)"),
    api_port: int = typer.Option(DEFAULT_API_PORT, help="controller REST API port"),
    router_port: int = typer.Option(DEFAULT_ROUTER_PORT, help="router HTTP port"),
    node: str = typer.Option("node-1", help="this node's id"),
    backend: str = typer.Option("auto", help="memory backend: auto, host or cuda"),
    base_dir: Path | None = typer.Option(None, help="data, sockets and logs (default: a temporary directory)"),
    engines_file: Path | None = typer.Option(None, help="JSON list of engine specs for the agent"),
    ha: bool = typer.Option(False, "--ha", help="3 etcd members, 3 NATS servers, 3 nodes, 2 controllers and "
                            "dc_managers (etcd at --etcd-port + 2i, NATS at --nats-port + i)"),
) -> None:
    """Start nats-server, etcd and every service on loopback, restarting any that dies (with backoff);
    Ctrl-C or SIGTERM stops them all."""
    from devstack.stack import Stack, StackConfig

    stack = Stack(StackConfig(base_dir=base_dir, nats_port=nats_port, etcd_port=etcd_port, etcd_peer_port=etcd_port + 1,
                              api_port=api_port, router_port=router_port, node=node, backend=backend,
                              engines_file=engines_file, ha=ha, api_port_2=api_port + 1))
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        with console.status("starting nats, etcd and the services..."):
            stack.start()
        table = Table(title="holdfast stack (Ctrl-C stops all)")
        for col in ("part", "pid", "where"):
            table.add_column(col)
        where = {"nats": stack.nats_url, "etcd": f"http://127.0.0.1:{etcd_port}", "controller": f"{stack.api_url}/docs",
                 "router": stack.router_url, "gpu_manager": str(stack.base_dir / "state"), "agent": str(stack.base_dir / "state")}
        for name, pid in stack.pids().items():
            table.add_row(name, str(pid), where.get(name, ""))
        console.print(table)
        console.print(f"logs: {stack.logs}")
        if stack.router_key():
            console.print(f"router API key (Authorization: Bearer ...): {stack.base_dir / 'state' / 'router-api-key'}")
        print("holdfast: ready", flush=True)
        while not stopping:
            stack.supervise_once(lambda line: console.print(f"[yellow]{line}[/yellow]"))  # restart what died
            time.sleep(0.2)
    except Exception as e:  # noqa: BLE001 - say why, stop everything, exit non-zero
        console.print(f"[red]holdfast up failed: {e}[/red]")
        stack.stop()
        raise typer.Exit(1) from None
    console.print("stopping...")
    stack.stop()
    console.print("stopped")


@app.command()
def demo(
    json_only: bool = typer.Option(False, "--json", help="print only the final JSON line"),
    size: str = typer.Option("auto", help="reference model size (auto: tiny on CPU, larger on a GPU)"),
) -> None:
    """Start the stack, kill an engine mid-generation, recover it, and compare with a cold restart."""
    from holdfast import demo as demo_mod

    sys.exit(demo_mod.run(json_only=json_only, size=size))


def say(line: str) -> None:
    """One line of error, whole (a script greps it) and as written (brackets in it are not markup)."""
    console.print(line, style="red", markup=False, soft_wrap=True, highlight=False)


@contextlib.contextmanager
def admin_api(api_url: str) -> Iterator[None]:
    """A call of the admin API: no answer, or a refusal, is said in one line and exits 1 (not a traceback)."""
    import httpx

    try:
        yield
    except httpx.HTTPStatusError as e:
        r = e.response
        try:
            body = r.json()
        except ValueError:
            body = None
        said = (body.get("message") or body.get("error")) if isinstance(body, dict) else None
        said = str(said) if said else " ".join(r.text[:300].split())  # one line, whatever a proxy answered
        hint = " (the token: --token or HF_ADMIN_TOKEN)" if r.status_code in (401, 403) else ""
        say(f"the admin API at {api_url} answered {r.status_code}: {said}{hint}")
        raise typer.Exit(1) from None
    except httpx.HTTPError as e:
        say(f"no answer from the admin API at {api_url}: {e or type(e).__name__} (is the controller running there? "
            "--api-url or HF_API_URL)")
        raise typer.Exit(1) from None


@app.command()
def status(
    api_url: str = typer.Option(f"http://127.0.0.1:{DEFAULT_API_PORT}", envvar="HF_API_URL"),
    token: str = typer.Option("holdfast-dev-admin", envvar="HF_ADMIN_TOKEN", help="the controller's admin or read token"),
) -> None:
    """Nodes, engines, leases and incidents as tables (from the controller's REST API)."""
    with admin_api(api_url):
        importlib.import_module("services.controller.status_cli").status(api_url, token)


@app.command()
def snapshot(
    lease_id: str = typer.Argument(..., help="a committed lease (holdfast status lists them)"),
    artifact: str | None = typer.Option(None, help="artifact name (default <engine class>.<lease name>)"),
    host_tier: bool = typer.Option(False, help="also keep a copy in the node's host memory"),
    api_url: str = typer.Option(f"http://127.0.0.1:{DEFAULT_API_PORT}", envvar="HF_API_URL"),
    token: str = typer.Option("holdfast-dev-admin", envvar="HF_ADMIN_TOKEN", help="the controller's admin token"),
) -> None:
    """Write a lease's weights to a weight artifact on its node (POST /v1/leases/{id}/snapshot; docs/restore.md)."""
    import httpx

    with admin_api(api_url):
        r = httpx.post(f"{api_url}/v1/leases/{segment(lease_id)}/snapshot", json={"artifact": artifact, "host_tier": host_tier},
                       headers={"Authorization": f"Bearer {token}"}, timeout=900)
        r.raise_for_status()
    console.print_json(r.text)


def segment(value: str) -> str:
    """An id as one path segment of an admin API URL: quoted whole, so that `/`, `?`, `#` or `%` in it never reach
    another route (httpx resolves `..`: `holdfast engine sleep '../../v1/nodes/n1/drain?'` drained node n1)."""
    import urllib.parse

    if value in (".", ".."):
        say(f"{value!r} is not an id")
        raise typer.Exit(2)
    return urllib.parse.quote(value, safe="")


def _engine_call(engine_id: str, what: str, body: dict[str, Any] | None, timeout_s: float, api_url: str,
                 token: str) -> None:
    import httpx

    with admin_api(api_url):
        r = httpx.post(f"{api_url}/v1/engines/{segment(engine_id)}/{what}", json=body,
                       headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s + 15)
        r.raise_for_status()
    console.print_json(r.text)


@engine_app.command("sleep")
def engine_sleep(
    engine_id: str = typer.Argument(..., help="the engine to put to sleep"),
    level: int = typer.Option(1, min=1, max=2, help="1: release the KV cache; 2: the weights too"),
    timeout_s: float = typer.Option(60.0, help="how long the engine has to quiesce"),
    api_url: str = typer.Option(f"http://127.0.0.1:{DEFAULT_API_PORT}", envvar="HF_API_URL"),
    token: str = typer.Option("holdfast-dev-admin", envvar="HF_ADMIN_TOKEN", help="the controller's admin token"),
) -> None:
    """Release an engine's KV cache memory, its addresses kept (POST /v1/engines/{id}/sleep)."""
    _engine_call(engine_id, "sleep", {"level": level, "timeout_s": timeout_s}, timeout_s, api_url, token)


@engine_app.command("wake")
def engine_wake(
    engine_id: str = typer.Argument(..., help="a sleeping engine"),
    timeout_s: float = typer.Option(60.0, help="how long the engine has to wake"),
    api_url: str = typer.Option(f"http://127.0.0.1:{DEFAULT_API_PORT}", envvar="HF_API_URL"),
    token: str = typer.Option("holdfast-dev-admin", envvar="HF_ADMIN_TOKEN", help="the controller's admin token"),
) -> None:
    """New memory at a sleeping engine's addresses, weights restored for level 2 (POST /v1/engines/{id}/wake)."""
    _engine_call(engine_id, "wake", {"level": 1, "timeout_s": timeout_s}, timeout_s, api_url, token)


@engine_app.command("regroup")
def engine_regroup(
    engine_id: str = typer.Argument(..., help="a degraded engine: fewer ranks than its spec, after a lost GPU"),
    api_url: str = typer.Option(f"http://127.0.0.1:{DEFAULT_API_PORT}", envvar="HF_API_URL"),
    token: str = typer.Option("holdfast-dev-admin", envvar="HF_ADMIN_TOKEN", help="the controller's admin token"),
) -> None:
    """Make a degraded engine a whole group again once its node's GPUs are back, every sequence continued from its KV
    backups; its streams pause while the group loads (POST /v1/engines/{id}/regroup; docs/multi_gpu.md)."""
    _engine_call(engine_id, "regroup", None, 30.0, api_url, token)


@app.command("api-token")
def api_token(scope: str = typer.Argument(..., help="read, operate or admin (the admin API); infer (the router)")) -> None:
    """A new token: the token (give it to its holder) and its hashed entry, for HF_API_TOKENS (the admin API) or,
    with scope infer, for the router's HF_API_KEYS / HF_API_KEYS_FILE (its OpenAI API's keys)."""
    from libs.common.web.tokens import TokenConfigError, new_token

    try:
        token, entry = new_token(scope)
    except TokenConfigError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    print(f"token: {token}\nentry: {entry}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
