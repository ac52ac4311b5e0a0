"""The step-cost model behind "on other hardware" (tr_core.projection), against roofline numbers worked by hand."""

import pytest

from tr_core.projection import (
    DEVICES,
    KERNELS_PER_LAYER,
    PAPER,
    Device,
    Shape,
    curve_error,
    fitted_here,
    paper_check,
    project,
    projection,
    step_ms,
)

SMOL = Shape(134.5e6, 30)  # the embedded model: 134.5M weights streamed a step, 30 decoder layers


def test_a_step_on_a_t4_by_hand():
    # launches: 30 layers x 14 kernels x 8 us = 3.36 ms; weights: 134.5e6 x 2 B / 320 GB/s = 0.8406 ms;
    # arithmetic at 81 tokens: 2 x 134.5e6 x 81 / 65e12 = 0.3352 ms, under the streaming time: memory-bound
    t4 = DEVICES["T4"]
    assert KERNELS_PER_LAYER == 14 and t4.launch_us == 8.0
    assert step_ms(t4, SMOL, 1) == pytest.approx(3.36 + 0.8406, abs=1e-4)
    assert step_ms(t4, SMOL, 81) == pytest.approx(step_ms(t4, SMOL, 1))
    # at 400 tokens the arithmetic (1.6554 ms) outgrows the streaming
    assert step_ms(t4, SMOL, 400) == pytest.approx(3.36 + 1.6554, abs=1e-4)


def test_a_laptop_cpu_is_compute_bound_early():
    # weights: 134.5e6 x 4 B / 51.2 GB/s = 10.508 ms; arithmetic: 2 x 134.5e6 x N / 0.36e12 = 0.7472 ms per token,
    # so from N = 15 on the step grows with N
    laptop = DEVICES["laptop CPU"]
    assert step_ms(laptop, SMOL, 1) == pytest.approx(3.36 + 10.508, abs=1e-3)
    assert step_ms(laptop, SMOL, 16) == pytest.approx(3.36 + 16 * 0.74722, abs=1e-3)


def test_a_runs_projection_counts_its_steps_and_its_host_work():
    flat = Device("flat", 100, 1e9, 2, 0.0, "streaming only")  # t(N) = 20 ms for 1e9 weights, whatever N
    shape = Shape(1e9, 1)
    assert step_ms(flat, shape, 1) == pytest.approx(20.0)
    # 6 tokens in 3 steps: plain needs 6 x 20 ms; the method 3 x 20 ms plus 2 ms of host work a step
    assert project([(13, 2, 2.0), (13, 3, 2.0), (13, 1, 2.0)], flat, shape) == pytest.approx(120 / 66)


def test_this_machine_is_fitted_to_its_measured_steps_and_its_error_is_shown():
    curve = {1: 30.0, 4: 33.0, 16: 41.0, 64: 70.0}  # ms, a CPU whose step grows with N
    here = fitted_here(curve, SMOL, bandwidth_gbs=20.0, bytes_per_weight=4)
    # streaming 134.5e6 x 4 / 20 GB/s = 26.9 ms: the fixed part 3.1 ms; t(64) met through the throughput
    assert step_ms(here, SMOL, 1) == pytest.approx(30.0) and step_ms(here, SMOL, 64) == pytest.approx(70.0)
    assert here.peak_tflops == pytest.approx(2 * 134.5e6 * 64 / (66.9e-3) / 1e12, rel=1e-6)
    # in between the model is off: t(4) and t(16) both modelled at 30.0 ms (streaming-bound), 33 and 41 measured
    error = curve_error(curve, here, SMOL)
    assert 0.05 < error < 0.2
    rows = projection([(13, 2, 1.0)], SMOL, here, curve, measured=1.1)
    assert rows[0] == {"device": "this machine", "speedup": 1.1, "modelled_speedup": rows[0]["modelled_speedup"],
                       "model_error": round(error, 3), "modelled": False}
    assert [r["device"] for r in rows[1:]] == list(DEVICES)


def test_the_a100_profile_against_the_papers_vicuna_7b():
    # Vicuna-7B on an A100: launches 32 x 14 x 8 us = 3.584 ms, weights 13.48 GB / 2,039 GB/s = 6.611 ms, 81 tokens of
    # arithmetic 3.50 ms: memory-bound, so the model gives the full 2.70 tokens per pass; the paper measured 2.03x
    check = paper_check()
    assert PAPER["tokens_per_pass"] == 2.70 and PAPER["speedup"] == 2.03
    assert check == {"device": "A100", "modelled": 2.7, "measured": 2.03, "error": 0.33}


def test_a_run_summary_and_its_projection_row_agree_on_the_measured_speedup():
    # 100 tokens in 1.0 s against plain's 172.5642 tokens/s: 0.579495..., which rounds to 0.5795 and then 0.58, where
    # rounding the raw ratio to 3 places would give 0.579 (CI once saw exactly that pair on the page's figures)
    from tr_core.events import Rates, StepEvent
    from ui.records import Baseline
    from ui.summaries import run_summary

    event = StepEvent(step=1, method="tr", tree_name="small", tree_tokens=[1] * 3, tree_parents=[-1, 0, 1],
                      tree_ranks=[0] * 3, tree_text=[""] * 3, predicted=[0] * 3, accepted_path=[0], bonus_token=0,
                      new_tokens=[0, 0], new_text="")
    profile = {"parameters": 134.5e6, "layers": 30, "curve": {1: 10.0, 16: 30.0}, "bandwidth_gbs": 30.0,
               "bytes_per_weight": 2}
    summary = run_summary("tr", "small", [event], Rates(tokens=100, steps=50, seconds=1.0),
                          Baseline(172.5642, 5.8, "measured beside the run"), "", profile)
    assert summary["speedup"] == 0.5795
    here = summary["projection"][0]
    assert here["device"] == "this machine" and here["speedup"] == round(summary["speedup"], 3) == 0.58
