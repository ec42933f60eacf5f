"""What kvtier's command-line tools (``kvctl``, ``kvbench``) share: an argparse parser whose usage errors are one
line, and :class:`Subcommands`, through which each subcommand module registers itself.

A subcommand module has ``register(commands: Subcommands) -> None``; it calls ``commands.add(name, help, run)``
(or ``commands.group(name, help)`` for ``NAME ACTION`` commands) and adds its own arguments to the parser it gets
back. The tool's entry point lists its modules in one tuple, calls ``args.run(...)`` on what was parsed and turns
the errors a user can cause into one line and an exit status (:func:`report_errors`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``TOOL: error: ...`` line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog.split()[0]}: error: {message} (see {self.prog} --help)\n")


class Subcommands:
    """The subcommands of one tool (or of one command group). Every subcommand gets the options of ``common``
    (the tool's global options, so that they may also follow the command)."""

    def __init__(self, subparsers: Any, common: argparse.ArgumentParser) -> None:
        self._subparsers = subparsers
        self._common = common

    def add(self, name: str, help_text: str, run: Callable[..., int], **defaults: Any) -> argparse.ArgumentParser:
        """A subcommand ``name``: parsing it sets ``args.run = run`` (and ``defaults``); add its arguments to the
        parser returned."""
        parser = self._new(name, help_text)
        parser.set_defaults(run=run, **defaults)
        return parser

    def group(self, name: str, help_text: str) -> Subcommands:
        """A subcommand ``name ACTION``: add its actions to the result (``args.action`` names the one given)."""
        parser = self._new(name, help_text)
        return Subcommands(parser.add_subparsers(dest="action", required=True, metavar="ACTION"), self._common)

    def _new(self, name: str, help_text: str) -> argparse.ArgumentParser:
        return self._subparsers.add_parser(name, help=help_text, description=help_text, parents=[self._common])


def report_errors(prog: str, run: Callable[[], int], errors: Sequence[tuple[type[Exception], int, str]]) -> int:
    """The exit status of ``run()``.

    An exception of a type listed in ``errors`` (``(type, exit status, prefix)``; the first that matches wins)
    becomes one ``PROG: PREFIX message`` line on stderr and that status; Ctrl-C is ``PROG: interrupted`` and 130.
    Any other exception is a bug and propagates, traceback and all.
    """
    try:
        return run()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        for kind, status, prefix in errors:
            if isinstance(exc, kind):
                print(f"{prog}: {prefix}{exc}", file=sys.stderr)
                return status
        raise
