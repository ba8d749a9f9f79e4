"""bench/run.py judges the targets groups print, and exits non-zero on a miss unless --report-only."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def run(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "HERE", tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # loading run.py put its repo root first

    def group(name: str, *lines: str, crash: bool = False) -> None:
        body = "".join(f"    print({line!r})\n" for line in lines)
        body += "    raise RuntimeError('boom')\n" if crash else ""
        (tmp_path / f"bench_{name}.py").write_text(f"def main():\n{body or '    pass'}\n")

    mod.group = group
    return mod


def test_targets_met_missed_and_malformed(run, capsys):
    run.group("a", "BENCH a p99_ms=4.00", "BENCH a target_p99_ms<=5", "BENCH a ratio=0.9 target_ratio>=1.0",
              "BENCH a n=1.0 target_n==1", "BENCH a target_gone_ms<=3", "BENCH a x=2 target_x=2")
    assert run.main(["a"]) == 1
    out = capsys.readouterr()
    assert "TARGET a p99_ms 4.00 <= 5 ok" in out.out
    assert "TARGET a ratio 0.9 >= 1.0 MISSED" in out.out
    assert "TARGET a n 1.0 == 1 ok" in out.out
    assert "TARGET a gone_ms unmeasured <= 3 MISSED" in out.out
    assert "TARGET a x 2 = (malformed: no direction) 2 MISSED" in out.out
    assert "3 of 5 targets missed" in out.err
    assert run.main(["--report-only", "a"]) == 0
    assert "(--report-only: not failing)" in capsys.readouterr().err


def test_all_met_passes_and_a_crash_fails_even_report_only(run, capsys):
    run.group("ok", "BENCH ok rss_mb=30.5", "BENCH ok target_rss_mb<=40")
    run.group("bad", "BENCH bad t=1", crash=True)
    assert run.main(["ok"]) == 0
    assert run.main(["--report-only", "ok", "bad"]) == 1
    out = capsys.readouterr()
    assert "BENCH bad error=1" in out.out and "crashed: bad" in out.err
    assert run.main(["nosuch"]) == 2
