"""Benchmark pages for the documentation site, generated from `benchmarks/results/*.json` at build time.

mkdocs-gen-files runs this file (`runpy.run_path`, module name `<run_path>`) and the pages it writes appear under
`benchmarks/`: an overview with the headline numbers (`benchmarks/index.md`) and one page per benchmark family, each
result file with its machine, date, tables and plots. Run by hand, it writes the same files into a folder:

    python scripts/docs_benchmarks.py /tmp/benchmark_pages

The work is split into pure functions that tests call without mkdocs: `load_results` (files in), `file_report`
(one file's data into method groups, tables and cost curves), `family_page` / `index_page` (markdown out),
`methods_figure` / `cost_figure` (PNG bytes out), and `build_pages` (every path and its content). A result file
whose layout none of the readers knows still gets a page section: a table of its top-level scalar fields.
"""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
OUTPUT_DIR = "benchmarks"  # where the pages go in the site

# Keys whose values are never shown: pre-rendered tables, output paths, free-form notes (which may narrate history).
HIDDEN_KEYS = {"markdown", "output", "note", "notes", "comment", "comments", "history"}
# Sentences or brackets that narrate how a number came about rather than what it is.
HISTORY_PATTERN = re.compile(r"\b(stop|issue|round|iteration)s?\s+#?\d+", re.IGNORECASE)

OURS_COLOR, TRANSFORMERS_COLOR, PLAIN_COLOR = "#1f77b4", "#ff7f0e", "#7f7f7f"


@dataclass(frozen=True)
class Family:
    """A benchmark family: one page, the result files whose names match `pattern`, and the script that writes them."""

    slug: str
    title: str
    pattern: str
    script: str | None


# Order matters: the first family whose pattern matches a file name takes the file; the last one takes the rest.
FAMILIES = (
    Family("batches", "Batches", r"^batch_|^memory_bound_.*_batches", "bench_batch.py"),
    Family("memory-bound", "Memory-bound 1.1B pair", r"^memory_bound_", "bench_memory_bound.py"),
    Family("real-model", "Real model: SmolLM2-135M", r"^real_model_", "bench_real_model.py"),
    Family("prompt-lookup", "Prompt lookup", r"^prompt_lookup_", "bench_prompt_lookup.py"),
    Family("gamma-policy", "γ policy", r"^gamma_policy_", "bench_gamma_policy.py"),
    Family("early-exit", "Early exit", r"^early_exit_", "bench_early_exit.py"),
    Family("static-compile", "Static cache and torch.compile", r"^static_compile_", "bench_static_compile.py"),
    Family("beam", "Speculative beam search", r"^beam_", "bench_beam.py"),
    Family("offload", "Offloaded target and data parallel", r"^offload_", "bench_offload.py"),
    Family("cross-tokenizer", "Cross-tokenizer drafting", r"^cross_tokenizer_", "bench_cross_tokenizer.py"),
    Family("zoo", "Zoo: code model and drafters", r"^zoo_", "bench_zoo.py"),
    Family("overhead", "Loop overhead and host reads", r"^overhead_", "bench_overhead.py"),
    Family("gpu", "GPU", r"^gpu_", "bench_gpu.py"),
    Family("native", "Drafters that ship with the model", r"^native_drafters_", "bench_native_drafters.py"),
    Family("hybrid", "Hybrid and state-space models", r"^hybrid_", "bench_hybrid.py"),
    Family("continuous-batching", "Continuous batching", r"^continuous_batching_", "bench_continuous_batching.py"),
    Family("other", "Other results", r"", None),
)


@dataclass(frozen=True)
class Method:
    """One method's numbers in a side-by-side comparison; speedups are over plain `generate` in the same run."""

    name: str
    speedup: float | None
    tokens_per_call: float | None = None
    alpha: float | None = None
    identical: str | None = None

    @property
    def source(self) -> str:
        lowered = self.name.lower()
        if "transformers" in lowered:
            return "transformers"
        if lowered.startswith("plain"):
            return "plain"
        return "ours"


@dataclass
class Group:
    """Methods measured side by side (same prompts, same process): one table and one figure."""

    title: str
    methods: list[Method]
    note: str = ""


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list]
    note: str = ""


@dataclass
class Report:
    """What one result file says, ready to render."""

    name: str
    family: Family
    date: str
    machine: str
    settings: str = ""
    groups: list[Group] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    curves: dict[str, dict[int, float]] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------- loading


def load_results(results_dir: Path = RESULTS_DIR) -> dict[str, dict]:
    """Every `*.json` in `results_dir` by file name; a file that does not parse as a JSON object is skipped."""
    results = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        results[path.name] = data if isinstance(data, dict) else {"values": data}
    return results


def family_of(name: str) -> Family:
    return next(family for family in FAMILIES if re.search(family.pattern, name))


@cache
def git_date(path: Path) -> str | None:
    """The date of the commit that last changed `path` (YYYY-MM-DD), or None outside a git checkout."""
    try:
        completed = subprocess.run(
            ["git", "log", "-1", "--format=%cs", "--", str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout.strip() or None


def run_date(data: dict, path: Path) -> str:
    """The run's date: a date field of the file where it has one, else the last commit that touched the file."""
    for source in (data, data.get("machine") or {}, data.get("environment") or {}, data.get("args") or {}):
        if not isinstance(source, dict):
            continue
        for key in ("date", "timestamp", "started", "created"):
            value = source.get(key)
            if isinstance(value, str) and re.match(r"\d{4}-\d{2}-\d{2}", value):
                return value[:10]
    committed = git_date(path)
    if committed:
        return f"{committed} (the commit that last changed the file)"
    return "not recorded"


# ----------------------------------------------------------------------------------------------------- reading


def _dicts(data: dict, *keys: str) -> list[dict]:
    found = [data]
    for key in keys:
        value = data.get(key)
        if isinstance(value, dict):
            found.append(value)
    return found


def _first(sources: Iterable[dict], *keys: str):
    for source in sources:
        for key in keys:
            value = source.get(key)
            if value not in (None, "", "None") and not isinstance(value, (dict, list)):
                return value
    return None


def machine_line(data: dict, name: str = "") -> str:
    """What the file says about where it ran: machine, device, threads, dtype, library versions."""
    sources = _dicts(data, "machine", "environment", "args", "pair")  # "machine": `harness.write_results`
    offload = data.get("offload")
    if isinstance(offload, dict) and isinstance(offload.get("pair"), dict):
        sources.append(offload["pair"])
    parts = []
    machine, processor, gpu = _first(sources, "machine"), _first(sources, "processor"), _first(sources, "gpu")
    device = _first(sources, "device")
    torch_version = _first(sources, "torch")
    if gpu:
        parts.append(f"GPU: {gpu}")
    if isinstance(device, str) and "," in device:  # "cpu, 2 threads, torch.float32": already a description
        parts.append(device.replace("cpu", "CPU", 1).replace("torch.", ""))
    else:
        on_cpu = (device or "").lower() == "cpu" or "+cpu" in str(torch_version or "") or "cpu" in name.split("_")
        if machine or processor:
            parts.append(" ".join(str(value) for value in (machine, processor) if value) + (" CPU" if on_cpu else ""))
        elif on_cpu:
            parts.append("CPU")
        elif device:
            parts.append(str(device))
        else:
            parts.append("machine not recorded in the file")
        named_threads, named_dtype = name_facts(name)
        threads, cores = _first(sources, "threads"), _first(sources, "cores")
        if threads:
            parts.append(f"{threads} thread{'s' if str(threads) != '1' else ''}")
        elif named_threads:
            parts.append(f"{named_threads} (from the file name)")
        if cores:
            parts.append(f"{cores} cores")
        dtype = _first(sources, "dtype")
        if dtype:
            parts.append(str(dtype).replace("torch.", ""))
        elif named_dtype:
            parts.append(f"{named_dtype} (from the file name)")
    hidden = _first(sources, "hidden_size")
    layers = _first(sources, "num_layers")
    if hidden:
        parts.append(f"target hidden size {hidden}" + (f", {layers} layers" if layers else ""))
    for library in ("torch", "transformers", "hf_specdec"):
        version = _first(sources, library)
        if version:
            parts.append(f"{library} {version}")
    return ", ".join(parts)


def name_facts(name: str) -> tuple[str, str]:
    """Threads and dtype as a result file's name states them (`..._cpu_bf16_..._2threads`), "" where it does not."""
    match = re.search(r"(?:^|_)(\d+)threads?(?:_|$)", name)
    threads = f"{match.group(1)} thread{'s' if match.group(1) != '1' else ''}" if match else ""
    tokens = name.split("_")
    dtypes = [
        dtype for token, dtype in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")) if token in tokens
    ]
    return threads, (dtypes[0] if dtypes else "")


SETTING_KEYS = {
    "gamma": "γ",
    "batch_gamma": "γ for batches",
    "max_gamma": "largest γ",
    "tree_budget": "tree budget",
    "prompts": "prompts",
    "batch": "rows per call",
    "repeats": "repeats",
    "prompt_length": "prompt length",
    "max_new_tokens": "new tokens",
}


def settings_line(data: dict) -> str:
    sources = _dicts(data, "args")
    parts = []
    for key, label in SETTING_KEYS.items():
        value = _first(sources, key)
        if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
            continue
        parts.append(f"{label} {value}")
    return ", ".join(parts)


def clean_text(text: str) -> str:
    """`text` without the sentences and brackets that narrate history (see `HISTORY_PATTERN`)."""
    text = re.sub(r"\s*[(\[][^()\[\]]*[)\]]", lambda m: "" if HISTORY_PATTERN.search(m.group()) else m.group(), text)
    sentences = re.split(r"(?<=[.;])\s+", text)
    return " ".join(sentence for sentence in sentences if not HISTORY_PATTERN.search(sentence)).strip()


def method_label(name: str) -> str:
    """A readable label for a method key: `ours_constant_5` -> `ours, γ = 5`, `ours_tree_8` -> `ours, tree 8`."""
    label = name
    for pattern, replacement in (
        (r"^plain$", "plain `generate`"),
        (r"^transformers_default$", "transformers assisted, its defaults"),
        (r"_constant$", ", `constant` policy"),
        (r"^hf_specdec", "ours"),
        (r"_constant_(\d+)", r", γ = \1"),
        (r"_assisted_(\d+)$", r" assisted, γ = \1"),
        (r"_tree_(\d+)", r", tree \1"),
        (r"_prompt_lookup_(\d+)$", r" prompt lookup, γ = \1"),
    ):
        label = re.sub(pattern, replacement, label)
    label = label.replace("_", " ")
    label = re.sub(r"^(ours|transformers)\s+(?!prompt|assisted|,)", r"\1, ", label)
    return label


def field_label(key: str) -> str:
    """A readable label for a field: `theorem_3_8_at_v1` -> `Theorem 3.8 at v = 1`, `alpha` -> `α`."""
    label = "_" + key + "_"
    for pattern, replacement in (
        (r"_theorem_3_8", "_Theorem 3.8"),
        (r"_alpha_", "_α_"),
        (r"_gamma_plus_1_", "(γ + 1)_"),
        (r"_gamma_", "_γ_"),
        (r"_at_v1_", "_at v = 1_"),
    ):
        label = re.sub(pattern, replacement, label)
    return label.strip("_").replace("_", " ")


def _identical(run: dict) -> str | None:
    if "identical_prompts" in run and "prompts" in run:
        return f"{run['identical_prompts']}/{run['prompts']}"
    value = run.get("identical_to_plain", run.get("identical"))
    if isinstance(value, list):
        return f"{sum(bool(item) for item in value)}/{len(value)}"
    if isinstance(value, (bool, str)):
        return str(value)
    return None


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def methods_from_runs(runs: dict) -> list[Method]:
    """Methods from a `{method: {speedup_..., tokens_per_..., stats}}` mapping (memory-bound, static compile, beam)."""
    methods = []
    for name, run in runs.items():
        if not isinstance(run, dict):
            continue
        speedup = _first([run], "speedup_ratio_of_medians", "speedup", "ratio_over_plain", "speedup_geomean")
        stats = run.get("speculative_stats") or run.get("stats") or {}
        tokens = _first(
            [run, stats], "tokens_per_target_forward", "tokens_per_target_call", "steps_per_target_call", "tokens"
        )
        methods.append(
            Method(
                method_label(name),
                _number(speedup),
                _number(tokens),
                _number(stats.get("alpha")),
                _identical(run),
            )
        )
    return methods


def methods_from_speedups(speedups: dict, identical: dict | None = None) -> list[Method]:
    """Methods from parallel `{method: speedup}` and `{method: identical}` mappings (early exit, prompt lookup)."""
    identical = identical or {}
    return [
        Method(method_label(name), _number(value), identical=_identical({"identical": identical.get(name)}))
        for name, value in speedups.items()
    ]


def _with_tokens(methods: list[Method], tokens: dict[str, float | None], alpha: dict[str, float | None]) -> list:
    return [
        Method(
            method.name,
            method.speedup,
            tokens.get(method.name, method.tokens_per_call),
            alpha.get(method.name, method.alpha),
            method.identical,
        )
        for method in methods
    ]


def _cost_curve(costs, key: str = "v_causal") -> dict[int, float]:
    """`costs[key]` (forward cost over k tokens relative to k = 1, keyed by k) as `{k: cost}`, sorted by k."""
    if not isinstance(costs, dict) or not isinstance(costs.get(key), dict):
        return {}
    curve = {}
    for tokens, value in costs[key].items():
        if str(tokens).isdigit() and _number(value) is not None:
            curve[int(tokens)] = float(value)
    return dict(sorted(curve.items()))


def _add_cost_curves(report: Report, costs, label: str) -> None:
    for key, suffix in (("v_causal", ""), ("v_tree_mask", ", tree mask")):
        curve = _cost_curve(costs, key)
        if curve and f"{label}{suffix}" not in report.curves:
            report.curves[f"{label}{suffix}"] = curve


def _scalar_rows(mapping: dict) -> list[list]:
    return [
        [key, clean_text(value) if isinstance(value, str) else value]
        for key, value in mapping.items()
        if key not in HIDDEN_KEYS and (value is None or isinstance(value, (str, int, float, bool)))
    ]


def _records_table(title: str, records: list[dict]) -> Table | None:
    """A table of a list of flat records (scalar values only), or None when the list holds no such record."""
    records = [record for record in records if isinstance(record, dict)]
    columns: list[str] = []
    for record in records:
        for key, value in record.items():
            if key not in columns and key not in HIDDEN_KEYS and not isinstance(value, (dict, list)):
                columns.append(key)
    if not columns:
        return None
    rows = [[record.get(column) for column in columns] for record in records]
    return Table(title, columns, rows)


def _read_memory_bound(data: dict, report: Report) -> bool:
    runs = data.get("batch1")
    if not isinstance(runs, dict) or not runs:
        return False
    report.groups.append(Group("Batch 1", methods_from_runs(runs)))
    theory = data.get("theory")
    if isinstance(theory, dict):
        rows = [[field_label(key), value] for key, value in _scalar_rows(theory)]
        report.tables.append(Table("Theorem 3.8 against the measurements", ["quantity", "value"], rows))
    return True


def _read_method_results(data: dict, report: Report) -> bool:
    runs = data.get("results")
    if not isinstance(runs, dict) or not runs or not all(isinstance(run, dict) for run in runs.values()):
        return False
    report.groups.append(Group("Methods", methods_from_runs(runs)))
    return True


def _read_batch_rows(data: dict, report: Report) -> bool:
    rows = data.get("results")
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) and "batch" in row for row in rows):
        return False
    columns = ["batch", "plain tok/s", "ours tok/s", "speedup", "tokens per call", "α", "verify cost v", "identical"]
    table_rows = [
        [
            row.get("batch"),
            row.get("plain_tokens_per_s"),
            row.get("speculative_tokens_per_s"),
            _speedup(_number(row.get("ratio"))),
            row.get("mean_accepted_length"),
            row.get("alpha"),
            row.get("verify_cost_ratio"),
            row.get("identical"),
        ]
        for row in rows
    ]
    report.tables.append(Table("Plain batched `generate` against ours, per batch size", columns, table_rows))
    return True


def _read_batches(data: dict, report: Report) -> bool:
    batches = data.get("batches")
    if not isinstance(batches, list) or not batches:
        return False
    columns = ["batch", "method", "tok/s", "speedup", "tokens per target call (all rows)", "α", "identical"]
    rows = []
    for batch in batches:
        if not isinstance(batch, dict) or not isinstance(batch.get("methods"), dict):
            continue
        for method in methods_from_runs(batch["methods"]):
            run = next(
                (
                    run
                    for key, run in batch["methods"].items()
                    if method_label(key) == method.name and isinstance(run, dict)
                ),
                {},
            )
            rows.append(
                [
                    batch.get("batch"),
                    method.name,
                    run.get("tokens_per_s"),
                    _speedup(method.speedup),
                    method.tokens_per_call,
                    method.alpha,
                    method.identical,
                ]
            )
        if _number(batch.get("bound")) is not None:
            rows.append([batch.get("batch"), f"Theorem 3.8 bound (γ = {batch.get('bound_gamma')})", None])
            rows[-1] += [_speedup(batch["bound"]), None, batch.get("alpha"), None]
    note = data.get("transformers_batches")
    note = f"transformers: {clean_text(note)}" if isinstance(note, str) else ""
    report.tables.append(Table("Batches of left-padded prompts", columns, rows, note))
    for batch in batches:
        if isinstance(batch, dict):
            _add_cost_curves(report, batch.get("costs"), f"batch {batch.get('batch', '?')}")
    return True


def _read_early_exit(data: dict, report: Report) -> bool:
    speedups = data.get("speedup_over_plain")
    if not isinstance(speedups, dict) or not all(_number(value) is not None for value in speedups.values()):
        return False
    methods = methods_from_speedups(speedups, data.get("identical_to_plain"))
    ours = method_label("hf_specdec")
    methods = _with_tokens(
        methods, {ours: _number(data.get("mean_tokens_per_target_call"))}, {ours: _number(data.get("alpha"))}
    )
    report.groups.append(Group("Methods", methods))
    theory = {key: value for key, value in data.items() if "theorem" in key or key.startswith(("c", "verify"))}
    rows = [[field_label(key), value] for key, value in _scalar_rows(theory)]
    report.tables.append(Table("Costs and Theorem 3.8", ["quantity", "value"], rows))
    return True


def _read_prompt_lookup(data: dict, report: Report) -> bool:
    cases = data.get("cases")
    if not isinstance(cases, list) or not cases:
        return False
    for case in cases:
        if not isinstance(case, dict) or not isinstance(case.get("speedup_over_plain"), dict):
            continue
        methods = methods_from_speedups(case["speedup_over_plain"], case.get("identical_to_plain"))
        tokens = {
            method_label("hf_specdec_prompt_lookup"): _number(case.get("mean_tokens_per_target_call")),
            method_label("hf_specdec_prompt_lookup_optimal"): _number(case.get("optimal_mean_tokens_per_target_call")),
        }
        note = ""
        if _number(case.get("acceptance_rate")) is not None:
            note = f"Acceptance rate of ours at the default setting: {case['acceptance_rate']:.2f}."
        report.groups.append(Group(f"Case: {case.get('case', '?')}", _with_tokens(methods, tokens, {}), note))
    mixed = data.get("mixed_workload")
    if isinstance(mixed, dict) and isinstance(mixed.get("speedup_over_plain"), dict):
        report.groups.append(Group("All cases together", methods_from_speedups(mixed["speedup_over_plain"])))
    return True


def _read_gamma_policy(data: dict, report: Report) -> bool:
    pairs = data.get("pairs")
    if not isinstance(pairs, dict) or not all(
        isinstance(pair, dict) and isinstance(pair.get("speedup_over_plain"), dict) for pair in pairs.values()
    ):
        return False
    for name, pair in pairs.items():
        note_parts = []
        if _number(pair.get("alpha")) is not None:
            note_parts.append(f"α = {pair['alpha']:.2f}")
        if pair.get("best_constant"):
            note_parts.append(f"best constant: {method_label('ours_' + pair['best_constant']).removeprefix('ours, ')}")
        # the policies' keys name no library: every one but plain is ours
        speedups = {
            key if key == "plain" else f"ours_{key}": value for key, value in pair["speedup_over_plain"].items()
        }
        methods = methods_from_speedups(speedups)
        report.groups.append(Group(f"{name.capitalize()} drafter", methods, "; ".join(note_parts)))
    return True


def _read_beam(data: dict, report: Report) -> bool:
    pairs = data.get("pairs")
    if not isinstance(pairs, dict) or not any(isinstance(pair, dict) and "beams" in pair for pair in pairs.values()):
        return False
    for pair_name, pair in pairs.items():
        beams = pair.get("beams") if isinstance(pair, dict) else None
        if not isinstance(beams, dict):
            continue
        for width, beam in beams.items():
            if isinstance(beam, dict) and isinstance(beam.get("methods"), dict):
                title = f"{pair_name.replace('_', ' ')} pair, {width} beams"
                report.groups.append(Group(title, methods_from_runs(beam["methods"]), "tokens per call: beam steps"))
    return True


def _read_offload(data: dict, report: Report) -> bool:
    offload, parallel = data.get("offload"), data.get("data_parallel")
    found = False
    if isinstance(offload, dict) and isinstance(offload.get("methods"), dict):
        pair = offload.get("pair") or {}
        title = f"Offloaded target ({pair['device_map']})" if pair.get("device_map") else "Offloaded target"
        report.groups.append(Group(title, methods_from_runs(offload["methods"])))
        _add_cost_curves(report, offload.get("costs"), "offloaded target")
        found = True
    if isinstance(parallel, dict) and isinstance(parallel.get("configs"), dict):
        columns = ["configuration", "generation s", "rows/s", "new tokens/s", "throughput over 1 process x 1 thread"]
        rows = [
            [
                name,
                config.get("median_generation_s"),
                config.get("rows_per_s"),
                config.get("new_tokens_per_s"),
                config.get("throughput_over_1_process_1_thread"),
            ]
            for name, config in parallel["configs"].items()
            if isinstance(config, dict)
        ]
        same = parallel.get("two_processes_equal_one_process_row_for_row")
        title = "Data-parallel generation" + (f" (2-process output equals 1-process output: {same})" if same else "")
        report.tables.append(Table(title, columns, rows))
        found = True
    return found


def _read_summary(data: dict, report: Report) -> bool:
    summary = data.get("summary")
    if not isinstance(summary, list) or not summary or not all(isinstance(row, dict) for row in summary):
        return False
    groups: dict[str, list[Method]] = {}
    for row in summary:
        title = f"{row.get('mode', '')}, {row.get('kind', '')} prompts".strip(", ")
        groups.setdefault(title, []).append(
            Method(
                str(row.get("method", "?")),
                _number(row.get("speedup_geomean")),
                _number(row.get("tokens_per_call_mean")),
                identical=_identical(row),
            )
        )
    note = data.get("speedup")
    for index, (title, methods) in enumerate(groups.items()):
        report.groups.append(Group(title, methods, clean_text(note) if isinstance(note, str) and index == 0 else ""))
    return True


def _read_runs(data: dict, report: Report) -> bool:
    """Drafters in `runs` (zoo, cross tokenizer): one group per task and temperature, transformers' beside ours."""
    runs = data.get("runs")
    if not isinstance(runs, list) or not runs or not all(isinstance(run, dict) and "drafter" in run for run in runs):
        return False
    groups: dict[str, list[Method]] = {}
    for run in runs:
        task = run.get("task")
        title = (f"{task}, " if task else "") + f"T = {run.get('temperature', '?')}"
        methods = groups.setdefault(title, [])
        drafter = str(run["drafter"]).replace("_", " ")
        methods.append(
            Method(
                f"ours, {drafter}",
                _number(run.get("speedup_over_plain")),
                _number(run.get("tokens_per_target_call")),
                _number(run.get("alpha")),
                _identical({"identical": run.get("exact_match_vs_plain")}),
            )
        )
        if _number(run.get("transformers_speedup_over_plain")) is not None:
            methods.append(
                Method(
                    f"transformers, {drafter}",
                    float(run["transformers_speedup_over_plain"]),
                    _number(run.get("transformers_tokens_per_target_call")),
                    identical=_identical({"identical": run.get("transformers_exact_match_vs_plain")}),
                )
            )
    for title, methods in groups.items():
        report.groups.append(Group(title, methods))
    exactness = data.get("first_token_exactness")
    if isinstance(exactness, dict):
        records = [{"sampler": name, **value} for name, value in exactness.items() if isinstance(value, dict)]
        table = _records_table(f"First-token exactness ({exactness.get('samples', '?')} samples)", records)
        if table:
            report.tables.append(table)
    return True


def _read_gamma_sweep(data: dict, report: Report) -> bool:
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) and "gamma" in row for row in rows):
        return False
    methods = []
    for row in rows:
        tokens, alpha = _number(row.get("tokens_per_target_call")), _number(row.get("alpha"))
        identical = _identical({"identical": row.get("identical_to_plain")})
        methods.append(
            Method(f"ours, γ = {row['gamma']}", _number(row.get("speedup_over_plain")), tokens, alpha, identical)
        )
        plain_s, transformers_s = _number(row.get("plain_s")), _number(row.get("transformers_s"))
        if plain_s and transformers_s:
            methods.append(Method(f"transformers, γ = {row['gamma']}", plain_s / transformers_s, tokens))
    report.groups.append(Group("γ sweep", methods))
    return True


def _read_real_model_rows(data: dict, report: Report) -> bool:
    _add_cost_curves(report, data.get("cost_curve"), "target")
    return False  # per-prompt rows are summarized by `_read_summary`


def _read_overhead(data: dict, report: Report) -> bool:
    """`bench_overhead.py`: the loop's own cost per round and its host reads, beside a minimal loop."""
    if data.get("benchmark") != "overhead" or not isinstance(data.get("results"), dict):
        return False
    rows = [
        [method_label(name), run.get("ms_per_round"), run.get("host_reads_per_round"), run.get("target_forwards")]
        for name, run in data["results"].items()
        if isinstance(run, dict)
    ]
    columns = ["method", "ms per target forward", "host reads per target forward", "target forwards"]
    report.tables.append(Table("Loop overhead", columns, rows))
    ratios = [["ours / minimal loop (speed)", data.get("ours_vs_minimal")]]
    report.tables.append(
        Table("Ratios", ["", "value"], ratios + [["ours / transformers", data.get("ours_vs_transformers")]])
    )
    return True


def _read_continuous_batching(data: dict, report: Report) -> bool:
    """`{"results": {task: {"B=n": {"requests": n, method: {speedup, tokens_per_call, p50_s, ...}}}}}`: one table
    per task, a row per number of slots, and figures of the fewest and the most slots."""
    results = data.get("results")
    if not isinstance(results, dict) or not all(
        isinstance(rows, dict) and all(key.startswith("B=") for key in rows) for rows in results.values()
    ):
        return False
    for task, rows in results.items():
        methods = [m for m in next(iter(rows.values())) if m != "requests"]
        columns = ["slots (B)", "requests"] + [f"{method_label(m)}: speedup, tokens/call, p50 s" for m in methods]
        table_rows = []
        for slots, row in rows.items():
            cells = [slots.removeprefix("B="), row.get("requests")]
            for m in methods:
                run = row.get(m, {})
                speedup, per_call = _number(run.get("speedup")), _number(run.get("tokens_per_call"))
                text = f"{speedup:.2f}x, {per_call:.2f}, {run.get('p50_s', float('nan')):.2f}" if speedup else "?"
                cells.append(text if run.get("identical_to_plain", True) else text + " (differs)")
            table_rows.append(cells)
        note = "Speedup: tokens per second over plain continuous batching, same requests; every output is compared."
        report.tables.append(Table(f"Task: {task}", columns, table_rows, note))
        ends = list(rows.items())
        for slots, row in ends[:1] + ends[1:][-1:]:  # the fewest and the most slots
            group = [
                Method(
                    method_label(m) if m != "plain" else "plain continuous batching",
                    _number(row[m].get("speedup")),
                    _number(row[m].get("tokens_per_call")),
                    identical="yes" if row[m].get("identical_to_plain") else "no",
                )
                for m in methods
                if isinstance(row.get(m), dict)
            ]
            report.groups.append(Group(f"{task}, {slots}", group))
    return True


READERS = (
    _read_continuous_batching,
    _read_overhead,
    _read_memory_bound,
    _read_method_results,
    _read_batch_rows,
    _read_batches,
    _read_early_exit,
    _read_prompt_lookup,
    _read_gamma_policy,
    _read_beam,
    _read_offload,
    _read_summary,
    _read_runs,
    _read_gamma_sweep,
    _read_real_model_rows,
)


def _generic_tables(data: dict) -> list[Table]:
    """The fallback for a layout no reader knows: top-level scalars, and top-level lists of flat records."""
    tables = []
    scalars = _scalar_rows(data)
    if scalars:
        tables.append(Table("Fields", ["field", "value"], scalars))
    for key, value in data.items():
        if key in HIDDEN_KEYS:
            continue
        if isinstance(value, list):
            table = _records_table(key.replace("_", " "), value)
        elif isinstance(value, dict) and value and all(not isinstance(item, (dict, list)) for item in value.values()):
            table = Table(key.replace("_", " "), ["field", "value"], _scalar_rows(value))
        else:
            table = None
        if table:
            tables.append(table)
    if not tables:
        tables.append(Table("Fields", ["field", "value"], [["(no scalar fields)", None]]))
    return tables


def file_report(name: str, data: dict, path: Path | None = None) -> Report:
    """Everything one result file shows: method groups, tables and cost curves, with its machine and date."""
    path = path or RESULTS_DIR / name
    report = Report(name, family_of(name), run_date(data, path), machine_line(data, name.removesuffix(".json")))
    report.settings = settings_line(data)
    recognized = False
    for reader in READERS:
        try:
            recognized = reader(data, report) or recognized
        except (AttributeError, KeyError, TypeError, ValueError):
            continue  # a layout a reader half knows: the generic tables below still show the file
    _add_cost_curves(report, data.get("costs"), "target, batch 1")
    if not recognized:
        report.tables.extend(_generic_tables(data))
    return report


# ----------------------------------------------------------------------------------------------------- markdown


def escape(text) -> str:
    """`text` safe inside a Markdown table cell: pipes escaped, angle brackets as entities, no line breaks."""
    text = str(text).replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"\s*\n\s*", " ", text)


def format_value(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return escape(value)


def markdown_table(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(escape(column) for column in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [format_value(cell) for cell in row] + ["–"] * (len(columns) - len(row))
        lines.append("| " + " | ".join(cells[: len(columns)]) + " |")
    return "\n".join(lines)


def _speedup(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def group_table(group: Group) -> str:
    """A group's methods: speedup over plain `generate`, over transformers' first method, tokens per call, α."""
    reference = next((m for m in group.methods if m.source == "transformers" and m.speedup), None)
    columns = ["method", "speedup over plain"]
    if reference:
        columns.append(f"vs {reference.name}")
    columns += ["tokens per target call", "α", "identical to plain"]
    lines = ["| " + " | ".join(escape(column) for column in columns) + " |", "|" + "---|" * len(columns)]
    for method in group.methods:
        cells = [escape(method.name), _speedup(method.speedup)]
        if reference:
            relative = method.speedup / reference.speedup if method.speedup is not None else None
            cells.append(_speedup(relative))
        cells += [
            "–" if method.tokens_per_call is None else f"{method.tokens_per_call:.2f}",
            "–" if method.alpha is None else f"{method.alpha:.2f}",
            format_value(method.identical),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def figure_path(report: Report, label: str) -> str:
    return f"{OUTPUT_DIR}/img/{report.name.removesuffix('.json')}-{_slug(label)}.png"


def report_markdown(report: Report, figures: set[str]) -> str:
    """One result file's section of its family page; `figures` are the image paths that exist."""
    lines = [f"## {report.name.removesuffix('.json')}", ""]
    lines.append(f"- **Machine:** {escape(report.machine)}")
    lines.append(f"- **Date:** {escape(report.date)}")
    if report.settings:
        lines.append(f"- **Settings:** {escape(report.settings)}")
    lines.append(f"- **File:** `benchmarks/results/{report.name}`")
    lines.append("")
    for group in report.groups:
        lines += [f"### {escape(group.title)}", ""]
        if group.note:
            lines += [escape(group.note), ""]
        lines += [group_table(group), ""]
        image = figure_path(report, group.title)
        if image in figures:
            lines += [f"![{escape(group.title)}: speedup and tokens per call](img/{Path(image).name})", ""]
    for table in report.tables:
        lines += [f"### {escape(table.title)}", ""]
        if table.note:
            lines += [escape(table.note), ""]
        lines += [markdown_table(table.columns, table.rows), ""]
    if report.curves:
        image = figure_path(report, "verify-cost")
        lines += ["### Verify cost", ""]
        lines += ["A target forward over k tokens, relative to a one-token forward (same cached context).", ""]
        if image in figures:
            lines += [f"![verify cost over k tokens](img/{Path(image).name})", ""]
        tokens = sorted({k for curve in report.curves.values() for k in curve})
        rows = [[label, *(curve.get(k) for k in tokens)] for label, curve in report.curves.items()]
        lines += [markdown_table(["k", *map(str, tokens)], rows), ""]
    return "\n".join(lines)


def script_summary(script: str | None) -> str:
    """The first paragraph of a benchmark script's docstring: what it measures, in the script's own words."""
    if not script:
        return ""
    import ast

    try:
        docstring = ast.get_docstring(ast.parse((REPO / "benchmarks" / script).read_text(encoding="utf-8")))
    except (OSError, SyntaxError):
        return ""
    return clean_text((docstring or "").split("\n\n")[0].replace("\n", " "))


def family_page(family: Family, reports: list[Report], figures: set[str]) -> str:
    lines = [f"# {family.title}", ""]
    summary = script_summary(family.script)
    if summary:
        lines += [summary, ""]
    if family.script:
        lines += [f"Written by `benchmarks/{family.script}`; its docstring says how to rerun it.", ""]
    lines += [
        "Speedups are over plain `generate` measured in the same process, on the same prompts; a method's "
        '"identical" column counts the outputs equal to plain greedy decoding. Newest results first.',
        "",
    ]
    for report in reports:
        lines.append(report_markdown(report, figures))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- figures


def _figure(width: float, height: float, panels: int = 1):
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry is touched

    figure = Figure(figsize=(width, height), dpi=100)
    return figure, figure.subplots(1, panels, squeeze=False)[0]


def _png(figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def methods_figure(group: Group) -> bytes | None:
    """Horizontal bars: speedup over plain per method (transformers' in orange beside ours in blue), and tokens per
    target call where known. None when no method has a speedup."""
    methods = [method for method in group.methods if method.speedup is not None]
    if not methods:
        return None
    with_tokens = any(method.tokens_per_call is not None for method in methods)
    figure, axes = _figure(10 if with_tokens else 6.5, 0.9 + 0.32 * len(methods), 2 if with_tokens else 1)
    colors = {"ours": OURS_COLOR, "transformers": TRANSFORMERS_COLOR, "plain": PLAIN_COLOR}
    positions = range(len(methods))
    bar_colors = [colors[method.source] for method in methods]
    axes[0].barh(positions, [method.speedup for method in methods], color=bar_colors)
    axes[0].axvline(1.0, color="black", linewidth=0.8)
    axes[0].set_yticks(list(positions), [method.name.replace("`", "") for method in methods], fontsize=8)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("speedup over plain generate")
    axes[0].set_title(group.title, fontsize=9)
    from matplotlib.patches import Patch

    present = dict.fromkeys(method.source for method in methods)
    axes[0].legend(
        handles=[Patch(color=colors[source], label=source) for source in present], fontsize=7, loc="lower right"
    )
    if with_tokens:
        axes[1].barh(positions, [method.tokens_per_call or 0.0 for method in methods], color=bar_colors)
        axes[1].set_yticks(list(positions), [""] * len(methods))
        axes[1].invert_yaxis()
        axes[1].set_xlabel("tokens per target call")
    return _png(figure)


def cost_figure(curves: dict[str, dict[int, float]]) -> bytes | None:
    """Lines: a forward over k tokens relative to a one-token forward. None without any curve."""
    curves = {label: curve for label, curve in curves.items() if curve}
    if not curves:
        return None
    figure, axes = _figure(6, 3.5)
    for label, curve in curves.items():
        axes[0].plot(list(curve), list(curve.values()), marker="o", label=label)
    largest = max(max(curve) for curve in curves.values())
    axes[0].plot([1, largest], [1, largest], linestyle=":", color=PLAIN_COLOR, label="proportional to k")
    axes[0].set_ylim(0, max(3.0, max(max(curve.values()) for curve in curves.values()) * 1.1))
    axes[0].set_xlabel("tokens in the forward (k)")
    axes[0].set_ylabel("cost relative to k = 1")
    axes[0].legend(fontsize=8)
    return _png(figure)


# ----------------------------------------------------------------------------------------------------- overview


def _sort_key(report: Report) -> tuple:
    return (report.date, report.name)


def headline_memory_bound(reports: list[Report]) -> tuple[Report, Group] | None:
    """The newest memory-bound batch-1 comparison, preferring a run that has our default settings."""
    candidates = [
        (report, group)
        for report in reports
        if report.family.slug == "memory-bound"
        for group in report.groups
        if group.title == "Batch 1"
    ]
    if not candidates:
        return None

    def score(candidate):
        report, group = candidate
        ours_default = any(method.source == "ours" and "default" in method.name for method in group.methods)
        return (ours_default, _sort_key(report))

    return max(candidates, key=score)


def headline_prompt_lookup(reports: list[Report]) -> tuple[Report, list[list]] | None:
    """Rows (prompts, transformers' prompt lookup, ours) of the newest real-model run, greedy."""
    real = sorted((report for report in reports if report.family.slug == "real-model"), key=_sort_key)
    for report in reversed(real):
        rows = []
        for group in report.groups:
            lookup = [method for method in group.methods if "prompt lookup" in method.name]
            transformers = next((method for method in lookup if method.source == "transformers"), None)
            ours = next((method for method in lookup if method.source == "ours"), None)
            if ours is not None:
                rows.append(
                    [group.title, _speedup(transformers.speedup if transformers else None), _speedup(ours.speedup)]
                )
        if rows:
            return report, rows
    return None


def index_page(reports: list[Report]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Every number on these pages is generated from the result files in `benchmarks/results/` when the site is "
        "built; each benchmark script in `benchmarks/` writes one such file per run.",
        "",
        "## How the numbers are measured",
        "",
        "- **Side by side, in one process.** Plain `generate`, transformers' assisted generation and hf_specdec run "
        "on the same model pair and the same prompts in one process.",
        "- **Interleaved and repeated.** The methods take turns within each repeat (the order rotates), so a slow "
        "spell on the machine hits all of them; each method's time is the median over repeats.",
        "- **Speedups are relative to plain `generate`** measured in the same run: 1.00x is no gain. Where "
        "transformers' assisted generation ran too, its row sits beside ours and a column gives ours relative "
        "to it.",
        "- **Tokens per target call** counts the tokens emitted per forward of the target model (1.00 for plain "
        "decoding); **α** is the drafter's measured acceptance rate (Leviathan et al., 2023).",
        "- **Exactness** is checked, not assumed: each table counts the outputs identical to plain greedy decoding. "
        "In bfloat16 a verify forward over several tokens can round a near-tie the other way; the result files "
        "record each divergence and its logit gap.",
        "- Each page states the machine and the date of its runs. Most were measured on a 2-core x86-64 CPU: "
        "absolute speeds are small, the ratios are what carries over.",
        "",
        "## Headline numbers",
        "",
    ]
    memory_bound = headline_memory_bound(reports)
    if memory_bound:
        report, group = memory_bound
        keep = [
            method
            for method in group.methods
            if method.source != "ours" or "default" in method.name or "tree" in method.name
        ]
        lines += [
            "**Memory-bound pair**: a 1.1B-parameter Llama (TinyLlama's shape) in bfloat16 with its 1-layer early "
            "exit as the drafter, greedy, batch 1 "
            f"([{report.name.removesuffix('.json')}](memory-bound.md); {escape(report.machine)}; "
            f"{escape(report.date)}):",
            "",
            group_table(Group(group.title, keep)),
            "",
        ]
    prompt_lookup = headline_prompt_lookup(reports)
    if prompt_lookup:
        report, rows = prompt_lookup
        lines += [
            "**Real model**: SmolLM2-135M-Instruct with prompt lookup, speedup over plain `generate` (geometric mean "
            f"over prompts; [{report.name.removesuffix('.json')}](real-model.md); {escape(report.machine)}; "
            f"{escape(report.date)}):",
            "",
            markdown_table(["prompts", "transformers' prompt lookup", "ours, prompt lookup"], rows),
            "",
        ]
    lines += ["## Pages", ""]
    counts: dict[str, int] = {}
    for report in reports:
        counts[report.family.slug] = counts.get(report.family.slug, 0) + 1
    for family in FAMILIES:
        if family.slug in counts:
            noun = "file" if counts[family.slug] == 1 else "files"
            lines.append(f"- [{family.title}]({family.slug}.md): {counts[family.slug]} result {noun}")
    lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- build


def build_pages(results_dir: Path = RESULTS_DIR, plots: bool = True) -> dict[str, str | bytes]:
    """Every generated file of the benchmark section, by its path in the site: markdown pages and PNG plots."""
    results_dir = Path(results_dir)
    reports = [file_report(name, data, results_dir / name) for name, data in load_results(results_dir).items()]
    reports.sort(key=_sort_key, reverse=True)
    files: dict[str, str | bytes] = {}
    if plots:
        for report in reports:
            for group in report.groups:
                if len(group.methods) > 1:
                    png = methods_figure(group)
                    if png:
                        files[figure_path(report, group.title)] = png
            png = cost_figure(report.curves)
            if png:
                files[figure_path(report, "verify-cost")] = png
    figures = set(files)
    for family in FAMILIES:
        members = [report for report in reports if report.family == family]
        if members:
            files[f"{OUTPUT_DIR}/{family.slug}.md"] = family_page(family, members, figures)
    files[f"{OUTPUT_DIR}/index.md"] = index_page(reports)
    return files


def write_with_gen_files(files: dict[str, str | bytes]) -> None:
    import mkdocs_gen_files

    for path, content in files.items():
        mode = "wb" if isinstance(content, bytes) else "w"
        with mkdocs_gen_files.open(path, mode) as handle:
            handle.write(content)
        if path.endswith(".md"):
            mkdocs_gen_files.set_edit_path(path, "scripts/docs_benchmarks.py")


def write_to_folder(files: dict[str, str | bytes], folder: Path) -> None:
    for path, content in files.items():
        target = Path(folder) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content, encoding="utf-8")


if __name__ == "<run_path>":  # mkdocs-gen-files: runpy.run_path(script)
    write_with_gen_files(build_pages())
elif __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", default="site_pages", type=Path, help="where the pages are written")
    write_to_folder(build_pages(), parser.parse_args().folder)
