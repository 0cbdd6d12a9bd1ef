"""Speculative decoding through the `text2text-generation` pipeline (registered by `hf_specdec.enable`).

Runs the same inputs through the pipeline without speculation, with an assistant model and with prompt lookup, and
prints whether the outputs match: greedy speculative decoding returns exactly the target's own output.

    # a tiny T5 pair built here from configs, with a tokenizer trained here (no download)
    python examples/text2text.py
    # any encoder-decoder checkpoints that share a tokenizer (paths or Hub ids)
    python examples/text2text.py --model google-t5/t5-large --assistant google-t5/t5-small \
        --task translation_en_to_de --text "How old are you?"
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedTokenizerFast, pipeline

import hf_specdec

TEXTS = [
    "translate English to German: the cat sat on the mat and the dog sat on the log",
    "summarize: the quick brown fox jumps over the lazy dog while the cat watches",
]


def train_tokenizer() -> PreTrainedTokenizerFast:
    """A small BPE tokenizer trained on a few sentences; pad, eos and unk are ids 0, 1 and 2, as in T5."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = TEXTS + [
        "speculative decoding drafts tokens with a small model and verifies them with a large one",
        "die Katze sitzt auf der Matte und der Hund sitzt auf dem Baumstamm",
    ]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "</s>", "<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_tiny_pair(tokenizer, seed: int = 0):
    """A random 3-layer T5 target and its early-exit drafter: the same encoder and embeddings, one decoder layer.

    The target's deeper decoder layers are scaled down so that the drafter agrees with it often, as a well-matched
    drafter does; its other weights are scaled up so that its greedy output varies (random-init decoders repeat one
    token).
    """
    config = AutoConfig.for_model(
        "t5",
        vocab_size=len(tokenizer),
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_heads=4,
        num_layers=3,
        num_decoder_layers=3,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    target = AutoModelForSeq2SeqLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in target.named_parameters():
            if param.dim() == 2 and name != "shared.weight":
                param.mul_(4.0)
        for block in target.decoder.block[1:]:
            for name, param in block.named_parameters():
                if name.endswith((".o.weight", ".wo.weight")):
                    param.mul_(0.1)
    drafter_config = copy.deepcopy(config)
    drafter_config.num_decoder_layers = 1
    drafter = AutoModelForSeq2SeqLM.from_config(drafter_config).eval()
    drafter.load_state_dict(target.state_dict(), strict=False)  # the deeper decoder layers are left out
    return target, drafter


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an encoder-decoder checkpoint (path or Hub id); default: a tiny T5 built here")
    parser.add_argument("--assistant", help="a smaller checkpoint with the same tokenizer (path or Hub id)")
    parser.add_argument(
        "--task",
        default="text2text-generation",
        help='"text2text-generation", "summarization", "translation" or "translation_xx_to_yy"',
    )
    parser.add_argument("--text", action="append", help="an input text (repeat for several); default: two samples")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--gamma", type=int, default=5, help="tokens drafted per round (speculative_gamma)")
    args = parser.parse_args()

    if args.model is None:
        torch.set_num_threads(1)  # tensors this small only pay the overhead of more threads
        tokenizer = train_tokenizer()
        model, assistant = build_tiny_pair(tokenizer)
        print(
            "A random tiny T5 pair: its outputs are gibberish and too small to speed up; what matters is that "
            "they match."
        )
    else:
        if args.assistant is None:
            parser.error("--model needs --assistant (a smaller checkpoint with the same tokenizer)")
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForSeq2SeqLM.from_pretrained(args.model).eval()
        assistant = args.assistant  # the pipeline loads a path or Hub id itself, once
    hf_specdec.enable(model)  # speculative decoding for this model instance

    pipe = pipeline(args.task, model=model, tokenizer=tokenizer)
    texts = args.text or TEXTS
    # greedy, and one beam: some checkpoints' task settings ask for beam search, which speculation does not verify
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False, num_beams=1)
    runs = {
        "plain": {},
        "assistant model": dict(assistant_model=assistant, speculative_gamma=args.gamma),
        "prompt lookup": dict(drafter="prompt_lookup", speculative_gamma=args.gamma),
    }
    reference = None
    for name, speculative in runs.items():
        start = time.perf_counter()
        outputs = pipe(texts, **greedy, **speculative)
        seconds = time.perf_counter() - start
        texts_out = [next(value for key, value in record.items() if key.endswith("_text")) for record in outputs]
        if reference is None:
            reference = texts_out
            print(f"{name:>16} ({seconds:.2f} s):")
            for text, output in zip(texts, texts_out):
                print(f"{'':>18}{text!r}\n{'':>18}-> {output!r}")
        else:
            print(f"{name:>16} ({seconds:.2f} s): outputs match the plain pipeline: {texts_out == reference}")


if __name__ == "__main__":
    main()
