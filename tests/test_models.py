"""Loading models: a hub id with the hub out of reach fails at once with one sentence, never after retries."""

import socket
import time

import pytest

import tr_core.models as models
from tr_core.models import ModelLoadError, hub_reachable, load_model


def test_offline_mode_never_checks_the_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("no connection in offline mode"))
    assert hub_reachable() is False


def test_the_hub_is_checked_once_every_five_minutes(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "_hub_checked", {})
    calls = []

    def refused(address, timeout):
        calls.append((address, timeout))
        raise OSError("unreachable")

    monkeypatch.setattr(socket, "create_connection", refused)
    assert hub_reachable(now=0.0) is False and hub_reachable(now=299.0) is False
    assert calls == [(("huggingface.co", 443), models.HUB_CHECK_S)]  # the second answer came from the check above
    assert hub_reachable(now=301.0) is False and len(calls) == 2


def test_a_hub_id_with_the_hub_out_of_reach_reads_the_local_cache_only(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty hub cache
    monkeypatch.setattr(models, "hub_reachable", lambda: False)
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as refused:
        load_model("no-such-org/no-such-model")
    print(f"refused in {time.perf_counter() - started:.2f} s")
    assert ("could not load model id 'no-such-org/no-such-model': the hub (huggingface.co) cannot be reached from "
            "here and the local hub cache has no copy of it") in str(refused.value)
