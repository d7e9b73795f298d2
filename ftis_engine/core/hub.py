"""The HF hub probe: whether the hub answers, once per process; offline mode when it does not. Its own module so
that models.py and tasks/ both use it without importing each other."""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import urllib.parse

from .env import set_for_process


@functools.cache
def hub_reachable() -> bool:
    """Whether the HF hub answers (one TCP connect, 3 s at most, once per process). When it does not, the hub
    libraries are switched to offline mode: cached models and datasets still load, and what is not cached fails
    at once with one line instead of after a minute of retries. Skipped (assumed reachable) behind a proxy.
    HF_HUB_OFFLINE in the environment counts even when set after huggingface_hub read it at import (a process that
    imported it before a probe, its own or its launcher's, set it)."""
    import huggingface_hub.constants as hub

    offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")  # as the library reads it
    if (offline or "").upper() in hub.ENV_VARS_TRUE_VALUES:
        _libraries_offline()
    if hub.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urllib.parse.urlparse(hub.ENDPOINT)
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=3).close()
        return True
    except OSError:
        _libraries_offline()
        # for the rest of the process, and its children (a launch's workers): datasets reads them at import, and
        # every later load of a model or a dataset, in this process or a child, is to use the cache alone
        set_for_process(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        logging.getLogger("ftis_engine").warning("the HF hub (%s) cannot be reached: using the local cache only",
                                                 url.hostname)
        return False


def _libraries_offline() -> None:
    """huggingface_hub's offline flag, and datasets' when it is already imported."""
    import huggingface_hub.constants as hub

    hub.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True
