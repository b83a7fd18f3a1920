"""Every ``make ...`` and ``python -m benchmarks.X ...`` command the documentation shows runs as written.

The commands are read, when the test runs, from README.md, CONTRIBUTING.md, recipes/README.md and docs/*.md:
inline code and the lines of fenced code blocks (``#`` comments and ``[optional]`` groups left out). A
``make`` line must name targets that exist, with options and variables make accepts (``make -n``, the venv
left as it is); the ``ARGS`` it gives a target that runs ``python -m benchmarks.X $(ARGS)`` must parse under
that benchmark's command line. A ``python -m benchmarks.X`` line must name a module whose ``main(argv)``
parses its arguments. Nothing is run: parsing stops the benchmark's ``main`` before it does any work.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "CONTRIBUTING.md", "recipes/README.md", "docs/*.md")


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def _snippets(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each fenced code line and each inline code span."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            out.append((number, line))
        else:
            out += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
    return out


def documented_commands(root: Path) -> list[Command]:
    """The ``make`` and ``python -m benchmarks.X`` commands shown in the documentation under ``root``."""
    commands = []
    for path in sorted({p for pattern in DOCS for p in root.glob(pattern)}):
        for number, code in _snippets(path.read_text()):
            code = re.sub(r"\[[^\[\]]*\]", " ", code)  # optional arguments in usage notation
            try:
                tokens = shlex.split(code, comments=True)
            except ValueError:  # not shell (an unbalanced quote in prose)
                continue
            words: list[str] = []
            for token in [*tokens, ";"]:
                if token not in (";", "&&", "||", "|"):
                    words.append(token)
                    continue
                is_make = words[:1] == ["make"]
                is_bench = (
                    len(words) > 2 and words[1] == "-m" and words[2].startswith("benchmarks.")
                )
                if is_make or (is_bench and Path(words[0]).name.startswith("python")):
                    where = f"{path.relative_to(root)}:{number}"
                    commands.append(
                        Command(where, tuple(words if is_make else ["python", *words[1:]]))
                    )
                words = []
    return commands


class _Parsed(Exception):
    pass


def benchmark_problem(module: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Why ``python -m module *args`` would not get past its command line (None: it would)."""
    try:
        main = importlib.import_module(module).main
    except (ImportError, AttributeError) as err:
        return f"no benchmark {module} with a main(argv): {err}"
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(
        self: argparse.ArgumentParser, *a: object, **k: object
    ) -> argparse.Namespace:
        raise _Parsed(parse_args(self, *a, **k))  # type: ignore[arg-type]

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        try:
            main(args)
        except _Parsed:
            return None
        except SystemExit as exit:
            return f"its command line rejects {shlex.join(args)!r} (exit {exit.code})"
    return f"{module}.main returned without parsing its arguments"


def _make_runs(target: str) -> str | None:
    """The benchmark module a Makefile target runs with ``$(ARGS)`` (None: it takes no ARGS)."""
    recipe = re.search(
        rf"^{re.escape(target)}:.*\n((?:\t.*\n)*)", (REPO / "Makefile").read_text(), re.M
    )
    found = re.search(r"-m (benchmarks\.[\w.]+) \$\(ARGS\)", recipe.group(1)) if recipe else None
    return found.group(1) if found else None


def make_problem(argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Why the make command line ``argv`` would not run as written (None: it would)."""
    dry = ["make", "-n", "-s", "-o", ".venv/.installed", "-C", str(REPO), *argv[1:]]
    done = subprocess.run(dry, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return f"make -n fails: {(done.stderr.strip().splitlines() or ['?'])[0]}"
    variables = dict(w.split("=", 1) for w in argv[1:] if "=" in w and not w.startswith("-"))
    targets = [w for w in argv[1:] if "=" not in w and not w.startswith("-")]
    if "ARGS" not in variables:
        return None
    runs = {t: _make_runs(t) for t in targets}
    if not targets or not all(runs.values()):
        return f"ARGS given to a target that does not pass them on: {targets}"
    for module in runs.values():
        assert module is not None
        if why := benchmark_problem(module, shlex.split(variables["ARGS"]), monkeypatch):
            return why
    return None


def problem(command: Command, monkeypatch: pytest.MonkeyPatch) -> str | None:
    if command.argv[0] == "make":
        return make_problem(command.argv, monkeypatch)
    return benchmark_problem(command.argv[2], list(command.argv[3:]), monkeypatch)


COMMANDS = documented_commands(REPO)


def test_the_documentation_shows_commands() -> None:
    assert any(c.argv[0] == "make" for c in COMMANDS), "no make command found in the documentation"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_documented_command_runs_as_written(
    command: Command, monkeypatch: pytest.MonkeyPatch
) -> None:
    why = problem(command, monkeypatch)
    assert why is None, f"{command}: {why}"


def test_the_checker_flags_what_would_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "Run `make bench ARGS=--quick`, `make gpu-check ARGS='--dry-run --skip recipes'`.\n"
        "```\nmake setup && make test  # the suite\npython -m benchmarks.overhead [--json PATH]\n```\n"
    )
    (tmp_path / "docs" / "x.md").write_text(
        "`make bench --workloads digits`, `make bench ARGS='--cadences 1/10'`, `make nothing`,\n"
        "`make train ARGS=--quick`, `python -m benchmarks.absent`, "
        "`python -m benchmarks.overhead --workloads nope`\n"
    )
    found = documented_commands(tmp_path)
    verdicts = {c.where + " " + shlex.join(c.argv): problem(c, monkeypatch) for c in found}
    good = [k for k, v in verdicts.items() if v is None]
    bad = [k for k, v in verdicts.items() if v is not None]
    assert good == [
        "README.md:1 make bench ARGS=--quick",
        "README.md:1 make gpu-check 'ARGS=--dry-run --skip recipes'",
        "README.md:3 make setup",
        "README.md:3 make test",
        "README.md:4 python -m benchmarks.overhead",
    ]
    assert len(bad) == 6 and all(k.startswith("docs/x.md:") for k in bad), verdicts
