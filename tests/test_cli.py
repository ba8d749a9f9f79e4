"""The shared CLI contract: subcommands, ACCELNODE_* environment equivalents, exit codes,
one-line errors, and unix-socket serving limits."""

from __future__ import annotations

import argparse
import errno
import os
import subprocess
import sys

import pytest

from accelnode import cli

from accelnode import exitcodes

from accelnode import grpcutil
from tests.conftest import accelnode_cmd


def run(*args, env=None):
    return subprocess.run(accelnode_cmd() + list(args), capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_help_lists_every_component_and_exit_codes():
    out = run("--help")
    assert out.returncode == 0
    for name in ("device-plugin", "csi", "agent", "cache", "controller"):
        assert f"    {name}" in out.stdout
    assert "exit codes:" in out.stdout and "ACCELNODE_" in out.stdout


def test_each_subcommand_is_registered_by_the_module_named_for_it():
    full = cli.build_parser()
    names = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert list(names) == list(cli.COMPONENTS)
    for name in cli.COMPONENTS:
        own = cli.build_parser(name)
        assert list(next(a for a in own._actions if isinstance(a, argparse._SubParsersAction)).choices) == [name]


@pytest.mark.parametrize("command, others", [
    ("device-plugin", ("agent", "csi_driver", "controller", "bootstrap", "ssl")),
    ("csi", ("agent", "device_plugin", "controller", "bootstrap")),
    ("agent", ("csi_driver", "device_plugin", "controller", "bootstrap")),
])
def test_a_daemon_imports_no_other_component(command, others):
    """Every module imported stays resident in a daemon: parsing its command line imports only
    its own component's (bench/bench_e2e.py measures the node daemons' memory)."""
    code = ("import sys; from accelnode import cli; cli.build_parser(sys.argv[1]); "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code, command],
                         capture_output=True, text=True, timeout=60, check=True)
    loaded = set(out.stdout.split())
    assert not loaded & set(others), loaded & set(others)


def test_no_command_is_usage_error():
    out = run()
    assert out.returncode == exitcodes.USAGE
    assert "usage: accelnode" in out.stderr


def _parser(env):
    p = argparse.ArgumentParser(prog="t")
    p.add_argument("--kubelet-dir", default="/var/lib/kubelet")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--plain-http", action="store_true")
    p.add_argument("--log-format", default="json", choices=["json", "text"])
    old = dict(os.environ)
    os.environ.update(env)
    try:
        return cli.apply_env(p)
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_env_equivalents_set_defaults_and_flags_win():
    p = _parser({"ACCELNODE_KUBELET_DIR": "/x", "ACCELNODE_TIMEOUT": "2.5", "ACCELNODE_PLAIN_HTTP": "true"})
    a = p.parse_args([])
    assert (a.kubelet_dir, a.timeout, a.plain_http) == ("/x", 2.5, True)
    assert p.parse_args(["--kubelet-dir", "/y"]).kubelet_dir == "/y"
    assert "[env ACCELNODE_KUBELET_DIR]" in p.format_help()


@pytest.mark.parametrize("env, fragment", [
    ({"ACCELNODE_TIMEOUT": "soon"}, "ACCELNODE_TIMEOUT='soon'"),
    ({"ACCELNODE_PLAIN_HTTP": "maybe"}, "expected true or false"),
    ({"ACCELNODE_LOG_FORMAT": "xml"}, "choose from json, text"),
])
def test_bad_env_value_is_a_usage_error(env, fragment, capsys):
    p = _parser(env)
    with pytest.raises(SystemExit) as e:
        cli.check_env(p.parse_args([]))
    assert e.value.code == exitcodes.USAGE
    assert fragment in capsys.readouterr().err


def test_a_bad_variable_of_one_command_does_not_break_another():
    bad = {"ACCELNODE_PULL_WAIT": "soon"}  # a csi flag
    out = run("cache", "--help", env=bad)
    assert out.returncode == 0, out.stderr
    out = run("csi", "--endpoint", "unix:///nonexistent/csi.sock", "--node-id", "n", "--agent-socket", "/nonexistent",
              env=bad)
    assert out.returncode == exitcodes.USAGE
    assert "ACCELNODE_PULL_WAIT='soon'" in out.stderr


def test_socket_path_over_the_unix_limit_is_refused_before_binding(tmp_path):
    long_dir = tmp_path / ("d" * 100)
    long_dir.mkdir()
    with pytest.raises(OSError) as e:
        grpcutil.serve_unix(long_dir / "x.sock", lambda s: None)
    assert e.value.errno == errno.ENAMETOOLONG
    assert not (long_dir / "x.sock").exists()


def test_daemon_with_a_too_long_socket_path_exits_3_with_one_line(tmp_path):
    long_dir = tmp_path / ("d" * 100)
    long_dir.mkdir()
    out = run("agent", "--store", str(tmp_path / "store"), "--socket", str(long_dir / "agent.sock"),
              "--log-format", "text")
    assert out.returncode == exitcodes.PREREQUISITE, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("accelnode agent: ") and "the limit is 107" in last


def test_refuses_to_replace_a_non_socket_file(tmp_path):
    f = tmp_path / "not-a-socket"
    f.write_text("keep me")
    with pytest.raises(FileExistsError):
        grpcutil.serve_unix(f, lambda s: None)
    assert f.read_text() == "keep me"


def test_a_bad_value_of_a_repeatable_flag_variable_is_a_usage_error_of_its_command_only(tmp_path):
    bad = run("cache", "build", str(tmp_path), "127.0.0.1:1/x:y", env={"ACCELNODE_TARGET": "bad"})
    assert bad.returncode == exitcodes.USAGE
    assert "ACCELNODE_TARGET='bad'" in bad.stderr and "Traceback" not in bad.stderr
    other = run("cache", "inspect", "not-a-reference", env={"ACCELNODE_TARGET": "bad"})
    assert "ACCELNODE_TARGET" not in other.stderr


# -- issue 24.8: loose ends a new user found --------------------------------------------------

def test_an_unknown_flag_shows_the_usage_of_the_subcommand_it_was_given_to(tmp_path):
    out = run("cache", "verify", "--store", str(tmp_path), "--bogus")
    assert out.returncode == exitcodes.USAGE
    assert out.stderr.startswith("usage: accelnode cache verify") and "--store DIR" in out.stderr
    assert "accelnode cache verify: error: unrecognized arguments: --bogus" in out.stderr
    top = run("--bogus")
    assert top.returncode == exitcodes.USAGE and top.stderr.startswith("usage: accelnode [-h]")


def test_cache_verify_of_a_missing_store_fails_and_creates_nothing(tmp_path):
    for action in (["verify"], ["gc"], ["push", "sha256:" + "0" * 64, "127.0.0.1:1/x:y"]):
        out = run("cache", action[0], "--store", str(tmp_path / "missing"), *action[1:])
        assert out.returncode == exitcodes.PREREQUISITE, (action, out.stderr)
        assert "not a cache store" in out.stderr and "ok" not in out.stdout
        assert not (tmp_path / "missing").exists()


def _kubeconfig(path, server, *, name="c", ca="ca.crt"):
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "current-context": name,
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": name, "user": {"token": f"token-{name}"}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}]}))
    return path


def test_api_server_found_as_kubectl_finds_it(tmp_path, monkeypatch):
    from accelnode.kube import client
    from accelnode.kube.client import Config, NoConfig

    a = _kubeconfig(tmp_path / "a/config", "https://a.example:6443", name="a")
    b = _kubeconfig(tmp_path / "b/config", "https://b.example:6443", name="b")
    home = _kubeconfig(tmp_path / "home/.kube/config", "https://home.example:6443", name="h")
    # the flag wins over everything
    assert Config.load(str(b), {"KUBECONFIG": str(a), "HOME": str(tmp_path / "home")}).server == "https://b.example:6443"
    # $KUBECONFIG: a list, missing files skipped, the first current-context wins; paths relative to their file
    merged = Config.load(None, {"KUBECONFIG": os.pathsep.join([str(tmp_path / "nope"), str(a), str(b)])})
    assert (merged.server, merged.token, merged.ca_file) == ("https://a.example:6443", "token-a",
                                                             str(tmp_path / "a/ca.crt"))
    # then ~/.kube/config
    assert Config.load(None, {"HOME": str(tmp_path / "home")}).server == "https://home.example:6443"
    assert home.exists()
    # then the pod's service account, when its token is mounted
    in_pod = {"HOME": str(tmp_path / "empty"), "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    monkeypatch.setattr(client, "SA_DIR", tmp_path / "sa")
    with pytest.raises(NoConfig, match="no kubeconfig"):
        Config.load(None, in_pod)  # no token (automountServiceAccountToken: false)
    (tmp_path / "sa").mkdir()
    (tmp_path / "sa/token").write_text("t")
    pod = Config.load(None, in_pod)
    assert pod.server == "https://10.96.0.1:443" and pod.token_file == str(tmp_path / "sa/token")
    with pytest.raises(NoConfig, match="no kubeconfig"):
        Config.load(None, {"HOME": str(tmp_path / "empty")})


def test_the_controller_honours_kubeconfig(tmp_path):
    bad = tmp_path / "kubeconfig"
    bad.write_text("current-context: x\ncontexts: []\n")
    out = run("controller", env={"KUBECONFIG": str(bad)})
    assert out.returncode == exitcodes.PREREQUISITE, out.stderr
    assert f"{bad}: no context named 'x'" in out.stderr
