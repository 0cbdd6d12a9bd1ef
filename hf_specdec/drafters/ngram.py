"""`NGramDrafter`: a static n-gram table built from a corpus, saved and loaded in Hub format (safetensors)."""

from __future__ import annotations

import copy
import heapq
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard, ModelCardData, ModelHubMixin, hf_hub_download
from huggingface_hub.errors import HFValidationError
from safetensors.torch import load_file, save_file

from ..sampling import sample_tokens
from .base import DraftContext, Drafter, DraftProposal, register_drafter
from .tree_builder import TokenTree

__all__ = ["NGramDrafter"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DRAFT_MODES = ("greedy", "sample")
_TEMPLATE = (Path(__file__).resolve().parent.parent / "templates" / "ngram_drafter.md").read_text()


class NGramDrafter(
    Drafter,
    ModelHubMixin,
    library_name="hf_specdec",
    tags=["speculative-decoding", "ngram-drafter"],
    model_card_template=_TEMPLATE,
):
    r"""
    A static n-gram table (unigram ... n-gram, with backoff to the longest context seen) that drafts without any
    model forward, like llama.cpp's static n-gram caches and the paper's unigram / bigram drafters (Table 3).

    For every context of `k - 1` tokens (k = 1 ... n) the table keeps its `top_k` most frequent continuations
    with their empirical probabilities, stored sparsely in safetensors. Drafting looks up the longest known
    context, turns its continuations into q, standardizes q with the target's logits processors, and proposes
    its argmax (`draft_mode="greedy"`, deterministic) or a sample from it (`draft_mode="sample"`, q is passed to
    the sampler, which then accepts with min(1, p/q)).

    With `speculative_tree_budget` set, the proposal is a token tree grown best-first, as in EAGLE-2: each node's
    candidate children are its context's continuations ranked by standardized q (the target's processors applied
    with the node's own prefix), and the tree takes, one node at a time, the candidate with the highest product of
    q along its path, until it holds `tree_budget` nodes or no candidate is left within depth `num_tokens`. These
    are the `tree_budget` most probable paths' nodes under q. Tree nodes are chosen deterministically in both draft
    modes (`probs=None`): in `draft_mode="sample"` the sampler then tries the siblings one by one, accepting each
    with the target's residual probability, which keeps sampling exact. A tree without branches is proposed as a
    chain.

    Build one with [`~NGramDrafter.from_corpus`] (token ids) or [`~NGramDrafter.from_texts`] (texts and a
    tokenizer), save it with `save_pretrained` (safetensors, `config.json`, a `README.md` model card), load it
    with `from_pretrained` (a directory or a Hub repo id; nothing is unpickled), share it with `push_to_hub`.

    Example:

    ```python
    >>> import hf_specdec
    >>> table = hf_specdec.NGramDrafter.from_corpus([[1, 2, 3, 1, 2, 3, 1, 2]], n=3, vocab_size=8)
    >>> table.propose_for([[1, 2]], num_tokens=4).tokens
    tensor([[3, 1, 2, 3]])
    >>> table = hf_specdec.NGramDrafter.from_corpus([[1, 2, 3, 1, 2, 3, 1, 2, 4]], n=3, vocab_size=8)
    >>> tree = table.propose_for([[1, 2]], num_tokens=2, tree_budget=3)
    >>> tree.tokens, tree.parents  # after [1, 2]: 3 (q = 2/3), then its child 1 (2/3 * 1), then 4 (1/3)
    (tensor([[3, 1, 4]]), tensor([[-1,  0, -1]]))

    ```
    """

    tree_budget: int | None = None  # set per call by `reset`

    def __init__(
        self,
        tables: dict[str, torch.Tensor],
        *,
        n: int,
        vocab_size: int,
        top_k: int,
        draft_mode: str = "greedy",
        tokenizer_name: str | None = None,
        target_name: str | None = None,
        corpus_description: str | None = None,
        alpha: float | None = None,
    ):
        _check_positive("n", n)
        _check_positive("vocab_size", vocab_size)
        _check_positive("top_k", top_k)
        if draft_mode not in DRAFT_MODES:
            raise ValueError(f"`draft_mode` must be one of {DRAFT_MODES}, got {draft_mode!r}.")
        self.n, self.vocab_size, self.top_k, self.draft_mode = n, vocab_size, top_k, draft_mode
        self.tokenizer_name, self.target_name = tokenizer_name, target_name
        self.corpus_description, self.alpha = corpus_description, alpha
        self.tables = _validated_tables(tables, n=n, vocab_size=vocab_size, top_k=top_k)
        # context tuple -> row, per order; built once here (per-call copies share it read-only)
        self._rows = [
            {tuple(context): row for row, context in enumerate(self.tables[f"order_{k}.contexts"].tolist())}
            for k in range(1, n + 1)
        ]

    # ----- building -----------------------------------------------------------------------------------------

    @classmethod
    def from_corpus(
        cls,
        sequences: Iterable[Sequence[int] | torch.Tensor],
        *,
        n: int = 3,
        vocab_size: int,
        top_k: int = 8,
        draft_mode: str = "greedy",
        **metadata: Any,
    ) -> NGramDrafter:
        """Counts every k-gram (k = 1 ... `n`) of `sequences` (lists or 1-D tensors of token ids).

        `metadata` (`tokenizer_name`, `target_name`, `corpus_description`, `alpha`) goes into the config and card.
        """
        _check_positive("n", n)
        _check_positive("vocab_size", vocab_size)
        _check_positive("top_k", top_k)
        sequences = [torch.as_tensor(seq, dtype=torch.long).flatten() for seq in sequences]
        sequences = [seq for seq in sequences if seq.numel() > 0]
        if not sequences:
            raise ValueError(
                "The corpus is empty: `sequences` holds no token ids. Pass at least one non-empty sequence."
            )
        low = min(int(seq.min()) for seq in sequences)
        high = max(int(seq.max()) for seq in sequences)
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"The corpus holds token ids outside [0, vocab_size={vocab_size}): min {low}, max {high}. "
                "Pass the vocabulary size of the tokenizer/target the ids come from."
            )
        tables = {}
        for k in range(1, n + 1):
            windows = [seq.unfold(0, k, 1) for seq in sequences if seq.numel() >= k]  # each [len - k + 1, k]
            windows = torch.cat(windows) if windows else torch.empty(0, k, dtype=torch.long)
            tables.update(_top_continuations(windows, k, top_k))
        return cls(tables, n=n, vocab_size=vocab_size, top_k=top_k, draft_mode=draft_mode, **metadata)

    @classmethod
    def from_texts(
        cls,
        texts: Iterable[str],
        *,
        tokenizer,
        n: int = 3,
        top_k: int = 8,
        vocab_size: int | None = None,
        draft_mode: str = "greedy",
        show_progress: bool | None = None,
        batch_size: int = 256,
        **metadata: Any,
    ) -> NGramDrafter:
        """Tokenizes `texts` with `tokenizer` (a progress bar on long corpora) and counts them like `from_corpus`.

        `vocab_size` defaults to `len(tokenizer)`; pass the target's logits width when its embeddings are padded.
        """
        from tqdm.auto import tqdm

        texts = list(texts)
        if not texts or not any(texts):
            raise ValueError("The corpus is empty: `texts` holds no text. Pass at least one non-empty string.")
        if show_progress is None:
            show_progress = len(texts) >= 1000
        sequences = []
        for start in tqdm(range(0, len(texts), batch_size), desc="tokenizing", disable=not show_progress, unit="batch"):
            # verbose=False: a corpus file longer than the tokenizer's model_max_length is fine here (we count
            # n-grams, nothing runs a model on it), so transformers' "sequence length is longer" warning would mislead
            encoded = tokenizer(texts[start : start + batch_size], add_special_tokens=False, verbose=False)["input_ids"]
            sequences.extend(encoded)
        metadata.setdefault("tokenizer_name", _shareable_name(getattr(tokenizer, "name_or_path", None)))
        return cls.from_corpus(
            sequences, n=n, vocab_size=vocab_size or len(tokenizer), top_k=top_k, draft_mode=draft_mode, **metadata
        )

    # ----- Hub format -----------------------------------------------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        """The table's settings and provenance, as `save_pretrained` writes them to `config.json` (with the
        hf_specdec version)."""
        from .. import __version__

        return {
            "drafter_type": "ngram",
            "n": self.n,
            "vocab_size": self.vocab_size,
            "top_k": self.top_k,
            "draft_mode": self.draft_mode,
            "tokenizer_name": self.tokenizer_name,
            "target_name": self.target_name,
            "corpus_description": self.corpus_description,
            "alpha": self.alpha,
            "hf_specdec_version": __version__,
        }

    def _save_pretrained(self, save_directory: Path) -> None:
        save_file({k: v.contiguous() for k, v in self.tables.items()}, str(save_directory / WEIGHTS_NAME))
        (save_directory / CONFIG_NAME).write_text(json.dumps(self.config_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | Path,
        *,
        force_download: bool = False,
        token: str | bool | None = None,
        cache_dir: str | Path | None = None,
        local_files_only: bool = False,
        revision: str | None = None,
        **overrides: Any,
    ) -> NGramDrafter:
        r"""
        Loads a table written by `save_pretrained`, from a local directory or a Hub repo id (nothing is unpickled).

        Args:
            pretrained_model_name_or_path (`str` or `Path`):
                A directory holding `config.json` and `model.safetensors`, or a Hub repo id (`"user/name"`).
            force_download, token, cache_dir, local_files_only, revision:
                As in `huggingface_hub.hf_hub_download`, for Hub repo ids.
            overrides:
                `n` (use orders 1 ... n only, at most the stored n), `top_k` (keep the top_k most frequent
                continuations per context, at most the stored top_k), `draft_mode`, `tokenizer_name`,
                `target_name`, `corpus_description`, `alpha`. Anything else is an error.

        Example:

        ```python
        >>> from hf_specdec.zoo import load_ngram
        >>> load_ngram(n=2, draft_mode="sample").n
        2

        ```
        """
        unknown = sorted(set(overrides) - set(_OVERRIDABLE))
        if unknown:
            raise TypeError(
                f"Unknown option(s) {unknown} for `NGramDrafter.from_pretrained`, got "
                f"{ {key: overrides[key] for key in unknown} }. It accepts {list(_OVERRIDABLE)} (and the download "
                "arguments `revision`, `cache_dir`, `force_download`, `local_files_only`, `token`)."
            )
        return cls._from_pretrained(
            model_id=str(pretrained_model_name_or_path),
            revision=revision,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
            token=token,
            **overrides,
        )

    @classmethod
    def _from_pretrained(
        cls, *, model_id: str, revision, cache_dir, force_download, local_files_only, token, **overrides
    ) -> NGramDrafter:
        directory = _local_directory(model_id)

        def fetch(filename: str) -> Path:
            if directory is not None:
                local = directory / filename
                if local.is_symlink() and not local.exists():
                    raise OSError(
                        f"{local} is a broken link (to {os.readlink(local)!r}); restore the file or save "
                        "the drafter again with `save_pretrained`."
                    )
                if local.exists() and not local.is_file():
                    raise OSError(f"{_describe(local)} is not a file; save the drafter again with `save_pretrained`.")
                if not local.is_file():
                    raise OSError(f"{model_id} has no {filename}; is it a directory written by save_pretrained?")
                return local
            try:
                return Path(
                    hf_hub_download(
                        model_id,
                        filename,
                        revision=revision,
                        cache_dir=cache_dir,
                        force_download=force_download,
                        local_files_only=local_files_only,
                        token=token,
                    )
                )
            except HFValidationError as err:
                raise OSError(f"{model_id!r} is neither a local directory nor a valid Hub repo id: {err}") from None

        config_path = fetch(CONFIG_NAME)
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise OSError(
                f"{_describe(config_path)} is not a readable JSON file ({err}); it is corrupt or "
                "truncated: save the drafter again with `save_pretrained`, or download it again."
            ) from None
        if not isinstance(config, dict) or config.get("drafter_type") != "ngram":
            found = config.get("drafter_type") if isinstance(config, dict) else type(config).__name__
            raise ValueError(
                f"{config_path} has drafter_type={found!r}, expected 'ngram': this is not an NGramDrafter checkpoint."
            )
        weights_path = fetch(WEIGHTS_NAME)
        try:
            tables = load_file(str(weights_path))  # safetensors: tensors only, never pickle
        except Exception as err:
            raise OSError(
                f"{_describe(weights_path)} is not a readable safetensors file ({_one_line(err)}); it is "
                "corrupt or truncated: save the drafter again with `save_pretrained`, or download it "
                "again."
            ) from None
        kwargs = {key: config.get(key) for key in ("n", "vocab_size", "top_k", *_OVERRIDABLE)}
        kwargs["draft_mode"] = kwargs["draft_mode"] or "greedy"
        stored_n, stored_top_k = kwargs["n"], kwargs["top_k"]
        try:
            for name in ("n", "vocab_size", "top_k"):
                _check_positive(name, kwargs[name])
            orders = sorted(int(key.split(".")[0][len("order_") :]) for key in tables if key.endswith(".contexts"))
            if orders != list(range(1, stored_n + 1)):
                raise ValueError(
                    f"config.json says n={stored_n}, but {WEIGHTS_NAME} holds the tables of orders {orders}: the two "
                    "files do not belong together. Save the drafter again with `save_pretrained`."
                )
            tables = _validated_tables(tables, n=stored_n, vocab_size=kwargs["vocab_size"], top_k=stored_top_k)
        except ValueError as err:
            raise ValueError(f"The n-gram drafter in {model_id} is invalid: {err}") from None
        kwargs.update(overrides)  # explicit user overrides win
        for name, stored in (("n", stored_n), ("top_k", stored_top_k)):
            _check_positive(name, kwargs[name])
            if kwargs[name] > stored:
                raise ValueError(
                    f"`{name}={kwargs[name]}` is larger than the stored table's {name}={stored} ({model_id}): a "
                    f"table keeps only what it counted. Pass `{name}` <= {stored}, or rebuild the table."
                )
        # a smaller n drops the longest contexts; a smaller top_k keeps each context's most frequent continuations
        tables = {
            key: tensor[:, : kwargs["top_k"]] if key.endswith((".tokens", ".probs")) else tensor
            for key, tensor in tables.items()
            if int(key.split(".")[0][len("order_") :]) <= kwargs["n"]
        }
        return cls(tables, **kwargs)

    def push_to_hub(self, repo_id: str, *, model_card_kwargs: dict | None = None, **kwargs) -> str:
        """`ModelHubMixin.push_to_hub`, with the model card's usage snippet naming `repo_id`."""
        model_card_kwargs = {"repo_id": repo_id, **(model_card_kwargs or {})}
        return super().push_to_hub(repo_id, model_card_kwargs=model_card_kwargs, **kwargs)

    def generate_model_card(self, *args, **kwargs) -> ModelCard:
        """The model card (`README.md`) that `save_pretrained` and `push_to_hub` write beside the table."""
        card_data = ModelCardData(
            library_name="hf_specdec",
            tags=["hf_specdec", "speculative-decoding", "ngram-drafter"],
            base_model=self.target_name,
        )
        counts = ", ".join(str(len(rows)) for rows in self._rows)
        return ModelCard.from_template(
            card_data,
            template_str=_TEMPLATE,
            model_name=kwargs.pop("model_name", "N-gram drafter"),
            contexts_per_order=counts,
            repo_id=kwargs.pop("repo_id", None),
            **self.config_dict(),
            **kwargs,
        )

    # ----- drafting -------------------------------------------------------------------------------------------

    def reset(self, context: DraftContext) -> None:
        if context.vocab_size != self.vocab_size:
            raise ValueError(
                f"This NGramDrafter was built for a vocabulary of {self.vocab_size} tokens but the target has "
                f"{context.vocab_size}. Rebuild it with `vocab_size={context.vocab_size}` from the target's tokenizer."
            )
        self.logits_processor = context.logits_processor
        self.sample = self.draft_mode == "sample"  # sampled drafts carry q (ignored when the target is greedy)
        self.tree_budget = context.tree_budget

    def distribution(self, context_tokens: Sequence[int]) -> tuple[torch.LongTensor, torch.FloatTensor]:
        """The continuations and their probabilities (renormalized) after the longest known suffix of the context."""
        for k in range(min(self.n, len(context_tokens) + 1), 0, -1):
            key = tuple(context_tokens[len(context_tokens) - k + 1 :]) if k > 1 else ()
            row = self._rows[k - 1].get(key)
            if row is not None:
                tokens = self.tables[f"order_{k}.tokens"][row]
                probs = self.tables[f"order_{k}.probs"][row].float()
                keep = tokens >= 0
                return tokens[keep], probs[keep] / probs[keep].sum()
        raise AssertionError("the unigram row always exists")

    def propose(self, input_ids: torch.LongTensor, num_tokens: int, attention_mask=None) -> DraftProposal:
        batch = input_ids.shape[0]
        if num_tokens == 0:
            return DraftProposal.empty(batch, input_ids.device)
        if self.tree_budget is not None and batch == 1:  # trees are verified at batch size 1 only: chains otherwise
            return self._propose_tree(input_ids, num_tokens, self.tree_budget)
        ids = input_ids
        contexts = input_ids[:, max(0, input_ids.shape[1] - self.n + 1) :].tolist() if self.n > 1 else [[]] * batch
        drafted, probs = [], []
        for _ in range(num_tokens):
            q_logits = torch.full((batch, self.vocab_size), float("-inf"), device=input_ids.device)
            for row, context in enumerate(contexts):
                tokens, token_probs = self.distribution(context)
                q_logits[row, tokens.to(input_ids.device)] = token_probs.log().to(input_ids.device)
            scores = self.logits_processor(ids, q_logits)  # [batch, vocab]: q standardized like p
            if not torch.isfinite(scores).any(dim=-1).all():
                break  # the processors ruled out every continuation the table knows: stop drafting here
            if self.sample:
                q = scores.softmax(dim=-1)
                token = sample_tokens(q)[:, None]  # [batch, 1]
                probs.append(q)
            else:
                token = scores.argmax(dim=-1, keepdim=True)
            drafted.append(token)
            ids = torch.cat([ids, token], dim=-1)
            contexts = [
                (context + [t])[-(self.n - 1) :] if self.n > 1 else []
                for context, t in zip(contexts, token[:, 0].tolist())
            ]
        if not drafted:
            return DraftProposal.empty(batch, input_ids.device)
        return DraftProposal(tokens=torch.cat(drafted, dim=-1), probs=torch.stack(probs, 1) if probs else None)

    def _propose_tree(self, input_ids: torch.LongTensor, num_tokens: int, budget: int) -> DraftProposal:
        """Best-first by the sum of log q along the path (ties: the earlier candidate). A node's children are
        looked up only once nothing left is more probable than the node itself (its children are at most as
        probable), so the nodes that end up as leaves cost no lookup and no processor call."""
        tree = TokenTree(budget, num_tokens)
        recent = input_ids[0, -(self.n - 1) :].tolist() if self.n > 1 else []  # the n-gram context of the root
        # heap of (-path log q, order, node, token): a candidate `token` under parent `node`, or with token None,
        # `node` (already in the tree) waiting for its children to be looked up
        heap: list[tuple[float, int, int, int | None]] = []
        order = itertools.count()

        def push_children(node: int, path_log_q: float) -> None:
            path = tree.path(node)
            context = (recent + path)[-(self.n - 1) :] if self.n > 1 else []
            tokens, token_probs = self.distribution(context)
            q_logits = torch.full((1, self.vocab_size), float("-inf"), device=input_ids.device)
            q_logits[0, tokens.to(input_ids.device)] = token_probs.log().to(input_ids.device)
            ids = torch.cat([input_ids, torch.tensor([path], dtype=torch.long, device=input_ids.device)], dim=-1)
            scores = self.logits_processor(ids, q_logits)[0]  # [vocab]: q standardized like p, given this path
            log_q = scores.log_softmax(dim=-1)
            # tokens the processors ruled out are no candidates; the others are argmax-ranked (a stable sort of
            # ascending ids: ties go to the lower id, like argmax), and more than the budget left could never join
            finite = (scores > float("-inf")).nonzero()[:, 0]  # [candidates], ascending token ids
            ranked = finite[torch.sort(scores[finite], descending=True, stable=True).indices][: budget - len(tree)]
            for token, token_log_q in zip(ranked.tolist(), log_q[ranked].tolist()):
                heapq.heappush(heap, (-(path_log_q + token_log_q), next(order), node, token))

        push_children(-1, 0.0)
        while heap and not tree.full:
            negative_log_q, _, node, token = heapq.heappop(heap)
            if token is None:
                push_children(node, -negative_log_q)
                continue
            child = tree.add(node, token)
            if tree.depths[child] < num_tokens:
                heapq.heappush(heap, (negative_log_q, next(order), child, None))
        return tree.proposal(input_ids.device)

    def propose_for(self, input_ids, num_tokens: int, tree_budget: int | None = None) -> DraftProposal:
        """One stand-alone proposal (no target processors), handy for inspecting or comparing tables; a token tree
        of at most `tree_budget` nodes when it is given."""
        from transformers import LogitsProcessorList

        drafter = copy.copy(self)
        drafter.logits_processor, drafter.sample, drafter.tree_budget = LogitsProcessorList(), False, tree_budget
        return drafter.propose(torch.as_tensor(input_ids, dtype=torch.long), num_tokens)

    @classmethod
    def from_options(cls, pretrained_model_name_or_path: str | None = None, **options) -> NGramDrafter:
        """`generate(drafter="ngram", drafter_kwargs={"pretrained_model_name_or_path": ...})` lands here."""
        if pretrained_model_name_or_path is None:
            raise ValueError(
                "`drafter='ngram'` needs a table: pass `drafter_kwargs={'pretrained_model_name_or_path': PATH}`, "
                "or pass the `NGramDrafter` itself as `drafter=`."
            )
        return cls.from_pretrained(pretrained_model_name_or_path, **options)


_OVERRIDABLE = ("n", "top_k", "draft_mode", "tokenizer_name", "target_name", "corpus_description", "alpha")


def _local_directory(model_id: str) -> Path | None:
    """The directory `model_id` names, None for a Hub repo id; a local path that is no directory fails here,
    rather than as an invalid repo id."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise OSError(
            f"{model_id!r} is a file; `NGramDrafter.from_pretrained` takes the directory written by "
            "`save_pretrained` (holding config.json and model.safetensors), or a Hub repo id."
        )
    parts = model_id.split("/")
    if model_id.startswith((".", "/", "~", "\\")) or "\\" in model_id or len(parts) != 2 or not all(parts):
        raise OSError(
            f"No such directory: {model_id!r} (and it is not a Hub repo id of the form 'user/name'). "
            "Pass the directory written by `save_pretrained`."
        )
    return None


def _describe(path: Path) -> str:
    """The file, and where it leads when it is a link (a Hub cache links snapshots to blobs)."""
    return f"{path} (a link to {path.resolve()})" if path.is_symlink() else str(path)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _shareable_name(name: str | None) -> str | None:
    """A tokenizer's `name_or_path` fit for a model card: a Hub id as is, a local path by its directory name only."""
    if not name:
        return None
    path = Path(name).expanduser()
    return f"{path.resolve().name} (a local tokenizer)" if path.exists() else name


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")


def _top_continuations(windows: torch.LongTensor, k: int, top_k: int) -> dict[str, torch.Tensor]:
    """From all k-grams (`[count, k]`), the `top_k` most frequent continuations of each (k-1)-token context."""
    if windows.shape[0] == 0:
        return {
            f"order_{k}.contexts": torch.empty(0, k - 1, dtype=torch.int64),
            f"order_{k}.tokens": torch.empty(0, top_k, dtype=torch.int64),
            f"order_{k}.probs": torch.empty(0, top_k, dtype=torch.float32),
        }
    grams, counts = torch.unique(windows, dim=0, return_counts=True)  # sorted: equal contexts are adjacent
    if k == 1:  # one empty context for all unigrams
        contexts = torch.empty(1, 0, dtype=torch.int64)
        group, group_sizes = torch.zeros(len(grams), dtype=torch.long), torch.tensor([len(grams)])
    else:
        contexts, group, group_sizes = torch.unique_consecutive(
            grams[:, : k - 1], dim=0, return_inverse=True, return_counts=True
        )
    totals = torch.zeros(len(contexts), dtype=torch.long).index_add_(0, group, counts)
    # order by (context, count descending, token): a stable sort on count, then on context
    order = torch.sort(-counts, stable=True).indices
    order = order[torch.sort(group[order], stable=True).indices]
    group_start = torch.cumsum(group_sizes, 0) - group_sizes
    rank = torch.arange(len(order)) - group_start[group[order]]
    keep = order[rank < top_k]
    rank = rank[rank < top_k]
    tokens = torch.full((len(contexts), top_k), -1, dtype=torch.int64)
    probs = torch.zeros(len(contexts), top_k, dtype=torch.float32)
    tokens[group[keep], rank] = grams[keep, k - 1]
    probs[group[keep], rank] = counts[keep].float() / totals[group[keep]].float()
    return {f"order_{k}.contexts": contexts, f"order_{k}.tokens": tokens, f"order_{k}.probs": probs}


def _validated_tables(tables: dict[str, torch.Tensor], *, n: int, vocab_size: int, top_k: int):
    """Checks every tensor a table needs: present, well-shaped, token ids in range, probabilities in [0, 1]."""
    checked = {}
    for k in range(1, n + 1):
        names = [f"order_{k}.{part}" for part in ("contexts", "tokens", "probs")]
        missing = [name for name in names if name not in tables]
        if missing:
            raise ValueError(
                f"The n-gram table (n={n}) is missing tensors {missing}; it may be corrupt or for another n."
            )
        contexts, tokens, probs = (tables[name] for name in names)
        rows = contexts.shape[0] if contexts.dim() == 2 else -1
        expected = {names[0]: (rows, k - 1), names[1]: (rows, top_k), names[2]: (rows, top_k)}
        for name, tensor in zip(names, (contexts, tokens, probs)):
            if tuple(tensor.shape) != expected[name] or rows < 0:
                raise ValueError(
                    f"Tensor {name} has shape {tuple(tensor.shape)}, expected {expected[name]} (contexts x {k - 1}, "
                    f"contexts x top_k={top_k}); the table is corrupt or its config does not match it."
                )
        if k == 1 and rows != 1:
            raise ValueError(f"Tensor order_1.contexts must have exactly one (empty) row, got {rows}.")
        for name, tensor, low in ((names[0], contexts, 0), (names[1], tokens, -1)):
            if tensor.numel() and (int(tensor.min()) < low or int(tensor.max()) >= vocab_size):
                raise ValueError(
                    f"Tensor {name} holds token ids outside [0, vocab_size={vocab_size}) (min {int(tensor.min())}, "
                    f"max {int(tensor.max())}): the table was built for another vocabulary."
                )
        if probs.numel() and (not torch.isfinite(probs).all() or float(probs.min()) < 0 or float(probs.max()) > 1):
            raise ValueError(f"Tensor {names[2]} holds values outside [0, 1]; the table is corrupt.")
        empty = ((probs * (tokens >= 0)).sum(dim=-1) <= 0).nonzero()[:, 0]  # contexts with no usable continuation
        if len(empty):
            raise ValueError(
                f"Tensor {names[2]} has {len(empty)} context row(s) whose continuations all have probability 0 "
                f"(rows {empty[:5].tolist()}{'...' if len(empty) > 5 else ''}); such a context could never draft: "
                "the table is corrupt. Rebuild it with `NGramDrafter.from_corpus` or `from_texts`."
            )
        checked.update({names[0]: contexts.long(), names[1]: tokens.long(), names[2]: probs.float()})
    return checked


register_drafter("ngram", NGramDrafter)
