"""`python -m services.gpu_manager` (or `holdfast gpu-manager`): the per-node owner of leased memory."""

from __future__ import annotations

import os
import sys

from libs.common.cli_support import parse_settings
from libs.common.service import run_service
from services.gpu_manager.app import setup
from services.gpu_manager.settings import GpuManagerSettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(GpuManagerSettings, argv, "holdfast gpu-manager")
    # What it writes (the lease database, weight artifacts of lease bytes, the keeper's files) is its uid's alone,
    # whatever the umask it was started with; its sockets set their own mode (libs/common/wire.py `listen_unix`).
    os.umask(0o077)
    run_service("gpu_manager", settings.node, settings, setup)


if __name__ == "__main__":
    main(sys.argv[1:])
