"""Identifier types shared by every part of the core.

NewType ids keep a node id from being passed where a tenant id is expected.
"""

from typing import NewType

NodeId = NewType("NodeId", str)
TenantId = NewType("TenantId", str)
RequestId = NewType("RequestId", str)

# A chained 64-bit block hash: h_i = H(h_{i-1}, block_i). One index holds one key space.
BlockHash = int
BlockChain = tuple[BlockHash, ...]

DEFAULT_TENANT = TenantId("default")
