"""The documentation generators in scripts/ (run by mkdocs-gen-files at build time), called without mkdocs."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load(name: str):
    """A script of scripts/ (not a package) as a module, without running its generation."""
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.fixture(scope="module")
def benchmarks():
    return _load("docs_benchmarks")


@pytest.fixture(scope="module")
def errors():
    return _load("docs_errors")


@pytest.fixture(scope="module")
def pages(benchmarks):
    return benchmarks.build_pages(plots=False)


def test_every_result_file_has_a_section_with_machine_and_date(benchmarks, pages):
    names = sorted(path.stem for path in (REPO / "benchmarks" / "results").glob("*.json"))
    assert names
    family_pages = {path: text for path, text in pages.items() if path.endswith(".md") and "index" not in path}
    for name in names:
        page = next((text for text in family_pages.values() if f"\n## {name}\n" in text), None)
        assert page is not None, f"no page shows {name}"
        section = page.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert re.search(r"\*\*Machine:\*\* \S", section), name
        assert re.search(r"\*\*Date:\*\* (\d{4}-\d{2}-\d{2}|not recorded)", section), name
    for text in pages.values():
        assert not re.search(r"\bstop \d+", text, re.IGNORECASE)


def test_index_has_the_headline_tables_and_links_every_page(pages):
    index = pages["benchmarks/index.md"]
    assert "relative to plain `generate`" in index
    assert "transformers assisted" in index and "ours, default" in index
    assert "ours, prompt lookup" in index
    for path in pages:
        if path.endswith(".md") and path != "benchmarks/index.md":
            assert f"]({Path(path).name})" in index, path


def test_unknown_layout_gets_a_generic_table_and_notes_lose_their_history(benchmarks, tmp_path):
    data = {"speed": 1.5, "label": "a|b", "note": "rerun after stop 33", "nested": {"x": [1, 2]}}
    (tmp_path / "mystery_bench.json").write_text(json.dumps(data))
    (tmp_path / "broken.json").write_text("{not json")
    files = benchmarks.build_pages(tmp_path, plots=False)
    page = files["benchmarks/other.md"]
    assert "| speed | 1.5 |" in page
    assert "a\\|b" in page  # a pipe in a value does not split the table row
    assert "stop 33" not in page
    assert "**Date:** not recorded" in page or "**Date:** 20" in page
    assert benchmarks.clean_text("Median of 3. Rerun in stop 33 with the new policy.") == "Median of 3."


def test_memory_bound_readers_keep_transformers_beside_ours(benchmarks):
    path = REPO / "benchmarks" / "results" / "memory_bound_cpu_bf16_tinyllama_auto_chooser.json"
    report = benchmarks.file_report(path.name, json.loads(path.read_text()), path)
    (group,) = [group for group in report.groups if group.title == "Batch 1"]
    sources = {method.source for method in group.methods}
    assert sources == {"plain", "transformers", "ours"}
    default = next(method for method in group.methods if method.name == "ours, default")
    assert default.speedup == pytest.approx(1.38, abs=0.01)
    assert default.tokens_per_call == pytest.approx(1.80, abs=0.01)
    assert report.curves["target, batch 1"][1] == 1.0
    assert "2 threads" in report.machine and "bfloat16" in report.machine


def test_plots_are_png(benchmarks):
    pytest.importorskip("matplotlib")
    group = benchmarks.Group(
        "g",
        [benchmarks.Method("plain", 1.0, 1.0), benchmarks.Method("transformers assisted", 1.3, 2.0)]
        + [benchmarks.Method("ours, default", 1.4, 1.8, 0.5)],
    )
    assert benchmarks.methods_figure(group).startswith(b"\x89PNG")
    assert benchmarks.cost_figure({"target": {1: 1.0, 6: 1.05, 11: 1.2}}).startswith(b"\x89PNG")
    assert benchmarks.cost_figure({}) is None


def test_errors_page_lists_a_known_message_with_its_place(errors):
    found = errors.collect_errors()
    known = [error for error in found if "must be a positive int" in error.message and "batch_size" in error.message]
    assert known, "the message of generate_dataset's batch_size check was not found"
    assert known[0].module == "hf_specdec.dataset_generation" and "generate_dataset" in known[0].where
    assert "{batch_size}" in known[0].message  # the f-string field as a placeholder
    keys = [(error.module, error.exception, error.message) for error in found]
    assert len(keys) == len(set(keys))
    page = errors.errors_page(found)
    assert "<code>batch&#95;size</code> must be a positive int, got {batch&#95;size}" in page


def test_errors_page_escapes_markdown(errors, tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "mod.py").write_text(
        '"""Module doc."""\n'
        "def check(x):\n"
        "    if x:\n"
        '        raise ValueError(f"`a|b` or c|d <tag> *x* got {x!r}; an odd ` tick")\n'
        '    raise TypeError(f"`x` must be `int`, got {type(x).__name__}")\n'
        "def again(x):\n"
        '    raise TypeError(f"`x` must be `int`, got {type(x).__name__}")\n'
    )
    found = errors.collect_errors(package)
    assert len(found) == 2 and found[1].where == ["check", "again"]
    page = errors.errors_page(found, package)
    rows = [line for line in page.splitlines() if line.startswith("| ") and "check" in line]
    assert rows and all(line.count("|") == 4 for line in rows)  # only the column separators
    assert "a&#124;b" in page and "&lt;tag&gt;" in page and "&#42;x&#42;" in page
    assert "<code>x</code> must be <code>int</code>, got {type(x).&#95;&#95;name&#95;&#95;}" in page
