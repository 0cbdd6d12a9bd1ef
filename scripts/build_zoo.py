"""Builds the embedded zoo (`hf_specdec/zoo_models/`) from the running interpreter's standard library.

Steps, each deterministic (fixed seeds, sorted inputs) and resumable; run them in order or `all`:

    python scripts/build_zoo.py corpus      # manifest.json: stdlib files, sha256, train/test split by module
    python scripts/build_zoo.py prompts     # heldout_prompts.json: 16 held-out prompts per benchmark task
    python scripts/build_zoo.py tokenizer   # byte-level BPE (8192 tokens) on the train split
    python scripts/build_zoo.py target      # ~5.6M-parameter Llama trained on the train split (1 CPU thread)
    python scripts/build_zoo.py target-long --steps 300 --batch-size 8 --threads 2 --bf16
    python scripts/build_zoo.py target-long --steps 500 --batch-size 8 --threads 2 --bf16 --editing-fraction 0.75 \
        --lr 1.5e-3 --init target_long_fp32 --save-as target_copy_fp32
                                            # then 1024-token windows, some of them copy-heavy editing documents
    python scripts/build_zoo.py drafter     # 1-layer Llama distilled from the target (hf_specdec.distill)
    python scripts/build_zoo.py ngram       # NGramDrafter (n=3) on the train split
    python scripts/build_zoo.py cards       # model cards with the measured numbers (benchmarks/results/zoo_*.json)

Intermediate files (token ids, fp32 checkpoints, logs) go to `build/zoo/` (git-ignored); the shipped files are
float16 safetensors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from hf_specdec.zoo import corpus as zoo_corpus  # noqa: E402

ZOO = REPO / "hf_specdec" / "zoo_models"
WORK = REPO / "build" / "zoo"
MANIFEST = ZOO / "manifest.json"
SEED = 0
TARGET_ID = "hf-specdec/stdlib-llama-5m"  # the name the cards use (base_model of the drafters)
SEQ_LEN = 256
TARGET_CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def step_corpus(args) -> None:
    files = zoo_corpus.build_manifest()
    ZOO.mkdir(parents=True, exist_ok=True)
    manifest = zoo_corpus.write_manifest(files, MANIFEST)
    log(f"manifest: {manifest['num_files']} files, {manifest['num_bytes']} bytes -> {MANIFEST}")


def step_tokenizer(args) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = zoo_corpus.read_split(zoo_corpus.load_manifest(MANIFEST), "train")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    start = time.perf_counter()
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(ZOO / "tokenizer")
    log(f"tokenizer: {len(fast)} tokens in {time.perf_counter() - start:.1f} s -> {ZOO / 'tokenizer'}")


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ZOO / "tokenizer")


def token_ids(split: str) -> torch.Tensor:
    """All files of a split, tokenized, each followed by eos, concatenated (cached in build/zoo)."""
    cache = WORK / f"{split}_ids.pt"
    if cache.exists():
        return torch.load(cache)
    tokenizer = load_tokenizer()
    texts = zoo_corpus.read_split(zoo_corpus.load_manifest(MANIFEST), split)
    ids = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    ids = torch.tensor(ids, dtype=torch.int16 if len(tokenizer) < 2**15 else torch.int32)
    WORK.mkdir(parents=True, exist_ok=True)
    torch.save(ids, cache)
    log(f"{split}: {ids.numel()} tokens")
    return ids


def blocks(ids: torch.Tensor, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """Non-overlapping `[num_blocks, seq_len]` windows (the tail that does not fill one is dropped)."""
    num = ids.numel() // seq_len
    return ids[: num * seq_len].view(num, seq_len).long()


@torch.no_grad()
def heldout_loss(model, test_blocks: torch.Tensor, batch_size: int = 32, max_blocks: int | None = None) -> float:
    model.eval()
    test_blocks = test_blocks[:max_blocks] if max_blocks else test_blocks
    total, count = 0.0, 0
    for start in range(0, len(test_blocks), batch_size):
        batch = test_blocks[start : start + batch_size]
        logits = model(batch).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total, count = total + loss.item(), count + batch[:, 1:].numel()
    model.train()
    return total / count


def train_step(model, batch: torch.Tensor, optimizer, schedule, *, bf16: bool) -> torch.Tensor:
    """One next-token AdamW step on `batch` (clipped at norm 1); returns the loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(batch).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def step_target(args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    tokenizer = load_tokenizer()
    train, test = blocks(token_ids("train")), blocks(token_ids("test"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TARGET_CONFIG,
    )
    model = LlamaForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"target: {num_params / 1e6:.2f}M parameters; train {len(train)} x {SEQ_LEN}, test {len(test)} x {SEQ_LEN}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 50)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps))))
        ),
    )
    generator = torch.Generator().manual_seed(SEED)
    order = torch.randperm(len(train), generator=generator)
    position, start, history = 0, time.perf_counter(), []
    model.train()
    for step in range(args.steps):
        if position + args.batch_size > len(order):
            order, position = torch.randperm(len(train), generator=generator), 0
        batch = train[order[position : position + args.batch_size]]
        position += args.batch_size
        loss = train_step(model, batch, optimizer, schedule, bf16=args.bf16)
        if step % 50 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - start
            log(
                f"step {step}/{args.steps} loss {loss.item():.3f} lr {schedule.get_last_lr()[0]:.2e} "
                f"{elapsed / 60:.1f} min ({(step + 1) * args.batch_size * SEQ_LEN / elapsed:.0f} tok/s)"
            )
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            history.append({"step": step + 1, "heldout_loss": heldout_loss(model, test, max_blocks=128)})
            log(f"held-out loss (128 blocks) {history[-1]['heldout_loss']:.3f}")
            model.save_pretrained(WORK / "target_fp32")
    train_minutes = (time.perf_counter() - start) / 60
    model.save_pretrained(WORK / "target_fp32")
    loss = heldout_loss(model, test)
    record = {
        "parameters": num_params,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": SEQ_LEN,
        "lr": args.lr,
        "train_tokens_seen": args.steps * args.batch_size * SEQ_LEN,
        "train_tokens": int(train.numel()),
        "test_tokens": int(test.numel()),
        "heldout_loss": loss,
        "heldout_perplexity": math.exp(loss),
        "train_minutes": train_minutes,
        "threads": args.threads,
        "bf16_autocast": args.bf16,
        "seed": SEED,
        "history": history,
    }
    model.to(torch.float16).save_pretrained(ZOO / "target")
    tokenizer.save_pretrained(ZOO / "target")
    (WORK / "target_record.json").write_text(json.dumps(record, indent=1))
    log(f"target done: held-out loss {loss:.3f} (ppl {math.exp(loss):.1f}), {train_minutes:.1f} min")


def train_files() -> list[tuple[str, str]]:
    manifest = zoo_corpus.load_manifest(MANIFEST)
    paths = [entry["path"] for entry in manifest["files"] if entry["split"] == "train"]
    return list(zip(paths, zoo_corpus.read_split(manifest, "train")))


def editing_ids() -> torch.Tensor:
    """The train split's copy-heavy editing documents (`zoo.tasks.editing_documents`), tokenized, each followed
    by eos, concatenated (cached in build/zoo)."""
    from hf_specdec.zoo.tasks import editing_documents

    cache = WORK / "train_editing_ids.pt"
    if cache.exists():
        return torch.load(cache)
    tokenizer = load_tokenizer()
    ids = []
    for text in editing_documents(train_files()):
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    ids = torch.tensor(ids, dtype=torch.int16 if len(tokenizer) < 2**15 else torch.int32)
    torch.save(ids, cache)
    log(f"train editing documents: {ids.numel()} tokens")
    return ids


def step_target_long(args) -> None:
    """Stage 2: the stage-1 target continues on `--seq-len` windows (the held-out prompts plus 96 new tokens reach
    ~650 positions, stage 1 saw 256), `--editing-fraction` of each batch the train split's copy-heavy editing
    documents and the rest plain train-split code, so that the target learns the editing task the benchmark asks of
    it. Run twice (see the module docstring); each run appends itself to the target record's `later_stages`."""
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    tokenizer = load_tokenizer()
    model = LlamaForCausalLM.from_pretrained(WORK / args.init, dtype=torch.float32)
    plain, editing = blocks(token_ids("train"), args.seq_len), blocks(editing_ids(), args.seq_len)
    test = blocks(token_ids("test"))
    log(f"stage 2: {len(plain)} plain and {len(editing)} editing windows of {args.seq_len} tokens")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps))))
        ),
    )
    generator = torch.Generator().manual_seed(SEED + 1)
    half = round(args.batch_size * args.editing_fraction)  # editing rows per batch
    start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        rows = [
            plain[torch.randint(len(plain), (args.batch_size - half,), generator=generator)],
            editing[torch.randint(len(editing), (half,), generator=generator)],
        ]
        batch = torch.cat(rows)
        loss = train_step(model, batch, optimizer, schedule, bf16=args.bf16)
        if step % 25 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - start
            log(
                f"step {step}/{args.steps} loss {loss.item():.3f} lr {schedule.get_last_lr()[0]:.2e} "
                f"{elapsed / 60:.1f} min"
            )
    minutes = (time.perf_counter() - start) / 60
    model.save_pretrained(WORK / args.save_as)
    loss = heldout_loss(model, test)
    record = json.loads((WORK / "target_record.json").read_text())
    record.setdefault("later_stages", []).append(
        {
            "init": args.init,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "editing_fraction": half / args.batch_size,
            "plain_windows": len(plain),
            "editing_windows": len(editing),
            "editing_tokens": len(editing) * args.seq_len,
            "train_tokens_seen": args.steps * args.batch_size * args.seq_len,
            "minutes": minutes,
            "threads": args.threads,
            "bf16_autocast": args.bf16,
            "heldout_loss": loss,
        }
    )
    record["stage_1_heldout_loss"] = record.get("stage_1_heldout_loss", record["heldout_loss"])
    record["heldout_loss"], record["heldout_perplexity"] = loss, math.exp(loss)
    model.to(torch.float16).save_pretrained(ZOO / "target")
    tokenizer.save_pretrained(ZOO / "target")
    (WORK / "target_record.json").write_text(json.dumps(record, indent=1))
    log(f"stage 2 done: held-out loss {loss:.3f} (ppl {math.exp(loss):.1f}), {minutes:.1f} min")


def step_prompts(args) -> None:
    from hf_specdec.zoo import tasks

    manifest = zoo_corpus.load_manifest(MANIFEST)
    paths = [entry["path"] for entry in manifest["files"] if entry["split"] == "test"]
    prompts = tasks.build_prompts(list(zip(paths, zoo_corpus.read_split(manifest, "test"))), per_task=16)
    record = {
        "description": "held-out prompts cut from the test split of manifest.json by hf_specdec.zoo.tasks",
        "python_version": manifest["python_version"],
        "tasks": prompts,
    }
    (ZOO / "heldout_prompts.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"prompts: { {task: len(items) for task, items in prompts.items()} } -> {ZOO / 'heldout_prompts.json'}")


def drafter_config(target_config, layers: int):
    import copy

    config = copy.deepcopy(target_config)
    config.num_hidden_layers = layers
    config.layer_types = None
    return config


def step_drafter(args) -> None:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from hf_specdec.distill import distill_drafter, drafter_agreement

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    target = AutoModelForCausalLM.from_pretrained(ZOO / "target", dtype=torch.float32).eval()  # shipped weights
    test = blocks(token_ids("test"))
    # the target's own training windows: plain code and copy-heavy editing documents, at the stage-2 length
    train = torch.cat([blocks(token_ids("train"), args.seq_len), blocks(editing_ids(), args.seq_len)])
    probe = test[torch.randperm(len(test), generator=torch.Generator().manual_seed(SEED))[:64]]
    config = drafter_config(target.config, args.layers)
    torch.manual_seed(SEED)
    early_exit = AutoModelForCausalLM.from_config(config)
    state = target.state_dict()
    early_exit.load_state_dict({k: v for k, v in state.items() if k in early_exit.state_dict()}, strict=False)
    before = drafter_agreement(target, early_exit.eval(), probe)
    log(f"drafter ({args.layers} layer(s)) before distillation (early exit of the target): {before}")
    start = time.perf_counter()
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if args.bf16 else "no")
    drafter = distill_drafter(
        target,
        train,
        early_exit.train(),
        objective=args.objective,
        num_steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        seed=SEED,
        accelerator=accelerator,
        seq_len=args.seq_len,
        output_dir=WORK / f"drafter_{args.objective}_fp32",
        log_every=25,
    )
    minutes = (time.perf_counter() - start) / 60
    drafter = drafter.to(torch.float16).float()  # measure what ships
    after = drafter_agreement(target, drafter, probe)
    log(f"after {args.steps} steps ({minutes:.1f} min): {after}")
    output = Path(args.output) if args.output else ZOO / "drafter"
    drafter.to(torch.float16).save_pretrained(output)
    tokenizer.save_pretrained(output)
    record = {
        "layers": args.layers,
        "objective": args.objective,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "editing_windows": len(blocks(editing_ids(), args.seq_len)),
        "train_windows": len(train),
        "lr": args.lr,
        "minutes": minutes,
        "threads": args.threads,
        "bf16": args.bf16,
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "heldout_probe_blocks": len(probe),
        "before": before,
        "after": after,
    }
    record_name = "drafter_record.json" if not args.output else f"drafter_{args.objective}_record.json"
    (WORK / record_name).write_text(json.dumps(record, indent=1))


def prune_rare_contexts(table, sequences, min_count: int):
    """Drops the rows of orders >= 2 whose context occurs fewer than `min_count` times (keeps the file small)."""
    from hf_specdec import NGramDrafter

    tables = dict(table.tables)
    for k in range(2, table.n + 1):
        windows = torch.cat([seq.unfold(0, k - 1, 1) for seq in sequences if seq.numel() >= k - 1])
        contexts, counts = torch.unique(windows, dim=0, return_counts=True)
        frequent = {tuple(c) for c in contexts[counts >= min_count].tolist()}
        rows = tables[f"order_{k}.contexts"]
        keep = torch.tensor([tuple(c) in frequent for c in rows.tolist()], dtype=torch.bool)
        for part in ("contexts", "tokens", "probs"):
            tables[f"order_{k}.{part}"] = tables[f"order_{k}.{part}"][keep]
    return NGramDrafter(
        tables,
        n=table.n,
        vocab_size=table.vocab_size,
        top_k=table.top_k,
        tokenizer_name=table.tokenizer_name,
        target_name=table.target_name,
        corpus_description=table.corpus_description,
    )


def save_compact(table, directory: Path) -> None:
    """`save_pretrained`, then the tables again in int16 / float16 (they load back as int64 / float32)."""
    from safetensors.torch import save_file

    (directory / "README.md").unlink(missing_ok=True)  # save_pretrained keeps an existing card
    table.save_pretrained(directory)
    compact = {
        name: (tensor.to(torch.int16) if name.endswith(("contexts", "tokens")) else tensor.to(torch.float16))
        for name, tensor in table.tables.items()
    }
    save_file({name: tensor.contiguous() for name, tensor in compact.items()}, str(directory / "model.safetensors"))


def step_ngram(args) -> None:
    from hf_specdec import NGramDrafter

    tokenizer = load_tokenizer()
    texts = zoo_corpus.read_split(zoo_corpus.load_manifest(MANIFEST), "train")
    sequences = [torch.tensor(ids, dtype=torch.long) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    start = time.perf_counter()
    table = NGramDrafter.from_corpus(
        sequences,
        n=args.n,
        vocab_size=len(tokenizer),
        top_k=args.top_k,
        tokenizer_name=TARGET_ID,
        target_name=TARGET_ID,
        corpus_description=f"train split of the Python {sys.version.split()[0]} "
        f"stdlib ({len(texts)} files, manifest.json)",
    )
    rows_before = [int(table.tables[f"order_{k}.contexts"].shape[0]) for k in range(1, args.n + 1)]
    table = prune_rare_contexts(table, sequences, args.min_count)
    rows = [int(table.tables[f"order_{k}.contexts"].shape[0]) for k in range(1, args.n + 1)]
    save_compact(table, ZOO / "ngram")
    log(
        f"ngram: rows per order {rows_before} -> {rows} (min_count {args.min_count}), "
        f"{time.perf_counter() - start:.1f} s -> {ZOO / 'ngram'}"
    )


def _bench_rows(results_path: Path) -> list[dict]:
    return json.loads(results_path.read_text())["runs"] if results_path.is_file() else []


def _row(rows, task, temperature, drafter):
    found = [r for r in rows if r["task"] == task and r["temperature"] == temperature and r["drafter"] == drafter]
    return found[0] if found else None


def _fmt(value, spec=".3f", missing="not measured"):
    return format(value, spec) if value is not None else missing


def step_cards(args) -> None:
    """Model cards (YAML metadata + measured numbers) next to the shipped models, copied into model_cards/."""
    from hf_specdec import NGramDrafter

    target_record = json.loads((WORK / "target_record.json").read_text())
    drafter_record = json.loads((WORK / "drafter_record.json").read_text())
    rows = _bench_rows(REPO / "benchmarks" / "results" / args.results)
    manifest = zoo_corpus.load_manifest(MANIFEST)
    corpus_line = (
        f"the train split of the Python {manifest['python_version']} standard library "
        f"({manifest['num_files']['train']} files, {manifest['num_bytes']['train'] / 1e6:.1f} MB; "
        f"{manifest['num_files']['test']} files of held-out modules kept for evaluation; see "
        "`manifest.json`: every file's sha256 and split)"
    )

    def table(drafter):
        lines = [
            "| task | T | γ | α | speedup over plain `generate` | over transformers' assisted | Theorem 3.8 | "
            "Theorem 3.8 with measured c, v | the same, per round |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for task in ("completion", "editing", "continuation"):
            for temperature in (0.0, 1.0):
                row = _row(rows, task, temperature, drafter)
                if row:
                    over = _fmt(row.get("speedup_over_transformers"), ".2f", "n/a")
                    lines.append(
                        f"| {task} | {temperature:g} | {row['gamma']} | {row['alpha']:.3f} | "
                        f"{row['speedup_over_plain']:.2f}x | {over}{'x' if over != 'n/a' else ''} | "
                        f"{row['theorem_3_8']:.2f}x | {row['theorem_3_8_with_measured_v']:.2f}x | "
                        f"{_fmt(row.get('theorem_3_8_per_round_with_v'), '.2f', 'n/a')}x |"
                    )
        return "\n".join(lines) if len(lines) > 2 else "Not measured yet (run `benchmarks/bench_zoo.py`)."

    results_path = REPO / "benchmarks" / "results" / args.results
    settings = (
        json.loads(results_path.read_text()) if results_path.is_file() else {"prompts": "?", "max_new_tokens": "?"}
    )
    bench_note = (
        f"measured with `benchmarks/bench_zoo.py` on {settings['prompts']} held-out prompts per task, "
        f"{settings['max_new_tokens']} new tokens, batch 1, one CPU thread of a shared 2-core machine, "
        "float32; speedups are wall-clock ratios, +-10% from run to run. The last two columns price a verify "
        "round at its measured cost v instead of one plain step; the last applies the theorem round by "
        "round to the γ actually drafted."
    )
    later_stages = "".join(
        f"| then | {stage['steps']} steps x {stage['batch_size']} x {stage['seq_len']} tokens "
        f"({stage['train_tokens_seen'] / 1e6:.1f}M tokens), {stage['editing_fraction']:.0%} of the windows copy-heavy "
        f"editing documents from the train split (a function, then the same function renamed: the `editing` task's "
        f"format, never its held-out prompts), lr {stage['lr']} cosine, {stage['minutes']:.0f} min on "
        f"{stage['threads']} CPU threads; held-out loss after it {stage['heldout_loss']:.3f} |\n"
        for stage in target_record.get("later_stages", [])
    )
    target_card = f"""---
library_name: transformers
license: apache-2.0
language:
- code
pipeline_tag: text-generation
tags:
- llama
- python
- code
- hf_specdec
- speculative-decoding
datasets:
- python-stdlib-{manifest["python_version"]}
---

# stdlib-llama-5m

A {target_record["parameters"] / 1e6:.1f}M-parameter Llama code model trained from scratch on {corpus_line}. It is the
embedded default target of `hf_specdec` (`hf_specdec.zoo.load_default()`, `hf-specdec demo`): small enough to ship
inside the package, trained enough that its drafters have something to predict.

| | |
|---|---|
| architecture | `LlamaForCausalLM`, {TARGET_CONFIG["num_hidden_layers"]} layers, hidden {TARGET_CONFIG["hidden_size"]}, MLP {TARGET_CONFIG["intermediate_size"]}, {TARGET_CONFIG["num_attention_heads"]} heads / {TARGET_CONFIG["num_key_value_heads"]} KV heads, tied embeddings |
| tokenizer | byte-level BPE, 8192 tokens, trained on the same train split (`<|endoftext|>` bos/eos, `<|pad|>`) |
| training | {target_record["steps"]} AdamW steps x {target_record["batch_size"]} x {target_record["seq_len"]} tokens ({target_record["train_tokens_seen"] / 1e6:.1f}M tokens, {target_record["train_tokens_seen"] / target_record["train_tokens"]:.1f} epochs), lr {target_record["lr"]} cosine, bf16 autocast, seed {target_record["seed"]}, {target_record["train_minutes"]:.0f} min on {target_record["threads"]} CPU thread{"s" if target_record["threads"] > 1 else ""} |
{later_stages}| held-out loss | **{target_record["heldout_loss"]:.3f}** nats/token (perplexity {target_record["heldout_perplexity"]:.1f}) on {target_record["test_tokens"] / 1e6:.2f}M tokens of held-out modules |
| weights | float16 safetensors |

## Usage

```python
import hf_specdec
from hf_specdec.zoo import load_default

target, drafter, tokenizer = load_default()
target = hf_specdec.enable(target)
ids = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
out = target.generate(ids, assistant_model=drafter, speculative_gamma=4, max_new_tokens=64, do_sample=False)
print(tokenizer.decode(out[0]))
```

Reproduce: `python scripts/build_zoo.py corpus`, then each step in `scripts/build_zoo.py`'s docstring, in order. Limitations: a 5M model
writes plausible-looking but often wrong Python; it is a benchmark and demo model, not a coding assistant.
"""
    after = drafter_record["after"]
    drafter_card = f"""---
library_name: transformers
license: apache-2.0
base_model: {TARGET_ID}
language:
- code
pipeline_tag: text-generation
tags:
- llama
- hf_specdec
- speculative-decoding
- draft-model
- distillation
---

# stdlib-llama-5m-drafter-{drafter_record["layers"]}l

A {drafter_record["layers"]}-layer draft model for [{TARGET_ID}]: the target's embeddings, first layer and final
norm (an early exit), then distilled from the target's soft labels with `hf_specdec.distill.distill_drafter`
(objective `{drafter_record["objective"]}`, {drafter_record["steps"]} steps x {drafter_record["batch_size"]} x
{drafter_record["seq_len"]} tokens of {corpus_line}; {drafter_record["minutes"]:.0f} min on {drafter_record["threads"]}
CPU thread{"s" if drafter_record["threads"] > 1 else ""}). {drafter_record["parameters"] / 1e6:.2f}M parameters, float16 safetensors, same tokenizer.

Agreement with the target on {drafter_record["heldout_probe_blocks"]} held-out windows of 256 tokens (teacher forcing):

| | before distillation (early exit) | after |
|---|---|---|
| top-1 agreement (≈ α at T=0) | {drafter_record["before"]["top1"]:.3f} | **{after["top1"]:.3f}** |
| 1 - TV (= E[β] at T=1) | {1 - drafter_record["before"]["tv"]:.3f} | **{1 - after["tv"]:.3f}** |
| KL(p ‖ q) | {drafter_record["before"]["kl"]:.3f} | {after["kl"]:.3f} |

Speculative decoding with `hf_specdec` (α measured during decoding; {bench_note})

{table("distilled")}

## Usage

```python
import hf_specdec
from hf_specdec.zoo import load_default

target, drafter, tokenizer = load_default()
out = hf_specdec.enable(target).generate(input_ids, assistant_model=drafter, speculative_gamma=4)
```
"""
    (ZOO / "target" / "README.md").write_text(target_card)
    (ZOO / "drafter" / "README.md").write_text(drafter_card)
    table_ngram = NGramDrafter.from_pretrained(ZOO / "ngram")
    completion = _row(rows, "completion", 0.0, "trigram")
    table_ngram.alpha = round(completion["alpha"], 3) if completion else None
    save_compact(table_ngram, ZOO / "ngram")
    with (ZOO / "ngram" / "README.md").open("a") as card:
        card.write(
            f"\n## Measured\n\nα above: greedy completion of held-out code. All tasks ({bench_note})\n\n"
            f"{table('trigram')}\n"
        )
    cards = REPO / "model_cards"
    for name, card_name in (
        ("target", "stdlib-llama-5m.md"),
        ("drafter", "stdlib-llama-5m-drafter.md"),
        ("ngram", "stdlib-llama-5m-ngram3.md"),
    ):
        (cards / card_name).write_text((ZOO / name / "README.md").read_text())
    log("cards written")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    steps.add_parser("corpus").set_defaults(func=step_corpus)
    steps.add_parser("prompts").set_defaults(func=step_prompts)
    tok = steps.add_parser("tokenizer")
    tok.add_argument("--vocab-size", type=int, default=8192)
    tok.set_defaults(func=step_tokenizer)
    target = steps.add_parser("target")
    target.add_argument("--steps", type=int, default=3000)
    target.add_argument("--batch-size", type=int, default=16)
    target.add_argument("--lr", type=float, default=2e-3)
    target.add_argument("--eval-every", type=int, default=500)
    target.add_argument("--threads", type=int, default=1)
    target.add_argument("--bf16", action="store_true", help="bf16 autocast (faster on CPUs with avx512_bf16)")
    target.set_defaults(func=step_target)
    long = steps.add_parser("target-long")
    long.add_argument("--steps", type=int, default=300)
    long.add_argument("--batch-size", type=int, default=4)
    long.add_argument("--seq-len", type=int, default=1024)
    long.add_argument("--lr", type=float, default=1e-3)
    long.add_argument("--threads", type=int, default=1)
    long.add_argument("--editing-fraction", type=float, default=0.5, help="share of editing windows per batch")
    long.add_argument("--init", default="target_fp32", help="checkpoint in build/zoo to continue from")
    long.add_argument("--save-as", default="target_long_fp32", help="fp32 checkpoint name in build/zoo")
    long.add_argument("--bf16", action="store_true", help="bf16 autocast (faster on CPUs with avx512_bf16)")
    long.set_defaults(func=step_target_long)
    drafter = steps.add_parser("drafter")
    drafter.add_argument("--layers", type=int, default=1)
    drafter.add_argument("--objective", default="kl", choices=["kl", "tv"])
    drafter.add_argument("--steps", type=int, default=600)
    drafter.add_argument("--batch-size", type=int, default=4)
    drafter.add_argument("--seq-len", type=int, default=1024)
    drafter.add_argument("--lr", type=float, default=2e-3)
    drafter.add_argument("--threads", type=int, default=1)
    drafter.add_argument("--bf16", action="store_true", help="bf16 autocast through accelerate")
    drafter.add_argument("--output", default=None, help="default: the shipped zoo_models/drafter (for comparisons)")
    drafter.set_defaults(func=step_drafter)
    ngram = steps.add_parser("ngram")
    ngram.add_argument("--n", type=int, default=3)
    ngram.add_argument("--top-k", type=int, default=4)
    ngram.add_argument("--min-count", type=int, default=2)
    ngram.set_defaults(func=step_ngram)
    cards = steps.add_parser("cards")
    cards.add_argument("--results", default="zoo_cpu_1thread.json", help="file in benchmarks/results/")
    cards.set_defaults(func=step_cards)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
