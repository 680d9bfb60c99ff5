"""notebooks/quickstart.ipynb runs from top to bottom on the CPU (executed here, so it cannot rot)."""

from pathlib import Path

import pytest

# Test-extra packages; a GPU machine's own Python may lack them (`make test-gpu` collects this).
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs_and_shows_streaming_modes_and_plot():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits this process's environment (JAX_PLATFORMS=cpu, from conftest).
    NotebookClient(notebook, timeout=600, startup_timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "focus-tiny: 12.7M parameters" in text and ">>> Add: 257+468" in text
    assert "#### 725" in text  # the streamed answer, complete
    tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert len(tables) == 1 and all(f"| {mode} |" in tables[0]
                                    for mode in ("baseline", "delayed", "focus"))
    assert any("image/png" in o.get("data", {}) for o in outputs)
