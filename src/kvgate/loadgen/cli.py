"""``kvgate bench``: replay a workload against any OpenAI-compatible endpoint.

:func:`add_bench_parser` adds the ``bench`` subcommand to an ``argparse`` subparsers
object and :func:`run_bench` runs it from the parsed arguments (exit code 0 when any
request succeeded, 1 when none did: all failed, or the time bound came before any was
sent; 2 on a usage or setup error, a malformed ``--base-url`` included; 130 when
interrupted: one line, no report; ``--max-seconds`` bounds a run). The table goes to
stdout, the progress bar to stderr; ``--json FILE`` writes :meth:`LoadReport.to_dict`
(keys documented in :mod:`kvgate.loadgen.report`). ``python -m kvgate.loadgen.cli``
runs the subcommand standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from kvgate.commands.argtypes import (
    check_closed_loop,
    check_distinct_files,
    check_output_file,
    positive_float,
    positive_int,
)
from kvgate.loadgen.client import check_base_url, one_line
from kvgate.loadgen.prompts import (
    MIN_BLOCK_CHARS,
    SYNTHETIC_WORKLOADS,
    check_block_chars,
    synthetic_workload,
    trace_workload,
)
from kvgate.loadgen.report import parse_goodput
from kvgate.loadgen.runner import LoadConfig, run_load

# --num-requests without --trace: a trace has its own length, a generator has none
SYNTHETIC_NUM_REQUESTS = 200

_DESCRIPTION = (
    "Replay a synthetic workload or a Mooncake trace against an OpenAI-compatible "
    "endpoint, turning block ids into real prompts that share text exactly where the "
    "ids match, and report TTFT/TPOT/ITL/E2EL, throughput, goodput and the cache hit "
    "ratio like `vllm bench serve`."
)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return value


def _temperature(text: str) -> float:
    """OpenAI's range, [0, 2]: a NaN went out as a bare NaN, which is not JSON, and every
    request came back 400."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 2.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be in [0, 2], got {text}")
    return value


def _fill_parser(p: argparse.ArgumentParser) -> None:
    wl = p.add_argument_group("workload")
    src = wl.add_mutually_exclusive_group()
    src.add_argument(
        "--workload", choices=SYNTHETIC_WORKLOADS, help="synthetic generator (default gsp)"
    )
    src.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace to replay")
    wl.add_argument(
        "--workload-size",
        type=positive_int,
        metavar="N",
        help="groups (gsp, 16 prompts each), sessions (chat), tasks (agent) or "
        "documents (zipf); default: enough for --num-requests",
    )
    wl.add_argument(
        "--arrival-rate",
        type=positive_float,
        metavar="R",
        help="the synthetic generator's own rate (sessions/tasks started per "
        "second for chat/agent); used by --schedule trace",
    )
    wl.add_argument(
        "--closed-loop",
        action="store_true",
        help="chat and agent: send a session's next request only once the previous one "
        "has ended (answered, failed or refused), plus its think time (an agent's tool "
        "gap) divided by --speedup (default: open loop, every request on its schedule)",
    )
    wl.add_argument(
        "--speedup",
        type=positive_float,
        default=1.0,
        help="divide workload timestamps by this (--schedule trace; default 1)",
    )
    wl.add_argument(
        "--bucket",
        choices=("spread", "burst"),
        help="--trace with --schedule trace: replay the requests sharing a bucketed trace "
        "timestamp at once (burst) or evenly spread to the next timestamp (spread), as "
        "kvgate simulate --bucket (default spread)",
    )
    wl.add_argument(
        "--limit", type=positive_int, metavar="N", help="read only the first N requests of --trace"
    )
    wl.add_argument(
        "--block-tokens",
        type=positive_int,
        default=512,
        help="tokens per block id (default 512); times --chars-per-token it must be at "
        f"least {MIN_BLOCK_CHARS}, the characters that give each id its own text",
    )
    wl.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the generator, the prompt text and Poisson gaps; change it "
        "to avoid a warm prefix cache from an earlier run (default 0)",
    )
    wl.add_argument(
        "--chars-per-token",
        type=positive_int,
        default=4,
        help="characters of text per token (default 4)",
    )
    wl.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        metavar="N",
        help="cut longer prompts to N tokens (their tail)",
    )
    wl.add_argument(
        "--output-tokens-cap",
        type=positive_int,
        metavar="N",
        help="cap max_tokens of every request",
    )

    ld = p.add_argument_group("load")
    ld.add_argument(
        "--rate",
        type=_rate,
        metavar="R",
        help="requests per second (Poisson unless --burstiness), or inf (default inf)",
    )
    ld.add_argument(
        "--burstiness",
        type=positive_float,
        metavar="B",
        help="gaps of --rate drawn from a gamma distribution of shape B, as vllm bench "
        "serve: 1 is Poisson, below 1 burstier, above 1 more even; the mean gap stays "
        "1/R (default 1)",
    )
    ld.add_argument(
        "--schedule",
        choices=("rate", "trace"),
        default="rate",
        help="rate: --rate; trace: the workload's own timestamps over --speedup (a trace's "
        "requests that share one placed by --bucket) (default rate)",
    )
    ld.add_argument(
        "--concurrency",
        type=positive_int,
        metavar="N",
        help="at most N requests in flight; alone, a closed loop of N users",
    )
    ld.add_argument(
        "--num-requests",
        type=positive_int,
        metavar="N",
        help="send at most the first N requests (default: all of --trace, after --limit; "
        f"{SYNTHETIC_NUM_REQUESTS} of a synthetic workload)",
    )
    ld.add_argument(
        "--max-seconds",
        type=positive_float,
        default=120.0,
        help="stop sending and cancel what runs after this long (default 120)",
    )
    ld.add_argument(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        help="per-request timeout in seconds (default 600)",
    )

    ep = p.add_argument_group("endpoint")
    ep.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="OpenAI base URL, /v1 appended (default http://127.0.0.1:8000)",
    )
    ep.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default completions)",
    )
    ep.add_argument("--model", help="model name (default: first id of GET /v1/models)")
    ep.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    ep.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="do not stream (no TTFT/ITL/TPOT then)",
    )
    ep.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to ignore EOS (vLLM/SGLang extension)",
    )
    ep.add_argument("--temperature", type=_temperature, default=0.0, help="in [0, 2] (default 0)")

    out = p.add_argument_group("output")
    out.add_argument(
        "--goodput",
        nargs="+",
        metavar="NAME:MS",
        default=[],
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft tpot e2el)",
    )
    out.add_argument("--json", metavar="FILE", help="write the aggregates as JSON")
    out.add_argument(
        "--save-detailed", action="store_true", help="add per-request arrays to --json"
    )
    out.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar on stderr"
    )


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``bench`` subcommand (its options: see ``kvgate bench --help``)."""
    p = subparsers.add_parser(
        "bench", help="benchmark an OpenAI-compatible endpoint", description=_DESCRIPTION
    )
    _fill_parser(p)


def check_json_output(json_path: str | None) -> None:
    """Fail before the run, not after it, when ``--json FILE`` cannot be written: its
    folder is missing or not writable, it is a folder, or it is a read-only file.
    Raises ValueError."""
    if json_path is None:
        return
    path = Path(json_path)
    check_output_file(path, "--json")
    parent = path.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--json {path}: the folder {parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"--json {path}: the file is not writable")


def check_block_size(block_tokens: int, chars_per_token: int) -> None:
    """Refuse blocks too short to give distinct ids distinct text (ValueError, exit 2),
    before a workload is built: such blocks shared text, so the server saw prefix
    sharing the workload does not have (see :mod:`kvgate.loadgen.prompts`)."""
    try:
        check_block_chars(block_tokens, chars_per_token)  # the rule; here in flags' words
    except ValueError:
        least = -(-MIN_BLOCK_CHARS // chars_per_token)
        raise ValueError(
            f"--block-tokens {block_tokens} x --chars-per-token {chars_per_token} = "
            f"{block_tokens * chars_per_token} characters per block, too few to give every "
            f"block id its own text (at least {MIN_BLOCK_CHARS}); use --block-tokens "
            f"{least} or more"
        ) from None


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The :class:`LoadConfig` for parsed ``bench`` arguments (reads ``--trace``; one
    line on stderr when ``--num-requests`` leaves out part of the trace)."""
    check_base_url(args.base_url, "--base-url")  # it failed every request instead
    if args.bucket is not None and (args.trace is None or args.schedule != "trace"):
        # the trace's timestamps are replayed only then; elsewhere it was ignored unsaid
        raise ValueError("--bucket places the requests that share a trace timestamp: it "
                         "applies to --trace with --schedule trace")
    if args.schedule == "trace" and args.rate is not None:
        raise ValueError(
            "--rate does not apply to --schedule trace (use --speedup, or "
            "--arrival-rate for a synthetic workload)"
        )
    finite_rate = args.rate is not None and not math.isinf(args.rate)
    if args.burstiness is not None and (args.schedule == "trace" or not finite_rate):
        # it shapes the gaps of a finite --rate; anywhere else it was ignored unsaid
        raise ValueError("--burstiness shapes the gaps of --rate R (finite, --schedule rate)")
    if args.save_detailed and not args.json:
        raise ValueError("--save-detailed needs --json FILE")
    check_json_output(args.json)
    check_distinct_files(
        {"--trace": Path(args.trace) if args.trace else None},
        {"--json": Path(args.json) if args.json else None},
    )
    check_closed_loop(args)
    check_block_size(args.block_tokens, args.chars_per_token)
    num_requests: int
    if args.trace:
        if args.workload_size is not None or args.arrival_rate is not None:
            raise ValueError("--workload-size and --arrival-rate shape a synthetic workload; "
                             "a trace has its own size and timestamps")
        workload = trace_workload(args.trace, limit=args.limit, block_tokens=args.block_tokens,
                                  bucket_mode=args.bucket or "spread")
        total = len(workload.requests)
        if not total:  # an all-zero table and exit 0 said nothing was wrong
            raise ValueError(f"--trace {args.trace}: the trace holds no requests")
        num_requests = total if args.num_requests is None else args.num_requests
        if num_requests < total:  # the user's choice, but a cut trace should not go unnoticed
            print(
                f"kvgate bench: --num-requests {num_requests} sends only the first "
                f"{num_requests} of the trace's {total} requests",
                file=sys.stderr,
            )
    else:
        if args.limit is not None:
            raise ValueError("--limit reads the first N requests of --trace; for a "
                             "synthetic workload use --num-requests")
        num_requests = args.num_requests or SYNTHETIC_NUM_REQUESTS
        workload = synthetic_workload(
            args.workload or "gsp",
            seed=args.seed,
            num_requests=num_requests,
            block_tokens=args.block_tokens,
            arrival_rate=args.arrival_rate,
            size=args.workload_size,
            closed_loop=args.closed_loop,
        )
    return LoadConfig(
        workload=workload,
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        stream=args.stream,
        schedule=args.schedule,
        rate=math.inf if args.rate is None else args.rate,
        burstiness=1.0 if args.burstiness is None else args.burstiness,
        concurrency=args.concurrency,
        speedup=args.speedup,
        num_requests=num_requests,
        max_seconds=args.max_seconds,
        seed=args.seed,
        chars_per_token=args.chars_per_token,
        max_prompt_tokens=args.max_prompt_tokens,
        output_tokens_cap=args.output_tokens_cap,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        request_timeout_s=args.request_timeout,
        goodput_slos_ms=parse_goodput(args.goodput),
        progress=args.progress,
        source=(
            # bucket: null when the trace's timestamps are not replayed (--schedule rate)
            {"trace": str(args.trace), "limit": args.limit,
             "bucket": (args.bucket or "spread") if args.schedule == "trace" else None}
            if args.trace
            else {"workload_size": args.workload_size, "arrival_rate": args.arrival_rate}
        ),
    )


def _setup_error(e: BaseException) -> str:
    """``e`` as one line. aiohttp's parser errors (a ClientResponseError) carry a message
    of several lines, the bad bytes and a caret under them, which its str() showed as a
    repr, ``\\n`` escapes and all; flattened from the message itself instead."""
    if isinstance(e, aiohttp.ClientResponseError):
        text = f"{e.status}, message={e.message}, url={e.request_info.real_url}"
    else:
        text = str(e)
    return f"{type(e).__name__}: {one_line(text, 500)}"


def run_bench(args: argparse.Namespace) -> int:
    """Run ``kvgate bench``; see the module docstring for exit codes."""
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as e:
        print(f"kvgate bench: {e}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run_load(config))
    except (aiohttp.ClientError, RuntimeError, TimeoutError) as e:
        print(f"kvgate bench: {_setup_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # one line, not a traceback (use --max-seconds for a bound)
        print("kvgate bench: interrupted; no report", file=sys.stderr)
        return 130
    print(report.format_table())
    if args.json:
        try:
            Path(args.json).write_text(
                json.dumps(report.to_dict(detailed=args.save_detailed), indent=2) + "\n"
            )
        except OSError as e:  # checked before the run; the disk or folder changed since
            print(f"kvgate bench: cannot write --json {args.json}: {e}", file=sys.stderr)
            return 2
    # nothing sent (the time bound came first) is no success either: it exited 0
    return 0 if report.completed else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate-bench", description=_DESCRIPTION)
    _fill_parser(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
