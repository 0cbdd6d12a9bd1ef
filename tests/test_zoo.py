"""The embedded zoo: corpus manifest and split, tokenizer, shipped models, greedy identity with every zoo drafter."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch
import yaml
from transformers import GenerationMixin

import hf_specdec
from hf_specdec import zoo
from hf_specdec.zoo import corpus
from hf_specdec.zoo.tasks import TASKS, build_prompts, editing_documents, load_prompts


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake_stdlib(tmp_path):
    root = tmp_path / "lib"
    for name in ["textwrap", "json", "abc", "queue", "operator", "heapq", "bisect", "shlex", "glob", "fnmatch"]:
        write(root / f"{name}.py", f"def {name}_function(x):\n    return x\n")
    write(root / "email" / "__init__.py", "from .parser import Parser\n")
    write(root / "email" / "parser.py", "class Parser:\n    pass\n")
    write(root / "test" / "test_json.py", "import json\n")
    write(root / "unittest" / "test_case.py", "import unittest\n")
    write(root / "site-packages" / "numpy" / "__init__.py", "x = 1\n")
    write(root / "empty.py", "\n")
    write(root / "huge.py", "x = 1\n" * 50_000)
    return root


def test_manifest_excludes_and_keeps_packages_together(fake_stdlib):
    files = corpus.build_manifest(fake_stdlib, test_fraction=0.5)
    paths = [f.path for f in files]
    assert paths == sorted(paths)
    assert "email/parser.py" in paths and "textwrap.py" in paths
    for excluded in (
        "test/test_json.py",
        "unittest/test_case.py",
        "site-packages/numpy/__init__.py",
        "empty.py",
        "huge.py",
    ):
        assert excluded not in paths
    email = {f.split for f in files if f.module == "email"}
    assert len(email) == 1
    assert {f.split for f in files} == {"train", "test"}
    assert all(f.sha256 == hashlib.sha256((fake_stdlib / f.path).read_bytes()).hexdigest() for f in files)


def test_split_is_deterministic_and_depends_only_on_the_module(fake_stdlib, tmp_path):
    first = corpus.build_manifest(fake_stdlib)
    write(fake_stdlib / "zzz_new.py", "y = 2\n")  # a new file does not move the others
    second = {f.path: f.split for f in corpus.build_manifest(fake_stdlib)}
    assert all(second[f.path] == f.split for f in first)
    assert corpus.module_split("json") == corpus.module_split("json")
    expected = "test" if int(hashlib.sha256(b"json").hexdigest()[:8], 16) < 0.1 * 16**8 else "train"
    assert corpus.module_split("json", 0.1) == expected


def test_manifest_round_trip_and_tamper_check(fake_stdlib, tmp_path):
    files = corpus.build_manifest(fake_stdlib, test_fraction=0.5)
    manifest = corpus.write_manifest(files, tmp_path / "manifest.json", root=fake_stdlib, test_fraction=0.5)
    loaded = corpus.load_manifest(tmp_path / "manifest.json")
    assert loaded == json.loads(json.dumps(manifest))
    assert loaded["num_files"]["train"] + loaded["num_files"]["test"] == len(files)
    train = corpus.read_split(loaded, "train")
    assert len(train) == loaded["num_files"]["train"]
    (fake_stdlib / files[0].path).write_text("changed = True\n")
    with pytest.raises(ValueError, match="differs from the manifest"):
        corpus.read_split(loaded, files[0].split)
    with pytest.raises(ValueError, match="`split` must be 'train' or 'test'"):
        corpus.read_split(loaded, "valid")
    with pytest.raises(ValueError, match="`root` must be a directory"):
        corpus.build_manifest(tmp_path / "nowhere")


def test_shipped_manifest_matches_this_interpreter():
    manifest = corpus.load_manifest(zoo.ZOO_DIR / "manifest.json")
    assert manifest["num_files"]["train"] > 5 * manifest["num_files"]["test"] / 2 > 0
    modules = {}
    for entry in manifest["files"]:
        modules.setdefault(entry["module"], set()).add(entry["split"])
        assert entry["split"] == corpus.module_split(entry["module"], manifest["test_fraction"])
    assert all(len(splits) == 1 for splits in modules.values())
    if manifest["python_version"] != sys.version.split()[0]:
        pytest.skip(f"the manifest was built with Python {manifest['python_version']}")
    again = corpus.build_manifest(test_fraction=manifest["test_fraction"])
    assert [f.__dict__ for f in again] == manifest["files"]


def test_tokenizer_round_trip():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(zoo.ZOO_DIR / "tokenizer")
    assert len(tokenizer) == 8192
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>" and tokenizer.pad_token == "<|pad|>"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    for text in ["def f(x):\n    return x ** 2  # é, 日本\n", "\t\tif a != b:\r\n", "x = '\\x00'"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    line = "    def __init__(self, name, value=None):\n"
    common = tokenizer(line, add_special_tokens=False)["input_ids"]
    assert len(common) < len(line) / 2  # the merges learned Python


def test_prompts_are_held_out_and_rebuildable():
    prompts = load_prompts()
    manifest = corpus.load_manifest(zoo.ZOO_DIR / "manifest.json")
    held_out = {entry["path"] for entry in manifest["files"] if entry["split"] == "test"}
    assert sorted(prompts) == sorted(TASKS)
    for task in TASKS:
        assert len(prompts[task]) == 16
        assert all(item["id"].rsplit(":", 1)[0] in held_out for item in prompts[task])
    source = (
        'class A:\n    def method(self, x):\n        """Doc."""\n' + "        x = x + 1\n" * 40 + "        return x\n"
    )
    built = build_prompts([("a.py", source)], per_task=4)
    assert built == build_prompts([("a.py", source)], per_task=4)
    # prompts end before their last newline, which the tokenizer would merge with the next line's indentation
    assert built["completion"][0]["prompt"].endswith('"""Doc."""')
    assert built["completion"][0]["reference"].startswith("\n        x = x + 1\n")
    assert built["editing"][0]["prompt"].endswith("def method_v2(self, x):")
    assert built["editing"][0]["reference"].startswith('\n        """Doc."""')
    assert not any(item["prompt"].endswith("\n") for items in built.values() for item in items)
    documents = editing_documents([("a.py", source)])
    assert documents == [built["editing"][0]["prompt"] + built["editing"][0]["reference"]]
    assert documents[0].count("def method(") == 1 and documents[0].count("def method_v2(") == 1


@pytest.fixture(scope="module")
def default_models():
    target, drafter, tokenizer = zoo.load_default()
    return hf_specdec.enable(target), drafter, tokenizer


def test_embedded_models_load_and_are_small(default_models):
    target, drafter, tokenizer = default_models
    assert target.config.model_type == drafter.config.model_type == "llama"
    assert target.config.vocab_size == drafter.config.vocab_size == len(tokenizer)
    assert drafter.config.num_hidden_layers < target.config.num_hidden_layers
    assert 4e6 < sum(p.numel() for p in target.parameters()) < 7e6
    total = sum(path.stat().st_size for path in zoo.ZOO_DIR.rglob("*") if path.is_file())
    assert total < 30 * 2**20
    for name in ("target", "drafter", "ngram"):
        card = (zoo.ZOO_DIR / name / "README.md").read_text()
        metadata = yaml.safe_load(card.split("---")[1])
        assert metadata["library_name"] in ("transformers", "hf_specdec")
        if name != "target":
            assert metadata["base_model"] == "hf-specdec/stdlib-llama-5m"


@pytest.mark.parametrize("drafter_name", ["distilled", "ngram", "prompt_lookup"])
def test_speculative_greedy_equals_plain_with_each_zoo_drafter(default_models, drafter_name):
    target, drafter, tokenizer = default_models
    kwargs = {
        "distilled": dict(assistant_model=drafter),
        "ngram": dict(drafter=zoo.load_ngram()),
        "prompt_lookup": dict(drafter="prompt_lookup"),
    }[drafter_name]
    prompt = load_prompts()["editing"][1]["prompt"]  # every drafter is partly right on it
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    common = dict(max_new_tokens=40, do_sample=False, attention_mask=torch.ones_like(ids))
    plain = GenerationMixin.generate(target, ids, **common)
    out = target.generate(ids, speculative_gamma=4, return_dict_in_generate=True, **kwargs, **common)
    assert torch.equal(out.sequences, plain)
    assert 0 < out.speculative_stats.accepted_tokens < out.speculative_stats.drafted_tokens


def test_prompt_offsets_count_lines_as_the_parser_does():
    """Form feeds (common in the standard library's sources) and other separators `str.splitlines` breaks at are not
    line breaks for Python's parser: every function's offset must still land on its `def`."""
    import ast

    from hf_specdec.zoo.tasks import _line_offsets

    source = "x = 1\x0c\n\x0c\ndef f():\n    return '\u2028'\n\x0c\ndef g():\n    return 2\n"
    offsets = _line_offsets(source)
    functions = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)]
    assert [source[offsets[node.lineno - 1] :].split("(")[0] for node in functions] == ["def f", "def g"]


def test_the_manifest_never_writes_through_a_link(tmp_path):
    from hf_specdec.zoo.corpus import load_manifest, write_manifest

    outside = tmp_path / "outside.json"
    outside.write_text("keep me")
    path = tmp_path / "manifest.json"
    path.symlink_to(outside)
    write_manifest([], path)
    assert outside.read_text() == "keep me" and not path.is_symlink()
    assert load_manifest(path)["files"] == []
