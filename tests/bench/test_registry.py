"""`swallow bench NAME`: one registry names every bench, each bench owns its
options, and every bench command the docs show still parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from bench.registry import BENCHES, BENCHES_BY_NAME, bench_parser
from swallow.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _documented_bench_commands() -> list[list[str]]:
    """`swallow bench ...` lines of the README's and docs' code blocks, continuations joined."""
    commands = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        in_code = False
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("```"):
                in_code = not in_code
                continue
            text = line.strip()
            if not in_code or not text.startswith("swallow bench "):
                continue
            while text.endswith("\\"):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            text = re.split(r"\s#|\s>|\s2>", text)[0]
            commands.append(shlex.split(text)[2:])
    return commands


def test_every_bench_builds_its_own_options() -> None:
    assert len(BENCHES_BY_NAME) == len(BENCHES)
    for bench in BENCHES:
        module = bench.load()
        assert callable(module.add_arguments) and callable(module.run), bench.name
        parser = bench_parser(bench.name)
        required = [a.option_strings[0] for a in parser._actions if a.required]
        assert required in ([], ["--trace"]), bench.name  # only trace replays need an input
        args = parser.parse_args(["--json", *(x for flag in required for x in (flag, "t"))])
        assert args.json is True


def test_documented_bench_commands_still_parse() -> None:
    commands = _documented_bench_commands()
    assert {argv[0] for argv in commands} >= {"throughput", "serve", "load", "kv", "fp8"}
    for argv in commands:
        name, options = argv[0], argv[1:]
        assert name in BENCHES_BY_NAME, argv
        bench_parser(name).parse_args(options)


def test_bench_dispatches_through_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "kv", "--preset", "tiny", "--context", "512", "--kv-budget-gib", "1"])
    assert (args.name, args.bench_args) == ("kv", ["--preset", "tiny", "--context", "512", "--kv-budget-gib", "1"])
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "no-such-bench"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # an option another bench owns is refused, not ignored
        main(["bench", "kv", "--trace", "x"])
    assert exit_.value.code == 2 and "--trace" in capsys.readouterr().err
