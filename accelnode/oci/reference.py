"""Image references (``HOST[:PORT]/REPOSITORY[:TAG][@sha256:HEX]``) and digests."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InvalidReference
from .mirrors import host_problem

_REF = re.compile(
    r"^(?P<host>[A-Za-z0-9.-]+(?::[0-9]+)?)/"
    r"(?P<repo>[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
DIGEST_PINNED = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")  # REGISTRY/REPO@sha256:<64 hex>, the form nodes pull
MAX_NAME = 255  # characters of HOST/REPOSITORY (the distribution reference's NameTotalLengthMax)


@dataclass(frozen=True)
class Reference:
    host: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> Reference:
        m = _REF.match(text or "")
        if not m:
            raise InvalidReference(
                "not an image reference: expected HOST[:PORT]/REPOSITORY[:TAG][@sha256:HEX]", text)
        if (problem := host_problem(m["host"])) is not None:
            raise InvalidReference(f"not an image reference: {problem}", text)
        if len(m["host"]) + 1 + len(m["repo"]) > MAX_NAME:
            raise InvalidReference(f"not an image reference: its name (HOST/REPOSITORY) is longer than {MAX_NAME} "
                                   "characters", text[:MAX_NAME] + "...")
        return cls(m["host"], m["repo"], m["tag"], m["digest"])

    @property
    def ref(self) -> str:
        """What the manifest endpoint is asked for: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def pinned(self, digest: str) -> str:
        return f"{self.host}/{self.repository}@{digest}"

    def __str__(self) -> str:
        return (f"{self.host}/{self.repository}" + (f":{self.tag}" if self.tag else "")
                + (f"@{self.digest}" if self.digest else ""))


def check_digest(digest: str, image: str | None = None) -> str:
    if not isinstance(digest, str) or not DIGEST.match(digest):
        raise InvalidReference(f"not a sha256 digest: {digest!r}", image)
    return digest


