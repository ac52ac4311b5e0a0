"""The direction of imports: tr_core knows torch and transformers only; nothing imports the app."""

import subprocess
import sys

from conftest import ROOT


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return {name.split(".")[0] for name in out.stdout.split()}


def test_tr_core_does_not_import_ui_or_plotting():
    modules = imported_after("import tr_core, tr_core.engine, tr_core.spec_bench")
    assert not modules & {"gradio", "plotly", "networkx", "visualize", "app"}
