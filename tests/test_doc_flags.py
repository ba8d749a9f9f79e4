"""Docs show only flags that exist (issue 24.8): every ``accelnode ...`` and ``cosign ...`` command
line in the docs below, in code spans and code blocks, names flags its command accepts (ours from
the real parser, cosign's from the real cosign)."""

from __future__ import annotations

import argparse
import re
import subprocess

import pytest

from accelnode import cli
from tests.conftest import ROOT, tool

DOCS = ["docs/signatures.md", "docs/device-plugin.md", "docs/tpu-env.md", "docs/dra.md", "docs/registries.md",
        "docs/agent-store.md"]
_SPAN = re.compile(r"`([^`\n]+)`")
_BLOCK = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def command_lines(text: str, program: str) -> list[list[str]]:
    lines = [m for m in _SPAN.findall(text)] + [ln for b in _BLOCK.findall(text) for ln in b.splitlines()]
    out = []
    for line in lines:
        words = line.replace("[", " ").replace("]", " ").split()
        if words and words[0] == program:
            out.append(words[1:])
    return out


def _subparser(parser: argparse.ArgumentParser, name: str):
    for action in parser._actions:  # argparse has no public accessor
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return None


def flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


@pytest.mark.parametrize("doc", DOCS)
def test_accelnode_flags_in_the_docs_exist(doc):
    parser = cli.build_parser()
    checked = 0
    for words in command_lines((ROOT / doc).read_text(), "accelnode"):
        p = parser
        for w in words:
            child = _subparser(p, w)
            if child is None:
                break
            p = child
        known = {o for a in p._actions for o in a.option_strings}
        missing = [f for f in flags(words) if f not in known]
        assert not missing, f"{doc}: `accelnode {' '.join(words)}`: {missing} not flags of {p.prog}"
        checked += 1
    assert checked or doc == "docs/tpu-env.md"


def test_cosign_flags_in_the_docs_exist():
    cosign = tool("cosign")
    lines = [w for w in command_lines((ROOT / "docs/signatures.md").read_text(), "cosign") if w]
    assert len(lines) >= 3
    for words in lines:
        verb = words[0]
        # cosign parses every flag before --help: an unknown one fails (hidden legacy flags count);
        # each is given a value of its own (`--flag=true`: a word for string flags, true for bools)
        given = [w if "=" in w else w + "=true" for w in words if w.startswith("--")]
        out = subprocess.run([cosign, verb, *given, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"`cosign {' '.join(words)}`: {out.stderr.strip()[-300:]}"


def test_every_agent_flag_is_documented():
    """Each flag of ``accelnode agent`` (its own and the registry flags) is named in a doc page,
    but for the one every command has (--log-format, said by --help)."""
    agent = _subparser(cli.build_parser(), "agent")
    text = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    missing = sorted(o for a in agent._actions for o in a.option_strings
                     if o.startswith("--") and o not in ("--help", "--log-format") and f"`{o}" not in text)
    assert not missing, f"flags of accelnode agent no doc names: {missing}"
