"""Settings from flags and environment for a service's entry point (`--help` included), via pydantic-settings."""

from __future__ import annotations

from typing import TypeVar

from pydantic_settings import CliApp, SettingsConfigDict

from libs.common.config import CommonSettings

S = TypeVar("S", bound=CommonSettings)


def parse_settings(cls: type[S], argv: list[str] | None, prog: str) -> S:
    """Parse `argv` (None: no flags, environment only) into `cls`; `--help` prints every flag and exits."""
    config = SettingsConfigDict(**{**cls.model_config, "cli_prog_name": prog, "cli_kebab_case": True,
                                   "cli_implicit_flags": True})
    bound = type(cls.__name__, (cls,), {"model_config": config, "__module__": cls.__module__})
    parsed: CommonSettings = CliApp.run(bound, cli_args=argv or [])
    return cls.model_validate(parsed.model_dump())
