"""Errors of the OCI library: one type per thing a caller acts on.

The agent maps these to its API's failure kinds, the CSI driver to gRPC codes and the CLI to
exit codes, so keep the classes stable. Every message names the image (reference or digest)
and the problem.
"""

from __future__ import annotations


class ImageError(Exception):
    """Base class. ``image`` is the reference or digest the error concerns."""

    def __init__(self, message: str, image: str | None = None):
        self.image = image
        self.detail = message  # the message without the image
        super().__init__(f"{image}: {message}" if image else message)

    def add_detail(self, more: str) -> None:
        """Append ``; more`` to the message (what else was tried, say)."""
        self.detail = f"{self.detail}; {more}"
        self.args = (f"{self.image}: {self.detail}" if self.image else self.detail,)


class ImageNotFound(ImageError):
    """The registry says the repository, tag or digest does not exist (HTTP 404)."""


class RegistryUnavailable(ImageError):
    """The registry could not be reached or kept failing within the deadline."""


class AuthError(ImageError):
    """The registry refused our credentials (401/403)."""


class InvalidReference(ImageError):
    """The image reference is malformed (or not digest-pinned where a digest is required)."""


class NoMatchingManifest(ImageError):
    """An image index has no manifest for this node's platform or accelerators."""


class IntegrityError(ImageError):
    """Content does not match its digest or size (blob, manifest, truncated stream)."""


class HostileContent(ImageError):
    """An image tried something forbidden: path escape, device node, bomb, unknown media type..."""


MAX_QUOTED = 300  # characters of a peer's text quoted in a status message


def quoted(text: str, limit: int = MAX_QUOTED) -> str:
    """Text a registry (or any peer) supplied, as a status message may carry it: truncated to
    ``limit`` characters and quoted (``repr``), so that it reads as a quotation and never as
    words of ours. Nothing parses a message; this keeps them honest for people."""
    text = str(text)
    return repr(text[:limit] + ("..." if len(text) > limit else ""))
