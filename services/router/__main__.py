"""`python -m services.router`: the reference router (HTTP front; endpoints from events)."""

from __future__ import annotations

import sys

from libs.common.cli_support import parse_settings
from libs.common.service import run_service
from services.router.app import setup
from services.router.settings import RouterSettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(RouterSettings, argv, "holdfast router")
    run_service("router", settings.instance, settings, lambda rt: setup(rt, settings))


if __name__ == "__main__":
    main(sys.argv[1:])
