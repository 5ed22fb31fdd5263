"""Package-wide rules: the model is single-device, nothing is unpickled or executed."""

import re
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "nlq"


def test_model_package_never_imports_torch_distributed():
    imports = re.compile(r"^\s*(import|from)\s+torch\.distributed", re.MULTILINE)
    for path in (PKG / "model").rglob("*.py"):
        assert not imports.search(path.read_text()), path
    # and importing the model does not pull it in as a side effect of nlq's own modules
    code = ("import sys; import nlq.model; "
            "print(any(m.split('.')[:2] in (['nlq', 'train'], ['nlq', 'run']) "
            "for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_pickle_eval_or_exec_in_package():
    bad = re.compile(r"pickle\.loads?\(|torch\.load\((?!.*weights_only=True)|(?<![.\w])eval\("
                     r"|(?<![.\w])exec\(")
    hits = [f"{p}:{i}" for p in PKG.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert hits == []


def test_cli_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "nlq", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for cmd in ("config", "params", "prepare", "train", "reproduce", "report"):
        assert cmd in out
