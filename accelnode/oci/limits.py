"""How much one image may hold: the bounds every reader of untrusted images enforces."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 64 << 30  # regular-file bytes of one image, all layers together
    max_files: int = 2_000_000  # entries of one image, all layers together
    max_ratio: int = 250  # uncompressed / compressed bytes of one layer
    max_manifest_bytes: int = 4 << 20
    max_config_bytes: int = 4 << 20
    max_layers: int = 128  # layers of one manifest
    max_index_entries: int = 256  # manifests of one image index

    @property
    def max_tar_bytes(self) -> int:
        """The most tar stream (content plus headers) one image can need within these limits."""
        return self.max_bytes + (self.max_files + 16) * 2048
