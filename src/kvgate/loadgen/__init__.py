"""Load generator: replay kvgate workloads as real prompts against any OpenAI-compatible
endpoint and report ``vllm bench serve``-style metrics (``kvgate bench``).

This package is an I/O shell (asyncio, aiohttp, clock, randomness); the workloads come
from the pure simulator (:mod:`kvgate.sim`).

* :mod:`~kvgate.loadgen.prompts`: block ids -> text shared exactly where ids match.
* :mod:`~kvgate.loadgen.client`: one timed streaming request.
* :mod:`~kvgate.loadgen.runner`: schedules and :func:`run_load`.
* :mod:`~kvgate.loadgen.report`: metrics arithmetic, the table and the JSON keys.
* :mod:`~kvgate.loadgen.cli`: ``add_bench_parser`` / ``run_bench``.
"""

from kvgate.loadgen.report import LoadReport, RequestResult, Stats, build_report
from kvgate.loadgen.runner import LoadConfig, run_load

__all__ = ["LoadConfig", "LoadReport", "RequestResult", "Stats", "build_report", "run_load"]
