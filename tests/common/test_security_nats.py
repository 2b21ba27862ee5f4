"""NATS with auth on (the session's nats-server: TLS, one nkey user per identity, per-role subject permissions):
intruders are refused at the server, so a forged command never reaches a service."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path
from typing import Any

import nats
import nkeys
import pytest
from nats.errors import NoServersError
from nats.errors import TimeoutError as NatsTimeout

from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.events import (
    FaultDetected,
    Freeze,
    FreezeReply,
    ListLeases,
    ListLeasesReply,
    Reclaim,
    StopEngine,
    Takeover,
    command_subject,
    event_subject,
)
from libs.common.security import Credentials
from libs.common.security.policy import inbox_prefix


class Intruder:
    """A raw nats-py client that keeps what the server told it (permission violations come as async errors)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: Any = None

    async def connect(self, url: str, **auth: Any) -> Intruder:
        async def error_cb(e: Exception) -> None:
            self.errors.append(str(e).lower())

        self.nc = await nats.connect(url, error_cb=error_cb, allow_reconnect=False, connect_timeout=2, **auth)
        return self

    async def violated(self, subject: str, timeout: float = 2.0) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if any("permissions violation" in e and subject.lower() in e for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()


def _ca_only(credentials: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(credentials / "ca.pem"))


def _as(credentials: Path, identity: str) -> dict[str, Any]:
    c = Credentials.load(credentials, identity)
    return {"tls": c.client_tls(), "nkeys_seed": str(c.nkey_seed), "inbox_prefix": inbox_prefix(identity)}


async def test_an_anonymous_client_is_refused(nats_server: str, credentials: Path) -> None:
    with pytest.raises((nats.errors.Error, NoServersError, OSError)):
        await Intruder().connect(nats_server, tls=_ca_only(credentials))


async def test_a_plaintext_client_is_refused(nats_server: str, credentials: Path) -> None:
    seed = str(Credentials.load(credentials, "admin").nkey_seed)
    with pytest.raises((nats.errors.Error, NoServersError, OSError)):
        await Intruder().connect(nats_server, nkeys_seed=seed)  # the right key, no TLS


async def test_a_client_with_an_unknown_key_and_no_certificate_is_refused(nats_server: str, credentials: Path,
                                                                         tmp_path: Path) -> None:
    seed = tmp_path / "stranger.nk"
    seed.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    with pytest.raises((nats.errors.Error, NoServersError, OSError)):
        await Intruder().connect(nats_server, tls=_ca_only(credentials), nkeys_seed=str(seed))


async def test_a_valid_certificate_does_not_stand_in_for_a_known_key(nats_server: str, credentials: Path,
                                                                    tmp_path: Path) -> None:
    """The server asks for a client certificate and an nkey: one stolen certificate (an agent's) with a key of
    the thief's own is refused, while the same certificate with its own key connects."""
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    agent = _as(credentials, "agent.node-1")
    with pytest.raises((nats.errors.Error, NoServersError, OSError)):
        await Intruder().connect(nats_server, tls=agent["tls"], nkeys_seed=str(stranger))
    ok = await Intruder().connect(nats_server, **agent)
    assert ok.nc.is_connected
    await ok.close()


async def _served(settings: CommonSettings, node: str, command: type, calls: list[Any]) -> Bus:
    """A real bus of `<command.service>` on `node` answering `command` (records what reaches it)."""
    bus = await Bus.connect(settings.model_copy(update={"node": node}), f"{command.service}:{node}", stream=False)

    async def handler(cmd: Any) -> Any:
        calls.append(cmd)
        return FreezeReply(lease_ids=[], epoch=1, transfer_token="t") if command is Freeze else \
            ListLeasesReply(leases=[])

    await bus.serve(node, command, handler)
    return bus


async def test_a_nodes_agent_cannot_command_or_overhear_another_node(settings: CommonSettings, credentials: Path) -> None:
    calls: list[Any] = []
    victim = await _served(settings, "node-2", Freeze, calls)
    agent = await Intruder().connect(settings.nats_url, **_as(credentials, "agent.node-1"))
    try:
        p = settings.subject_prefix
        await agent.nc.subscribe(f"{p}.node.node-2.gpu_manager.>")
        assert await agent.violated(f"{p}.node.node-2.gpu_manager.>")
        subject = command_subject(p, "node-2", Freeze)
        with pytest.raises(NatsTimeout):
            await agent.nc.request(subject, b'{"source":"dc_manager","data":{"owner":"e1"}}', timeout=0.5)
        assert await agent.violated(subject)
        assert calls == []  # the forged freeze never reached node-2's gpu_manager
    finally:
        await agent.close()
        await victim.close()


@pytest.mark.parametrize("who", ["router", "gpu_manager.node-1", "agent.node-1", "agent.node-2"])
async def test_no_other_role_can_forge_the_pipelines_commands_or_read_leases(settings: CommonSettings, credentials: Path,
                                                                            who: str) -> None:
    """ListLeases, freeze, reclaim, takeover, stop for node-1 from the router or a node's service (node-1's own
    included): each refused by the server; only the dc_manager (the controller for reclaim/stop) sends them, and
    node-1's agent a freeze to its own node (its promotion of a standby: services/agent/takeover.py), which node-2's
    agent may not."""
    node = "node-1"
    served: list[Any] = []
    listing = await _served(settings, node, ListLeases, served)
    intruder = await Intruder().connect(settings.nats_url, **_as(credentials, who))
    p = settings.subject_prefix
    try:
        for command in (ListLeases, Reclaim, Takeover, StopEngine, *([] if who == "agent.node-1" else [Freeze])):
            subject = command_subject(p, node, command)
            with pytest.raises(NatsTimeout):
                await intruder.nc.request(subject, b"{}", timeout=0.3)
            assert await intruder.violated(subject), (who, subject, intruder.errors)
        assert served == []
    finally:
        await intruder.close()
        await listing.close()


async def test_only_agents_forge_no_fault_and_the_router_publishes_nothing(settings: CommonSettings, credentials: Path,
                                                                          bus: Bus) -> None:
    seen: list[Any] = []

    async def on_fault(env: Any) -> None:
        seen.append(env)

    await bus.subscribe("fault.detected", on_fault)
    subject = event_subject(settings.subject_prefix, FaultDetected, "node-1")
    for who in ("router", "gpu_manager.node-1", "controller", "dc_manager"):
        intruder = await Intruder().connect(settings.nats_url, **_as(credentials, who))
        try:
            await intruder.nc.publish(subject, b"{}")
            assert await intruder.violated(subject), (who, intruder.errors)
        finally:
            await intruder.close()
    agent = await Intruder().connect(settings.nats_url, **_as(credentials, "agent.node-1"))
    await agent.nc.publish(subject, b"not an event")  # the agent may: the subscriber rejects the malformed body
    await agent.nc.flush()
    await agent.close()
    await asyncio.sleep(0.3)
    assert bus.rejected == 1 and seen == []


async def test_the_router_subscribes_to_router_events_only_and_reads_no_ones_replies(settings: CommonSettings,
                                                                                   credentials: Path) -> None:
    p = settings.subject_prefix
    router = await Intruder().connect(settings.nats_url, **_as(credentials, "router"))
    try:
        await router.nc.subscribe(f"{p}.router.endpoint.added")
        for subject in (f"{p}.fault.detected", f"{p}.node.node-1.agent.>", "_INBOX.>", f"{inbox_prefix('controller')}.>",
                        "$JS.API.CONSUMER.CREATE.>"):
            await router.nc.subscribe(subject)
            assert await router.violated(subject), (subject, router.errors)
        assert not any("router.endpoint.added" in e for e in router.errors)
    finally:
        await router.close()


async def test_the_roles_can_do_their_own_jobs(settings: CommonSettings) -> None:
    """Not too tight: the dc_manager commands any node, the controller reclaims, the agent asks its gpu_manager."""
    calls: list[Any] = []
    gm = await _served(settings, "node-2", Freeze, calls)
    dcm = await Bus.connect(settings, "dc_manager:dc-1", stream=False)
    try:
        reply = await dcm.request("node-2", Freeze(owner="e1"), FreezeReply, timeout=2)
        assert reply.epoch == 1 and len(calls) == 1
    finally:
        await dcm.close()
        await gm.close()


async def test_a_command_whose_envelope_names_another_node_is_refused_and_not_acted_on(settings: CommonSettings,
                                                                                    bus: Bus) -> None:
    calls: list[Any] = []
    gm = await _served(settings, "node-1", Freeze, calls)
    try:
        subject = command_subject(settings.subject_prefix, "node-1", Freeze)
        forged = b'{"source":"dc_manager","to":"node-2","data":{"owner":"e1"}}'
        msg = await bus.nc.request(subject, forged, timeout=2)
        assert b'"wrong_node"' in msg.data and calls == [] and gm.rejected == 1
        await bus.request("node-1", Freeze(owner="e1"), FreezeReply, timeout=2)  # addressed right: served
        assert len(calls) == 1
    finally:
        await gm.close()


async def test_only_the_control_plane_creates_or_rewrites_the_event_stream(settings: CommonSettings, credentials: Path,
                                                                          bus: Bus) -> None:
    """A stream's config names its subjects, republish targets and seal: one rewritten by the router (or any node)
    could copy everyone's replies to it, answer a node's commands with stream acks, store no node's events, or seal
    the stream for good (every publish refused). Only the controller, the dc_manager and operators may create or
    update it; the others only read its info (probe of 2026-12-06)."""
    update = f"$JS.API.STREAM.UPDATE.{settings.stream_name}"
    create = f"$JS.API.STREAM.CREATE.{settings.stream_name}"
    sealed = b'{"name":"%s","subjects":["x.>"],"sealed":true}' % settings.stream_name.encode()
    for who in ("router", "agent.node-1", "gpu_manager.node-1"):
        intruder = await Intruder().connect(settings.nats_url, **_as(credentials, who))
        try:
            info = await intruder.nc.request(f"$JS.API.STREAM.INFO.{settings.stream_name}", b"", timeout=2)
            assert b'"config"' in info.data  # it may look
            for subject in (update, create):
                await intruder.nc.publish(subject, sealed, reply=f"{inbox_prefix(who)}.x")
                assert await intruder.violated(subject), (who, subject, intruder.errors)
        finally:
            await intruder.close()
    info = await bus.link.js.stream_info(settings.stream_name)
    assert not info.config.sealed and info.config.subjects != ["x.>"]
    for source in ("agent:node-1", "controller:c1"):  # a service's own start: the one looks, the other ensures
        started = await Bus.connect(settings.model_copy(update={"node": "node-1"}), source)
        await started.close()
    await bus.emit(FaultDetected(engine_id="e1", kind="exited", node="node-1"), node="node-1")  # still stored


async def test_a_nodes_service_answers_health_requests_for_its_own_node_only(settings: CommonSettings,
                                                                             credentials: Path) -> None:
    """One node answering another's health subject could say a dead agent healthy (or a healthy one broken)."""
    p = settings.subject_prefix
    for role in ("agent", "gpu_manager"):
        node1 = await Intruder().connect(settings.nats_url, **_as(credentials, f"{role}.node-1"))
        try:
            for subject in (f"{p}.health.{role}.node-1", f"{p}.health.{role}"):  # its own, and any instance's
                await node1.nc.subscribe(subject)
            for subject in (f"{p}.health.{role}.node-2", f"{p}.health.{role}.>"):
                await node1.nc.subscribe(subject)
                assert await node1.violated(subject), (role, subject, node1.errors)
            assert sum("permissions violation" in e for e in node1.errors) == 2, node1.errors  # not its own two
        finally:
            await node1.close()
