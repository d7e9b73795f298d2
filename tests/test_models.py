"""Models: without a reachable hub the run goes offline at once (one warning), instead of retrying for a minute."""

from __future__ import annotations

import logging

import huggingface_hub.constants as hub

from ftis_engine import models


def test_an_unreachable_hub_switches_to_the_local_cache_once(monkeypatch, caplog):
    calls = []

    def refuse(address, timeout):
        calls.append((address, timeout))
        raise OSError("unreachable")

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(models.socket, "create_connection", refuse)
    models.hub_reachable.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="ftis_engine"):
            assert models.hub_reachable() is False and models.hub_reachable() is False
        assert calls == [(("huggingface.co", 443), 3)]  # probed once, within 3 s
        assert hub.HF_HUB_OFFLINE is True
        assert caplog.text.count("cannot be reached: using the local cache only") == 1
    finally:
        models.hub_reachable.cache_clear()


def test_offline_mode_and_proxies_are_not_probed(monkeypatch):
    monkeypatch.setattr(models.socket, "create_connection", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    models.hub_reachable.cache_clear()
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    assert models.hub_reachable() is False
    models.hub_reachable.cache_clear()
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert models.hub_reachable() is True
    models.hub_reachable.cache_clear()
