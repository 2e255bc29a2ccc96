"""The research notebooks (jupytext percent .py is the source of truth) execute on CPU, and the committed .ipynb
files are in sync with their .py sources."""

import os

import jax
import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

from helpers import REPO  # noqa: E402

NB = os.path.join(REPO, "notebooks")


@pytest.mark.parametrize("name", ["01_speculative_step", "02_kernel_numerics", "03_acceptance_and_step_time",
                                  "04_real_checkpoint", "05_where_the_time_goes"])
def test_notebook_executes(name, monkeypatch):
  monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  # the kernel is another process: give it the suite's persistent compilation cache (see conftest.py)
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir or "")
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # (as conftest.py)
  monkeypatch.delenv("GLM5_CHECKPOINT", raising=False)
  nb = jupytext.read(os.path.join(NB, name + ".py"))
  nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": NB}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors


@pytest.mark.parametrize("name", ["01_speculative_step", "02_kernel_numerics", "03_acceptance_and_step_time",
                                  "04_real_checkpoint", "05_where_the_time_goes"])
def test_ipynb_in_sync(name):
  src = jupytext.read(os.path.join(NB, name + ".py"))
  ipynb = jupytext.read(os.path.join(NB, name + ".ipynb"))
  assert [c.source for c in src.cells] == [c.source for c in ipynb.cells]
