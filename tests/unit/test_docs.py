"""The code in README.md and docs/: the README's Python and commands run; every Python snippet in docs/ runs, either
itself (in a harness that builds what its text presumes, ``_docs_run.py``) or as an exact excerpt of a script or test
scenario that the suite runs; every other snippet is checked (each `sdc-telemetry` command names a real subcommand
and real options, YAML loads, `make` targets exist), so that the documentation cannot drift from the code unseen.

A Python block in docs/ is preceded by one marker line: ``<!-- snippet: run HARNESS -->`` or
``<!-- snippet: from PATH -->``. An excerpt's lines (comments and indentation aside; ``...`` elides) appear in PATH in
the same order."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import sdc_telemetry as sdc
from sdc_telemetry.ops.cli import build_parser
from sdc_telemetry.ops.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARKED = re.compile(r"^(?:<!-- snippet: (run|from) (\S+) -->\n)?```python\n(.*?)^```", re.S | re.M)
TESTS = ROOT / "tests"


def python_snippets() -> list[tuple[str, str, str, str]]:
    """(id, kind, target, code) of every Python block in docs/; kind and target are None without a marker."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in MARKED.finditer(text):
            line = text[:m.start()].count("\n") + 1
            out.append((f"{path.name}:{line}", m.group(1), m.group(2), m.group(3)))
    return out


def _code_lines(text: str) -> list[str]:
    """A file's or excerpt's lines, whitespace-normalised, without comments, blank lines and ``...`` elisions."""
    out = []
    for line in text.splitlines():
        line = re.split(r"(?:^|\s)#\s", line, maxsplit=1)[0]
        line = " ".join(line.split())
        if line and line != "...":
            out.append(line)
    return out


def excerpt_missing(code: str, source: str) -> list[str]:
    """The excerpt's lines not found in ``source`` in order (empty: an exact excerpt)."""
    lines, at, missing = _code_lines(source), 0, []
    for line in _code_lines(code):
        try:
            at = lines.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


def blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def commands(code: str) -> list[list[str]]:
    """The shell commands of a bash block, continuation lines joined, split at ;, &&, || and |."""
    text = code.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"\s(?:&&|\|\||;|\|)\s", line):
            try:
                out.append(shlex.split(part))
            except ValueError:
                out.append(part.split())
        continue
    return out


def _subparsers() -> dict[str, Any]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(action.choices)  # type: ignore[attr-defined]


def check_sdc_command(argv: list[str], where: str) -> None:
    """``sdc-telemetry SUB --opt ...``: SUB exists and every --option is one of its options (``...`` elides)."""
    sub = _subparsers()
    i = argv.index("sdc-telemetry")
    name = argv[i + 1] if i + 1 < len(argv) else ""
    if name in ("...", ""):
        return
    assert name in sub, f"{where}: 'sdc-telemetry {name}' is no subcommand ({', '.join(sub)})"
    known = {s for a in sub[name]._actions for s in a.option_strings}
    for token in argv[i + 2:]:
        if token.startswith("--"):
            option = token.split("=", 1)[0]
            assert option in known, f"{where}: 'sdc-telemetry {name}' has no option {option}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_snippet_in_docs_is_valid(path: Path) -> None:
    """Python parses, sdc-telemetry command lines use real subcommands and options, YAML and JSON load."""
    import yaml

    found = blocks(path)
    for n, (lang, code) in enumerate(found):
        where = f"{path.name} block {n + 1}"
        if lang == "python":
            ast.parse(code, filename=where)
        elif lang in ("yaml", "yml"):
            yaml.safe_load(code)
        elif lang == "json":
            json.loads(code)
        elif lang in ("bash", "sh", ""):
            for argv in commands(code):
                if "sdc-telemetry" in argv:
                    check_sdc_command(argv, where)
                if argv[:1] == ["make"] and len(argv) > 1:
                    assert re.search(rf"^{re.escape(argv[1])}:", (ROOT / "Makefile").read_text(), re.M), where


SNIPPETS = python_snippets()


def test_every_python_snippet_in_docs_is_marked() -> None:
    """Each Python block says how it is run; the excerpt rule itself notices a changed line."""
    unmarked = [where for where, kind, _, _ in SNIPPETS if kind is None]
    assert SNIPPETS and not unmarked, f"Python blocks without a snippet marker: {unmarked}"
    source = "a = 1\nwith f() as g:  # opens\n    g.run(a)\n"
    assert excerpt_missing("a = 1\n...\nwith f() as g:\n    g.run(a)   # other words\n", source) == []
    assert excerpt_missing("g.run(a)\na = 1\n", source) == ["a = 1"]  # order counts
    assert excerpt_missing("g.run(b)\n", source) == ["g.run(b)"]


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s[1] == "from"], ids=lambda s: s[0])
def test_docs_excerpt_is_exact_and_its_source_runs(snippet: tuple[str, str, str, str]) -> None:
    """An excerpt is the code of a file the suite runs: an example launched by tests/integrations, or a multi-rank
    scenario module of tests/distributed."""
    where, _, target, code = snippet
    source = ROOT / target
    assert source.is_file(), f"{where}: {target} does not exist"
    missing = excerpt_missing(code, source.read_text())
    assert not missing, f"{where}: not in {target} (in this order): {missing}"
    stem = source.stem if source.parent.name != "torchtitan" else "torchtitan"
    runners = [f for f in TESTS.rglob("test_*.py") if stem in f.read_text()]
    assert runners, f"{where}: no test runs {target}"


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s[1] == "run"], ids=lambda s: s[0])
def test_docs_snippet_runs(snippet: tuple[str, str, str, str], tmp_path: Path) -> None:
    """The snippet runs, in its own process, with what its text presumes built for real on CPU, and does what the
    text says (each harness checks it: a checkpoint that verifies, a fit whose every step was checked, ...)."""
    where, _, harness, code = snippet
    (tmp_path / "snippet.py").write_text(code)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "SDC_METRICS_PORT": "none", "SDC_NVML": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_docs_run.py")), harness,
                           str(tmp_path / "snippet.py"), str(work)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0 and "SNIPPET OK" in proc.stdout, f"{where}:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"


def test_readme_recipe_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's three-line recipe runs as printed on a small model in one process, with SDC_* variables from
    the environment (no endpoint here): every step checked and applied (step.finite), nothing found."""
    [recipe] = [code for lang, code in blocks(ROOT / "README.md") if lang == "python"]
    monkeypatch.setenv("SDC_METRICS_PORT", "none")
    monkeypatch.setenv("SDC_NVML", "0")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loader = [torch.randn(3, 4) for _ in range(3)]
    before = model.weight.detach().clone()
    namespace: dict[str, Any] = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
                                 "loader": loader, "compute_loss": lambda m, b: m(b).square().mean()}
    exec(compile(recipe, "README.md", "exec"), namespace)
    monitor = namespace["monitor"]
    assert isinstance(monitor, sdc.SDCMonitor) and monitor.closed and monitor.config.metrics_port is None
    assert monitor.incidents == [] and monitor.current_step == 2
    assert not torch.equal(model.weight, before)  # every step was finite: every update applied


def test_readme_commands_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's make targets exist, and its sdc-telemetry commands run (on a ledger and a certified checkpoint
    made here, in place of the paths it prints)."""
    from sdc_telemetry.ops.ledger import Ledger

    ledger = tmp_path / "ledger.sqlite3"
    with Ledger(f"sqlite:///{ledger}") as led:
        led.add_strike("GPU-readme", host_name="node-r", alertname="SDCReplayMismatch")
    weights = {"w": torch.ones(2)}
    ckpt = tmp_path / "step-1200.pt"
    torch.save({"model": weights, "sdc_certificate": sdc.WeightCertificate.from_tensors(1200, weights).to_dict()},
               ckpt)
    paths = {"/var/lib/sdc-telemetry/ledger.sqlite3": str(ledger), "/ckpts/step-1200.pt": str(ckpt)}
    ran = 0
    for lang, code in blocks(ROOT / "README.md"):
        if lang != "bash":
            continue
        for argv in commands(code):
            if argv[:1] == ["make"]:
                assert re.search(rf"^{re.escape(argv[1])}:", (ROOT / "Makefile").read_text(), re.M), argv
            elif argv[:1] == ["sdc-telemetry"]:
                line = [next((v.replace(k, p) for k, p in paths.items() if k in v), v) for v in argv[1:]]
                assert cli(line) == 0, (argv, capsys.readouterr())
                ran += 1
    assert ran == 2
    out = capsys.readouterr().out
    assert "GPU-readme" in out and "intact" in out


def _docs_command_lines() -> list[tuple[str, list[str], str]]:
    """(where, argv after ``sdc-telemetry``, the documented output that follows it) of every command line in docs/."""
    out = []
    for path in DOCS:
        for n, (lang, code) in enumerate(blocks(path)):
            if lang not in ("bash", "sh", ""):
                continue
            lines = code.replace("\\\n", " ").splitlines()
            for i, line in enumerate(lines):
                if not re.match(r"^(\$ )?sdc-telemetry ", line):
                    continue
                shown = []
                for after in lines[i + 1:]:
                    if after.startswith("$ ") or not line.startswith("$ "):
                        break
                    shown.append(after)
                argv = shlex.split(line.removeprefix("$ ").split("  #", 1)[0])[1:]
                while argv and argv[-1] in ("&", ";"):  # shell syntax after the command
                    argv.pop()
                out.append((f"{path.name} block {n + 1}", argv, "\n".join(shown)))
    return out


def test_docs_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """Every `sdc-telemetry` command line in docs/ that ends by itself runs, on a scene made here: a ledger with a
    strike, certified checkpoints (one corrupted) in place of /checkpoints and the ledger path it prints, and ends
    as documented (a documented FAIL or CORRUPT exits 1, with that word; the rest exit 0). The responder's lines (a
    server) are parsed by the real argument parser; usage lines (``[--opt N]``, ``TEMPLATE``, ``...``) only checked."""
    from sdc_telemetry.ops.ledger import Ledger

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SDC_STATE_DIR", str(tmp_path / "state"))  # screen's default ledger
    ledger = tmp_path / "ledger.sqlite3"
    with Ledger(f"sqlite:///{ledger}") as led:
        led.add_strike("GPU-docs", host_name="node-docs", alertname="SDCReplayMismatch")
    weights = {f"layer{i}.weight": torch.full((4,), float(i)) for i in range(3)}
    for step, audit in ((1100, 1000), (1200, 1100), (1220, 1200), (1300, 1200)):
        cert = sdc.WeightCertificate.from_tensors(step, weights, last_passing_audit=audit)
        saved = dict(weights)
        if step == 1300:
            saved["layer1.weight"] = saved["layer1.weight"] + 1  # changed after it was certified
        torch.save({"model": saved, "sdc_certificate": cert.to_dict()}, tmp_path / f"ckpt-{step:08d}.pt")
    paths = {"sqlite:////var/lib/sdc-telemetry/ledger.sqlite3": f"sqlite:///{ledger}", "/checkpoints/": ""}
    parser = build_parser()
    ran, parsed = [], 0
    for where, argv, shown in _docs_command_lines():
        synopsis = any(a == "..." or a.startswith("[") or re.fullmatch(r"[A-Z][A-Z:_]*", a) for a in argv)
        if synopsis:  # a usage line: its options are checked by test_every_snippet_in_docs_is_valid
            continue
        if argv[0] == "respond":  # a server: the real parser takes the line as printed
            parser.parse_args(argv)  # SystemExit (2) on an unknown option or a bad value
            parsed += 1
            continue
        line: list[str] = []
        for a in argv:
            for k, p in paths.items():
                a = a.replace(k, p)
            line.extend(sorted(str(f.name) for f in tmp_path.glob(a)) if "*" in a else [a])
        rc = cli(line)
        out = capsys.readouterr()
        failing = next((w for w in ("FAIL", "CORRUPT") if w in shown), None)
        assert rc == (1 if failing else 0), (where, line, rc, out)
        if failing:
            assert failing in out.out + out.err, (where, out)
        ran.append(argv[0])
    assert sorted(set(ran)) == ["fleet", "screen", "verify-checkpoint"] and len(ran) >= 5, ran
    assert parsed >= 3
