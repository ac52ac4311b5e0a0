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


def test_the_conversion_parses_the_gguf_file_once_and_puts_gguf_back(monkeypatch):
    # transformers reads the file for the tokenizer, the config and the weights, and builds a tensor-name map per
    # module: inside the conversion each is made once per argument (17.2 s -> 7.4 s, the files byte for byte the same)
    gguf = pytest.importorskip("gguf")
    made = []

    class Reader:
        def __init__(self, path, mode="r"):
            made.append(("reader", path, mode))

    def name_map(arch, n_blocks):
        made.append(("map", arch, n_blocks))
        return object()

    monkeypatch.setattr(gguf, "GGUFReader", Reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", name_map)
    with models._gguf_read_once():
        first = [gguf.GGUFReader("a.gguf"), gguf.GGUFReader("a.gguf"), gguf.GGUFReader("b.gguf")]
        maps = [gguf.get_tensor_name_map("llama", 30), gguf.get_tensor_name_map("llama", 30),
                gguf.get_tensor_name_map("llama", 2)]
    assert first[0] is first[1] is not first[2] and maps[0] is maps[1] is not maps[2]
    assert made == [("reader", "a.gguf", "r"), ("reader", "b.gguf", "r"), ("map", "llama", 30), ("map", "llama", 2)]
    assert gguf.GGUFReader is Reader and gguf.get_tensor_name_map is name_map  # put back
    Reader("a.gguf")
    assert len(made) == 5  # outside the conversion, nothing is kept
