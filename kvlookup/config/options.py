"""How a setting is declared, once: its field in :class:`kvlookup.config.Settings` carries an
:class:`Option` (flag, help, docs text, which processes read it). The command-line flags
(:func:`add_flags`), the overrides taken from them (:func:`overrides`), the environment names
(:func:`env_name`) and the table in docs/configuration.md (:func:`markdown_table`) all follow
from it, so they cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field
from typing import Any

ENV_PREFIX = "KVLOOKUP_"

#: Readers: ``controller`` (the HTTP processes), ``sidecar`` (ingest), ``reap`` (``kvlookup reap``),
#: ``embedded`` (read by a sidecar and given on the controller's command line too, for the
#: sidecar it embeds; the embedded sidecar gets *every* resolved setting, this only adds flags).
CONTROLLER, SIDECAR, REAP, EMBEDDED = "controller", "sidecar", "reap", "embedded"
COMMON = (CONTROLLER, SIDECAR, REAP)
#: which readers each command's flags serve
COMMAND_READERS = {CONTROLLER: (CONTROLLER, EMBEDDED), SIDECAR: (SIDECAR, EMBEDDED), REAP: (REAP,)}


@dataclass(frozen=True)
class Option:
    """One setting's declaration beside its type and default.

    help: one line for ``--help``; doc: the docs table's text (default: help); readers: the
    processes that read it (above); flag: its command-line flag (default ``--<name-with-dashes>``;
    ``""`` for none: secrets and nested settings); choices: the values it takes, if a fixed set.
    """

    help: str
    readers: tuple[str, ...]
    flag: str | None = None
    doc: str = ""
    choices: tuple[str, ...] | None = None
    default_text: str = ""
    env_text: str = ""


def setting(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, **option: Any) -> Any:
    """A :class:`Settings` field with its :class:`Option` (keyword arguments of Option)."""
    meta = {"option": Option(**option)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def declared(settings_cls: type) -> Iterator[tuple[dataclasses.Field, Option]]:
    """Every field of ``settings_cls`` with its Option, in declaration order."""
    for f in dataclasses.fields(settings_cls):
        yield f, f.metadata["option"]


def flag_of(f: dataclasses.Field, opt: Option) -> str | None:
    """The command-line flag of a setting, or None when it has none."""
    if opt.flag == "":
        return None
    return opt.flag or "--" + f.name.replace("_", "-")


def env_name(name: str) -> str:
    """The environment variable of setting ``name``: ``KVLOOKUP_<NAME>``."""
    return ENV_PREFIX + name.upper()


def read_by(opt: Option, command: str) -> bool:
    """Does ``kvlookup <command>`` take this setting from its flags?"""
    return any(r in opt.readers for r in COMMAND_READERS[command])


def add_flags(parser: argparse.ArgumentParser, settings_cls: type, command: str) -> None:
    """Add a flag for every setting ``command`` reads (None when not given). Numbers are parsed
    by argparse; :meth:`Settings.validate` types and checks the rest, naming the setting."""
    for f, opt in declared(settings_cls):
        if read_by(opt, command):
            add_flag(parser, f, opt)


def add_flag(parser: argparse.ArgumentParser, f: dataclasses.Field, opt: Option) -> None:
    """Add setting ``f``'s flag to ``parser`` (nothing when it has none)."""
    flag = flag_of(f, opt)
    if flag is None:
        return
    if str(f.type) == "bool":
        parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=opt.help)
    else:
        # str for the rest: argparse's own default (type=None) keeps the text as given, as str does
        convert: Callable[[str], Any] = {"int": int, "float": float}.get(str(f.type).partition(" | ")[0], str)
        parser.add_argument(flag, dest=f.name, type=convert, choices=opt.choices, help=opt.help)


def add_flag_named(parser: argparse.ArgumentParser, settings_cls: type, name: str) -> None:
    """Add the flag of setting ``name`` (for commands that take a few settings)."""
    for f, opt in declared(settings_cls):
        if f.name == name:
            add_flag(parser, f, opt)


def overrides(args: argparse.Namespace, settings_cls: type, command: str) -> dict[str, Any]:
    """The settings given as flags to ``command`` (None: not given)."""
    return {f.name: getattr(args, f.name, None) for f, opt in declared(settings_cls) if read_by(opt, command)}


def default_text(f: dataclasses.Field, opt: Option) -> str:
    """The default as the docs show it."""
    if opt.default_text:
        return opt.default_text
    value = f.default_factory() if f.default_factory is not MISSING else f.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ", ".join(f"`{v}`" for v in value) or "empty"
    if isinstance(value, str):
        return f"`{value}`" if value else '""'
    return str(value)


def markdown_table(settings_cls: type) -> str:
    """The settings table of docs/configuration.md, one row per setting."""
    lines = ["| setting | flag | environment | default | read by | meaning |", "|---|---|---|---|---|---|"]
    for f, opt in declared(settings_cls):
        flag = flag_of(f, opt)
        readers = ", ".join(opt.readers)
        lines.append(f"| `{f.name}` | {f'`{flag}`' if flag else ''} | `{opt.env_text or env_name(f.name)}` | "
                     f"{default_text(f, opt)} | {readers} | {opt.doc or opt.help} |")
    return "\n".join(lines) + "\n"
