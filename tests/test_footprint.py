"""What the node daemons leave out of memory: every module a process imports stays resident in
it, on every node (bench/bench_e2e.py measures them as pods by mapping)."""

from __future__ import annotations

import subprocess
import sys

import pytest

AGENT = "agent.core, agent.store, agent.service, agent.reporter, accelnode.oci.registry"


def _loaded(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=60, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("unused", ["charset_normalizer", "chardet", "tomllib", "isal"])
def test_the_agent_does_not_load_what_it_does_not_use(unused):
    assert unused not in _loaded(f"import {AGENT}")


def test_the_hidden_guessers_stay_importable_for_others():
    """requests is imported without them; any other library of the process still finds them."""
    loaded = _loaded("import accelnode.oci.registry, requests\n"
                     "assert requests.compat.chardet is None\n"
                     "import charset_normalizer")
    assert "charset_normalizer" in loaded


def test_a_registry_answer_without_a_charset_reads_as_utf8(registry):
    """What requests does with text when it has no guesser: UTF-8, no warning."""
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import accelnode.oci.registry, requests\n"
            f"r = requests.get('http://{registry.host}/v2/')\n"
            "assert r.apparent_encoding == 'utf-8' and isinstance(r.text, str)\n")
    _loaded(code)
