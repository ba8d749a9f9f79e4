"""Errors of the cache store and its registry client: one type per thing a caller acts on.

The CSI driver maps these to gRPC codes and the CLI to exit codes, so keep the classes
stable. Every message names the image (reference or digest) and the problem.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class. ``image`` is the reference or digest the error concerns."""

    def __init__(self, message: str, image: str | None = None):
        self.image = image
        super().__init__(f"{image}: {message}" if image else message)


class ImageNotFound(CacheError):
    """The registry says the repository, tag or digest does not exist (HTTP 404)."""


class RegistryUnavailable(CacheError):
    """The registry could not be reached or kept failing within the deadline."""


class AuthError(CacheError):
    """The registry refused our credentials (401/403)."""


class InvalidReference(CacheError):
    """The image reference is malformed (or not digest-pinned where a digest is required)."""


class NoMatchingManifest(CacheError):
    """An image index has no manifest for this node's platform or accelerators."""


class IntegrityError(CacheError):
    """Content does not match its digest or size (blob, manifest, truncated stream)."""


class HostileContent(CacheError):
    """A layer tried something forbidden: path escape, device node, bomb, unknown media type..."""


class StoreCorrupt(CacheError):
    """Installed content no longer matches what was recorded (found by verify)."""


class Busy(CacheError):
    """Another operation holds what this one needs (e.g. a pull of this digest is in progress)."""
