"""Beyond one device and one process (issue 21): targets and drafters dispatched or offloaded by accelerate
(`device_map` over "cpu" and "disk", `cpu_offload`), data-parallel generation over a dataset (`generate_dataset`,
`hf-specdec generate --dataset` under a 2-process `accelerate launch`, resume after a killed run, bad input), and
tensor-parallel targets (`tp_plan="auto"` under `torchrun` with gloo on CPU)."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ScriptedDrafter, noisy_copy, prompt, tiny_model
from transformers import AutoModelForCausalLM, GenerationMixin

import hf_specdec
from hf_specdec import zoo
from hf_specdec.cli import main
from hf_specdec.dataset_generation import generate_dataset, read_jsonl
from hf_specdec.devices import execution_device

TESTS = Path(__file__).parent
NEW = 16
# module name -> device: embeddings and head on "disk" make `model.device` `meta`, the case accelerate users hit
MIXED_MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


def _env():
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny llama target and a partly-right drafter (a noisy copy), saved with safetensors."""
    folder = tmp_path_factory.mktemp("scale_out")
    target = tiny_model("llama", seed=0)
    target.save_pretrained(folder / "target")
    noisy_copy(target, 0.3).save_pretrained(folder / "drafter")
    return folder, target


def _dispatched(path, device_map, offload_folder):
    model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, offload_folder=offload_folder).eval()
    model.generation_config.eos_token_id = None  # as `tiny_model`: no early stop hides a difference
    return model


# ----- dispatched and offloaded models ---------------------------------------------------------------------------


def test_dispatched_and_offloaded_targets_are_exact_with_any_drafter(saved, tmp_path):
    folder, reference = saved
    ids = prompt(8)
    plain = GenerationMixin.generate(reference, ids, max_new_tokens=NEW, do_sample=False)  # [1, 8 + NEW]
    target = hf_specdec.enable(_dispatched(folder / "target", MIXED_MAP, tmp_path / "target"))
    assert target.device.type == "meta" and execution_device(target) == torch.device("cpu")
    offloaded_drafter = _dispatched(folder / "drafter", {"": "disk"}, tmp_path / "drafter")
    assert offloaded_drafter.device.type == "meta"  # what made ModelDrafter fail: "Cannot copy out of meta tensor"
    drafters = {
        "always right": dict(drafter=ScriptedDrafter(plain)),
        "never right": dict(drafter=ScriptedDrafter(plain, period=1)),
        "noisy copy": dict(assistant_model=AutoModelForCausalLM.from_pretrained(folder / "drafter")),
        "disk-offloaded noisy copy": dict(assistant_model=offloaded_drafter),
        "prompt lookup": dict(drafter="prompt_lookup"),
    }
    for name, kwargs in drafters.items():
        out = target.generate(
            ids, max_new_tokens=NEW, do_sample=False, speculative_gamma=4, return_dict_in_generate=True, **kwargs
        )
        assert torch.equal(out.sequences, plain), name
    noisy = target.generate(
        ids,
        max_new_tokens=NEW,
        do_sample=False,
        speculative_gamma=4,
        return_dict_in_generate=True,
        assistant_model=offloaded_drafter,
    )
    assert 0 < noisy.speculative_stats.accepted_tokens < noisy.speculative_stats.drafted_tokens  # partly right


def test_an_offloaded_target_samples_exactly_what_the_whole_model_samples(saved, tmp_path):
    """Offloading moves weights, never numbers: with the same seed, the speculative sampler draws the same tokens
    from the dispatched target as from the model in memory (whose sampling exactness test_sampling_distribution
    proves)."""
    folder, reference = saved
    whole = hf_specdec.enable(copy.deepcopy(reference))
    target = hf_specdec.enable(_dispatched(folder / "target", MIXED_MAP, tmp_path / "target"))
    drafter = _dispatched(folder / "drafter", {"": "disk"}, tmp_path / "drafter")
    ids = prompt(8, seed=3)
    kwargs = dict(
        max_new_tokens=NEW, do_sample=True, temperature=1.5, speculative_gamma=3, speculative_gamma_policy="constant"
    )  # rounds that do not depend on measured timings
    torch.manual_seed(7)
    want = whole.generate(ids, assistant_model=AutoModelForCausalLM.from_pretrained(folder / "drafter"), **kwargs)
    torch.manual_seed(7)
    got = target.generate(ids, assistant_model=drafter, **kwargs)
    assert torch.equal(got, want)
    torch.manual_seed(8)
    assert not torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), want)  # the seed matters


def test_cpu_offload_and_left_padded_batches_through_dispatched_targets(saved, tmp_path):
    from accelerate import cpu_offload

    folder, reference = saved
    ids = torch.cat([prompt(8, seed=1), prompt(8, seed=2)])  # [2, 8]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 is left-padded
    plain = GenerationMixin.generate(reference, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    cpu = torch.device("cpu")
    offloaded = hf_specdec.enable(cpu_offload(copy.deepcopy(reference), execution_device=cpu))
    assert offloaded.device.type == "meta"
    drafter = cpu_offload(AutoModelForCausalLM.from_pretrained(folder / "drafter"), execution_device=cpu)
    dispatched = hf_specdec.enable(_dispatched(folder / "target", MIXED_MAP, tmp_path / "target"))
    for target in (offloaded, dispatched):
        out = target.generate(
            ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=NEW, do_sample=False, speculative_gamma=3
        )
        assert torch.equal(out, plain)


def test_execution_device_of_plain_and_dispatched_models(saved, tmp_path):
    folder, reference = saved
    assert execution_device(reference) == torch.device("cpu")
    assert execution_device(_dispatched(folder / "drafter", {"": "disk"}, tmp_path / "d")) == torch.device("cpu")
    meta = copy.deepcopy(reference).to("meta")  # no hook and no weights anywhere: a CPU default, never meta
    assert execution_device(meta) == torch.device("cpu")


def test_token_trees_on_a_dispatched_target(saved, tmp_path):
    folder, reference = saved
    ids = prompt(8)
    plain = GenerationMixin.generate(reference, ids, max_new_tokens=NEW, do_sample=False)
    target = hf_specdec.enable(_dispatched(folder / "target", MIXED_MAP, tmp_path / "target"))
    out = target.generate(
        ids,
        drafter="prompt_lookup",
        max_new_tokens=NEW,
        do_sample=False,
        speculative_gamma=3,
        speculative_tree_budget=6,
    )
    assert torch.equal(out, plain)


def test_an_eagle_head_on_a_dispatched_target(tmp_path):
    from test_eagle import eagle_target

    reference = eagle_target("llama")
    reference.save_pretrained(tmp_path / "target")
    ids = prompt(9, seed=4)
    plain = GenerationMixin.generate(reference, ids, max_new_tokens=NEW, do_sample=False)
    target = hf_specdec.enable(_dispatched(tmp_path / "target", {"": "disk"}, tmp_path / "offload"))
    head = hf_specdec.EagleDrafter.from_target(target, seed=3)
    out = target.generate(ids, drafter=head, max_new_tokens=NEW, do_sample=False, speculative_gamma=3)
    assert torch.equal(out, plain)


# ----- generation over a dataset ---------------------------------------------------------------------------------

CODE_PROMPTS = [
    "def add(a, b):",
    "import os\n",
    "class Stack:\n    def __init__(self):",
    "x = 1",
    "while True:",
    "for i in range(10):\n    print(i)\n",
    "# compute the mean\ndef mean(values):",
    "return",
]


@pytest.fixture(scope="module")
def zoo_models():
    target, drafter, tokenizer = zoo.load_default()
    return target, drafter, tokenizer


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _plain_completion(target, tokenizer, text, max_new_tokens):
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = GenerationMixin.generate(target, ids, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    ends = [i for i, token in enumerate(new) if token in eos]
    return tokenizer.decode(new[: ends[0] + 1] if ends else new, skip_special_tokens=True)


def test_generate_dataset_matches_plain_generate_row_by_row_in_input_order(zoo_models, tmp_path):
    import datasets

    target, drafter, tokenizer = zoo_models
    rows = [{"id": f"r{i}", "prompt": text} for i, text in enumerate(CODE_PROMPTS)]
    rows[2]["generation_kwargs"] = {"max_new_tokens": 5}  # per-row options: its own batch
    out = tmp_path / "out.jsonl"
    written = generate_dataset(
        target,
        tokenizer,
        _write_jsonl(tmp_path / "rows.jsonl", rows),
        out,
        assistant_model=drafter,
        speculative_gamma=3,
        max_new_tokens=12,
        batch_size=3,
        show_progress=False,
    )
    assert written == len(rows)
    records = read_jsonl(out)
    assert [record["index"] for record in records] == list(range(len(rows)))
    for row, record in zip(rows, records):
        assert record["id"] == row["id"] and record["prompt"] == row["prompt"]
        limit = 5 if "generation_kwargs" in row else 12
        assert record["completion"] == _plain_completion(target, tokenizer, row["prompt"], limit), row
        assert record["num_new_tokens"] <= limit
        assert record["speculative_stats"]["target_calls"] >= 1
        # the row's own statistics, not its batch's: it emitted exactly its own tokens
        assert record["speculative_stats"]["emitted_tokens"] == record["num_new_tokens"], record
    assert records[2]["batch_size"] == 1 and records[2]["num_new_tokens"] == 5
    assert sorted(record["batch_size"] for record in records) == [1, 1] + [3] * 6  # row 2, and 7 rows: 3 + 3 + 1
    # a `datasets` dataset, with the text in another field
    table = datasets.Dataset.from_list([{"text": text} for text in CODE_PROMPTS[:3]])
    generate_dataset(
        target,
        tokenizer,
        table,
        tmp_path / "table.jsonl",
        text_field="text",
        completion_field="code",
        drafter="prompt_lookup",
        max_new_tokens=12,
        batch_size=2,
        show_progress=False,
    )
    want = [
        records[0]["completion"],
        records[1]["completion"],
        _plain_completion(target, tokenizer, CODE_PROMPTS[2], 12),
    ]
    assert [record["code"] for record in read_jsonl(tmp_path / "table.jsonl")] == want


def test_bad_dataset_rows_and_outputs_are_refused_before_anything_is_written(zoo_models, tmp_path):
    target, _, tokenizer = zoo_models
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a"}\n\n{"text": "b"}\n', encoding="utf-8")
    with pytest.raises(
        ValueError,
        match=r"row 1 \(line 3 of .*rows.jsonl'\) has no 'prompt' field.*\['text'\].*"
        r"text_field",
    ):
        generate_dataset(target, tokenizer, data, tmp_path / "out.jsonl", drafter="prompt_lookup")
    data.write_text('{"prompt": "a"}\n{"prompt": "b",\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2 of .*rows.jsonl' is not valid JSON"):
        generate_dataset(target, tokenizer, data, tmp_path / "out.jsonl", drafter="prompt_lookup")
    data.write_text('{"prompt": "a", "generation_kwargs": 3}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="'generation_kwargs' must be a dict"):
        generate_dataset(target, tokenizer, data, tmp_path / "out.jsonl", drafter="prompt_lookup")
    assert not (tmp_path / "out.jsonl").exists()
    existing = tmp_path / "existing.jsonl"
    existing.write_text("keep me\n", encoding="utf-8")
    _write_jsonl(data, [{"prompt": "a"}])
    with pytest.raises(ValueError, match=r"exists; pass `resume=True` \(--resume\)"):
        generate_dataset(target, tokenizer, data, existing, drafter="prompt_lookup")
    with pytest.raises(ValueError, match="cannot resume: line 1 .* is not a row this function wrote"):
        existing.write_text("keep me\n{}\n", encoding="utf-8")
        generate_dataset(target, tokenizer, data, existing, drafter="prompt_lookup", resume=True)
    assert existing.read_text() == "keep me\n{}\n"  # nothing already written is lost
    with pytest.raises(ValueError, match="`batch_size` must be a positive int, got 0"):
        generate_dataset(target, tokenizer, data, tmp_path / "out.jsonl", batch_size=0)
    with pytest.raises(ValueError, match="one completion per row, got num_return_sequences=2"):
        generate_dataset(target, tokenizer, data, tmp_path / "out.jsonl", do_sample=True, num_return_sequences=2)
    assert not (tmp_path / "out.jsonl").exists()
    with pytest.raises(TypeError, match="row 0 of `dataset` is a str"):
        generate_dataset(target, tokenizer, ["a prompt"], tmp_path / "out.jsonl")


def test_cli_dataset_errors_are_one_line(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": \n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    cases = [
        (["--dataset", str(data), "--output", str(out)], "line 2 of"),
        (["--dataset", str(data)], "--dataset needs --output FILE"),
        (["--output", str(out)], "--output goes with --dataset FILE"),
        (["--dataset", str(tmp_path / "missing.jsonl"), "--output", str(out)], "neither a JSONL file"),
        (["--tp-plan", "auto"], "torchrun --nproc-per-node N"),
        (["--offload-folder", str(tmp_path)], "--offload-folder needs --device-map"),
    ]
    partial = tmp_path / "partial.jsonl"
    partial.write_text("partial\n", encoding="utf-8")
    cases.append((["--dataset", str(data), "--output", str(partial)], "exists; pass --resume"))
    out2 = tmp_path / "fresh.jsonl"
    no_text = _write_jsonl(tmp_path / "no_text.jsonl", [{"text": "a"}])
    cases.append((["--dataset", str(no_text), "--output", str(out2)], "row 0 (line 1 of"))
    for argv, message in cases:
        capsys.readouterr()
        assert main(["generate", "--drafter", "prompt_lookup", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("hf-specdec: error: ") and err.count("\n") == 1 and message in err, (argv, err)
    assert partial.read_text() == "partial\n" and not out.exists() and not out2.exists()


def _cli(*argv):
    return subprocess.run(
        [sys.executable, "-m", "hf_specdec.cli", "generate", *argv],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )


def _without_timings(records):
    for record in records:
        for key in ("draft_time_s", "verify_time_s"):
            record["speculative_stats"].pop(key)
    return records


@pytest.fixture(scope="module")
def code_dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dataset")
    return _write_jsonl(folder / "prompts.jsonl", [{"id": i, "prompt": text} for i, text in enumerate(CODE_PROMPTS)])


GENERATE = (
    "--drafter",
    "model",
    "--batch-size",
    "3",
    "--max-new-tokens",
    "12",
    "--gamma",
    "3",
    "--threads",
    "1",
    "--gamma-policy",
    "constant",
)  # rounds (and so statistics) that do not depend on measured timings


def test_two_process_accelerate_launch_writes_what_one_process_writes(code_dataset, tmp_path):
    assert main(["generate", "--dataset", str(code_dataset), "--output", str(tmp_path / "one.jsonl"), *GENERATE]) == 0
    # accelerate 1.15: `--cpu --num_processes 2` starts one process; `--multi_gpu` with ACCELERATE_USE_CPU starts two
    # (torchrun and gloo underneath)
    launcher = (
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        str(_free_port()),
    )
    two = subprocess.run(
        [
            *launcher,
            "-m",
            "hf_specdec.cli",
            "generate",
            "--dataset",
            str(code_dataset),
            "--output",
            str(tmp_path / "two.jsonl"),
            *GENERATE,
        ],
        capture_output=True,
        text=True,
        env=dict(_env(), ACCELERATE_USE_CPU="true"),
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stderr.count("row(s) generated") == 1  # one summary, from the main process
    records = read_jsonl(tmp_path / "two.jsonl")
    assert [record["index"] for record in records] == list(range(len(CODE_PROMPTS)))
    assert _without_timings(records) == _without_timings(read_jsonl(tmp_path / "one.jsonl"))


def test_resume_after_a_killed_run_loses_and_repeats_no_row(tmp_path):
    rows = [{"id": i, "prompt": text} for i, text in enumerate(CODE_PROMPTS * 2)]
    data = _write_jsonl(tmp_path / "prompts.jsonl", rows)
    argv = (
        "--drafter",
        "prompt_lookup",
        "--batch-size",
        "1",
        "--max-new-tokens",
        "20",
        "--threads",
        "1",
        "--gamma-policy",
        "constant",
    )
    assert main(["generate", "--dataset", str(data), "--output", str(tmp_path / "full.jsonl"), *argv]) == 0
    output = tmp_path / "killed.jsonl"
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_specdec.cli", "generate", "--dataset", str(data), "--output", str(output), *argv],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if output.exists() and output.read_text().count("\n") >= 3:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    lines = output.read_text().count("\n")
    assert 3 <= lines < len(rows), "the run ended before it could be killed"
    with output.open("a") as file:
        file.write('{"index": 99, "prompt": "cut sh')  # a line cut short by the interruption
    resumed = _cli("--dataset", str(data), "--output", str(output), "--resume", *argv)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{len(rows) - lines} row(s) generated" in resumed.stderr
    got = _without_timings(read_jsonl(output))
    assert [record["index"] for record in got] == list(range(len(rows)))
    assert got == _without_timings(read_jsonl(tmp_path / "full.jsonl"))


# ----- tensor parallel -------------------------------------------------------------------------------------------

TENSOR_PARALLEL = """
import json, os, sys, torch
from transformers import AutoModelForCausalLM, DistributedConfig, GenerationMixin
import hf_specdec
from hf_specdec.cli import main
folder = sys.argv[1]
rank = int(os.environ["RANK"])
model = AutoModelForCausalLM.from_pretrained(folder + "/target", distributed_config=DistributedConfig(tp_plan="auto"))
model.generation_config.eos_token_id = None
sharded = type(model.model.layers[0].self_attn.q_proj.weight).__name__
ids = torch.tensor([[5, 9, 3, 7, 11, 2, 8, 4]])
plain = GenerationMixin.generate(model, ids, max_new_tokens=16, do_sample=False)
target = hf_specdec.enable(model)
drafter = AutoModelForCausalLM.from_pretrained(folder + "/drafter")  # replicated: whole in every process
# every process decides from the same seconds (the slowest one's), here made to differ on purpose
agreed = hf_specdec.devices.seconds_agreement(model)(0.25 * (rank + 1), 1.0 - rank)
same = [torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False, speculative_gamma=3, **kwargs), plain)
        for kwargs in (dict(assistant_model=drafter), dict(drafter="prompt_lookup"))]
status = main(["generate", "--target", folder + "/target", "--tp-plan", "auto", "--drafter", "model",
               folder + "/drafter", "--dataset", folder + "/rows.jsonl", "--output", folder + "/tp.jsonl",
               "--max-new-tokens", "8", "--batch-size", "2", "--threads", "1"])
refused = main(["generate", "--target", folder + "/gpt2", "--tp-plan", "auto", "--drafter", "prompt_lookup",
                "--prompt", "a"])
# one file per process: the two processes' prints to one pipe can interleave within a line
with open(f"{folder}/result{rank}.json", "w") as out:
    json.dump({"rank": rank, "tp_size": model.tp_size, "sharded": sharded, "same": same, "plain": plain.tolist(),
               "status": status, "refused": refused, "agreed": agreed}, out)
"""


def test_tensor_parallel_target_is_exact_with_a_replicated_drafter(saved, local_tokenizer, tmp_path):
    folder = tmp_path
    target = tiny_model("llama", seed=0, vocab_size=len(local_tokenizer))
    target.save_pretrained(folder / "target")
    local_tokenizer.save_pretrained(folder / "target")
    noisy_copy(target, 0.3).save_pretrained(folder / "drafter")
    tiny_model("gpt2").save_pretrained(folder / "gpt2")  # transformers has no tensor-parallel plan for GPT-2
    local_tokenizer.save_pretrained(folder / "gpt2")
    texts = ["the cat sat on the mat", "def add(a, b):", "a quick brown fox"]
    _write_jsonl(folder / "rows.jsonl", [{"prompt": text} for text in texts])
    script = folder / "tensor_parallel.py"
    script.write_text(TENSOR_PARALLEL)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(folder),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    results = [json.loads(path.read_text()) for path in sorted(folder.glob("result*.json"))]
    # a process that aborts (a collective mismatch in gloo) prints its reason first: show it with the end
    assert len(results) == 2, "\n".join(
        [line for line in result.stderr.splitlines() if "what()" in line] + [result.stderr[-3000:]]
    )
    for item in results:
        assert item["tp_size"] == 2 and item["sharded"] == "DTensor"
        assert item["agreed"] == [0.5, 1.0]
        assert item["same"] == [True, True]
        assert item["status"] == 0 and item["refused"] == 2
    assert "has no `tp_plan`" in result.stderr and "hf-specdec: error: could not load a model" in result.stderr
    whole = tiny_model("llama", seed=0, vocab_size=len(local_tokenizer))
    ids = torch.tensor([[5, 9, 3, 7, 11, 2, 8, 4]])
    assert results[0]["plain"] == GenerationMixin.generate(whole, ids, max_new_tokens=16, do_sample=False).tolist()
    records = read_jsonl(folder / "tp.jsonl")  # written once, by rank 0
    assert [record["prompt"] for record in records] == texts
    for record in records:
        assert record["completion"] == _plain_completion(whole, local_tokenizer, record["prompt"], 8)


def test_cli_reads_a_saved_datasets_folder(tmp_path, capsys):
    import datasets

    table = datasets.Dataset.from_list([{"code": text} for text in CODE_PROMPTS[:3]])
    table.save_to_disk(str(tmp_path / "table"))
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(tmp_path / "splits"))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--drafter", "prompt_lookup", "--text-field", "code", "--max-new-tokens", "4", "--threads", "1"]
    assert main([*argv, "--dataset", str(tmp_path / "table"), "--output", str(out)]) == 0
    assert [record["code"] for record in read_jsonl(out)] == CODE_PROMPTS[:3]
    assert "3 row(s) generated" in capsys.readouterr().err
    assert main([*argv, "--dataset", str(tmp_path / "splits"), "--output", str(tmp_path / "splits.jsonl")]) == 2
    assert "holds the splits ['test', 'train']; pass one split's folder" in capsys.readouterr().err
