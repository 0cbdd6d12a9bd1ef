"""The structures behind `SuffixDrafter` (SuffixDecoding, Oliaro et al., 2024): a depth-bounded suffix trie with
occurrence counts (`SuffixTrie`), and the shared, bounded, thread-safe cache of earlier outputs (`SuffixCache`),
saved and loaded as safetensors.

A `SuffixTrie` of depth D holds every substring of up to D tokens of its sequences, each node counting how often
its substring occurs. Appending a token extends the (at most D - 1) substrings that end at the previous token and are
still shorter than D, plus the one-token substring of the new token: at most D nodes, never a rebuild. Removing a
sequence's oldest token walks the one substring of up to D tokens that starts there and decrements it (nodes whose
count reaches 0 are deleted): eviction costs O(D) per token too.

From the node of a matched pattern (the context's last m tokens), `speculate` grows the continuation greedily by
estimated probability: a child's fraction is its count over the sum of its siblings' counts (the continuations that
were observed), and a node's estimated probability is the product of the fractions along its path from the match.
"""

from __future__ import annotations

import heapq
import os
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..file_writes import replace_file

__all__ = ["SuffixCache", "SuffixTrie", "Speculation"]

FORMAT = "hf_specdec.suffix_cache"
FORMAT_VERSION = "1"
MAX_TREE_DEPTH = 1024  # a loaded file's tree depth beyond this is refused (building costs depth x tokens)


def check_int(name: str, value, low: int = 1) -> None:
    """Fails unless `value` (the argument `name`) is an int >= `low`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")


class _Sequence:
    """One sequence in a trie: its tokens since `first`, and the nodes (ids) of its substrings that end at its last
    token and are shorter than the trie's depth (oldest start first), the ones the next token extends."""

    __slots__ = ("tokens", "first", "active")

    def __init__(self):
        self.tokens: deque[int] = deque()
        self.first = 0  # absolute position of tokens[0]
        self.active: deque[int] = deque()


class Speculation:
    """A speculated continuation: `tokens`, `parents` (-1: a child of the context's last token; parents first),
    `score` (the sum of the nodes' estimated probabilities: the expected number of accepted tokens) and the length of
    the pattern it was matched with (`match_length`)."""

    __slots__ = ("tokens", "parents", "score", "match_length")

    def __init__(self, tokens: list[int], parents: list[int], score: float, match_length: int):
        self.tokens, self.parents, self.score, self.match_length = tokens, parents, score, match_length

    def better_than(self, other: Speculation | None) -> bool:
        return other is None or (self.score, self.match_length) > (other.score, other.match_length)


class SuffixTrie:
    """The substrings of up to `depth` tokens of several sequences, with their occurrence counts (not thread-safe on
    its own: `SuffixCache` locks around it).

    Nodes are ids into two lists (each node's children, `{token: id}` or None, and its count), not objects: a dict of
    ints is not tracked by Python's garbage collector, so a trie of millions of nodes adds nothing to a collection's
    work, where one object per node made every full collection walk them all. `touched` counts the nodes that appends
    and removals have visited (for tests of the incremental cost).
    """

    ROOT = 0

    def __init__(self, depth: int):
        check_int("depth", depth)
        self.depth = depth
        self.children: list[dict[int, int] | None] = [None]  # node id -> {token: child id}, None while it has none
        self.counts: list[int] = [0]  # node id -> occurrences of its substring
        self._free: list[int] = []  # ids of deleted nodes, given out again
        self.sequences: dict[int, _Sequence] = {}
        self.touched = 0

    def _new_node(self) -> int:
        if self._free:
            return self._free.pop()
        self.children.append(None)
        self.counts.append(0)
        return len(self.counts) - 1

    def append(self, key: int, tokens: Iterable[int]) -> None:
        """Appends `tokens` to sequence `key` (a new one when unknown): at most `depth` nodes per token.

        Each substring is walked from where it starts (the substrings already begun first, oldest first, then one
        walk per new token), which creates every node in the order the token-by-token definition would (a parent's
        children in the order of their first occurrence) in a tight loop: a prompt is indexed in one call."""
        sequence = self.sequences.get(key)
        if sequence is None:
            sequence = self.sequences[key] = _Sequence()
        tokens = [int(token) for token in tokens]
        depth, count, begun = self.depth, len(tokens), len(sequence.active)
        children, counts, new_node = self.children, self.counts, self._new_node
        active: deque[int] = deque()
        starts = [(node, begun - j) for j, node in enumerate(sequence.active)] + [(self.ROOT, 0)] * count
        for start, (node, length) in enumerate(starts):
            offset = max(0, start - begun)  # the walk's first new token
            steps = tokens[offset : offset + depth - length]
            for token in steps:
                below = children[node]
                if below is None:
                    below = children[node] = {}
                child = below.get(token)
                if child is None:
                    child = below[token] = new_node()
                counts[child] += 1
                node = child
            self.touched += len(steps)
            if length + len(steps) < depth:  # shorter than `depth`, so it ran to the last token: it grows next time
                active.append(node)
        sequence.active = active
        sequence.tokens.extend(tokens)

    def _delete(self, node: int) -> None:
        """Gives `node` and everything below it back (their substrings no longer occur)."""
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend((self.children[node] or {}).values())
            self.children[node] = None
            self.counts[node] = 0
            self._free.append(node)

    def pop_oldest(self, key: int) -> None:
        """Removes the oldest token of sequence `key` (the substrings that start there); the sequence goes when it
        has no tokens left."""
        sequence = self.sequences[key]
        length = len(sequence.tokens)
        span = min(self.depth, length)
        if length < self.depth:  # the substring starting at the oldest token is still growing: it leaves `active`
            sequence.active.popleft()
        node = self.ROOT
        for offset in range(span):
            token = sequence.tokens[offset]
            below = self.children[node]
            child = below[token]
            self.counts[child] -= 1
            self.touched += 1
            if self.counts[child] == 0:  # no other occurrence goes through it (nor through anything below it)
                del below[token]
                if not below:
                    self.children[node] = None
                self._delete(child)
                break
            node = child
        sequence.tokens.popleft()
        sequence.first += 1
        if not sequence.tokens:
            del self.sequences[key]

    def remove(self, key: int) -> int:
        """Removes sequence `key` entirely; returns how many tokens it held."""
        sequence = self.sequences.get(key)
        if sequence is None:
            return 0
        length = len(sequence.tokens)
        for _ in range(length):
            self.pop_oldest(key)
        return length

    def find(self, pattern: Sequence[int]) -> int | None:
        """The node of `pattern` (`counts[node]` is how often it occurs), or None when it never occurs."""
        node = self.ROOT
        for token in pattern:
            below = self.children[node]
            if below is None:
                return None
            node = below.get(token)
            if node is None:
                return None
        return node

    def speculate(
        self,
        context: Sequence[int],
        *,
        max_pattern: int,
        max_depth: int,
        max_spec_factor: float,
        max_spec_tokens: int,
        min_token_prob: float,
        vocab_size: int | None,
        tree: bool,
    ) -> Speculation | None:
        """The best speculation over every pattern length m = 1 ... `max_pattern` (the context's last m tokens) that
        occurs with a continuation: at most `min(max_spec_tokens, int(max_spec_factor * m))` nodes, none deeper than
        `max_depth` below the match (nor than the trie's depth allows), no node below `min_token_prob`. A tree
        (`tree=True`) grows best-first by estimated probability; a chain follows the most frequent child. The
        highest `score` wins (at equal score, the longer match)."""
        best = None
        longest = min(max_pattern, len(context), self.depth - 1)
        for m in range(1, longest + 1):
            node = self.find(context[len(context) - m :])
            if node is None:  # a longer pattern ends with this one: it cannot occur either
                break
            scaled = max_spec_factor * m  # compared before `int`: a huge factor may scale to infinity
            size = max_spec_tokens if scaled >= max_spec_tokens else int(scaled)
            depth = min(max_depth, self.depth - m)
            if size < 1 or depth < 1 or self.children[node] is None:
                continue
            grow = _grow_tree if tree else _grow_chain
            tokens, parents, score = grow(self, node, size, depth, min_token_prob, vocab_size)
            if tokens:
                candidate = Speculation(tokens, parents, score, m)
                if candidate.better_than(best):
                    best = candidate
        return best

    def substrings(self) -> list[tuple[tuple[int, ...], int]]:
        """Every substring the trie holds with its count, depth first, each node's children in the trie's order (the
        order of their first occurrence, in which `speculate` breaks ties): for tests."""
        found, stack = [], [((), self.ROOT)]
        while stack:
            path, node = stack.pop()
            below = list((self.children[node] or {}).items())
            for token, child in reversed(below):
                stack.append((path + (token,), child))
            if path:
                found.append((path, self.counts[node]))
        return found

    def snapshot(self) -> dict[tuple[int, ...], int]:
        """Every substring the trie holds, with its count (for tests: an incremental trie equals a fresh build)."""
        return dict(self.substrings())


def _usable(trie: SuffixTrie, node: int, vocab_size: int | None) -> list[tuple[int, int]]:
    below = trie.children[node] or {}
    return [(t, c) for t, c in below.items() if vocab_size is None or t < vocab_size]


def _grow_chain(trie: SuffixTrie, node: int, size: int, depth: int, min_prob: float, vocab_size: int | None):
    counts = trie.counts
    tokens, parents, score, prob = [], [], 0.0, 1.0
    while len(tokens) < min(size, depth) and trie.children[node]:
        total = sum(counts[child] for child in trie.children[node].values())  # the observed continuations
        usable = _usable(trie, node, vocab_size)
        if not usable:
            break
        token, child = max(usable, key=lambda item: (counts[item[1]], -item[0]))  # ties: the smaller token id
        prob *= counts[child] / total
        if prob < min_prob:
            break
        parents.append(len(tokens) - 1)
        tokens.append(token)
        score += prob
        node = child
    return tokens, parents, score


def _grow_tree(trie: SuffixTrie, node: int, size: int, depth: int, min_prob: float, vocab_size: int | None):
    counts = trie.counts
    tokens, parents, score = [], [], 0.0
    heap, order = [], 0  # (-probability, insertion order, parent index, depth, token, node)

    def push_children(parent_node: int, parent: int, parent_prob: float, parent_depth: int) -> None:
        nonlocal order
        if parent_depth >= depth or not trie.children[parent_node]:
            return
        total = sum(counts[child] for child in trie.children[parent_node].values())
        for token, child in _usable(trie, parent_node, vocab_size):
            prob = parent_prob * counts[child] / total
            if prob >= min_prob:
                heapq.heappush(heap, (-prob, order, parent, parent_depth + 1, token, child))
                order += 1

    push_children(node, -1, 1.0, 0)
    while heap and len(tokens) < size:
        negative_prob, _, parent, node_depth, token, child = heapq.heappop(heap)
        # a child's probability never exceeds its parent's, so parents are always taken before their children
        index = len(tokens)
        tokens.append(token)
        parents.append(parent)
        score -= negative_prob
        push_children(child, index, -negative_prob, node_depth)
    return tokens, parents, score


class SuffixCache:
    """A bounded, thread-safe cache of earlier outputs for `SuffixDrafter`, shared across `generate` calls, batch rows
    and threads (the global tree of SuffixDecoding).

    Each `generate` call (each row of a batch) is one request, whose confirmed output tokens are added as they
    arrive (and its prompt first, with `SuffixDrafter(cache_prompts=True)`). When the cache holds more than
    `max_requests` requests, the oldest requests are evicted whole; when it holds more than `max_tokens` tokens, the
    oldest tokens of the oldest request go first (a request that loses all its tokens is evicted; a call whose
    request was evicted stops adding to the cache). Every method takes the cache's lock, so concurrent calls
    neither lose nor corrupt entries.

    Memory: the trie holds up to `tree_depth` nodes per cached token (fewer for repetitive text), each two list
    entries and, when it has children, a small dict (none of them tracked by the garbage collector): budget roughly
    `max_tokens * tree_depth * 270` bytes at worst (about 650 MB for the defaults).

    Args:
        max_requests (`int`, *optional*, defaults to 1000): the most requests (calls, rows) kept.
        max_tokens (`int`, *optional*, defaults to 100000): the most tokens kept, over all requests.
        tree_depth (`int`, *optional*, defaults to 24): the longest substring indexed, which bounds a global match's
            pattern length plus its speculation depth (vLLM's `suffix_decoding_max_tree_depth`).

    Example:

    ```python
    >>> from hf_specdec.drafters.suffix_tree import SuffixCache
    >>> cache = SuffixCache(max_requests=2, max_tokens=100)
    >>> for output in ([1, 2, 3], [4, 5], [6]):
    ...     _ = cache.add(output)
    >>> cache.requests()  # the oldest request was evicted
    [[4, 5], [6]]

    ```
    """

    def __init__(self, max_requests: int = 1000, max_tokens: int = 100_000, tree_depth: int = 24):
        check_int("max_requests", max_requests)
        check_int("max_tokens", max_tokens)
        check_int("tree_depth", tree_depth, low=2)
        self.max_requests, self.max_tokens, self.tree_depth = max_requests, max_tokens, tree_depth
        self._lock = threading.Lock()
        self._trie = SuffixTrie(tree_depth)
        self._num_tokens = 0
        self._next_id = 0

    def __repr__(self) -> str:
        return (
            f"SuffixCache(max_requests={self.max_requests}, max_tokens={self.max_tokens}, "
            f"tree_depth={self.tree_depth}; {len(self)} requests, {self.num_tokens} tokens)"
        )

    def __len__(self) -> int:
        with self._lock:
            return len(self._trie.sequences)

    @property
    def num_tokens(self) -> int:
        with self._lock:
            return self._num_tokens

    def add(self, tokens: Iterable[int], request: int | None = None) -> int | None:
        """Appends `tokens` to `request` (an id this method returned before), or to a new request when `request`
        is None; returns the request's id (None when nothing was added to a new request). Tokens added to a request
        that has been evicted are dropped (the same id comes back)."""
        tokens = [int(token) for token in tokens]
        if any(token < 0 for token in tokens):
            raise ValueError(f"`tokens` must be non-negative token ids, got {tokens[:20]!r}.")
        with self._lock:
            if request is None:
                if not tokens:
                    return None
                request, self._next_id = self._next_id, self._next_id + 1
            elif request not in self._trie.sequences:
                if request >= self._next_id:
                    raise ValueError(f"`request={request!r}` was never returned by this cache's `add`.")
                return request  # evicted
            self._trie.append(request, tokens)
            self._num_tokens += len(tokens)
            self._evict()
            return request

    def _evict(self) -> None:
        sequences = self._trie.sequences  # insertion order: the oldest request first
        while len(sequences) > self.max_requests:
            self._num_tokens -= self._trie.remove(next(iter(sequences)))
        while self._num_tokens > self.max_tokens:
            self._trie.pop_oldest(next(iter(sequences)))
            self._num_tokens -= 1

    def speculate(self, context: Sequence[int], **limits) -> Speculation | None:
        """`SuffixTrie.speculate` over the cached requests, under the lock."""
        with self._lock:
            return self._trie.speculate(context, **limits)

    def requests(self) -> list[list[int]]:
        """The cached requests' tokens, the oldest request first (a copy)."""
        with self._lock:
            return [list(sequence.tokens) for sequence in self._trie.sequences.values()]

    def clear(self) -> None:
        with self._lock:
            self._trie = SuffixTrie(self.tree_depth)
            self._num_tokens = 0

    def snapshot(self) -> dict[tuple[int, ...], int]:
        """The trie's substrings and counts (see `SuffixTrie.snapshot`)."""
        with self._lock:
            return self._trie.snapshot()

    def save(self, path: str | os.PathLike) -> None:
        """Saves the cached requests to `path` as safetensors (`tokens`: every request's tokens, concatenated;
        `lengths`: each request's length, oldest first), through a new file renamed over `path`: a link standing
        at `path` is replaced, never written through."""
        from safetensors.torch import save_file

        requests = self.requests()
        tensors = {
            "tokens": torch.tensor([token for request in requests for token in request], dtype=torch.int64),
            "lengths": torch.tensor([len(request) for request in requests], dtype=torch.int64),
        }
        metadata = {"format": FORMAT, "version": FORMAT_VERSION, "tree_depth": str(self.tree_depth)}
        replace_file(path, lambda file: save_file(tensors, str(file), metadata=metadata))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        max_requests: int = 1000,
        max_tokens: int = 100_000,
        tree_depth: int | None = None,
    ) -> SuffixCache:
        """A cache holding the requests `save` wrote to `path` (a safetensors file: nothing is unpickled). A file
        holding more than `max_requests` requests or `max_tokens` tokens is refused before its tensors are read.
        `tree_depth` defaults to the saved one."""
        from safetensors import safe_open

        check_int("max_requests", max_requests)
        check_int("max_tokens", max_tokens)
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No SuffixCache file at {path}: pass the path `SuffixCache.save` wrote.")
        try:
            with safe_open(str(path), framework="pt") as file:
                metadata = file.metadata() or {}
                names = set(file.keys())
                if metadata.get("format") != FORMAT or names != {"tokens", "lengths"}:
                    raise ValueError(
                        f"{path} is a safetensors file, but not a SuffixCache (format {metadata.get('format')!r}, "
                        f"tensors {sorted(names)}). Pass a file written by `SuffixCache.save`."
                    )
                shapes = {name: file.get_slice(name).get_shape() for name in names}
                dtypes = {name: file.get_slice(name).get_dtype() for name in names}
                if any(len(shape) != 1 for shape in shapes.values()) or set(dtypes.values()) != {"I64"}:
                    raise ValueError(
                        f"{path} holds tensors of shapes {shapes} and dtypes {dtypes}; a SuffixCache file holds two "
                        "1-D int64 tensors. The file is corrupt: save the cache again with `SuffixCache.save`."
                    )
                num_tokens, num_requests = shapes["tokens"][0], shapes["lengths"][0]
                if num_tokens > max_tokens:
                    raise ValueError(
                        f"{path} holds {num_tokens} tokens, more than `max_tokens={max_tokens}`. Pass "
                        f"`SuffixCache.load(..., max_tokens={num_tokens})` or more if you trust the file and have "
                        "the memory for it."
                    )
                if num_requests > max_requests:
                    raise ValueError(
                        f"{path} holds {num_requests} requests, more than `max_requests={max_requests}`. Pass "
                        f"`SuffixCache.load(..., max_requests={num_requests})` or more if you trust the file."
                    )
                tokens, lengths = file.get_tensor("tokens"), file.get_tensor("lengths")
        except ValueError:
            raise
        except Exception as err:  # safetensors' own errors (a pickle, a truncated file) are not OSError or ValueError
            message = " ".join(str(err).split()) or type(err).__name__
            raise OSError(
                f"{path} is not a readable safetensors file ({message}). `SuffixCache.load` reads only files written "
                "by `SuffixCache.save` (never pickle); save the cache again."
            ) from None
        if tree_depth is None:
            stored = metadata.get("tree_depth", "")
            tree_depth = int(stored) if stored.isdigit() else -1
            if not 2 <= tree_depth <= MAX_TREE_DEPTH:
                raise ValueError(
                    f"{path} says tree_depth={stored!r}, expected an int in [2, {MAX_TREE_DEPTH}]: the file is "
                    "corrupt. Pass `tree_depth=` to `SuffixCache.load`, or save the cache again."
                )
        if (lengths < 1).any() or int(lengths.sum()) != num_tokens or (num_tokens and int(tokens.min()) < 0):
            raise ValueError(
                f"{path} is corrupt: its `lengths` must be positive and sum to the {num_tokens} `tokens`, and the "
                "tokens must be non-negative ids. Save the cache again with `SuffixCache.save`."
            )
        cache = cls(max_requests=max_requests, max_tokens=max_tokens, tree_depth=tree_depth)
        if num_requests:
            for request in torch.split(tokens, lengths.tolist()):
                cache.add(request.tolist())
        return cache
