"""A depth-bounded suffix trie with occurrence counts (``child.count / node.count`` is the
empirical next-token probability) and lazily materialised single-occurrence tails. One
sequence at a time may be extended. Design and costs: docs/notes/spec-decode.md."""
from __future__ import annotations

from array import array
from collections.abc import Sequence


class Node:
    """A trie node: ordinary (``children`` token -> Node, ``best`` the top child or None if
    unknown) or a tail (``children`` None; continues at ``seq.tokens[pos]``)."""

    __slots__ = ("tok", "count", "children", "best", "seq", "pos")

    def __init__(self, tok: int, children: dict | None = None, seq: TokenSeq | None = None, pos: int = 0):
        self.tok = tok
        self.count = 1
        self.children = children
        self.best: Node | None = None
        self.seq = seq
        self.pos = pos

    def top_child(self) -> Node | None:
        if self.best is None and self.children:
            self.best = max(self.children.values(), key=_count)
        return self.best


def _count(node: Node) -> int:
    return node.count


class TokenSeq:
    """A stored sequence: tokens (int32 array) and hot starts (start -> ordinary node at the path's end)."""

    __slots__ = ("tokens", "hot")

    def __init__(self):
        self.tokens = array("i")
        self.hot: dict[int, Node] = {}

    def __len__(self) -> int:
        return len(self.tokens)


class SuffixTree:
    """Counts of every substring of length <= ``max_depth`` of the inserted sequences."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = Node(-1, children={})

    def extend(self, seq: TokenSeq, new_tokens: Sequence[int]) -> None:
        """Append ``new_tokens`` to ``seq`` (the only sequence being extended) and insert their paths."""
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
        """Make ``tail`` (at ``depth``) ordinary, with one tail child for its owner's next token."""
        owner, q = tail.seq, tail.pos
        tail.children = {}
        tail.seq = None
        if depth < self.max_depth and q < len(owner.tokens):
            tok = owner.tokens[q]
            tail.children[tok] = tail.best = Node(tok, seq=owner, pos=q + 1)

    def remove(self, seq: TokenSeq) -> None:
        """Take every path of a finished ``seq`` out of the tree (counts down, zero nodes deleted)."""
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
        """Find ``context`` as a path from the root: ``(node, depth, into_tail)`` (the deepest node,
        its depth, context tokens beyond it inside its tail), or None when it does not occur."""
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
        """Greedy continuation from a ``match``: the most frequent child while the path probability
        (first parent count ``denominator`` > 0) stays >= ``min_token_prob``. Returns (up to
        ``max_tokens`` tokens, score = sum of their path probabilities)."""
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
