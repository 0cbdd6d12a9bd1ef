"""Generate completions for a JSONL dataset with speculative decoding, in one process or data-parallel.

One process:

    python examples/generate_dataset.py prompts.jsonl completions.jsonl

Two CPU processes (accelerate 1.15: `accelerate launch --cpu --num_processes 2` starts only one; this starts two,
joined with gloo through torchrun):

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        examples/generate_dataset.py prompts.jsonl completions.jsonl

On GPUs, `accelerate launch --num_processes N examples/generate_dataset.py ...` (one model per GPU). After an
interruption, run the same command with `--resume`: rows already written are kept, and only the missing ones are
generated. Without a dataset of your own, `--demo` writes one from the embedded zoo's held-out prompts.

Each row of `prompts.jsonl` is an object with a "prompt" and, optionally, "generation_kwargs" (e.g.
{"max_new_tokens": 32}); the output rows add "completion", "num_new_tokens" and "speculative_stats".
"""

import argparse
import json

import hf_specdec
from hf_specdec import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", help='JSONL file, one {"prompt": ...} object per line')
    parser.add_argument("output", help="JSONL file to write")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run's output")
    parser.add_argument("--demo", action="store_true", help="first write `dataset` from the zoo's held-out prompts")
    args = parser.parse_args()

    # the embedded 5.6M-parameter code model and its distilled drafter; any causal LM works the same way, including
    # one loaded with `device_map="auto"` (and `offload_folder=`) or `tp_plan="auto"` under torchrun
    target, drafter, tokenizer = zoo.load_default()
    state = hf_specdec.dataset_generation.process_state()  # the launch's processes, with gloo on a CPU
    if args.demo and state.is_main_process:
        from hf_specdec.zoo.tasks import load_prompts

        with open(args.dataset, "w", encoding="utf-8") as file:
            for item in load_prompts()["completion"]:
                print(json.dumps({"id": item["id"], "prompt": item["prompt"]}), file=file)
    state.wait_for_everyone()
    target.to(state.device)
    drafter.to(state.device)
    written = hf_specdec.generate_dataset(
        target,
        tokenizer,
        args.dataset,
        args.output,
        resume=args.resume,
        batch_size=8,
        assistant_model=drafter,
        speculative_gamma=4,
        max_new_tokens=64,
        do_sample=False,
    )
    if state.is_main_process:
        print(f"{written} row(s) generated into {args.output}")


if __name__ == "__main__":
    main()
