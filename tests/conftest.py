"""Shared fixtures: tiny random models (float64, built from a config, no download) and the embedded model."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path

# Before transformers is imported (the hub library reads these once): tests never reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig, Qwen2Config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
VOCAB = 256


def pytest_configure(config):
    # the tiers: `bash scripts/test.sh --fast` leaves out what is marked app, load or slow; the whole suite runs all
    config.addinivalue_line("markers", "load: many requests against one launched app (minutes); CI runs them, "
                                       "-m 'not load' skips them locally")
    config.addinivalue_line("markers", "app: a launched app, a browser or gradio's page (left out by --fast)")
    config.addinivalue_line("markers", "slow: a test of ten seconds or more (left out by --fast)")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one; device_check.sh runs them)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here (scripts/device_check.sh runs these on a GPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _on_this_machine(host) -> bool:
    if host is None:
        return True
    host = host.decode() if isinstance(host, bytes) else str(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


THREADS = torch.get_num_threads()  # the session's, as torch chose it at start


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """Every test, and every fixture it used, leaves torch's thread count as the session started with it: one left at
    1 thread (a module's fixture ran a benchmark in the process with --threads 1) ran every later test of the suite on
    one core and measured every kernel plan and t(N) again."""
    yield
    now = torch.get_num_threads()
    if now != THREADS:
        torch.set_num_threads(THREADS)
        pytest.fail(f"torch's thread count was left at {now} (the session's is {THREADS})")


@pytest.fixture(scope="module")
def no_outside_network():
    """While a module's tests run, every connection and name lookup of this process (the launched app's included)
    must stay on this machine: one that would leave is refused, and fails the module at the end."""
    attempts = []
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def guarded(real):
        def attempt(self, address):
            if self.family in (socket.AF_INET, socket.AF_INET6) and not _on_this_machine(address[0]):
                attempts.append(address)
                raise OSError(f"test guard: a connection to {address} would leave this machine")
            return real(self, address)
        return attempt

    def lookup(host, *args, **kwargs):
        if not _on_this_machine(host):
            attempts.append(host)
            raise socket.gaierror(f"test guard: looking up {host!r} would leave this machine")
        return getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = guarded(connect), guarded(connect_ex), lookup
    yield attempts
    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
    assert not attempts, f"requests tried to leave this machine: {attempts}"


def tiny_config(arch: str, vocab: int = VOCAB):
    if arch == "llama":
        return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "qwen2":
        return Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                          bos_token_id=None, eos_token_id=None)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, dtype=torch.float64, vocab: int = VOCAB):
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab)
    config.initializer_range = 0.2  # sharper random distributions: fewer trivial repetition loops
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@pytest.fixture(scope="session", params=["llama", "qwen2", "gpt2"])
def tiny(request):
    return request.param, tiny_model(request.param)


@pytest.fixture(scope="session")
def embedded():
    """The real embedded model (SmolLM2-135M-Instruct, fp32), loaded once per test session."""
    from tr_core.models import load_model

    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def app_models():
    """One model cache for every launched app and every app-level test of the session: the embedded model loads, and
    its kernels and t(N) are measured, once per mode (a fixture imported into several modules would be made once per
    module)."""
    from ui.models import ModelCache

    return ModelCache()


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding by transformers' own generate(): the reference every method must match."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama with the embedded model's tokenizer (and chat template), saved like a hub model."""
    from tr_core.models import embedded_model_folder

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_folder())
    torch.manual_seed(0)
    config = tiny_config("llama", vocab=len(tokenizer))
    config.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer
