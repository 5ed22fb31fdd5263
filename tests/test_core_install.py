"""The light core install: with every optional dependency unimportable (as after `pip install
nlq` without extras), the model, prepare on local text, train and sample work, and what
needs an extra says which one in one line."""

import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import ROOT, env, tiny_config, write_config

from nlq.extras import EXTRAS

# The path finder is told that extras do not exist (find_spec None, import
# ModuleNotFoundError), exactly as where they are not installed.
BLOCKER = textwrap.dedent(f"""
    import importlib.machinery as m
    BLOCKED = {sorted(set(EXTRAS) | {"pandas", "pyarrow"})!r}
    _find = m.PathFinder.find_spec
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in BLOCKED else _find(name, path, target)
    m.PathFinder.find_spec = classmethod(find_spec)
""")


def core(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`nlq ARGS` in a process where no extra can be imported."""
    (tmp_path / "block_extras.py").write_text(BLOCKER)
    code = "import block_extras, sys; from nlq.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False, env=env(PYTHONPATH=str(tmp_path)))


def test_core_install_trains_and_samples_without_extras(tmp_path):
    text = tmp_path / "corpus"
    text.mkdir()
    for i in range(40):  # 40 small documents: enough for train, val and test splits
        (text / f"d{i}.txt").write_text(" ".join(f"word{(i * j) % 53}" for j in range(300)))
    data, run = tmp_path / "data", tmp_path / "run"
    p = core(tmp_path, "prepare", "--source", str(text), "--tokenizer", "bpe:300", "--out",
             str(data), "--workers", "1")
    assert p.returncode == 0, p.stderr
    cfg = write_config(tmp_path / "c.toml", tiny_config(data))
    p = core(tmp_path, "train", str(cfg), "--out", str(run), "--no-progress")
    assert p.returncode == 0, p.stderr
    assert (run / "summary.json").is_file() and not (run / "tb").exists()
    p = core(tmp_path, "sample", str(run), "--prompt", "word1", "--max-new-tokens", "4")
    assert p.returncode == 0, p.stderr
    p = core(tmp_path, "eval", str(run))
    assert p.returncode == 0, p.stderr
    p = core(tmp_path, "report", str(run), "--out", str(tmp_path / "report"))
    assert p.returncode == 2 and "nlq[report]" in p.stderr and "Traceback" not in p.stderr


def test_core_install_names_the_extra_that_is_missing(tmp_path):
    p = core(tmp_path, "prepare", "--source", "embedded:shakespeare", "--out",
             str(tmp_path / "d"))
    assert p.returncode == 2 and "nlq[data]" in p.stderr and "Traceback" not in p.stderr


def test_query_module_imports_no_extra():
    code = ("import sys, nlq.model.query as q, torch; "
            "print(q.NonlinearQuery(d_model=8)(torch.zeros(1, 2, 8)).shape); "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(EXTRAS)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[:2] == ["torch.Size([1, 2, 8])", "[]"]

