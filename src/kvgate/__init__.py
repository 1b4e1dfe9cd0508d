"""kvgate: KV-cache-aware routing and global admission control for LLM inference clusters.

The decisions live in :mod:`kvgate.core`, a pure synchronous library; the gateway,
the simulator and the tests are drivers around it.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
