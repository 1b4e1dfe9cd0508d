"""`kvgate` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvgate import __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="KV-cache-aware routing and global admission control for LLM clusters.",
    )
    parser.add_argument("--version", action="version", version=f"kvgate {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # no --seed: the demo turns exploration off, so no decision is random (a seed
    # flag changed nothing)
    sub.add_parser(
        "demo",
        help="route a few requests through the core and explain each decision",
        description="Route a few chat requests through kvgate's core on 4 in-memory nodes "
        "and print each decision with its reason and score parts (deterministic).",
    )
    from kvgate.commands.simulate_args import add_simulate_parser
    from kvgate.commands.up import add_up_parser
    from kvgate.engine.server import add_engine_parser
    from kvgate.gateway.serve import add_serve_parser
    from kvgate.loadgen.cli import add_bench_parser

    add_serve_parser(sub)
    add_simulate_parser(sub)
    add_engine_parser(sub)
    add_bench_parser(sub)
    add_up_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling (e.g. imports)
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout's reader went away (`kvgate ... | head`): stop quietly, as Unix tools do
        from kvgate.commands.pipes import EXIT_BROKEN_PIPE, silence_stdout

        silence_stdout()
        return EXIT_BROKEN_PIPE


def _run(argv: Sequence[str] | None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from kvgate.demo import run_demo

        return run_demo()
    if args.command == "simulate":
        from kvgate.commands.simulate import run_simulate

        return run_simulate(args)
    if args.command == "serve":
        from kvgate.gateway.serve import run_serve

        return run_serve(args)
    if args.command == "engine":
        from kvgate.engine.server import run_engine

        return run_engine(args)
    if args.command == "bench":
        from kvgate.loadgen.cli import run_bench

        return run_bench(args)
    if args.command == "up":
        from kvgate.commands.up import run_up

        return run_up(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
