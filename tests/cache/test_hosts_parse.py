"""``accelnode/oci/hosts.py`` without servers: how a containerd ``certs.d`` directory is read
(docs/registries.md#mirrors-hoststoml). The pulls through real mirrors are in test_hosts_toml.py."""

from __future__ import annotations

import dataclasses
import os

import pytest

from accelnode.oci.hosts import Host, HostsConfig, HostsConfigError, parse_duration
from accelnode.oci.registry import Registry, RegistryOptions

REG = "registry.example.com:5000"
MIRROR, TLS, HEADER = '[host."http://m.local"]\n', '[host."https://m.local"]\n', '[host."http://m.local".header]\n'


def write(root, name: str, text: str | bytes) -> str:
    """``root/name/hosts.toml`` holding ``text``; the directory ``root``."""
    (root / name).mkdir(parents=True, exist_ok=True)
    data = text.encode() if isinstance(text, str) else text
    (root / name / "hosts.toml").write_bytes(data)
    return str(root)


def hosts(tmp_path, text: str, registry: str = REG, **kw) -> list[Host]:
    return HostsConfig(write(tmp_path, registry.replace(":", "_") + "_", text), **kw).hosts(registry)


def refused(tmp_path, text, registry: str = REG) -> str:
    with pytest.raises(HostsConfigError) as err:
        hosts(tmp_path, text, registry)
    path = f"{tmp_path}/{registry.replace(':', '_')}_/hosts.toml"
    assert f"mirror configuration {path}" in str(err.value), str(err.value)
    return str(err.value)


# -- durations ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [
    ("200ms", 0.2), ("1.5s", 1.5), ("1m30s", 90.0), ("2h", 7200.0), ("500us", 0.0005), ("250µs", 0.00025),
    ("1000000ns", 0.001), (".5s", 0.5), ("1.s", 1.0), ("1h1m1s1ms", 3661.001), ("+1s", 1.0),
    ("3\u03bcs", 0.000003),  # Go takes U+03BC (Greek mu) as well as U+00B5 (micro sign)
])
def test_go_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["0", "0s", "-1s", "+0", "-0"])
def test_zero_or_less_is_no_timeout_of_its_own(text):
    """Go parses these; containerd then has no dial timeout of the file's, and the caller's
    default (--mirror-dial-timeout) applies."""
    assert parse_duration(text) is None


@pytest.mark.parametrize("value, fragment", [
    ("3", "is not a duration"), ("3 seconds", "is not a duration"), ("1d", "is not a duration"),
    ("--1s", "is not a duration"), ("1s ", "is not a duration"), ("+", "is not a duration"),
    ("", "must be a duration string"), (3, "must be a duration string"), (1.5, "must be a duration string"),
])
def test_bad_durations(value, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_duration(value)


def test_dial_timeout_in_a_file(tmp_path):
    mirror, server = hosts(tmp_path, '[host."http://m.local"]\ndial_timeout = "300ms"\n')
    assert mirror.dial_timeout == pytest.approx(0.3) and server.dial_timeout is None


# -- hosts and their URLs -------------------------------------------------------------------

@pytest.mark.parametrize("url, extra, scheme, netloc, path", [
    ("http://m.local:5000", "", "http", "m.local:5000", "/v2"),
    ("m.local", "", "https", "m.local", "/v2"),  # no scheme: https, as containerd
    ("httpcache.local:5000", "", "https", "httpcache.local:5000", "/v2"),  # a name, not a scheme
    ("https://M.Local", "", "https", "m.local", "/v2"),
    ("http://m.local/v2", "", "http", "m.local", "/v2"),
    ("http://m.local/v2/", "", "http", "m.local", "/v2"),
    ("http://m.local/mirror", "", "http", "m.local", "/mirror/v2"),
    ("http://m.local/a//b/../mirror/", "", "http", "m.local", "/a/mirror/v2"),
    ("http://m.local/api/registry", "override_path = true", "http", "m.local", "/api/registry"),
    ("http://m.local", "override_path = true", "http", "m.local", ""),
])
def test_host_urls(tmp_path, url, extra, scheme, netloc, path):
    h = hosts(tmp_path, f'[host."{url}"]\n{extra}\n')[0]
    assert (h.scheme, h.netloc, h.path) == (scheme, netloc, path)
    assert h.url == f"{scheme}://{netloc}{path}" and str(h) == f"{scheme}://{netloc}"
    assert not h.is_registry and h.registry == REG


def test_hosts_in_file_order_then_the_server(tmp_path):
    text = ('server = "https://origin.local"\n'
            '[host."http://c.local"]\n[host."http://a.local"]\n[host."http://b.local"]\n')
    assert [h.netloc for h in hosts(tmp_path, text)] == ["c.local", "a.local", "b.local", "origin.local"]


def test_default_server_is_the_registry(tmp_path):
    mirror, server = hosts(tmp_path, '[host."http://m.local"]\n')
    assert (server.scheme, server.netloc, server.path) == ("https", REG, "/v2") and server.is_registry
    assert server.capabilities == {"pull", "resolve", "push"}
    # --plain-http: the scheme of a server written without one
    assert hosts(tmp_path, '[host."http://m.local"]\n', plain_http=True)[1].scheme == "http"
    # no file at all, or a directory without hosts.toml: the registry alone
    assert HostsConfig(str(tmp_path / "none")).hosts(REG) == [Host("https", REG, registry=REG, source="default")]
    (tmp_path / "empty" / "other.example.com").mkdir(parents=True)
    assert [h.netloc for h in HostsConfig(str(tmp_path / "empty")).hosts("other.example.com")] == ["other.example.com"]
    assert HostsConfig(None).hosts(REG) == HostsConfig("").hosts(REG) == [Host("https", REG, registry=REG,
                                                                              source="default")]


@pytest.mark.parametrize("name", ["docker.io", "index.docker.io", "Registry-1.Docker.io"])
def test_docker_hub_default_server_is_its_api_host(tmp_path, name):
    d = write(tmp_path, "docker.io", '[host."http://m.local:5000"]\n')
    mirror, server = HostsConfig(d, plain_http=True).hosts(name)
    assert mirror.registry == "docker.io" and not mirror.is_registry
    assert (server.scheme, server.netloc) == ("https", "registry-1.docker.io") and server.is_registry
    assert HostsConfig(None, plain_http=True).hosts(name)[0].url == "https://registry-1.docker.io/v2"


def test_a_host_that_is_the_registry_itself(tmp_path):
    """Listed as a [host], the registry is still the registry: no ns=, its own credentials."""
    first, server = hosts(tmp_path, f'server = "http://{REG}"\n[host."https://{REG}"]\n')
    assert first.is_registry and server.is_registry


# -- capabilities ---------------------------------------------------------------------------

def test_capabilities(tmp_path):
    text = ('[host."http://pull.local"]\ncapabilities = ["pull"]\n'
            '[host."http://both.local"]\ncapabilities = ["PULL", "Resolve"]\n'
            '[host."http://all.local"]\n'
            '[host."http://none-given.local"]\ncapabilities = []\n')  # containerd: empty is the default
    got = {h.netloc: h.capabilities for h in hosts(tmp_path, text)}
    assert got == {"pull.local": {"pull"}, "both.local": {"pull", "resolve"}, "all.local": {"pull", "resolve", "push"},
                   "none-given.local": {"pull", "resolve", "push"}, REG: {"pull", "resolve", "push"}}


def test_candidates_follow_capabilities(tmp_path):
    d = write(tmp_path, REG.replace(":", "_") + "_",
              '[host."http://pull.local"]\ncapabilities = ["pull"]\n[host."http://all.local"]\n')
    reg = Registry(REG, RegistryOptions(hosts_dir=d))
    assert [h.netloc for h in reg.candidates(("pull",), "img")] == ["pull.local", "all.local", REG]
    assert [h.netloc for h in reg.candidates(("pull", "resolve"), "img")] == ["all.local", REG]
    assert [h.netloc for h in reg.candidates(("push",), "img")] == ["all.local"]  # a push goes to one host
    pull_only = reg.hosts()[0]
    assert [h.netloc for h in reg.candidates(("pull",), "img", exclude=(pull_only,))] == ["all.local", REG]


def test_top_level_capabilities_apply_to_a_named_server_only(tmp_path):
    """As containerd: the default server (no ``server``) can do everything whatever the file's
    top level says; a ``server`` named there takes the top level's capabilities."""
    assert hosts(tmp_path, 'capabilities = ["pull"]\n')[-1].capabilities == {"pull", "resolve", "push"}
    server = hosts(tmp_path, 'server = "https://origin.local"\ncapabilities = ["pull"]\n')[-1]
    assert server.netloc == "origin.local" and server.capabilities == {"pull"}


# -- TLS files, headers ---------------------------------------------------------------------

def test_relative_paths_are_the_files_directory(tmp_path):
    text = ('[host."https://m.local"]\nca = ["ca.pem", "/etc/ssl/other.pem", "../shared/ca.pem"]\n'
            'client = [["client.pem", "keys/client-key.pem"], "both.pem"]\n')
    h = hosts(tmp_path, text)[0]
    here = f"{tmp_path}/{REG.replace(':', '_')}_"
    assert h.ca == (f"{here}/ca.pem", "/etc/ssl/other.pem", f"{here}/../shared/ca.pem")
    assert h.client == ((f"{here}/client.pem", f"{here}/keys/client-key.pem"), (f"{here}/both.pem", None))
    assert all(os.path.isabs(p) for p in h.ca)


@pytest.mark.parametrize("client, expected", [
    ('"both.pem"', (("both.pem", None),)),
    ('["a.pem", "b.pem"]', (("a.pem", None), ("b.pem", None))),
    ('[["cert.pem", "key.pem"]]', (("cert.pem", "key.pem"),)),
    ('["/abs/both.pem", ["c.pem", "/abs/k.pem"]]', (("/abs/both.pem", None), ("c.pem", "/abs/k.pem"))),
])
def test_client_forms(tmp_path, client, expected):
    here = f"{tmp_path}/{REG.replace(':', '_')}_"

    def full(p):
        return p if p is None or p.startswith("/") else f"{here}/{p}"
    h = hosts(tmp_path, f'[host."https://m.local"]\nclient = {client}\n')[0]
    assert h.client == tuple((full(c), full(k)) for c, k in expected)


def test_headers(tmp_path):
    text = '[host."http://m.local".header]\nX-Token = "abc"\nX-Multi = ["1", "2"]\nAuthorization = "Basic dTpw"\n'
    h = hosts(tmp_path, text)[0]
    assert h.header == (("X-Token", "abc"), ("X-Multi", "1"), ("X-Multi", "2"), ("Authorization", "Basic dTpw"))
    assert Registry._headers(h) == {"X-Token": "abc", "X-Multi": "1, 2", "Authorization": "Basic dTpw"}


def test_top_level_fields_apply_to_the_default_server(tmp_path):
    text = ('ca = "ca.pem"\nclient = "client.pem"\nskip_verify = true\ndial_timeout = "2s"\n'
            '[header]\nX-Registry = "r"\n'
            '[host."http://m.local"]\n')
    mirror, server = hosts(tmp_path, text)
    here = f"{tmp_path}/{REG.replace(':', '_')}_"
    assert (server.ca, server.client, server.skip_verify, server.dial_timeout, server.header) == (
        (f"{here}/ca.pem",), ((f"{here}/client.pem", None),), True, 2.0, (("X-Registry", "r"),))
    assert (mirror.ca, mirror.client, mirror.skip_verify, mirror.header) == ((), (), False, ())


# -- files that cannot be used --------------------------------------------------------------

@pytest.mark.parametrize("text, fragment", [
    ('[host."http://m.local"\n', "is not valid TOML"),
    (b"server = '\xff'\n", "is not valid TOML"),
    ('host = "http://m.local"\n', '"host" must be a table of [host."URL"] tables'),
    ('[host]\n"http://m.local" = 5\n', 'must be a table'),
    ("server = 5000\n", '"server" must be a string'),
    ("x" * (1 << 20) + "\n", "is over 1048576 bytes"),
    # URLs
    ('[host."ftp://m.local"]\n', "is not an http(s)://HOST[:PORT][/PATH] URL"),
    ('[host."http://m.local/v2?x=1"]\n', "is not an http(s)"),
    ('[host."http://user:pw@m.local"]\n', "is not an http(s)"),
    ('[host."http://"]\n', "is not an http(s)"),
    ('[host."http://m.local:99999"]\n', "has an invalid port"),
    # capabilities
    (MIRROR + 'capabilities = ["pull", "fetch"]\n', "unknown capability 'fetch' (pull, resolve, push)"),
    (MIRROR + 'capabilities = "pull"\n', "capabilities must be a list of strings"),
    (MIRROR + 'capabilities = ["pull", 1]\n', "capabilities must be a list of strings"),
    # TLS files and flags
    (TLS + 'client = [["cert.pem", "key.pem", "extra.pem"]]\n', "is neither a path nor a [certificate, key] pair"),
    (TLS + 'client = 5\n', "client must be a path, a list of paths or of [certificate, key] pairs"),
    (TLS + 'client = [[1, 2]]\n', "is neither a path nor a [certificate, key] pair"),
    (TLS + 'ca = 5\n', "ca must be a string or a list of strings"),
    (TLS + 'ca = ""\n', "an empty path"),
    (TLS + 'skip_verify = "yes"\n', "skip_verify must be true or false"),
    (TLS + 'override_path = 1\n', "override_path must be true or false"),
    # headers
    (HEADER + '"Bad Name" = "x"\n', "header name 'Bad Name' is not a valid HTTP header name"),
    (HEADER + '"X-Colon:" = "x"\n', "is not a valid HTTP header name"),
    (HEADER + 'X-Token = "a\\nInjected: 1"\n', "header 'X-Token' has a value with control characters"),
    (HEADER + 'X-Token = "a\\r"\n', "has a value with control characters"),
    # requests refuses a leading space quoting the value in its error, which would put the token in logs
    (HEADER + 'X-Token = " s3cret"\n', "header 'X-Token' has a value with control characters or that starts"),
    (HEADER + 'X-Token = "\\ts3cret"\n', "has a value with control characters or that starts"),
    (HEADER + 'X-Token = 5\n', "header 'X-Token' must be a string or a list of strings"),
    (HEADER + 'X-Token = ["a", 5]\n', "must be a string or a list of strings"),
    (MIRROR + 'header = "X-Token: a"\n', "header must be a table"),
    # durations
    (MIRROR + 'dial_timeout = "3"\n', "dial_timeout '3' is not a duration"),
    ('dial_timeout = "soon"\n', "is not a duration"),  # the top level is checked too
])
def test_unusable_files_name_the_file_and_say_why(tmp_path, text, fragment):
    assert fragment in refused(tmp_path, text)


def test_a_fifo_or_a_deep_nest_is_refused_not_waited_on_or_crashed_on(tmp_path):
    """A FIFO named hosts.toml would block every pull opening it; a 10 KB file of nested arrays
    would exhaust the parser's recursion (the agent's start-up check crashed on it)."""
    import os

    (tmp_path / "fifo.example.com").mkdir()
    os.mkfifo(tmp_path / "fifo.example.com" / "hosts.toml")
    with pytest.raises(HostsConfigError, match="is not readable .not a regular file."):
        HostsConfig(str(tmp_path)).hosts("fifo.example.com")
    (tmp_path / "deep.example.com").mkdir()
    (tmp_path / "deep.example.com" / "hosts.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(HostsConfigError, match="nests too deeply"):
        HostsConfig(str(tmp_path)).hosts("deep.example.com")
    problems = HostsConfig(str(tmp_path)).check()
    assert len(problems) == 2 and all("hosts.toml" in p for p in problems), problems


def test_unreadable_file_names_the_file(tmp_path):
    (tmp_path / "registry.example.com" / "hosts.toml").mkdir(parents=True)
    with pytest.raises(HostsConfigError, match=rf"mirror configuration {tmp_path}/registry.example.com/hosts.toml "
                                               r"is not readable"):
        HostsConfig(str(tmp_path)).hosts("registry.example.com")


def test_check_reports_every_unusable_file(tmp_path):
    write(tmp_path, "good.example.com", '[host."http://m.local"]\n')
    write(tmp_path, "bad.example.com", '[host."http://m.local"]\ncapabilities = ["fetch"]\n')
    write(tmp_path, "127.0.0.1_5000_", "server = 1\n")
    write(tmp_path, "_default", "[[[\n")
    problems = HostsConfig(str(tmp_path)).check()
    assert len(problems) == 3, problems
    for d in ("127.0.0.1_5000_", "_default", "bad.example.com"):
        assert any(p.startswith(f"mirror configuration {tmp_path}/{d}/hosts.toml") for p in problems), problems
    assert HostsConfig(str(tmp_path / "missing")).check() == [] and HostsConfig(None).check() == []


# -- which file applies ---------------------------------------------------------------------

def test_lookup_order(tmp_path):
    config = HostsConfig(str(tmp_path))
    assert config.file(REG) is None
    write(tmp_path, "_default", "")
    assert config.file(REG) == tmp_path / "_default" / "hosts.toml"
    write(tmp_path, REG, "")
    assert config.file(REG) == tmp_path / REG / "hosts.toml"
    write(tmp_path, "registry.example.com_5000_", "")
    assert config.file(REG) == tmp_path / "registry.example.com_5000_" / "hosts.toml"
    # without a port: the host's directory, then _default
    assert config.file("quay.io") == tmp_path / "_default" / "hosts.toml"
    write(tmp_path, "quay.io", "")
    assert config.file("quay.io") == tmp_path / "quay.io" / "hosts.toml"


def test_the_files_are_read_at_every_lookup(tmp_path):
    config = HostsConfig(str(tmp_path))
    assert [h.netloc for h in config.hosts(REG)] == [REG]
    write(tmp_path, "_default", '[host."http://late.local"]\n')  # a mirror set up after start (Spegel)
    assert [h.netloc for h in config.hosts(REG)] == ["late.local", REG]


def test_registry_mirror_flag_wins_over_the_directory(tmp_path):
    d = write(tmp_path, "quay.io", '[host."http://m.local"]\n')
    only, = HostsConfig(d, {"Quay.IO": "flag-mirror.local:5000"}, plain_http=True).hosts("quay.io")
    assert (only.scheme, only.netloc, only.path, only.source) == ("http", "flag-mirror.local:5000", "/v2",
                                                                  "--registry-mirror")
    assert not only.is_registry and only.registry == "quay.io"
    assert [h.netloc for h in HostsConfig(d, {"docker.io": "x.local"}).hosts("quay.io")] == ["m.local", "quay.io"]
    with pytest.raises(ValueError, match="without a scheme"):
        HostsConfig(d, {"quay.io": "http://m.local"})


# -- requests: ns=, the mirrors that failed lately ------------------------------------------

def test_mirror_requests_name_the_registry(tmp_path):
    d = write(tmp_path, "quay.io", '[host."http://m.local/cache"]\n')
    reg = Registry("quay.io", RegistryOptions(hosts_dir=d))
    mirror, server = reg.hosts()
    assert reg._url(mirror, "org/img/manifests/v1") == "http://m.local/cache/v2/org/img/manifests/v1?ns=quay.io"
    assert reg._url(mirror, "x/blobs/uploads/u?_state=s") \
        == "http://m.local/cache/v2/x/blobs/uploads/u?_state=s&ns=quay.io"
    assert reg._url(server, "org/img/manifests/v1") == "https://quay.io/v2/org/img/manifests/v1"
    flag = Registry(REG, RegistryOptions(mirrors={REG: "m.local"}))
    assert flag._url(flag.hosts()[0], "") == "https://m.local/v2/?ns=registry.example.com%3A5000"


def test_mirrors_down_are_remembered_per_host():
    config = HostsConfig()
    a, b = Host("http", "a.local"), Host("https", "a.local")
    assert config.down(a) == 0
    config.mark_down(a)
    assert 0 < config.down(a) <= 30 and config.down(b) == 0
    config.mark_up(a)
    assert config.down(a) == 0


def test_options_keep_their_hosts_config_while_it_is_the_same(tmp_path):
    """What was found down outlives a pull: RegistryOptions copied for another pull (a tenant's
    credentials, a deadline) keep the same HostsConfig, unless the mirror settings change."""
    options = RegistryOptions(hosts_dir=str(tmp_path), mirror_dial_timeout=0.5)
    assert dataclasses.replace(options, timeout=5, config_file="/x").hosts is options.hosts
    assert dataclasses.replace(options, hosts_dir=str(tmp_path / "other")).hosts is not options.hosts
    assert dataclasses.replace(options, plain_http=True).hosts.plain_http is True
    assert options.hosts.mirror_dial_timeout == 0.5
    with pytest.raises(ValueError, match="mirror dial timeout must be positive"):
        RegistryOptions(mirror_dial_timeout=0)
