"""What a router learns from its own routing alone: the prompts it sent each node.

SGLang's router in HTTP mode (and vllm-router's ``cache_aware``, a fork of it) keeps
such a tree: each prompt is inserted under the worker it was sent to and stays there
until that worker's tree outgrows ``max_tree_size`` (2^26), when its least recently
used leaves go. It knows nothing of the engine's own eviction, so it remembers
prefixes long gone from a node whose KV pool is a small fraction of that; routing
sends a session back to where it went before whatever the node has dropped since.
kvgate's cache location table (``kvgate.core.index``) mirrors each node's KV
capacity instead, and a baseline modelled on those routers must not be handed it:
a policy whose ``cache_view`` is ``"routed"`` is matched against this tree, in
precise mode too (SGLang's gRPC mode reads the engines' events, but selects by overlap
without the HTTP router's threshold: a different policy).

Keys are the index's chain hashes: a chain hash names its whole prefix, so a node's
match is the run of the prompt's leading blocks it holds.
"""

from __future__ import annotations

from collections import OrderedDict

from kvgate.core.ids import BlockChain, NodeId

# SGLang's max_tree_size per worker, here in tokens (gRPC mode counts tokens, HTTP
# mode characters: at ~4 a token, a quarter as many tokens, still 32 768 blocks of 512
# tokens, more than the conversation trace sends one node: at most 23 700 at 0.95 of
# round robin's saturation)
SGLANG_MAX_TREE_TOKENS = 1 << 26


class RoutedTree:
    """Per node, the chain blocks routed there, least recently routed first."""

    __slots__ = ("_max_tokens", "_nodes")

    def __init__(self, max_tokens: int = SGLANG_MAX_TREE_TOKENS) -> None:
        if max_tokens <= 0:
            raise ValueError("max_tokens must be > 0")
        self._max_tokens = max_tokens
        self._nodes: dict[NodeId, OrderedDict[int, None]] = {}

    def match(self, chain: BlockChain) -> dict[NodeId, int]:
        """Each node's longest routed prefix of ``chain``, in blocks (absent: none)."""
        out: dict[NodeId, int] = {}
        if not chain:
            return out
        first = chain[0]
        for node_id, blocks in self._nodes.items():
            if first not in blocks:
                continue
            n = 1
            for h in chain[1:]:
                if h not in blocks:
                    break
                n += 1
            out[node_id] = n
        return out

    def insert(self, node_id: NodeId, chain: BlockChain, tokens_per_block: int) -> None:
        """``chain`` was sent to the node: its blocks become the most recent there, and
        beyond the size bound the least recently routed go."""
        if not chain:
            return
        blocks = self._nodes.setdefault(node_id, OrderedDict())
        for h in reversed(chain):  # the root ends most recent, as SGLang's leaves go first
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        cap = max(1, self._max_tokens // max(1, tokens_per_block))
        while len(blocks) > cap:
            blocks.popitem(last=False)

    def forget(self, node_id: NodeId) -> None:
        """The node left: its tree goes (bounded memory as node ids come and go)."""
        self._nodes.pop(node_id, None)

    def size(self, node_id: NodeId) -> int:
        """Blocks held for the node."""
        return len(self._nodes.get(node_id, ()))
