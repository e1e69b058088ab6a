"""Tell quickly whether the Hugging Face Hub can be reached.

keras-hub downloads an `hf://` preset's `config.json` with
`huggingface_hub.hf_hub_download`, which retries a failed connection five
times (about 35 seconds) and then reports a missing file, the network error
lost. One request without retries, made first, tells an unreachable network
at once, as a `ConnectionError` that `loaders.is_network_error` recognizes.
"""

from __future__ import annotations

import socket
import sys

from keras_hub_autodist.reading.records import CONFIG_FILE

HF_SCHEME = "hf://"


def check_hugging_face_reachable(preset: str) -> None:
    """Raise `ConnectionError` if the Hub holding `preset` can't be reached.

    Does nothing for presets that are not `hf://` handles, for a handle
    whose `config.json` is in the local Hugging Face cache (keras-hub reads
    it from there), and whenever the Hub answers, even with an error such as
    401 or 404: keras-hub's own download then reports it.

    Args:
        preset: the preset as passed to `from_preset`, e.g.
            `"hf://google/gemma-2b"`.

    Raises:
        ConnectionError: no connection to the Hub (no network, no name
            resolution, a timeout, or `HF_HUB_OFFLINE` set), with the
            Hub's error as its cause.

    Example:
    >>> check_hugging_face_reachable("./gemma_2b")  # not a handle: no request
    """
    if not isinstance(preset, str) or not preset.lower().startswith(HF_SCHEME):
        return
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    repo_id = preset[len(HF_SCHEME) :]
    if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, CONFIG_FILE), str):
        return
    url = huggingface_hub.hf_hub_url(repo_id, CONFIG_FILE)
    try:
        huggingface_hub.get_hf_file_metadata(url, retry_on_errors=False)
    except HfHubHTTPError:
        return  # the Hub answered
    except Exception as error:
        if is_unreachable(error):
            raise ConnectionError(
                f"The Hugging Face Hub did not answer for {preset}: "
                f"{type(error).__name__}: {error}"
            ) from error
        # Anything else (a malformed handle, ...) keras-hub reports itself.


def is_unreachable(error: BaseException) -> bool:
    """True for an error that means no connection was made: the OS's
    connection errors and timeouts, failed name resolution, and the
    transport errors of httpx (huggingface_hub >= 1) and requests.

    Example:
    >>> is_unreachable(ConnectionRefusedError())
    True
    >>> is_unreachable(ValueError("not a network error"))
    False
    """
    kinds = [ConnectionError, TimeoutError, socket.gaierror]
    for name in ("httpx2", "httpx"):
        module = sys.modules.get(name)
        if module is not None:
            kinds.append(module.TransportError)
    requests = sys.modules.get("requests")
    if requests is not None:
        kinds += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
    return isinstance(error, tuple(kinds))
