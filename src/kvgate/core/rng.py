"""The randomness the core may use, injected by the driver.

The core never imports :mod:`random`; a seeded ``random.Random`` satisfies this
protocol, so the same seed gives the same decisions.
"""

from typing import Protocol


class Rng(Protocol):
    def random(self) -> float:
        """A float in [0, 1)."""
        ...


def pick_index(rng: Rng, n: int) -> int:
    """A uniform index in ``range(n)`` drawn with one call to ``rng.random()``."""
    if n <= 0:
        raise ValueError("pick_index needs n >= 1")
    i = int(rng.random() * n)
    return i if i < n else n - 1
