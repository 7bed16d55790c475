"""The layer contract (pyproject.toml, import-linter): kept by the package, and broken by a
deliberate upward import or a cycle hidden inside a function."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import minifloat

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "pyproject.toml"
PACKAGE = Path(minifloat.__file__).parent

pytest.importorskip("importlinter", reason="import-linter is a test dependency (pip install -e '.[dev]')")


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    """lint-imports with the contract of pyproject.toml, on the minifloat found in `package_parent`."""
    env = dict(os.environ, PYTHONPATH=str(package_parent))
    script = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", script, "--config", str(CONFIG), "--no-cache"],
                          capture_output=True, text=True, env=env, cwd=package_parent)  # fmt: skip


def copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package with `line` appended to `module` (a path inside the package)."""
    shutil.copytree(PACKAGE, tmp_path / "minifloat", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    with open(tmp_path / "minifloat" / module, "a") as f:
        f.write("\n" + line + "\n")
    return tmp_path


def test_the_package_keeps_its_layers_and_has_no_cycles():
    out = lint(PACKAGE.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "minifloat layers KEPT" in out.stdout and "no import cycles KEPT" in out.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    """The kernels reaching up for QuantizedTensor — what they did before they returned parts."""
    out = lint(copy_with(tmp_path, "kernels/cpu.py", "from minifloat.quant.tensor import QuantizedTensor  # noqa"))
    assert out.returncode != 0
    assert "minifloat layers BROKEN" in out.stdout and "minifloat.kernels.cpu -> minifloat.quant.tensor" in out.stdout


def test_a_cycle_inside_a_function_breaks_the_contract(tmp_path):
    """An import inside a function hides a cycle from Python, not from the contract."""
    line = "def _late():\n    from minifloat.train.loop import train  # noqa"
    out = lint(copy_with(tmp_path, "train/config.py", line))
    assert out.returncode != 0
    assert "no import cycles BROKEN" in out.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [  # inference reaching into training (what infer/models.py did), and training into inference
     ("infer/quantize.py", "from minifloat.train.loop import train  # noqa", "minifloat layers BROKEN"),
     ("train/loop.py", "from minifloat.infer.quantize import quantize_model  # noqa", "minifloat layers BROKEN"),
     # the models below both halves: the GPT may not know the KV cache it is handed
     ("models/gpt.py", "from minifloat.infer.generation.kvcache import KVCache  # noqa", "minifloat layers BROKEN"),
     # inference's rooms: an algorithm may not know a module or a checkpoint format
     ("infer/ptq/rtn.py", "from minifloat.infer.modules.linear import QuantizedLinear  # noqa", "infer rooms BROKEN"),
     ("infer/modules/linear.py", "from minifloat.infer.checkpoints.export import export  # noqa", "infer rooms BROKEN")],
)  # fmt: skip
def test_train_and_infer_are_siblings_and_infer_keeps_its_rooms(tmp_path, module, line, broken):
    out = lint(copy_with(tmp_path, module, line))
    assert out.returncode != 0 and broken in out.stdout, out.stdout
