"""``accelnode bootstrap`` end to end on the node side: the controller's token (controller/
jointoken.py) appears in the emulated metadata -> the parked long poll wakes -> token discovery
against the real API server (cluster-info signed by the real bootstrap signer) -> the real
``kubeadm join --dry-run`` with our JoinConfiguration passes discovery and TLS bootstrap.
And the refusals: a wrong CA hash, a token the API server does not know, no token at all."""

from __future__ import annotations

import json

from tests.conftest import tool

RUN = ("--ignore-preflight-errors", "all", "--backoff", "0.2")


def records(b) -> list[dict]:
    out = []
    for line in b.output().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def test_the_token_appearing_in_the_metadata_wakes_bootstrap_and_kubeadm_joins(
        metadata, join_tokens, control_plane_endpoint, kubeadm_wrapper, bootstrap):
    wrapper, calls = kubeadm_wrapper
    b = bootstrap(metadata, wrapper, *RUN)
    metadata.wait_for_waiters(1)  # parked in its long poll on the attributes directory
    assert b.proc.poll() is None and not calls.exists()
    info = join_tokens.ensure(f"group-{metadata.instance['name']}", control_plane_endpoint)
    metadata.set_attributes(info.metadata_items())
    assert b.wait() == 0, b.output()
    out = b.output()
    secret = info.token.split(".")[1]
    assert secret not in out  # kubeadm's dry run prints bootstrap-kubelet.conf: masked
    assert "This node has joined the cluster" in out
    msgs = [r["msg"] for r in records(b)]
    assert "discovery verified: cluster-info signed by the token, CA pinned by its hash" in msgs
    assert "join dry run succeeded" in msgs
    # the token reached kubeadm through a 0600 file in a 0700 directory, never the command line
    log = calls.read_text()
    assert secret not in log and info.token_id not in log
    assert "argv: join --config" in log and "--dry-run" in log and "mode: 600 dir: 700" in log
    # kubeadm took the providerID and the node name (its dry run writes the kubelet's flags)
    name = metadata.instance["name"]
    flags = (b.dryrun_dir / "kubeadm-flags.env").read_text()
    assert f"--provider-id=gce://accelnode-test/us-east5-b/{name}" in flags
    assert f"--hostname-override={name}" in flags or name in (b.dryrun_dir / "config.yaml").read_text() + flags
    # ... and the TLS bootstrap token it was given is the metadata's
    assert secret in (b.dryrun_dir / "bootstrap-kubelet.conf").read_text()


def test_a_wrong_ca_hash_is_refused_before_kubeadm_runs(metadata, join_tokens, control_plane_endpoint,
                                                        kubeadm_wrapper, bootstrap):
    wrapper, calls = kubeadm_wrapper
    info = join_tokens.ensure(f"group-{metadata.instance['name']}", control_plane_endpoint)
    items = dict(info.metadata_items(), **{"kubeadm-ca-hash": "sha256:" + "0" * 64})
    metadata.set_attributes(items)
    b = bootstrap(metadata, wrapper, *RUN)
    assert b.wait() == 1, b.output()
    out = b.output()
    assert "REFUSING TO JOIN" in out and info.ca_hash in out and "sha256:" + "0" * 64 in out
    assert not calls.exists()  # kubeadm never started
    assert info.token.split(".")[1] not in out


def test_a_token_the_api_server_does_not_know_is_reported_and_a_new_one_awaited(
        metadata, join_tokens, control_plane_endpoint, kubeadm_wrapper, bootstrap):
    wrapper, calls = kubeadm_wrapper
    real = join_tokens.ensure(f"group-{metadata.instance['name']}", control_plane_endpoint)
    # a token of the right shape that no Secret backs (expired and cleaned up, or revoked)
    metadata.set_attributes(dict(real.metadata_items(), **{"kubeadm-join-token": "zzzzzz.0123456789abcdef"}))
    b = bootstrap(metadata, wrapper, *RUN, "--discovery-timeout", "1", "--wait-timeout", "60")
    metadata.wait_for_waiters(1)  # reported, now waiting for a new token
    assert not calls.exists()
    assert any("no signature for token id zzzzzz" in r["msg"] and "waiting for a new token" in r["msg"]
               for r in records(b)), b.output()
    metadata.set_attributes(real.metadata_items())  # the controller writes a fresh one
    assert b.wait() == 0, b.output()
    assert "0123456789abcdef" not in b.output()


def test_no_token_within_the_wait_timeout_is_a_clear_exit(metadata, kubeadm_wrapper, bootstrap):
    wrapper, calls = kubeadm_wrapper
    b = bootstrap(metadata, wrapper, "--wait-timeout", "1")
    assert b.wait() == 4, b.output()
    assert "join token did not appear in the instance metadata" in b.output()
    assert not calls.exists()


def test_malformed_metadata_is_refused_without_echoing_the_token(metadata, kubeadm_wrapper, bootstrap):
    wrapper, _ = kubeadm_wrapper
    metadata.set_attributes({"kubeadm-join-token": "NOT-A-TOKEN-secretvalue", "kubeadm-control-plane-ip": "10.0.0.2",
                             "kubeadm-ca-hash": "sha256:" + "a" * 64})
    b = bootstrap(metadata, wrapper, "--wait-timeout", "5")
    assert b.wait() == 1
    assert "is not a kubeadm bootstrap token" in b.output() and "secretvalue" not in b.output()


def test_kubeadm_failing_is_retried_with_reset_between(metadata, join_tokens, control_plane_endpoint,
                                                       kubeadm_wrapper, bootstrap):
    """Without --ignore-preflight-errors the real kubeadm fails its preflight here (no container
    runtime): two attempts, `kubeadm reset -f --dry-run` between them, then a clear exit."""
    wrapper, calls = kubeadm_wrapper
    info = join_tokens.ensure(f"group-{metadata.instance['name']}", control_plane_endpoint)
    metadata.set_attributes(info.metadata_items())
    b = bootstrap(metadata, wrapper, "--attempts", "2", "--backoff", "0.1")
    assert b.wait() == 1, b.output()
    argvs = [line for line in calls.read_text().splitlines() if line.startswith("argv:")]
    assert [a.split()[1] for a in argvs] == ["join", "reset", "join"]
    assert "reset -f --dry-run" in argvs[1]
    assert "kubeadm join failed 2 times" in b.output()


def test_kubeadm_itself_accepts_our_join_configuration(tmp_path):
    import subprocess

    import yaml

    from bootstrap.poller import JoinValues, join_configuration

    values = JoinValues.from_attributes({"kubeadm-join-token": "abcdef.0123456789abcdef",
                                         "kubeadm-control-plane-ip": "10.0.0.2", "kubeadm-ca-hash": "sha256:" + "a" * 64})
    path = tmp_path / "join.yaml"
    path.write_text(yaml.safe_dump(join_configuration(values, node_name="tpu-0", provider="gce://p/z/tpu-0",
                                                      ignore_preflight_errors=["Swap"], patches=str(tmp_path))))
    out = subprocess.run([tool("kubeadm"), "config", "validate", "--config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_stopping_bootstrap_mid_join_stops_kubeadm_and_removes_the_token_file(
        metadata, join_tokens, control_plane_endpoint, bootstrap, tmp_path):
    import os
    import signal
    import time

    record = tmp_path / "hung-kubeadm"
    hung = tmp_path / "kubeadm-hangs"
    hung.write_text(f'#!/bin/sh\necho "$$ $3" > {record}.tmp && mv {record}.tmp {record}\nexec sleep 120\n')
    hung.chmod(0o755)
    info = join_tokens.ensure(f"group-{metadata.instance['name']}", control_plane_endpoint)
    metadata.set_attributes(info.metadata_items())
    b = bootstrap(metadata, hung, *RUN)
    deadline = time.monotonic() + 60
    while not record.exists() and b.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    pid, config = record.read_text().split()
    assert os.path.exists(config)
    b.proc.send_signal(signal.SIGTERM)  # systemctl stop
    assert b.wait(30) == 130, b.output()
    assert not os.path.exists(config) and not os.path.exists(os.path.dirname(config))
    assert not os.path.exists(f"/proc/{pid}")  # kubeadm stopped (and reaped) with it


def test_prerequisites_and_an_absent_metadata_server_are_clear_exits(tmp_path):
    import os
    import subprocess

    from tests.rigs.devcluster import free_port
    from tests.conftest import accelnode_cmd

    env = dict(os.environ, GCE_METADATA_HOST=f"127.0.0.1:{free_port()}")
    out = subprocess.run(accelnode_cmd() + ["bootstrap", "--kubeadm", str(tmp_path / "nope")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "kubeadm not found" in out.stderr
    out = subprocess.run(accelnode_cmd() + ["bootstrap", "--kubeadm", tool("kubeadm"), "--metadata-timeout", "1",
                                            "--log-format", "text"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 4, out.stderr
    assert "reading this instance's name, zone and project from the metadata server" in out.stderr
