"""Benchmark results keep their raw data: every file RESULTS.md or the README cites exists,
every result file has record.py's format and is cited, and the writer never overwrites a file
nor records a dirty tree unless told (benchmarks/record.py)."""

import argparse
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
spec = importlib.util.spec_from_file_location("record", ROOT / "benchmarks" / "record.py")
record = importlib.util.module_from_spec(spec)
spec.loader.exec_module(record)

CITED = re.compile(r"(?:benchmarks/)?results/([\w.\-]+\.json)")
NAME = re.compile(r"(?P<bench>\w+)-(?P<date>\d{4}-\d\d-\d\d)-(?P<sha>[0-9a-f]{7})(-\d+)?\.json")
FILES = sorted(RESULTS.glob("*.json"))


def cited(doc: Path) -> set[str]:
    return set(CITED.findall(doc.read_text()))


@pytest.mark.parametrize("doc", ["benchmarks/RESULTS.md", "README.md"])
def test_every_cited_result_file_exists(doc):
    missing = sorted(n for n in cited(ROOT / doc) if not (RESULTS / n).is_file())
    assert not missing, f"{doc} cites result files that do not exist: {missing}"


def test_every_result_file_is_cited():
    orphans = sorted(p.name for p in FILES if p.name not in cited(ROOT / "benchmarks/RESULTS.md"))
    assert not orphans, f"result files no section of benchmarks/RESULTS.md cites: {orphans}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_result_file_has_the_common_format(path):
    r = json.loads(path.read_text())
    assert set(record.KEYS) <= set(r), f"missing {set(record.KEYS) - set(r)}"
    assert set(r) <= {*record.KEYS, "note"}
    assert {"cpu", "cores", "torch", "cuda"} <= set(r["hardware"])
    assert r["dirty"] in (True, False, None) and isinstance(r["results"], dict)
    # a value not recorded (null) is only allowed in a converted file that says why
    unknown = [k for k in ("dirty", "command", "cpu") if {**r, **r["hardware"]}[k] is None]
    assert not unknown or "note" in r, f"{unknown} are null without a note"
    m = NAME.fullmatch(path.name)
    assert m, f"{path.name} is not <bench>-<date>-<commit>[-n].json"
    assert (m["bench"], m["date"]) == (r["bench"], r["date"][:10])
    assert r["commit"].startswith(m["sha"]) and len(r["commit"]) == 40


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_converted_file_keeps_its_recorded_metadata(path):
    r = json.loads(path.read_text())
    if "note" not in r:
        pytest.skip("written by record.py, not converted")
    old = r["results"]  # before record.py: a "meta" dict, or prepare_bench's flat keys
    meta = old.get("meta") or {"commit": old["git_commit"], "date": old["date"]}
    assert r["commit"].startswith(meta["commit"]) and r["date"] == meta["date"]
    assert r["dirty"] == meta.get("dirty")  # as recorded; None where it was not


def git(cwd, *a):
    subprocess.run(["git", *a], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@t")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("# results\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "init")
    return tmp_path


def args(folder, allow_dirty=False):
    return argparse.Namespace(results_dir=str(folder), allow_dirty=allow_dirty)


def test_writer_never_overwrites(repo):
    out = repo / "benchmarks" / "results"
    first = record.Recorder("demo", args(out), root=repo).write({"x": 1})
    before = first.read_bytes()
    second = record.Recorder("demo", args(out), root=repo).write({"x": 2})
    assert second != first and second.name == first.name.replace(".json", "-2.json")
    assert first.read_bytes() == before
    r = json.loads(second.read_text())
    assert tuple(r) == record.KEYS and r["results"] == {"x": 2} and r["dirty"] is False


def test_writer_refuses_a_dirty_tree_unless_allowed(repo):
    out = repo / "benchmarks" / "results"
    (repo / "benchmarks" / "RESULTS.md").write_text("# results, edited\n")  # a record: clean
    record.Recorder("demo", args(out), root=repo)
    (repo / "code.py").write_text("x = 2\n")  # measured code changed: dirty
    with pytest.raises(SystemExit, match="--allow-dirty"):
        record.Recorder("demo", args(out), root=repo)
    assert not any(out.iterdir())
    path = record.Recorder("demo", args(out, allow_dirty=True), root=repo).write({})
    assert json.loads(path.read_text())["dirty"] is True


def test_readme_study_table_is_the_committed_rungs_reports():
    """Every rung row of the README's study table carries the numbers of that rung's committed
    report.json (control and the three pre-registered questions, to the printed digits), and
    every finished rung of results/study has a row: the README cannot drift from the runs."""
    study = ROOT / "results" / "study"
    rows = {m[1]: m[0] for m in re.findall(r"^(\| (S\d[\w-]*|R\d) \(.*)$", (ROOT / "README.md")
                                            .read_text(), flags=re.MULTILINE)}
    finished = {p.parents[1].name for p in study.glob("*/compare/report.json")}
    assert set(rows) == finished, f"README rows {sorted(rows)} vs finished {sorted(finished)}"
    for rung, row in rows.items():
        rep = json.loads((study / rung / "compare" / "report.json").read_text())
        pairs = {(c["arm"], c["against"]): c for c in rep["preregistered"]}
        ctl = rep["positive_control"]
        pairs[(ctl["arm"], ctl["against"])] = ctl
        cells = [c.strip() for c in row.strip("|").split("|")]
        want = [("linear+12.5%", "linear"), ("nonlinear", "linear"),
                ("nonlinear", "linear-qnorm"), ("nonlinear-qknorm", "linear-qknorm")]
        for cell, key in zip(cells[1:5], want, strict=True):
            c = pairs[key]
            lo, hi = c["ci95"]
            assert cell.startswith(f"{c['mean_pct']:+.2f}% [{lo:+.2f}, {hi:+.2f}]"), (rung, key)
            if "p_holm" in c:
                assert f"Holm p {c['p_holm']:.2g}" in cell, (rung, key)
        assert ("**fails**" in cells[1]) == (not rep["verdicts_allowed"]), rung
