from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvgate import __version__
from kvgate.cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "demo" in capsys.readouterr().out


def test_demo_explains_every_decision() -> None:
    lines: list[str] = []
    from kvgate.demo import run_demo

    assert run_demo(lines.append) == 0
    rows = [ln for ln in lines if ln.strip().startswith(("0.", "1.", "2.", "3."))]
    assert len(rows) == 9
    # later turns of a conversation return to the node holding its history
    assert any("cache_hit" in ln or "spread" in ln for ln in rows)
    assert lines[-1].startswith("routing reasons:")


def test_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert __version__ in out.stdout


@pytest.mark.parametrize("command", ["simulate", "bench"])
def test_closed_loop_help_says_when_the_next_request_goes(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """simulate and bench wait for the same thing: the previous request's end, however
    it ended, then its think time."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "only once the previous one has ended (answered, failed or refused), plus its think "
        "time (an agent's tool gap) divided by --speedup" in text
    )


def test_stdout_without_a_reader_ends_quietly() -> None:
    """`kvgate demo | head -1`: the reader has gone; no traceback, the shell's
    broken-pipe status (141), whichever command was printing."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read what the command prints
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvgate.cli", "demo"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and b"Traceback" not in proc.stderr


def test_ctrl_c_before_a_command_handles_it_is_quiet(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while the command is still importing was a KeyboardInterrupt traceback."""
    import kvgate.cli

    def interrupted(argv: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(kvgate.cli, "_run", interrupted)
    assert main(["demo"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_serve_help_shows_the_config_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgate.gateway.config import AdmissionSection

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"(admission.budget, default {AdmissionSection().budget})" in out
    assert "(server.route_headers, default on)" in out
    assert "(nodes.metrics_interval_s, default 1)" in out and "(default info)" in out


def test_kvgate_up_says_when_a_crashed_engines_log_goes_away(
        capsys: pytest.CaptureFixture[str]) -> None:
    """An engine that died is reported with its log file; without --log-dir that file is
    removed when kvgate up exits, which the line now says."""
    import asyncio
    import contextlib
    from types import SimpleNamespace

    from kvgate.commands.up import _watch_engines

    dead = SimpleNamespace(node_id="node-1", pid=4242, alive=lambda: False,
                           proc=SimpleNamespace(returncode=-9), log_path="/tmp/x/node-1.log")

    async def watch(own: bool) -> None:
        task = asyncio.ensure_future(_watch_engines(
            SimpleNamespace(engines=[dead], own_log_dir=own)))  # type: ignore[arg-type]
        await asyncio.sleep(1.2)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(watch(True))
    err = capsys.readouterr().err
    assert "engine node-1 (pid 4242) exited with code -9; see /tmp/x/node-1.log" in err
    assert "removed when kvgate up exits; --log-dir keeps it" in err
    asyncio.run(watch(False))
    assert "removed" not in capsys.readouterr().err
