"""The ``inferq`` command line: the typer app, the way settings become flags, and the
commands that need neither side, ``queues`` (inspect streams, pending entries and
workers) and ``settings`` (print the settings table). ``serve`` (embedded Redis + worker +
batch worker + gateway) and ``gateway`` live in ``gateway/cli.py``, ``worker`` and
``batch-worker`` (Batch API jobs) in ``worker/cli.py``; ``load_commands`` adds them.

Every settings field becomes a flag (``--max-num-seqs``) whose default is unset, so the
precedence flag > ``INFERQ_*`` variable > dataclass default is applied in one place
(``shared.settings.build``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import typing
from collections.abc import Callable
from typing import Any

import typer

from shared.settings import (
    ENV_PREFIX,
    RedisSettings,
    SettingsError,
    build,
    flag_name,
    settings_table,
)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="inferq: queue-driven LLM serving (OpenAI API -> Redis streams -> paged-KV workers)")

log = logging.getLogger("inferq")


def _parameters(classes: tuple[type, ...], aliases: dict[str, str]) -> list[inspect.Parameter]:
    params = [inspect.Parameter("log_level", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                                default=typer.Option("info", "--log-level", help="debug | info | warning"))]
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            annotation: Any = list[str] | None if typing.get_origin(hint) is tuple else hint | None
            flag = flag_name(f)
            if hint is bool:  # --x / --no-x, as vLLM spells its switches
                flag = f"{flag}/--no-{flag[2:]}"
            flags = (flag, aliases[f.name]) if f.name in aliases else (flag,)
            option = typer.Option(None, *flags, help=f"{f.metadata.get('help', '')} [env {ENV_PREFIX}{f.name.upper()}; "
                                                     f"default {f.default!r}]", show_default=False)
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=annotation))
    return params


def settings_command(name: str, *classes: type, extra: tuple[inspect.Parameter, ...] = (),
                     aliases: dict[str, str] | None = None) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register ``fn(*settings, **extra)`` as command ``name`` with a flag per settings
    field, plus the command's own options ``extra`` (passed as keywords). ``aliases``
    gives fields a second flag in this command (``{"gateway_workers": "--workers"}``)."""

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        def command(**kwargs: Any) -> None:
            logging.basicConfig(level=kwargs.pop("log_level").upper(),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            try:
                built = [build(cls, {f.name: kwargs[f.name] for f in dataclasses.fields(cls)}) for cls in classes]
            except SettingsError as exc:  # a bad flag or variable: say which, no traceback
                typer.echo(f"Error: {exc}", err=True)
                raise typer.Exit(2) from None
            fn(*built, **{p.name: kwargs[p.name] for p in extra})

        command.__signature__ = inspect.Signature([*_parameters(classes, aliases or {}), *extra])  # type: ignore[attr-defined]
        command.__doc__ = fn.__doc__
        command.__name__ = name
        app.command(name)(command)
        return fn

    return decorate


def settings_env(*settings: Any) -> dict[str, str]:
    """``INFERQ_*`` variables that reproduce ``settings`` in a child process."""
    env: dict[str, str] = {}
    for obj in settings:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            env[ENV_PREFIX + f.name.upper()] = ",".join(value) if isinstance(value, tuple) else str(value)
    return env


def option_param(name: str, annotation: Any, default: Any, *flags: str, help: str, hidden: bool = False
                 ) -> inspect.Parameter:
    """A command's own option (not a settings field) for ``settings_command(extra=...)``."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *flags, help=help, hidden=hidden))


@settings_command("queues", RedisSettings, extra=(
    option_param("as_json", bool, False, "--json", help="Print JSON instead of tables"),
    option_param("models", list[str] | None, None, "--model", help="Only these models' streams (repeat; default all)"),
))
def queues_cmd(redis_settings: RedisSettings, as_json: bool, models: list[str] | None) -> None:
    """Inspect the queues: per model stream length, consumer-group lag, pending entries
    per consumer with idle time, redeliveries, and live workers with heartbeat age,
    running/waiting requests and KV usage."""
    from shared.queues import queues_command

    if not redis_settings.redis_url:
        raise typer.BadParameter("inferq queues needs --redis-url (or INFERQ_REDIS_URL)")
    queues_command(redis_settings.redis_url, redis_settings.namespace, as_json, models or None)


@app.command("settings")
def settings_cmd() -> None:
    """Print every setting with its variable and default (markdown)."""
    typer.echo(settings_table())


#: Entry-point group in which ``gateway/cli.py`` and ``worker/cli.py`` are named
#: (pyproject.toml, ``[project.entry-points."inferq.commands"]``): loading them adds their
#: commands (``serve``, ``gateway``; ``worker``, ``batch-worker``) to ``app``. The command
#: line is assembled from package metadata, so this module, on the ground floor, imports
#: neither side.
COMMANDS_GROUP = "inferq.commands"


def load_commands() -> typer.Typer:
    """``app`` with every command: loads the modules named in ``COMMANDS_GROUP`` (once).

    Raises:
        RuntimeError: no module is named there: inferq is not installed (``pip install
            -e .``, which ``make setup`` runs), so only ``queues`` and ``settings`` exist.
    """
    from importlib.metadata import distributions

    # Every installed copy's metadata, not the first per name: a stale inferq.egg-info in
    # the working directory (older setuptools wrote one there) would hide the install's.
    modules = {ep.value for dist in distributions() for ep in dist.entry_points if ep.group == COMMANDS_GROUP}
    if not modules:
        raise RuntimeError(f"no {COMMANDS_GROUP} entry points: inferq is not installed (pip install -e .)")
    for name in sorted(modules):
        importlib.import_module(name)
    return app


def main() -> None:
    """The ``inferq`` program (``python -m shared.cli`` too). Without its entry points
    it says why in one line and exits with status 2."""
    try:
        load_commands()
    except RuntimeError as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise SystemExit(2) from None
    app()


if __name__ == "__main__":
    # Run as __main__, this file is not the module ``shared.cli`` that the command modules
    # import and add to: use that one.
    from shared import cli  # noqa: PLW0406 - the imported module, not this __main__

    cli.main()
