"""Shared fixtures: one real nats-server and one real etcd for the session, on free loopback ports.

Every test gets its own `settings` with a unique subject prefix, etcd prefix and stream name, so tests
share the servers without seeing each other's messages or keys.
"""

from __future__ import annotations

import os

# Some tests fork (tests/gpu_manager/harness.py `as_other_uid`) in this process, which by then holds gRPC
# channels (the etcd client); gRPC's fork handlers then aborted the child once in a full run. The child does no
# gRPC work: the handlers are turned off, as gRPC documents for processes that fork without using gRPC after.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import shutil  # noqa: E402
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

try:  # pytest 9: the type of a node's id (`_join_group`)
    from _pytest.nodeid import coerce_node_id
except ImportError:  # an older pytest (the GPU machine's image) reads the `_nodeid` xdist sets: nothing to mend
    coerce_node_id = None

from libs.common import procs, security
from libs.common.bus import Bus
from libs.common.config import CommonSettings
from libs.common.gpu import has_gpu
from libs.common.ids import new_id
from libs.common.security import servers
from libs.common.security.policy import KeyRange
from libs.common.store import Store

HAS_GPU = has_gpu()

# Under pytest-xdist (`make test` runs several workers), each worker is its own process with its own nats-server
# and etcd (the session fixtures below run once per worker). `procs.free_port` never hands a port twice within one
# process, but two processes could each be handed the same closed port and race to bind it: each worker takes only
# the ports of its own residue class (procs.PORT_CLASS), and the processes its tests start (`holdfast chaos`,
# `holdfast up`, the demo: HF_PORT_CLASS) another class of the worker's own, so that no two are ever handed the
# same one. (A chaos run once set up etcd's users on another worker's etcd, which had taken its port first.)
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1"... (unset without xdist)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKER.startswith("gw") and _WORKERS > 1:
    _CLASS = int(_WORKER[2:]) % _WORKERS
    procs.PORT_CLASS = (_CLASS, 2 * _WORKERS)
    os.environ["HF_PORT_CLASS"] = f"{_WORKERS + _CLASS}/{2 * _WORKERS}"
    # Each torch process (an engine, a worker running the model in-process) would start one compute thread per
    # core, and OpenMP threads spin while they wait: several workers' engines on 2 cores then spend the CPU
    # spinning. One thread each while the workers already share the cores (a child inherits this).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# Minutes a slow test takes in a full run on 2 cores (December 2026; one not named here counts as 1): what
# `_slow_lanes` balances. The rest of the slow tests take a half to one and a half minutes each.
_SLOW_MINUTES = {"test_chaos.py": 4.0, "test_demo.py": 4.0, "test_stall_stack.py": 3.0,
                 "test_kv_backup_incident.py": 1.5}
SLOW_LANES = 2


def _slow_lanes(slow: list[pytest.Item]) -> dict[str, list[pytest.Item]]:
    """The slow tests dealt into SLOW_LANES xdist groups of about equal minutes, the longest first, each to the
    lane with the fewest minutes so far (ties to the first lane: the same lanes every run)."""
    lanes: dict[str, list[pytest.Item]] = {f"slow-{n}": [] for n in range(SLOW_LANES)}
    minutes = dict.fromkeys(lanes, 0.0)
    weight = {item.nodeid: _SLOW_MINUTES.get(item.path.name, 1.0) for item in slow}
    for item in sorted(slow, key=lambda item: -weight[item.nodeid]):  # stable: equal ones in collection order
        lane = min(lanes, key=lambda name: minutes[name])
        lanes[lane].append(item)
        minutes[lane] += weight[item.nodeid]
    return lanes


def _join_group(config: pytest.Config, item: pytest.Item, group: str) -> None:
    """Mark `item` for the xdist group `group`, and give it the node id `<id>@<group>` that `--dist loadgroup`
    schedules by. pytest-xdist 3.8 sets that id on `item._nodeid`, which pytest 9 no longer reads (a node's id is
    `item._id`): the markers alone were ignored, and every worker took slow tests, three stacks at once."""
    item.add_marker(pytest.mark.xdist_group(group))
    if coerce_node_id is not None and getattr(config.option, "loadgroup", False) and not item.nodeid.endswith(
            f"@{group}"):  # an xdist worker's
        item._id = coerce_node_id(f"{item.nodeid}@{group}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The `slow` tests (each a whole stack, half a minute or more) run in two xdist groups (lanes), collected
    # first: under `--dist loadgroup` two workers each run one lane's tests one after another from the start while
    # the third shares the rest with them. So at most two whole stacks run at once on 2 cores (stacks side by side
    # starved each other's engines past their readiness timeouts in one clean-clone run), and neither lane is the
    # run's critical path: the slow tests one after another take ~20 minutes in a full run, more than the rest
    # of the suite takes on the other workers.
    slow = [item for item in items if "slow" in item.keywords]
    lanes = _slow_lanes(slow)
    for name, lane in lanes.items():
        for item in lane:
            _join_group(config, item, name)
    order = {item.nodeid: n for n, item in enumerate(item for lane in lanes.values() for item in lane)}
    items.sort(key=lambda item: order.get(item.nodeid, len(order)))  # stable: the rest keep their order
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU here (run on the device: scripts/device_run.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def infra_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=f"hf-test-{_WORKER or 'main'}-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# Nodes whose agent and gpu_manager get credentials in the test servers (a service on another node is refused:
# `CredentialsMissing` names it). Every other connection of the tests is `admin` (security.identity_for).
TEST_NODES = ("node-1", "node-2", "node-3", "node-t", "n-early", "n-handed-on")
TEST_IDENTITIES = security.identities(TEST_NODES)


@pytest.fixture(scope="session")
def credentials(infra_dir: Path) -> Path:
    """The tests' CA, certificates and nkeys, minted once a session (~0.1 s)."""
    return security.mint(infra_dir / "credentials", TEST_IDENTITIES)


@pytest.fixture(scope="session")
def nats_conf(infra_dir: Path, credentials: Path) -> Path:
    """TLS, nkey users and per-role subject permissions as in production; each test has its own subject prefix
    and stream, so the permissions name them `*` (tests/common/test_security_nats.py checks the real ones).
    Also for a test's own nats-server (`procs.nats_server(..., config=nats_conf)`)."""
    return servers.write_nats_config(infra_dir / "nats.conf", credentials, TEST_IDENTITIES, prefix="*", stream="*")


@pytest.fixture(scope="session")
def nats_server(infra_dir: Path, nats_conf: Path) -> Iterator[str]:
    port = procs.free_port()
    child = procs.nats_server(port, infra_dir / "nats", infra_dir / "nats.log", config=nats_conf).start()
    procs.wait_port(port, child)
    yield f"nats://127.0.0.1:{port}"
    child.stop()


def _whole_keyspace(identity: str, prefix: str) -> list[KeyRange]:
    return [KeyRange("/", write=True)]


def start_etcd(port: int, peer: int, data: Path, log: Path, credentials: Path) -> procs.Child:
    """etcd with TLS, client certificates and auth on, listening and set up. Each test has its own key prefix,
    which etcd's static key ranges cannot follow, so every identity may touch every key here
    (tests/common/test_security_etcd.py checks the real key ranges; the e2e tests run the stack with them)."""
    child = procs.etcd_server(port, peer, data, log, tls_flags=servers.etcd_tls_flags(credentials)).start()
    procs.wait_port(port, child)
    servers.etcd_setup(f"127.0.0.1:{port}", credentials, TEST_IDENTITIES, prefix="/", ranges=_whole_keyspace)
    return child


@pytest.fixture(scope="session")
def etcd_server(infra_dir: Path, credentials: Path) -> Iterator[str]:
    port, peer = procs.free_port(), procs.free_port()
    child = start_etcd(port, peer, infra_dir / "etcd", infra_dir / "etcd.log", credentials)
    yield f"127.0.0.1:{port}"
    child.stop()


@pytest.fixture
def settings(nats_server: str, etcd_server: str, credentials: Path, tmp_path: Path) -> CommonSettings:
    tag = new_id("t")
    return CommonSettings(
        credentials_dir=credentials,
        nats_url=nats_server,
        etcd_endpoints=etcd_server,
        subject_prefix=tag.replace("-", ""),
        etcd_prefix=f"/{tag}/",
        stream_name=f"S{tag.replace('-', '')}",
        node="node-1",
        state_dir=tmp_path / "state",
    )


@pytest.fixture
async def settings_env(settings: CommonSettings) -> dict[str, str]:
    """The same settings as environment variables, for child processes; the test's event stream made first, as a
    deployment's control plane or `holdfast up` makes it (a node's services and routers only look for it:
    security/policy.py `manages_stream`)."""
    bus = await Bus.connect(settings, "test")
    await bus.close()
    return settings.to_env()


@pytest.fixture
async def bus(settings: CommonSettings) -> AsyncIterator[Bus]:
    b = await Bus.connect(settings, "test")
    yield b
    await b.close()


@pytest.fixture
async def store(settings: CommonSettings) -> AsyncIterator[Store]:
    s = await Store.connect(settings)
    yield s
    await s.delete_prefix("")
    await s.close()
