"""`python -m services.agent` (or `holdfast agent`): the per-node engine supervisor."""

from __future__ import annotations

import sys

from libs.common.cli_support import parse_settings
from libs.common.service import run_service
from services.agent.app import setup
from services.agent.settings import AgentSettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(AgentSettings, argv, "holdfast agent")
    run_service("agent", settings.node, settings, setup)


if __name__ == "__main__":
    main(sys.argv[1:])
