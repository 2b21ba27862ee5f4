"""`python -m services.router`: the reference router (HTTP front; endpoints from events)."""

from __future__ import annotations

import sys

from libs.common.cli_support import parse_settings
from libs.common.service import run_service
from services.router.app import setup
from services.router.settings import RouterSettings
from services.router.workers import die_with_parent, worker_instance


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(RouterSettings, argv, "holdfast router")
    if settings.router_worker_index > 0:  # started by worker 0 (workers.py)
        die_with_parent(settings.router_parent_pid)
    run_service("router", worker_instance(settings.instance, settings.router_worker_index), settings,
                lambda rt: setup(rt, settings, argv or []))


if __name__ == "__main__":
    main(sys.argv[1:])
