"""`python -m services.controller`: the controller process (leader-elected; the API runs on every instance)."""

from __future__ import annotations

import sys

from libs.common.cli_support import parse_settings
from libs.common.service import run_service
from services.controller.app import setup
from services.controller.settings import ControllerSettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(ControllerSettings, argv, "holdfast controller")
    run_service("controller", settings.instance, settings, lambda rt: setup(rt, settings))


if __name__ == "__main__":
    main(sys.argv[1:])
