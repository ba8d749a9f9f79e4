"""A fresh VM's boot disk for node-startup.sh: a Debian 12 root file system from mmdebstrap.

:func:`boot_disk` returns a tar of ``mmdebstrap --variant=minbase bookworm`` plus what every
stock GCE image has and a minimal one lacks (``curl``, ``ca-certificates``), built once and
cached under :func:`tests.rigs.image.cache_dir` (git-ignored ``.tools/images``) by the recipe's
key. So that a test's ``apt-get install`` does not download again, the cached tar also holds the
package lists and the ``.deb`` files of what node-startup.sh installs (downloaded, not
installed: the disk is still fresh). :func:`unpack` extracts it for one test.

Cost (measured here): the first build about 60 s and 100 MB of downloads; the cached tar about
400 MB on disk; unpacking it about 5 s.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from tests.rigs.image import EPOCH, SUITE, cache_dir

RECIPE_VERSION = "1"  # bump when the recipe below changes what it makes
IMAGE_PACKAGES = ("curl", "ca-certificates")  # what a stock GCE image has and minbase lacks
# what node-startup.sh installs with apt-get (downloaded into the cache, not installed); containerd 2
# comes from its release tarball (accelnode-containerd-url), not from apt
STARTUP_PACKAGES = ("runc", "python3", "python3-venv", "conntrack", "iptables")


def key() -> str:
    text = "\0".join((RECIPE_VERSION, SUITE, *IMAGE_PACKAGES, *STARTUP_PACKAGES))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def boot_disk(log=print) -> Path:
    """The cached root file system tar (built on first use)."""
    out = cache_dir() / f"vmroot-{key()}.tar"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"vmroot: mmdebstrap --variant=minbase {SUITE} (+{', '.join(IMAGE_PACKAGES)}; caching the .debs of "
        f"{', '.join(STARTUP_PACKAGES)})")
    hook = (f'chroot "$1" apt-get install -y -q --download-only --no-install-recommends {" ".join(STARTUP_PACKAGES)}')
    tmp = out.with_name(out.stem + ".partial.tar")  # mmdebstrap picks its output format by the name
    subprocess.run(["mmdebstrap", "--variant=minbase", "--mode=root", f"--include={','.join(IMAGE_PACKAGES)}",
                    "--aptopt=APT::Install-Recommends \"false\"",
                    "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/locale/*",
                    "--dpkgopt=path-exclude=/usr/share/doc/*",
                    "--skip=cleanup/apt/lists", "--skip=cleanup/apt/cache",
                    f"--customize-hook={hook}", SUITE, str(tmp)],
                   check=True, capture_output=True, env=dict(os.environ, SOURCE_DATE_EPOCH=str(EPOCH)))
    tmp.rename(out)
    for old in cache_dir().glob("vmroot-*.tar"):
        if old != out:
            old.unlink(missing_ok=True)
    return out


def unpack(disk: Path, root: Path) -> Path:
    root.mkdir(parents=True)
    subprocess.run(["tar", "-xf", str(disk), "-C", str(root)], check=True)
    return root


def chroot_argv(root: Path, argv: list[str]) -> list[str]:
    """Run ``argv`` in ``root`` as its own system: a private mount namespace with /proc and /dev
    (gone with the process), the host's network (the metadata server and the mirror)."""
    script = (f'mount -t proc proc "{root}/proc" && mount --rbind /dev "{root}/dev" && '
              f'cp /etc/resolv.conf "{root}/etc/resolv.conf" && exec chroot "{root}" "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]
