"""The documentation against what it documents: the benchmark tables of the README and docs/benchmarks.md are
the ones bench/tables.py renders from bench/results (and a figure changed in a results file, or by hand in a
table, is caught), every results file says where its figures came from, and every relative link resolves."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import tables
from bench.provenance import host_kind

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_committed_tables_are_the_ones_the_results_render() -> None:
    done = subprocess.run([sys.executable, "bench/tables.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The README, docs/benchmarks.md and bench/results, copied where a test may change them."""
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(ROOT / "docs" / "benchmarks.md", tmp_path / "docs" / "benchmarks.md")
    shutil.copytree(RESULTS, tmp_path / "results")
    return tmp_path


def test_a_figure_changed_in_its_results_file_makes_both_documents_stale(copy: Path) -> None:
    assert tables.stale(copy, copy / "results") == []
    path = copy / "results" / "peers-avx512.json"
    record = json.loads(path.read_text())
    record["series"]["llmserve"][0]["output_tok_s"] *= 2
    path.write_text(json.dumps(record))
    assert tables.stale(copy, copy / "results") == ["README.md", "docs/benchmarks.md"]


def test_a_figure_edited_by_hand_in_a_table_is_stale(copy: Path) -> None:
    readme = (copy / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| peers |"))
    edited = row.replace("**", "", 1)
    assert edited != row
    (copy / "README.md").write_text(readme.replace(row, edited))
    assert tables.stale(copy, copy / "results") == ["README.md"]


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda path: path.name)
def test_each_results_file_is_one_benchmark_on_one_host_kind_and_says_where_it_came_from(path: Path) -> None:
    record = json.loads(path.read_text())
    assert path.stem == f"{record['benchmark']}-{record['host_kind']}"
    provenance = record["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}", provenance["commit"]), provenance["commit"]
    assert re.match(r"\d{4}-\d{2}-\d{2}T", provenance["at"]), provenance["at"]
    assert re.match(r"([A-Z_]+=\S+ )*python[\d.]* bench/\w+\.py", provenance["command"]), provenance["command"]
    if record["host_kind"] == "unknown":
        assert provenance["isa"] == [] and "backfilled" in provenance
    else:
        assert host_kind(provenance) == record["host_kind"]
    assert record["benchmark"] in tables.RENDERERS, "bench/tables.py has no table for it"


def test_each_plot_belongs_to_a_results_file() -> None:
    for plot in RESULTS.glob("*.png"):
        assert plot.with_suffix(".json").exists(), plot.name


def anchors(document: Path) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", document.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_relative_link_and_its_anchor_resolve(document: Path) -> None:
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", document.read_text()):
        if "://" in target:
            continue
        linked = (document.parent / target).resolve() if target else document
        assert linked.exists(), f"{document.name} links to {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{document.name} links to {target}#{anchor}"
