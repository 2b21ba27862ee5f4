"""Certificate rotation with nothing stopped, on a real nats-server and etcd of this module's own (TLS, client
certificates, auth on): a client stays connected through it, a new connection gets the new certificates, a
client that reconnects takes its rotated files up, and the previous CA's certificates are refused once it is
retired (libs/common/security/rotation.py, renewal.py; docs/security.md)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import shutil
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import nats
import pytest
from aetcd import rpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from libs.common import procs
from libs.common.bus.commands import settle
from libs.common.config import CommonSettings
from libs.common.security import Credentials, RenewingNATS, mint, servers
from libs.common.security.policy import inbox_prefix
from libs.common.security.rotation import Overlap, reload_nats, retire_ca, rotate_ca, rotate_certificates
from libs.common.store import Store, ThreadKeepAlive
from tests.conftest import TEST_IDENTITIES, start_etcd


@pytest.fixture
def creds(tmp_path: Path) -> Path:
    return mint(tmp_path / "credentials", TEST_IDENTITIES)


def _snapshot(d: Path, to: Path) -> Path:
    """A copy of the files as they are now: the credentials an untouched holder keeps."""
    shutil.copytree(d, to)
    return to


def _rotate_all(d: Path) -> Overlap:
    ov = rotate_ca(d, overlap_days=1)
    rotate_certificates(d)
    return ov


def _retire_after_overlap(d: Path, ov: Overlap) -> None:
    retire_ca(d, now=ov.retire_after + dt.timedelta(seconds=1))


def _fingerprint(der: bytes | None) -> bytes:
    assert der is not None
    return x509.load_der_x509_certificate(der).fingerprint(hashes.SHA256())


def _file_fingerprint(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).fingerprint(hashes.SHA256())


def _old_leaf_new_bundle(old: Path, new: Path) -> Credentials:
    """A holder that took up the new trust bundle but still presents its old certificate (the overlap's case)."""
    shutil.copy(new / "ca.pem", old / "ca.pem")
    return Credentials(old, "admin")


# ----------------------------------------------------------------------------------------------------- NATS


@pytest.fixture
def nats_of(creds: Path, tmp_path: Path) -> Iterator[tuple[str, procs.Child]]:
    conf = servers.write_nats_config(tmp_path / "nats.conf", creds, TEST_IDENTITIES, prefix="*", stream="*")
    port = procs.free_port()
    child = procs.nats_server(port, tmp_path / "nats", tmp_path / "nats.log", config=conf).start()
    procs.wait_port(port, child)
    yield f"nats://127.0.0.1:{port}", child
    child.stop()


async def _nats(url: str, c: Credentials, *, renewing: bool = False, **kw: object) -> nats.NATS:
    nc = RenewingNATS(c) if renewing else nats.NATS()
    await nc.connect(servers=[url], tls=c.client_tls(), nkeys_seed=str(c.nkey_seed), inbox_prefix=inbox_prefix(c.identity),
                     connect_timeout=2, **kw)
    return nc


def _served_cert(nc: nats.NATS) -> bytes:
    ssl_object = nc._transport._io_writer.get_extra_info("ssl_object")
    return _fingerprint(ssl_object.getpeercert(binary_form=True))


async def _refused_nats(url: str, c: Credentials) -> None:
    with pytest.raises(Exception):  # noqa: B017, PT011 - nats-py raises the handshake's error or its own
        nc = await _nats(url, c, allow_reconnect=False, max_reconnect_attempts=0)
        await nc.close()


async def test_nats_rotation_keeps_a_client_connected_and_refuses_the_old_ca_after_its_overlap(
        creds: Path, nats_of: tuple[str, procs.Child], tmp_path: Path) -> None:
    url, server = nats_of
    old = _snapshot(creds, tmp_path / "old")
    admin = Credentials(creds, "admin")
    stayed = await _nats(url, admin)
    reconnects = stayed.stats["reconnects"]

    ov = _rotate_all(creds)
    reload_nats(server.pid)
    await asyncio.sleep(0.5)  # the reload is asynchronous to the signal

    new = await _nats(url, admin)  # the new files: the new CA's certificates, both ways
    assert _served_cert(new) == _file_fingerprint(creds / "server.pem") != _file_fingerprint(old / "server.pem")
    still_old = await _nats(url, _old_leaf_new_bundle(old, creds))  # the overlap: the previous CA still trusted
    await still_old.close()

    _retire_after_overlap(creds, ov)
    reload_nats(server.pid)
    await asyncio.sleep(0.5)
    await _refused_nats(url, Credentials(old, "admin"))  # the previous CA's certificate: refused now
    await (await _nats(url, admin)).close()

    sub = await new.subscribe("after.rotation")
    await settle(new)  # the subscription is at the server before anything is published to it (one flush is not)
    await stayed.publish("after.rotation", b"x")  # the connection made before it all: never cut
    assert (await sub.next_msg(timeout=10)).data == b"x"  # a bound for a loaded CI machine, not a latency
    assert stayed.stats["reconnects"] == reconnects and stayed.is_connected
    await stayed.close()
    await new.close()


async def test_a_nats_client_that_reconnects_after_a_ca_rotation_presents_its_new_certificate(
        creds: Path, nats_of: tuple[str, procs.Child], tmp_path: Path) -> None:
    url, server = nats_of
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    client = await _nats(url, Credentials(creds, "admin"), renewing=True, reconnect_time_wait=0.1,
                         max_reconnect_attempts=-1, reconnected_cb=on_reconnect)
    ov = _rotate_all(creds)
    _retire_after_overlap(creds, ov)  # from here only the new CA's certificates are any good
    server.stop()  # the connection breaks: the client has to handshake again
    port = int(url.rsplit(":", 1)[1])
    again = procs.nats_server(port, tmp_path / "nats", tmp_path / "nats.log", config=tmp_path / "nats.conf").start()
    try:
        procs.wait_port(port, again)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reconnected.wait(), 10)
        assert reconnected.is_set() and client.is_connected, "no reconnect with the rotated certificate"
        assert _served_cert(client) == _file_fingerprint(creds / "server.pem")
        await client.flush(timeout=2)
        await client.close()
    finally:
        again.stop()


# ----------------------------------------------------------------------------------------------------- etcd


@pytest.fixture
def etcd_of(creds: Path, tmp_path: Path) -> Iterator[tuple[int, procs.Child]]:
    port, peer = procs.free_port(), procs.free_port()
    child = start_etcd(port, peer, tmp_path / "etcd", tmp_path / "etcd.log", creds)
    yield port, child
    child.stop()


def _etcd_served_cert(port: int, ca: Path) -> bytes:
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=3) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return _fingerprint(tls.getpeercert(binary_form=True))


def _etcd_status(port: int, c: Credentials) -> None:
    """One new connection presenting `c`'s certificate (etcd decides at its handshake)."""
    channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(*c.grpc_parts()))
    try:
        rpc.MaintenanceStub(channel).Status(rpc.StatusRequest(), timeout=3)
    finally:
        channel.close()


def _restart_etcd(child: procs.Child, port: int, tmp_path: Path, creds: Path) -> procs.Child:
    """One member restarted on its data (a cluster restarts its members one at a time: no outage)."""
    child.stop()
    return start_etcd(port, procs.free_port(), tmp_path / "etcd", tmp_path / "etcd.log", creds)


async def _store_of(creds: Path, port: int, tmp_path: Path) -> Store:
    settings = CommonSettings(etcd_endpoints=f"127.0.0.1:{port}", credentials_dir=creds, etcd_prefix="/r/",
                              state_dir=tmp_path / "state")
    return await Store.connect(settings, timeout=10)


def _only_a_new_ca_from_now(creds: Path, child: procs.Child, port: int, tmp_path: Path) -> procs.Child:
    """A whole CA rotation, retired, and etcd restarted on it: every connection breaks, and a new handshake
    succeeds only with a certificate of the new CA."""
    _retire_after_overlap(creds, _rotate_all(creds))
    return _restart_etcd(child, port, tmp_path, creds)


async def _until_ok(store: Store, key: str, value: str) -> None:
    for _ in range(50):  # the store reconnects to a restarted etcd by itself
        with contextlib.suppress(Exception):
            await store.put(key, value)
            break
        await asyncio.sleep(0.2)
    assert await store.get(key) == value.encode()


async def test_etcd_renews_certificates_on_new_connections_and_retires_a_ca_at_its_restart(
        creds: Path, etcd_of: tuple[int, procs.Child], tmp_path: Path) -> None:
    port, child = etcd_of
    old = _snapshot(creds, tmp_path / "old")
    stayed = await _store_of(creds, port, tmp_path)
    await stayed.put("k", "before")
    try:
        rotate_certificates(creds)  # the same CA: no signal, no restart (etcd reads its files at each handshake)
        assert _etcd_served_cert(port, creds / "ca.pem") == _file_fingerprint(creds / "server.pem")
        _etcd_status(port, Credentials(creds, "admin"))
        await _until_ok(stayed, "k", "renewed")  # the store opened before: never cut

        ov = rotate_ca(creds, overlap_days=1)
        rotate_certificates(creds)
        with pytest.raises(grpc.RpcError):  # etcd reads its trusted CAs at start only: a new CA needs a restart
            _etcd_status(port, Credentials(creds, "admin"))
        child = _restart_etcd(child, port, tmp_path, creds)
        _etcd_status(port, Credentials(creds, "admin"))
        _etcd_status(port, _old_leaf_new_bundle(old, creds))  # the overlap: the previous CA still trusted

        _retire_after_overlap(creds, ov)
        child = _restart_etcd(child, port, tmp_path, creds)
        with pytest.raises(grpc.RpcError):
            _etcd_status(port, Credentials(old, "admin"))  # the previous CA's certificate: refused now
        _etcd_status(port, Credentials(creds, "admin"))
        await _until_ok(stayed, "k", "after")  # reconnected by itself, with its renewed certificate
    finally:
        await stayed.close()
        child.stop()


async def test_an_etcd_client_takes_up_its_rotated_certificate_for_its_next_connections(
        creds: Path, etcd_of: tuple[int, procs.Child], tmp_path: Path) -> None:
    port, child = etcd_of
    store = await _store_of(creds, port, tmp_path)
    await store.put("k", "before")
    child = _only_a_new_ca_from_now(creds, child, port, tmp_path)
    try:
        await asyncio.sleep(1.1)  # the client looks at its files at most once a second
        await _until_ok(store, "k", "after")
    finally:
        await store.close()
        child.stop()


async def test_a_lease_keep_alive_thread_takes_up_its_rotated_certificate(
        creds: Path, etcd_of: tuple[int, procs.Child], tmp_path: Path) -> None:
    port, child = etcd_of
    store = await _store_of(creds, port, tmp_path)
    lease = await store.grant(3)
    keeper = ThreadKeepAlive(store, lease)
    task = asyncio.create_task(keeper.run())
    try:
        while keeper.refreshes == 0:  # its channel is open, with the certificate of before
            await asyncio.sleep(0.1)
        child = _only_a_new_ca_from_now(creds, child, port, tmp_path)
        before = keeper.refreshes
        for _ in range(50):
            if keeper.refreshes > before:
                break
            await asyncio.sleep(0.2)
        assert keeper.refreshes > before and not keeper.lost.is_set()
    finally:
        keeper.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()
        child.stop()
