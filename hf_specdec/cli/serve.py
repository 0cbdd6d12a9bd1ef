"""`hf-specdec serve`: transformers' OpenAI-compatible server with continuous batching, drafting and verifying with an
hf_specdec drafter (`hf_specdec.serving`). Same endpoints and request format as `transformers serve
--continuous-batching`; by default it serves the embedded zoo model with prompt lookup. `--no-continuous-batching`
decodes one request at a time with `generate` and the drafter (models continuous batching does not run)."""

from __future__ import annotations

import argparse
import sys

from . import loading
from .arguments import add_threads, positive_int
from .common import CLIError, set_threads

DRAFTERS = ("prompt_lookup", "suffix", "ngram", "model")


def serve(args: argparse.Namespace) -> int:
    from hf_specdec import serving

    try:
        serving.check_serve_available()
    except ImportError as err:
        raise CLIError(str(err)) from None
    drafting = _drafting(args)
    threads = set_threads(args.threads)
    model, dtype = args.model, args.dtype
    if model is None:  # the embedded zoo model, stored in float16: float32 is the fast dtype on CPUs
        from hf_specdec import zoo

        model, dtype = str(zoo.ZOO_DIR / "target"), ("float32" if dtype == "auto" else dtype)
    from transformers import ContinuousBatchingConfig

    cb_options = {
        "page_size": args.cb_block_size,  # transformers serve's name for the page size
        "num_blocks": args.cb_num_blocks,
        "max_batch_tokens": args.cb_max_batch_tokens,
        "max_memory_percent": args.cb_max_memory_percent,
    }
    cb_options = {name: value for name, value in cb_options.items() if value is not None}
    if cb_options and not args.continuous_batching:
        raise CLIError(
            f"--no-continuous-batching serves without a paged cache: drop {', '.join(_cb_flags(args))}, or serve "
            "with continuous batching"
        )
    app, model_manager, _ = serving.build_server(
        model,
        drafting,
        device=args.device,
        dtype=dtype,
        attn_implementation=args.attn_implementation,
        continuous_batching=args.continuous_batching,
        continuous_batching_config=ContinuousBatchingConfig(**cb_options) if cb_options else None,
        enable_cors=args.enable_cors,
    )
    for loaded in model_manager.loaded_models.values():  # the preloaded model: an n-gram table must fit its vocabulary
        loading.check_vocabulary(loaded.model, drafting)
        if "assistant_model" in drafting:  # a draft model runs where the target runs, in its dtype
            drafting["assistant_model"].to(device=loaded.model.device, dtype=loaded.model.dtype)
    import uvicorn

    batching = "continuous batching" if args.continuous_batching else "one request at a time"
    print(
        f"hf-specdec serve: {model} with {_drafter_name(args)}, {batching}, {threads}, on "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)).run()
    return 0


def _drafting(args: argparse.Namespace) -> dict:
    """`--drafter KIND [PATH]`, `--gamma` and `--gamma-policy` -> the keyword arguments of `init_continuous_batching`."""
    spec = args.drafter or [_drafter_name(args)]
    if spec[0] not in DRAFTERS:
        raise CLIError(
            f"--drafter must be one of {', '.join(DRAFTERS)} (continuous batching drafts with those), got {spec[0]!r}"
        )
    if spec[0] == "suffix":
        if len(spec) > 1:
            raise CLIError("--drafter suffix takes no path")
        drafting = {"drafter": "suffix"}
    elif spec[0] in ("ngram", "model") and len(spec) == 1 and args.model is not None:
        raise CLIError(f"--drafter {spec[0]} needs a PATH (or Hub id) when MODEL is not the embedded default")
    else:
        drafting = loading.load_drafter(spec, embedded_target=args.model is None)
    if args.gamma is not None:
        drafting["speculative_gamma"] = args.gamma
    drafting["speculative_gamma_policy"] = args.gamma_policy
    return drafting


def _cb_flags(args: argparse.Namespace) -> list[str]:
    names = ("cb_block_size", "cb_num_blocks", "cb_max_batch_tokens", "cb_max_memory_percent")
    return [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in names if getattr(args, name) is not None]


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {value} (for example 0.8)")
    return value


def _drafter_name(args: argparse.Namespace) -> str:
    return args.drafter[0] if args.drafter else "prompt_lookup"


def add_parser(command) -> None:
    """The `serve` command and its options."""
    sub = command("serve", "an OpenAI-compatible server (transformers serve) whose continuous batching drafts")
    sub.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local directory, Hub id or <repo>:<file>.gguf of a causal LM (safetensors or GGUF), served for every "
        "request (default: the embedded zoo model)",
    )
    sub.add_argument(
        "--drafter",
        nargs="+",
        metavar="KIND [PATH]",
        default=None,
        help="prompt_lookup | suffix | ngram [PATH] | model [PATH]: the drafter of every request (PATH: an n-gram "
        "table, or a draft model sharing the target's tokenizer, as a directory or Hub id; optional with the embedded "
        "model, whose distilled drafter `model` then loads; default: prompt_lookup)",
    )
    sub.add_argument(
        "--gamma",
        type=positive_int,
        default=None,
        metavar="N",
        help="most drafts per request per step (default: the drafter's own, 10 for prompt lookup)",
    )
    sub.add_argument(
        "--gamma-policy",
        default="auto",
        choices=["auto", "constant"],
        help="auto: each step, the drafts verified are priced on the batch's query tokens; constant: all of them",
    )
    sub.add_argument(
        "--continuous-batching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="requests share each step's forward (default); --no-continuous-batching decodes one request at a time "
        "with generate(), for models continuous batching does not run (hybrid, sliding-window)",
    )
    sub.add_argument("--host", default="localhost", help="address to listen on")
    sub.add_argument("--port", type=positive_int, default=8000, help="port to listen on")
    sub.add_argument("--device", default="auto", help="where the model goes (transformers serve's --device)")
    sub.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype the model is loaded in (auto: the checkpoint's; float32 for the embedded model)",
    )
    sub.add_argument("--attn-implementation", default=None, help="attention implementation (e.g. sdpa)")
    sub.add_argument(
        "--cb-block-size", type=positive_int, default=None, metavar="N", help="KV cache block (page) size in tokens"
    )
    sub.add_argument("--cb-num-blocks", type=positive_int, default=None, metavar="N", help="KV cache blocks")
    sub.add_argument("--cb-max-batch-tokens", type=positive_int, default=None, metavar="N", help="most tokens per step")
    sub.add_argument(
        "--cb-max-memory-percent",
        type=_fraction,
        default=None,
        metavar="F",
        help="fraction of free GPU memory the KV cache may take, in (0, 1]",
    )
    sub.add_argument("--enable-cors", action="store_true", help="permissive CORS")
    sub.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"], help="log level"
    )
    add_threads(sub)
    sub.set_defaults(func=serve)
