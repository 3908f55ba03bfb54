"""The docs hold facts: measured numbers rendered from benchmarks/results, links that resolve, a short README.

tools/render_docs.py renders every measured table of README.md and docs/performance.md from one result
file; these tests fail when a table and its file disagree, when a number with a unit appears in those
two documents outside a rendered block (a hand-copied measurement), when a relative link or its anchor
does not resolve, and when the README outgrows a user's first read.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# a measurement: a number followed by a unit of time, a ratio or a rate
MEASUREMENT = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s*(?:ms|µs|us|×|x|tok/s|GB/s)(?![\w/])")
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "tools" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


render_docs = _load_renderer()


def _documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_rendered_tables_match_the_result_files():
    assert render_docs.check(ROOT) == [], "run: python tools/render_docs.py"


def test_every_result_file_is_rendered_and_every_table_has_its_file():
    rendered = {table.source for table in render_docs.TABLES.values()}
    rendered |= {line.source for line in render_docs.HEADLINE}
    on_disk = {path.name for path in (ROOT / "benchmarks" / "results").glob("*.json")}
    assert on_disk - rendered == set(), "result files no document shows: render them or delete them"
    assert rendered - on_disk == set(), "tables whose result file is missing"
    for document in render_docs.DOCUMENTS:
        names = {m.group("name") for m in render_docs.BLOCK.finditer((ROOT / document).read_text(encoding="utf-8"))}
        assert names - set(render_docs.TABLES) - {"headline"} == set(), document
    shown = set()
    for document in render_docs.DOCUMENTS:
        shown |= {m.group("name") for m in render_docs.BLOCK.finditer((ROOT / document).read_text(encoding="utf-8"))}
    assert set(render_docs.TABLES) - shown == set(), "tables defined in tools/render_docs.py that no document shows"


def test_every_result_file_records_command_commit_cpu_flags_and_torch():
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        _, source = render_docs.load(path.name, ROOT)
        for field in ("command", "commit", "cpu_flags", "torch"):
            assert getattr(source, field), f"{path.name}: no {field}"
        assert source.command != "unknown" and source.torch != "unknown", path.name
        assert re.fullmatch(r"[0-9a-f]{12}", source.commit), f"{path.name}: commit {source.commit!r}"


def test_a_changed_result_fails_the_check_until_rendered(tmp_path):
    """Edit a number in a copy of the repository's docs and results: the check names the stale table,
    and rendering makes it pass again with the new number in the document."""
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(ROOT / "docs" / "performance.md", tmp_path / "docs" / "performance.md")
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    assert render_docs.check(tmp_path) == []

    result = tmp_path / "benchmarks" / "results" / "native_dispatch_avx2_only.json"
    data = json.loads(result.read_text())
    row = next(r for r in data["decode"] if r["dtype"] == "bfloat16" and r["B"] == 1 and r["ctx"] == 4096
               and r.get("vllm_backend") == "CPU_MLA")
    row["speed_vs_vllm"] = 9.876
    result.write_text(json.dumps(data))
    stale = render_docs.check(tmp_path)
    assert "docs/performance.md: native-decode-avx2" in stale
    assert "README.md: headline" in stale  # the headline row comes from the same file

    assert render_docs.render(tmp_path) == stale
    assert render_docs.check(tmp_path) == []
    assert "**9.88×**" in (tmp_path / "docs" / "performance.md").read_text()
    assert "**9.88×**" in (tmp_path / "README.md").read_text()


def test_unknown_block_is_refused(tmp_path):
    text = "<!-- BEGIN rendered: no-such-table -->\n<!-- END rendered: no-such-table -->\n"
    with pytest.raises(KeyError, match="unknown rendered block 'no-such-table'"):
        render_docs.render_document(text, pathlib.Path("docs/performance.md"), ROOT)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


@pytest.mark.parametrize("name", ["README.md", "docs/performance.md"])
def test_no_measurement_outside_rendered_blocks(name):
    text = (ROOT / name).read_text(encoding="utf-8")
    spans = render_docs.rendered_spans(text)
    found = [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in MEASUREMENT.finditer(text)
             if not any(start <= m.start() < end for start, end in spans)]
    assert found == [], f"{name}: numbers with units outside rendered blocks (line, text): {found}"


def test_the_measurement_pattern_catches_what_it_should():
    for measured in ("2.67×", "1.3x", "0.94 ms", "12 µs", "9 us", "22.8 tok/s", "18 GB/s"):
        assert MEASUREMENT.search(f"took {measured} here"), measured
    for not_measured in ("4096x1", "top-2048", "torch 2.13", "1152 bytes", "B=8", "16 heads", "v2lite"):
        assert not MEASUREMENT.search(not_measured), not_measured


def _slug(title: str) -> str:
    """GitHub's heading anchor: lower case, markup and punctuation dropped, spaces to hyphens."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
    title = re.sub(r"[^\w\- ]", "", title.lower().replace("`", ""))
    return title.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m.group("title")) for m in HEADING.finditer(text)}


@pytest.mark.parametrize("document", _documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(document):
    text = FENCE.sub("", document.read_text(encoding="utf-8"))
    broken = []
    for match in LINK.finditer(text):
        target = match.group("target")
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (document.parent / path_part).resolve() if path_part else document
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(target)
    assert broken == [], f"{document.name}: links that do not resolve: {broken}"


def test_bench_meta_records_the_commit_and_cpu_flags():
    from mla_ops.bench.timing import cpu_flags
    from mla_ops.cli.bench import run_metadata

    meta = run_metadata("2.13.0", 1, "mla-ops bench ops")
    assert meta["cpu_flags"] == cpu_flags()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        assert meta["commit"] is None
    else:
        assert meta["commit"] is not None and meta["commit"].removesuffix("-dirty") == head.stdout.strip()
