"""The `tracekit` command: a click group whose subcommands load lazily.

`tracekit inspect` must stay fast and work without torch or vLLM installed, so each
subcommand's module is imported only when that subcommand runs, and imports neither itself
(`tracekit --help` imports them all). Every `TracekitError` that escapes a subcommand becomes
one readable line on stderr and the error's exit code: a bad bundle never shows a traceback.
"""

import importlib
import sys

import click

from tracekit import __version__
from tracekit.errors import TracekitError

SUBCOMMANDS = {
    "arm": ("tracekit.cli.live_client", "arm_command"),
    "diff": ("tracekit.cli.diff_command", "diff_command"),
    "disarm": ("tracekit.cli.live_client", "disarm_command"),
    "export": ("tracekit.cli.export_command", "export_command"),
    "inspect": ("tracekit.cli.inspect_command", "inspect_command"),
    "invariance": ("tracekit.cli.invariance_command", "invariance_command"),
    "record": ("tracekit.cli.record_command", "record_command"),
    "redact": ("tracekit.cli.redact_command", "redact_command"),
    "replay": ("tracekit.cli.replay_command", "replay_command"),
    "shrink": ("tracekit.cli.shrink_command", "shrink_command"),
    "status": ("tracekit.cli.live_client", "status_command"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        module_name, attribute = SUBCOMMANDS[name]
        return getattr(importlib.import_module(module_name), attribute)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TracekitError as error:
            click.echo(f"tracekit: error: {error}", err=True)
            sys.exit(error.exit_code)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tracekit")
def main():
    """Record one exact vLLM engine step into a bundle; replay, check and time it anywhere."""
