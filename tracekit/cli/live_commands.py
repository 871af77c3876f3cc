"""`tracekit arm|status|disarm --server URL`: live control of a running `vllm serve`.

The server must have been started with tracekit's plugins and a bundle folder
(`VLLM_PLUGINS=tracekit TRACEKIT_SERVE_DIR=FOLDER vllm serve ...`); the work is in
`tracekit.cli.live_client`.
"""

import click

from tracekit.format.schema import KV_MODES
from tracekit.integrations.vllm.serving import API_KEY_VARIABLE
from tracekit.record.triggers import DEFAULT_MAX_BUNDLES

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
    from tracekit.cli import live_client
    from tracekit.cli.arguments import comma_separated
    from tracekit.record.triggers import CLI_NAMES

    settings = {"output": output, "steps": steps, "when": when, "on": list(comma_separated(events)), "kv": kv,
                "max_bundles": max_bundles, "window": window}
    reply = live_client.arm(server, settings, key, CLI_NAMES)
    click.echo("\n".join(live_client.report("arm", reply)))


@click.command("status")
@server_option
@key_option
def status_command(server, key):
    """What the recorders of a running vllm serve record, and the bundles they wrote."""
    from tracekit.cli import live_client

    click.echo("\n".join(live_client.report("status", live_client.ask(server, "status", key))))


@click.command("disarm")
@server_option
@key_option
def disarm_command(server, key):
    """Disarm the recorders of a running vllm serve; the engine then runs as without tracekit."""
    from tracekit.cli import live_client

    click.echo("\n".join(live_client.report("disarm", live_client.ask(server, "disarm", key, {}))))
