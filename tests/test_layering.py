"""The layering of docs/design.md, as the import contracts in pyproject.toml write it down."""

import pathlib
import tomllib

from importlinter.cli import lint_imports

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def _contracts() -> list[dict]:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]


def test_the_import_contracts_hold(monkeypatch):
    monkeypatch.chdir(ROOT)  # import-linter reads the contracts from the working directory
    assert lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True) == 0


def test_every_part_of_jvllm_stands_on_a_floor_or_in_the_vocabulary():
    """A new package or top-level module must be placed in the contracts, or no contract
    would see it import upward."""
    floors, vocabulary = set(), set()
    for contract in _contracts():
        if contract["type"] == "layers":
            floors |= {name.strip() for layer in contract["layers"] for name in layer.split("|")}
        elif contract["name"].startswith("the shared vocabulary"):
            vocabulary |= {m.removeprefix("jvllm.") for m in contract["source_modules"]}
    package = ROOT / "jvllm"
    parts = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    parts |= {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    assert parts - floors - vocabulary == set()
