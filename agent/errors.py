"""Errors of the node's cache store, beside the image errors of :mod:`accelnode.oci.errors`
(which the store raises too: a pull fails as an image, a registry or a layer fails)."""

from __future__ import annotations

from accelnode.oci.errors import ImageError


class StoreCorrupt(ImageError):
    """Installed content no longer matches what was recorded (found by verify)."""


class Busy(ImageError):
    """Another operation holds what this one needs (e.g. a pull of this digest is in progress)."""


class NoSpace(ImageError):
    """The store's file system cannot hold an image (checked before a pull, or hit while unpacking)."""
