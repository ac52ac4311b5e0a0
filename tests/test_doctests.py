"""Every ``>>>`` example in the project's modules runs with the suite, one test per module.

Modules are found from the files on disk (tr_core, visualize, ui and app.py), so a new module's examples run without
being listed here; a module without examples passes trivially.
"""

import doctest
import importlib

import pytest
from conftest import ROOT

PACKAGES = ("tr_core", "visualize", "ui")

# Modules known to carry worked examples: if their examples stopped being collected (a docstring turned into prose,
# the finder pointed at the wrong objects), every module would pass trivially and nothing would say so.
WITH_EXAMPLES = ("tr_core.assets", "tr_core.drafters", "tr_core.events", "tr_core.recycling", "tr_core.tree",
                 "ui.inputs")


def module_names() -> list[str]:
    names = ["app"]
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    return [test for test in doctest.DocTestFinder().find(module) if test.examples]


@pytest.mark.parametrize("name", module_names())
def test_doctests_pass(name):
    runner = doctest.DocTestRunner(verbose=False)
    report = []
    for test in examples(name):
        runner.run(test, out=report.append)
    assert runner.failures == 0, f"{runner.failures} doctest(s) failed in {name}:\n" + "".join(report)


def test_the_modules_with_examples_are_found():
    assert set(WITH_EXAMPLES) <= set(module_names())
    counts = {name: sum(len(test.examples) for test in examples(name)) for name in WITH_EXAMPLES}
    assert all(counts.values()), f"no examples collected from {[n for n, c in counts.items() if not c]}"
