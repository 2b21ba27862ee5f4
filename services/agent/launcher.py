"""Start engine processes: posix_spawn in a new session, output to a log file, the agent's env plus theirs.

A new session (setsid) keeps engines alive when the agent dies or its terminal sends SIGINT: the agent's
death must never take its engines with it (a restarted agent re-adopts them).
"""

from __future__ import annotations

import os
from pathlib import Path

from libs.common.events import EngineRole, EngineSpec
from services.agent.settings import AgentSettings


def engine_env(settings: AgentSettings, spec: EngineSpec, *, engine_id: str, role: EngineRole, gpu: int,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(settings.to_env())
    env.update({
        "HF_ENGINE_ID": engine_id,
        "HF_ENGINE_ROLE": role.value,
        "HF_MODEL": spec.model,
        "HF_ENGINE_CLASS": spec.engine_class,
        "HF_ENGINE_VERSION": spec.version,
        "HF_GPU": str(gpu),
        "HF_AGENT_SOCKET": str(settings.socket_path()),
        "HF_GPU_MANAGER_SOCKET": str(settings.gpu_manager_path()),
    })
    # An engine of ours must not inherit a takeover that was meant for another process.
    for key in ("HF_TAKEOVER_FROM", "HF_TRANSFER_TOKEN", "HF_INCIDENT_ID", "HF_TAKEOVER_GANG", "HF_GANG_GENERATION",
                "HF_ENGINE_TP", "HF_DEGRADE_GANG", "HF_ENGINE_SPARE"):
        env.pop(key, None)
    if spec.tp > 1:  # rank 0 starts the other ranks (engines/reference/tp_runner.py)
        env["HF_ENGINE_TP"] = str(spec.tp)
    env.update(spec.env)
    env.update(extra or {})
    return env


def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> int:
    """Start `argv` and return its pid (the caller watches it through a pidfd and reaps it with waitid)."""
    if not argv:
        raise ValueError("an engine spec needs a command")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    return os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True)
