"""`python -m services.dc_manager`: one datacenter manager (one per datacenter or zone)."""

from __future__ import annotations

import sys

from libs.common.cli_support import parse_settings
from libs.common.service import run_service
from services.dc_manager.app import setup
from services.dc_manager.settings import DcManagerSettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(DcManagerSettings, argv, "holdfast dc-manager")
    run_service("dc_manager", settings.datacenter, settings, lambda rt: setup(rt, settings))


if __name__ == "__main__":
    main(sys.argv[1:])
