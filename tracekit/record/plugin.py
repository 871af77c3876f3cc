"""The vLLM plugins: a recorder armed from environment variables at start, and live control.

vLLM loads `vllm.general_plugins` entry points in every process it starts (`register` here) and
`vllm.endpoint_plugins` in its API server when `VLLM_PLUGINS` names them (`endpoint_plugin`).
What each does, its variables, and when a recorder arms: docs/GUIDE.md, "The vLLM plugin".
tracekit's lines go to the server's log (`serving.route_logs_to_vllm`).
"""

import atexit
import logging
import os
import threading
from typing import Any

from tracekit.errors import TracekitError

logger = logging.getLogger("tracekit.record")

OUTPUT_VARIABLE = "TRACEKIT_RECORD_OUTPUT"


def register() -> None:
    """vLLM's general plugin, in every process: nothing unless armed at start or live control is on."""
    from tracekit.record.settings import served_folder

    armed_at_start, live_control = bool(os.environ.get(OUTPUT_VARIABLE)), served_folder() is not None
    if not (armed_at_start or live_control):
        return
    from tracekit.integrations.vllm.recording import install_worker_method, installed_release, route_logs_to_vllm
    from tracekit.record import live

    route_logs_to_vllm()
    try:
        release = installed_release()
    except TracekitError as error:  # a vLLM this tracekit does not know: serve unrecorded
        logger.error("tracekit: not armed, live control off: %s", error)
        return
    if live_control:
        install_worker_method(live.handle)
    release.on_each_runner_ready(lambda runner: _runner_ready(runner, armed_at_start, live_control))
    atexit.register(live.disarm_all)


def endpoint_plugin() -> Any:
    """vLLM's endpoint plugin, in the API server when `VLLM_PLUGINS` names `tracekit`: the live
    control routes where the operator named the bundle folder, else none (said in the log)."""
    from tracekit.integrations.vllm.recording import LiveControlEndpoint, LiveControlOff, route_logs_to_vllm
    from tracekit.record import live

    route_logs_to_vllm()
    served = live.served_folder()
    if served is None:
        return LiveControlOff(f"start the server with {live.SERVE_DIR_VARIABLE}=FOLDER, the folder "
                              "bundles may be written to, to enable it")
    return LiveControlEndpoint(live.ServerControl(served))


def _runner_ready(runner: Any, armed_at_start: bool, live_control: bool) -> None:
    if armed_at_start:
        _arm_from_environment(runner)
    if live_control:  # hash the weights for the bundles now, off the engine's thread, not at the first arming
        threading.Thread(target=_prepare, args=(runner,), name="tracekit-prepare", daemon=True).start()


def _arm_from_environment(runner: Any) -> None:
    from tracekit.record import live
    from tracekit.record.recorder import Recorder
    from tracekit.record.settings import RecordSettings
    from tracekit.record.triggers import DEFAULT_MAX_BUNDLES, SettingNames

    if live.status(runner)["armed"]:  # warmed up twice
        return
    names = SettingNames(steps="TRACEKIT_RECORD_STEPS", when="TRACEKIT_RECORD_WHEN", on="TRACEKIT_RECORD_ON",
                         kv="TRACEKIT_RECORD_KV", max_bundles="TRACEKIT_RECORD_MAX_BUNDLES",
                         window="TRACEKIT_RECORD_WINDOW", output=OUTPUT_VARIABLE)
    events = tuple(e.strip() for e in os.environ.get(names.on, "").split(",") if e.strip())
    try:
        settings = RecordSettings(
            steps=os.environ.get(names.steps),
            when=os.environ.get(names.when),
            on=events,
            kv=os.environ.get(names.kv, "read"),
            max_bundles=_int_env(names.max_bundles, DEFAULT_MAX_BUNDLES),
            window=_int_env(names.window, 1),
            keep_lora_weights=os.environ.get("TRACEKIT_RECORD_LORA_WEIGHTS", "") == "1",
        )
        recorder = Recorder(runner, os.environ[OUTPUT_VARIABLE], settings, names=names).arm()
    except Exception as error:  # bad settings, or anything else: the engine starts unrecorded
        logger.error("tracekit: recorder not armed, the server runs unrecorded: %s", error)
        return
    if not recorder.armed:  # it logged why
        return
    live.keep_armed_at_start(runner, recorder, f"{OUTPUT_VARIABLE} at start")


def _prepare(runner: Any) -> None:
    from tracekit.integrations.vllm.recording import installed_release

    try:
        installed_release().adapter_for(runner).engine_config()
    except Exception as error:  # arming will say what is wrong, if anything is
        logger.debug("tracekit: could not prepare the engine's record: %s", error)


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit():
        raise TracekitError(f"{name} must be a whole number, not {value!r}")
    return int(value)
