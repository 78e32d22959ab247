"""A depth-bounded suffix trie with occurrence counts and lazily materialised tails.

The trie over a set of token sequences holds, for every position i of every sequence, the
path ``tokens[i : i + max_depth]`` (shorter at the sequence's end); a node's ``count`` is
the number of positions whose path passes through it, so ``child.count / node.count`` is
the empirical probability that the substring spelled by ``node`` is followed by
``child``'s token (occurrences that end at a sequence end or at the depth bound are in
the parent's count only).

Tails (the memory bound): a node passed by ONE occurrence has a single-chain subtree, so
it is not built: the node is a *tail* (``children is None``) that points into its owner
sequence (``seq``, ``pos`` = index of the token after it) and stands for the whole chain.
When a second occurrence reaches a tail, the tail *bursts*: it becomes an ordinary node
with one tail child for the owner's next token. Materialised nodes are therefore the
substrings that occur at least twice, plus one tail per other position: about n nodes
for text that rarely repeats (n = tokens inserted) instead of n * max_depth for a plain
trie; text copied c times costs about (c-1) * n * max_depth / c nodes. Measured (with
the stored tokens): ~190 bytes per token of random tokens, ~500 per token of source code,
~7 KiB per token of a verbatim copy at max_depth 24.

Insertion (``extend``): a sequence's *hot* starts are the positions whose whole path is
materialised (its deepest node is an ordinary node at the path's depth); a start whose
path ended in a tail is dormant (the tail grows with its owner for free). Appending a
token visits each hot start once (one dict lookup, one count increment) and drops the
starts that reached ``max_depth``: at most ``max_depth`` node visits per token, usually a
few. Bursting needs only the owner's stored tokens, so it works whatever the owner. One
sequence at a time may be extended (the trees here hold one growing request, or finished
responses inserted whole); that is what lets a burst skip the owner's hot starts.

Removal (``remove``): each of the sequence's paths is walked from the root and its counts
decremented, deleting nodes that reach zero: O(n * max_depth) dict operations at most,
stopping at the path's tail.

Ties between children of equal count go to the one that reached the count last (the most
recent continuation); a node whose top child lost a count in a removal recomputes it when
next needed, taking the first in insertion order among equals.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence


class Node:
    """A trie node: ordinary (``children`` maps token -> Node, ``best`` is the child of
    highest count or None when unknown) or a tail (``children`` is None; its one
    occurrence continues at ``seq.tokens[pos]``)."""

    __slots__ = ("tok", "count", "children", "best", "seq", "pos")

    def __init__(self, tok: int, children: dict | None = None, seq: TokenSeq | None = None, pos: int = 0):
        self.tok = tok
        self.count = 1
        self.children = children
        self.best: Node | None = None
        self.seq = seq
        self.pos = pos

    def top_child(self) -> Node | None:
        """The child with the highest count (None for a tail or a childless node)."""
        if self.best is None and self.children:
            self.best = max(self.children.values(), key=_count)
        return self.best


def _count(node: Node) -> int:
    return node.count


class TokenSeq:
    """A sequence stored in a tree: its tokens (int32, compact) and its hot starts (start
    position -> the ordinary node at depth ``len(tokens) - start``)."""

    __slots__ = ("tokens", "hot")

    def __init__(self):
        self.tokens = array("i")
        self.hot: dict[int, Node] = {}

    def __len__(self) -> int:
        return len(self.tokens)


class SuffixTree:
    """Counts of every substring of length <= ``max_depth`` of the sequences inserted
    (see the module docstring)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = Node(-1, children={})

    def extend(self, seq: TokenSeq, new_tokens: Sequence[int]) -> None:
        """Append ``new_tokens`` to ``seq`` (which must be the only sequence of this tree
        being extended) and insert the paths they create or lengthen."""
        toks, root, last = seq.tokens, self.root, self.max_depth - 1
        hot = seq.hot
        for t in new_tokens:
            p = len(toks)
            toks.append(t)
            hot[p] = root
            new_hot = {}
            for start, node in hot.items():
                children = node.children
                child = children.get(t)
                if child is None:                # a new branch: one tail for the rest
                    child = children[t] = Node(t, seq=seq, pos=p + 1)
                    dormant = True
                else:
                    if child.children is None:   # another occurrence's tail: burst it
                        self._burst(child, p - start + 1)
                    child.count += 1
                    dormant = False
                best = node.best
                if best is None:                 # no child yet, or unknown after a removal
                    if len(children) == 1:
                        node.best = child
                elif best is not child and child.count >= best.count:
                    node.best = child            # ties: the latest to reach the top count
                if not dormant and p - start < last:   # below max_depth: stays hot
                    new_hot[start] = child
            hot = new_hot
        seq.hot = hot

    def _burst(self, tail: Node, depth: int) -> None:
        """Materialise ``tail`` (at ``depth``): an ordinary node whose one child is a tail
        for its owner's next token, if the owner has one within the depth bound."""
        owner, q = tail.seq, tail.pos
        tail.children = {}
        tail.seq = None
        if depth < self.max_depth and q < len(owner.tokens):
            tok = owner.tokens[q]
            tail.children[tok] = tail.best = Node(tok, seq=owner, pos=q + 1)

    def remove(self, seq: TokenSeq) -> None:
        """Take every path of a finished ``seq`` out of the tree (counts down, nodes at
        zero deleted)."""
        toks, n = seq.tokens, len(seq.tokens)
        for start in range(n):
            node = self.root
            for i in range(start, min(n, start + self.max_depth)):
                tok = toks[i]
                child = node.children[tok]
                child.count -= 1
                if node.best is child:
                    node.best = None             # recomputed when next needed
                if child.count == 0:
                    del node.children[tok]
                    break
                node = child
        seq.hot.clear()

    def match(self, context: list[int]) -> tuple[Node, int, int] | None:
        """Find ``context`` as a path from the root.

        Returns:
            ``(node, depth, into_tail)``: the deepest node on the path, its depth, and how
            many context tokens lie beyond it inside its tail (0 for an ordinary node), or
            None when the context does not occur.
        """
        node, k, n = self.root, 0, len(context)
        while k < n:
            children = node.children
            if children is None:
                rest = context[k:]
                q = node.pos
                if node.seq.tokens[q:q + len(rest)].tolist() != rest:
                    return None
                return node, k, len(rest)
            node = children.get(context[k])
            if node is None:
                return None
            k += 1
        return node, n, 0

    def follow(self, node: Node, depth: int, into_tail: int, denominator: int, max_tokens: int,
               min_token_prob: float) -> tuple[list[int], float]:
        """Greedy continuation from a ``match`` result: the most frequent child while the
        path probability (product of ``child.count / parent count``, the first parent
        count being ``denominator``, > 0) stays >= ``min_token_prob``; inside a tail every
        token keeps the probability reached (one occurrence, one continuation).

        Returns:
            (up to ``max_tokens`` tokens, score = sum of their path probabilities).
        """
        out: list[int] = []
        prob, score, n = 1.0, 0.0, 0
        while n < max_tokens:
            children = node.children
            if children is None:
                owner = node.seq.tokens
                begin = node.pos + into_tail
                end = min(len(owner), node.pos - depth + self.max_depth, begin + max_tokens - n)
                if end > begin:
                    out += owner[begin:end].tolist()
                    score += prob * (end - begin)
                break
            child = node.best
            if child is None:
                if not children:
                    break
                child = node.best = max(children.values(), key=_count)
            prob *= child.count / denominator
            if prob < min_token_prob:
                break
            out.append(child.tok)
            score += prob
            n += 1
            node, depth, into_tail, denominator = child, depth + 1, 0, child.count
        return out, score
