"""The accelnode image built without a container engine (tests/rigs/image.py): the same
inputs give the same layer, the archive is an OCI image layout containerd names correctly, and
the Containerfile copies what the wheel is made of."""

from __future__ import annotations

import hashlib
import json
import re
import tarfile

from tests.rigs import image as images
from tests.conftest import ROOT


def test_the_app_layer_is_reproducible_and_holds_the_command(tmp_path):
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    images.build_app(a, log=lambda m: None)
    images.build_app(b, log=lambda m: None)
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    with tarfile.open(a) as t:
        names = set(t.getnames())
        script = t.extractfile("opt/accelnode/bin/accelnode").read().decode()
        assert {m.uid for m in t.getmembers()} == {0} and {m.mtime for m in t.getmembers()} == {images.EPOCH}
    assert script.startswith("#!/opt/accelnode/bin/python\n") and "from accelnode.cli import main" in script
    site = images.SITE.lstrip("/")
    for pkg in images.SOURCE_DIRS:
        assert f"{site}/{pkg}/__init__.py" in names, pkg
    # runtime code only: the packages of the wheel and their metadata, never the rigs, tests or tools
    tops = {n[len(site) + 1:].split("/")[0] for n in names if n.startswith(site + "/") and n != site}
    assert {t for t in tops if not t.endswith(".dist-info")} == set(images.SOURCE_DIRS)
    assert not [n for n in names if "/testing/" in n or "/rigs/" in n or n.endswith("protogen.py")]
    assert any(n.endswith(".pyc") for n in names)  # byte code compiled in: roots are read-only


def test_the_archive_is_an_oci_layout_named_for_containerd(tmp_path):
    layer = tmp_path / "layer.tar"
    images.pause_layer(layer)
    out = tmp_path / "img.oci.tar"
    images.write_oci_archive(out, "docker.io/library/x:1", [layer], entrypoint=["/pause"], user="1:1")
    with tarfile.open(out) as t:
        index = json.loads(t.extractfile("index.json").read())
        (desc,) = index["manifests"]
        assert desc["annotations"]["io.containerd.image.name"] == "docker.io/library/x:1"
        manifest = json.loads(t.extractfile(f"blobs/sha256/{desc['digest'][7:]}").read())
        config = json.loads(t.extractfile(f"blobs/sha256/{manifest['config']['digest'][7:]}").read())
        (ldesc,) = manifest["layers"]
        blob = t.extractfile(f"blobs/sha256/{ldesc['digest'][7:]}").read()
    assert "sha256:" + hashlib.sha256(blob).hexdigest() == ldesc["digest"] == config["rootfs"]["diff_ids"][0]
    assert config["config"]["Entrypoint"] == ["/pause"] and config["config"]["User"] == "1:1"


def test_the_containerfile_copies_every_package_of_the_wheel():
    text = (ROOT / "Containerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) /src/\1$", text, re.M))
    assert copied == set(images.SOURCE_DIRS)
    assert "USER 65532:65532" in text and f"{images.UID}" == "65532"


def test_the_image_is_pushed_to_the_operators_registry_as_built(tmp_path, auth_registry):
    """`make image PUSH=REF` (``--push``): the archive's manifest, config and layers land in the
    registry the operator names, with its credentials, byte for byte (the same manifest digest);
    a reference without a tag is refused before anything is sent."""
    import pytest

    from accelnode.oci.registry import Deadline, Registry

    layer = tmp_path / "layer.tar"
    images.pause_layer(layer)
    archive = tmp_path / "img.oci.tar"
    images.write_oci_archive(archive, "ghcr.io/accelnode/accelnode:9.9.9", [layer], entrypoint=["/pause"])
    image = images.Image(archive, "ghcr.io/accelnode/accelnode:9.9.9", "k")
    ref = f"{auth_registry.host}/team/accelnode:9.9.9"
    pinned = images.push(image, ref, auth_registry.options())
    with tarfile.open(archive) as t:
        (desc,) = json.loads(t.extractfile("index.json").read())["manifests"]
        manifest = json.loads(t.extractfile(f"blobs/sha256/{desc['digest'][7:]}").read())
    assert pinned == f"{auth_registry.host}/team/accelnode@{desc['digest']}"
    reg = Registry(auth_registry.host, auth_registry.options(), Deadline(30))
    got = reg.request("GET", "team/accelnode/manifests/9.9.9", ref, "reading the manifest",
                      headers={"Accept": desc["mediaType"]})
    assert "sha256:" + hashlib.sha256(got.content).hexdigest() == desc["digest"]
    for d in (manifest["config"], *manifest["layers"]):
        assert reg.blob_exists("team/accelnode", d["digest"], ref)
    with pytest.raises(images.ImageError, match="name a tag"):
        images.push(image, f"{auth_registry.host}/team/accelnode", auth_registry.options())


def test_import_uses_the_containerd_2_ctr_we_build_never_paths(tmp_path, monkeypatch, capsys):
    """``--import`` runs .tools/containerd2/bin/ctr (fresh machines have no Debian ctr on PATH;
    an old one would be containerd 1.x); a ctr that is not there fails before any build."""
    from tests.rigs.node import containerd_bin

    bin_dir = tmp_path / "path"
    bin_dir.mkdir()
    (bin_dir / "ctr").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "ctr").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    tools = tmp_path / "tools" / "bin"
    monkeypatch.setenv("ACCELNODE_TOOLS_BIN", str(tools))
    built = containerd_bin(tools) / "ctr"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\nexit 0\n")
    assert images.import_ctr(None) == built  # not PATH's
    built.unlink()
    monkeypatch.setattr(images, "build", lambda **kw: (_ for _ in ()).throw(AssertionError("built anyway")))
    assert images.main(["--import", str(tmp_path / "sock")]) == 1
    assert f"no ctr at {built}" in capsys.readouterr().err
    assert images.main(["--import", str(tmp_path / "sock"), "--ctr", str(tmp_path / "none")]) == 1
