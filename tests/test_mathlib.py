"""``tr_core.mathlib``: torch's vector math gives the same bits on a process's first call as on later ones once
``tr_core.models`` is imported (the first call on two threads otherwise computed part of a tensor less accurately in
about a third of fresh processes on an Intel Xeon with AMX: mathlib.py)."""

import subprocess
import sys

import pytest

import tr_core.models  # noqa: F401 (what settles the vector math in every process that loads a model)

# a fresh interpreter: the package's settling first, then cos over 4,096 floats (two pieces of 2,048, one per thread
# where torch runs two) twice; prints whether the first call gave the later call's bits
_FIRST_CALL = """
import sys, torch
import tr_core.mathlib
torch.set_num_threads(max(2, torch.get_num_threads()))
x = torch.arange(4096, dtype=torch.float32) * 0.37
first = x.cos()
sys.stdout.write(str(torch.equal(first, x.cos())))
"""
PROCESSES = 12  # without the settling about a third of them failed: all 12 passing by chance is ~0.4%


def test_models_settles_the_vector_math_on_import():
    assert sys.modules["tr_core.mathlib"]._settled


@pytest.mark.slow  # 12 interpreters: ~16 s
def test_a_fresh_process_first_vector_math_call_gives_the_later_calls_bits():
    results = [subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True, text=True, timeout=120)
               for _ in range(PROCESSES)]
    assert all(r.returncode == 0 for r in results), [r.stderr[-500:] for r in results if r.returncode]
    assert [r.stdout for r in results] == ["True"] * PROCESSES
