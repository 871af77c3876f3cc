"""The options several commands share, defined once so each means the same everywhere, and the
check that refuses an option no one knows before anything slow starts.

Conventions every command follows: a report goes to `--json [FILE]` (no FILE, or `-`: standard
output); a step is picked with `--steps`; an output that exists is written over only with
`--force`; vLLM's and torch's own output is shown only with `-v`.
"""

import difflib
import functools
import re
from pathlib import Path

import click

from tracekit.errors import UsageError
from tracekit.outputs import STDOUT

# Commands that pass the options they do not know to vLLM as engine arguments.
ENGINE_ARGUMENTS = {"ignore_unknown_options": True, "allow_extra_args": True}
# A value such as `-1` (after `--seed`) is not an option.
_NUMBER = re.compile(r"-\d")


def json_option(what: str):
    """`--json [FILE]`: `what` as JSON into FILE, or standard output (no FILE, or `-`)."""
    return click.option("--json", "json_out", default=None, is_flag=False, flag_value="-", metavar="[FILE]",
                        type=click.Path(dir_okay=False, allow_dash=True),
                        help=f"Write {what} as JSON to FILE (no FILE, or '-': standard output).")


def json_took_an_argument(json_out: str | None, argument: str):
    """Refuse a command line that lacks `argument` (usage), saying so where `--json` took it for
    its FILE (`tracekit inspect --json B`: the old spelling of `--json` as a flag)."""
    if json_out not in (None, STDOUT) and Path(json_out).exists():
        raise UsageError(f"--json took {json_out} as the file to write, leaving no {argument}: put --json after "
                         f"the {argument}, or write --json - for standard output")
    raise UsageError(f"missing argument {argument}")


def bundle_argument():
    """BUNDLE, one bundle file: where there is none, refused (usage) before any work."""

    def existing(ctx, parameter, value):
        if not Path(value).is_file():
            raise UsageError(f"no bundle at {value}")
        return value

    return click.argument("bundle", type=click.Path(dir_okay=False), callback=existing)


def _stacked(*decorators):
    """The decorators as one, applied as if written one above the other in this order."""
    return lambda command: functools.reduce(lambda made, decorator: decorator(made), reversed(decorators), command)


def weights_options():
    """`--model` and `--allow-weights-mismatch`, for a command that replays a bundle's step."""
    return _stacked(
        click.option("--model", default=None, help="Where the weights are here, if not at the recorded path."),
        click.option("--allow-weights-mismatch", is_flag=True,
                     help="Replay even if the weights' fingerprint (the model's, a LoRA adapter's) differs."))


def one_step_options(step_help: str, json_what: str):
    """The options of a command that replays one step of a bundle (`invariance`, `shrink`), in
    this order: `--steps`, the weights', `--json`, `--force`, `-v`."""
    return _stacked(steps_option(step_help), weights_options(), json_option(json_what), force_option(), verbose_option(),
                    renamed_option("--step", "--steps"))


def force_option():
    return click.option("--force", is_flag=True,
                        help="Write over output files that exist (a bundle, or this command's own input, too).")


def verbose_option():
    return click.option("-v", "--verbose", is_flag=True,
                        help="Show vLLM's and torch's own output (warnings, progress bars) as it comes, instead of "
                             "keeping it in a log file the report names.")


def steps_option(help: str):
    return click.option("--steps", default=None, metavar="STEPS", help=help)


def renamed_option(old: str, new: str, message: str | None = None):
    """A hidden option under a spelling the command no longer takes: given, it is refused in one
    line naming the new spelling (`message`, or "OLD is now NEW")."""

    def refuse(ctx, parameter, value):
        if value is not None:
            raise UsageError(message or f"{old} is now {new}")

    return click.option(old, hidden=True, expose_value=False, default=None, callback=refuse)


def one_step(steps: str | None) -> int | None:
    """The step index `--steps` names, for a command that takes one step (None: the first)."""
    if steps is None:
        return None
    try:
        return int(steps)
    except ValueError:
        raise UsageError(f"--steps {steps}: this command takes one step: give its index (--steps 7)") from None


def comma_separated(values: tuple[str, ...]) -> tuple[str, ...]:
    """A repeatable option's values, each of which may list several, comma separated."""
    return tuple(part.strip() for value in values for part in value.split(",") if part.strip())


def refuse_unknown_options(argv: list[str], command: click.Command) -> None:
    """Refuse (usage, before vLLM is imported) each option in `argv` that is neither the command's
    own nor one of vLLM's engine arguments, naming the closest of either. Where the installed
    vLLM's options cannot be read, vLLM's parser judges them later."""
    from tracekit.integrations.vllm.engines.engine_options import engine_option_names, is_engine_option

    engine_names = engine_option_names()
    if engine_names is None:
        return
    for token in argv:
        if token.startswith("-") and not _NUMBER.match(token) and not is_engine_option(token, engine_names):
            raise UsageError(_unknown(token.split("=", 1)[0], command, engine_names))


def _unknown(option: str, command: click.Command, engine_names: frozenset[str]) -> str:
    own = [name for parameter in command.params if not getattr(parameter, "hidden", False)
           for name in (*parameter.opts, *parameter.secondary_opts) if name.startswith("-")]
    closest = difflib.get_close_matches(option, own, n=1, cutoff=0.6) or difflib.get_close_matches(
        option, sorted(engine_names), n=1, cutoff=0.75)
    hint = f"; did you mean {closest[0]}?" if closest else f" (tracekit {command.name} --help lists its own)"
    return f"unknown option {option}: not a tracekit {command.name} option nor a vLLM engine argument{hint}"
