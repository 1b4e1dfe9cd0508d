"""The cache location table (block hash -> nodes) and hot-prefix rate tracking."""

from kvgate.core.index.cluster_index import ClusterIndex
from kvgate.core.index.hot_prefix import HotPrefixTracker

__all__ = ["ClusterIndex", "HotPrefixTracker"]
