"""The Hugging Face hub, asked only where it answers: without a network, the hub's libraries retry
for half a minute before they fail, so a short connection attempt comes first and, where it fails,
they are put in offline mode: a copy in the local cache still loads, anything else fails at once."""
from __future__ import annotations

import os
import socket
import sys
import urllib.parse

PROBE_SECONDS = 3.0
DEFAULT_ENDPOINT = "https://huggingface.co"
OFFLINE_SWITCHES = (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"))


def offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_answers(endpoint: str | None = None, timeout: float = PROBE_SECONDS) -> bool:
    """Whether a TCP connection to the hub's endpoint (HF_ENDPOINT, else huggingface.co) opens in time."""
    url = urllib.parse.urlsplit(endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def offline_unless_the_hub_answers() -> bool:
    """Before a name is looked up on the hub: True (and the hub's libraries in offline mode, for the
    rest of the process) when it is not reached; False when it is, or offline mode was asked for."""
    if offline_requested() or hub_answers():
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when the libraries are first imported
    for module, switch in OFFLINE_SWITCHES:  # and by those already imported, at each call
        if module in sys.modules:
            setattr(sys.modules[module], switch, True)
    return True
