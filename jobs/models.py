"""`overnight models`: list aliases and prepare them once into the cache."""

from __future__ import annotations

import click

from overnight.jobs.options import user_errors
from overnight.pipeline.config import DEFAULT_MODEL
from overnight.pipeline.tools import models as store


@click.group()
def models() -> None:
    """Model aliases and the local model cache.

    \b
    Example:
        overnight models list
        overnight models prepare smollm2-135m
    """


@models.command("list")
def list_cmd() -> None:
    """List model aliases, whether each is prepared, and where.

    \b
    Example:
        overnight models list
    """
    for alias in store.ALIASES.values():
        state = "prepared" if store.is_prepared(alias) else "not prepared"
        click.echo(f"{alias.name}\t{state}\t{store.alias_folder(alias)}\n    {alias.description}")


@models.command("prepare")
@click.argument("alias", default=DEFAULT_MODEL)
@click.option("--force", is_flag=True, help="Convert again even if already prepared.")
@user_errors
def prepare_cmd(alias: str, force: bool) -> None:
    """Convert a model alias into a local bf16 folder that vLLM serves (once).

    The cache lives in $OVERNIGHT_CACHE/models (default ~/.cache/overnight/models).

    \b
    Example:
        overnight models prepare smollm2-135m
    """
    path = store.prepare(alias, force=force, echo=click.echo)
    click.echo(f"{alias}: {path}")
