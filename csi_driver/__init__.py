"""CSI node plugin ``csi.gkm.io``: mounts kernel caches read-only into pods."""
