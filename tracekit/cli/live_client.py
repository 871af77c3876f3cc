"""`tracekit arm|status|disarm --server URL`: live control of a running `vllm serve` (started with
`VLLM_PLUGINS=tracekit TRACEKIT_SERVE_DIR=FOLDER`), through the routes `tracekit.record.live`
answers. Needs neither torch nor vLLM on the machine it runs on.

Every refusal is one line with the exit code of its kind: a setting the server refused (or
that is refused here before anything is sent) 2, a server that cannot be reached or has live
control off 3.
"""

import json
import urllib.error
import urllib.request
from typing import Any

import click

from tracekit import __version__
from tracekit.cli.arguments import comma_separated
from tracekit.errors import CannotRunHere, UsageError
from tracekit.format.schema import KV_MODES
from tracekit.integrations.vllm.serving import API_KEY_VARIABLE
from tracekit.record.settings import SERVE_DIR_VARIABLE, bundles, check_settings
from tracekit.record.triggers import CLI_NAMES, DEFAULT_MAX_BUNDLES

ROUTES = {"arm": ("POST", "/v1/tracekit/arm"), "status": ("GET", "/v1/tracekit/status"),
          "disarm": ("POST", "/v1/tracekit/disarm")}
TIMEOUT_S = 180.0


server_option = click.option("--server", required=True, help="The server's URL, e.g. http://127.0.0.1:8000.")
key_option = click.option("--api-key", "key", envvar=API_KEY_VARIABLE, default=None,
                          help=f"The server's API key (its --api-key), if it has one. Default: ${API_KEY_VARIABLE}.")


@click.command("arm")
@server_option
@key_option
@click.option("--steps", default=None, help="Step indices to record, counted from arming: 7, 5:9, 3,7.")
@click.option("--when", default=None,
              help="Predicate, e.g. 'request==cmpl-99a6ae51716401f0 and first_chunk', 'num_reqs>=8'.")
@click.option("--on", "events", multiple=True, help="exception and/or nonfinite (commas or repeated).")
@click.option("--kv", type=click.Choice(KV_MODES), default="read", show_default=True, help="KV blocks to save.")
@click.option("-o", "--output", default=None,
              help="A new folder under the server's bundle folder (TRACEKIT_SERVE_DIR). Default: live-DATE-TIME.")
@click.option("--max-bundles", type=int, default=DEFAULT_MAX_BUNDLES, show_default=True,
              help="The most bundles this arming takes; then the recorder stops by itself.")
@click.option("--window", type=int, default=1, show_default=True, help="Consecutive steps per bundle.")
def arm_command(server, key, steps, when, events, kv, output, max_bundles, window):
    """Arm (or re-arm with new triggers) the recorders of a running vllm serve, without a restart."""
    settings = {"output": output, "steps": steps, "when": when, "on": list(comma_separated(events)), "kv": kv,
                "max_bundles": max_bundles, "window": window}
    click.echo("\n".join(report("arm", arm(server, settings, key))))


@click.command("status")
@server_option
@key_option
def status_command(server, key):
    """What the recorders of a running vllm serve record, and the bundles they wrote."""
    click.echo("\n".join(report("status", ask(server, "status", key))))


@click.command("disarm")
@server_option
@key_option
def disarm_command(server, key):
    """Disarm the recorders of a running vllm serve; the engine then runs as without tracekit."""
    click.echo("\n".join(report("disarm", ask(server, "disarm", key, {}))))


def arm(server: str, settings: dict[str, Any], key: str | None) -> dict[str, Any]:
    """Arm (or re-arm) the server's recorders; `settings` as the route takes them, checked here
    first (refusals name them as the command line spells them)."""
    body = {name: value for name, value in settings.items() if value not in (None, (), [])}
    check_settings(body, CLI_NAMES)
    return ask(server, "arm", key, body)


def ask(server: str, op: str, key: str | None, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The server's reply to one live-control request, or a one-line refusal."""
    if not server.startswith(("http://", "https://")):
        raise UsageError(f"bad --server {server!r}: give the server's URL, e.g. http://127.0.0.1:8000")
    method, path = ROUTES[op]
    headers = {"Content-Type": "application/json", "User-Agent": f"tracekit/{__version__}"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if method == "POST" else None
    request = urllib.request.Request(server.rstrip("/") + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        raise _refusal(server, error) from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise CannotRunHere(f"cannot reach {server}: {reason}") from None


def _refusal(server: str, error: urllib.error.HTTPError) -> Exception:
    try:
        said = json.load(error).get("error")
    except (ValueError, AttributeError):
        said = None
    if error.code == 401:
        return UsageError(f"{server} wants its API key: pass --api-key KEY or set {API_KEY_VARIABLE}")
    if error.code == 404:
        return CannotRunHere(f"{server} has no tracekit routes: start it with VLLM_PLUGINS=tracekit and "
                             f"{SERVE_DIR_VARIABLE}=FOLDER (the folder bundles may go to), with tracekit installed")
    if error.code == 400:
        return UsageError(said or f"{server} refused the request")
    return CannotRunHere(f"{server} answered {error.code}: {said or error.reason}")


def report(op: str, reply: dict[str, Any]) -> list[str]:
    """The server's reply to `op` as lines a person reads: one per rank, what it records where."""
    ranks = reply.get("ranks", [])
    lines = []
    if op == "arm":
        lines.append(f"armed on {len(ranks)} rank{'s' if len(ranks) != 1 else ''}: bundles go to {reply.get('output')}")
    for rank, state in enumerate(ranks):
        prefix = f"rank {rank}: " if len(ranks) > 1 else ""
        if "by" not in state:
            lines.append(f"{prefix}not armed (nothing armed since the server started)")
            continue
        written = state.get("written", [])
        size = sum(item.get("bytes") or 0 for item in written)
        where = "armed" if state.get("armed") else f"not armed ({state.get('stopped')})"
        lines.append(f"{prefix}{where}; recording {state['trigger']} (armed by {state['by']}), "
                     f"{state.get('steps_seen', 0)} steps seen, {len(written)} of at most {bundles(state['max_bundles'])} "
                     f"written ({size / (1 << 20):.1f} MiB) to {state['output']}")
        lines.extend(f"{prefix}  {item['path']}" for item in written)
    return lines
