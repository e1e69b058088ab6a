"""The `keras-hub-autodist` command's messages: the package's errors and
advice name options as Python keywords (`errors.option`); the command
rewrites them into its flags, and the Python calls they name into what the
command does instead.
"""

from __future__ import annotations

import re

from keras_hub_autodist.fitting.report import COMPILED_CHECK

# The options messages name as keywords (`errors.option`), and the flag
# each is on this command.
FLAGS = {
    "batch_axis": "--batch-axis",
    "model_axis": "--model-axis",
    "context_axis": "--context-axis",
    "context_parallel_strategy": "--context-parallel-strategy",
    "strategy": "--strategy",
    "dtype": "--dtype",
    "device_memory": "--device-memory",
    "device": "--device",
    "lora_rank": "--lora-rank",
    "remat": "--remat",
    "devices": "--devices",
    "num_devices": "--devices",
    "device_mesh": "--mesh",
    "batch_size": "--batch",
    "sequence_length": "--seq",
    "optimizer": "--optimizer",
}
# Python calls messages name, and what this command does instead.
CALLS = {COMPILED_CHECK: "`--compiled` (with `--batch` and `--seq`)"}
_KEYWORD = re.compile(r"`([a-z_]+)=([^`]*)`")
# An option named bare, as a message's `Received: name=value` part names it.
_BARE_KEYWORD = re.compile(r"(?<![\w`-])([a-z_]+)=")


def as_flags(message: str) -> str:
    """`message` with the options it names as keywords named as this
    command's flags, in its advice and in its `Received:` part.

    Example:
    >>> as_flags("pass `batch_axis=`, e.g. `device_mesh={'batch': 1, 'model': 8}`")
    'pass `--batch-axis`, e.g. `--mesh batch=1,model=8`'
    >>> as_flags("Received: device_memory=0, preset='x'")
    "Received: --device-memory 0, preset='x'"
    """

    def flag(match):
        name, value = match.groups()
        if name not in FLAGS:
            return match.group(0)
        if not value:
            return f"`{FLAGS[name]}`"
        if name == "device_mesh" and value.strip("'\"") != "auto":
            sizes = re.findall(r"'(\w+)': (\d+)", value)
            value = ",".join(f"{axis}={size}" for axis, size in sizes)
        return f"`{FLAGS[name]} {value.strip(chr(39))}`"

    def bare(match):
        name = match.group(1)
        return f"{FLAGS[name]} " if name in FLAGS else match.group(0)

    for call, instead in CALLS.items():
        message = message.replace(call, instead)
    advice, received, values = message.partition("Received:")
    return (
        _KEYWORD.sub(flag, advice)
        + received
        + _BARE_KEYWORD.sub(bare, _KEYWORD.sub(flag, values))
    )
