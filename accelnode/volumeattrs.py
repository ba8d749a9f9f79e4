"""The csi.gkm.io driver's name and the volume attributes that name a cache (docs/csi.md): one
place for the names the CSI driver reads, the controller writes into PersistentVolumes and the
agent reads from pods' inline volumes (components do not import each other)."""

DRIVER = "csi.gkm.io"
CACHE = "csi.gkm.io/GKMCache"  # the cache's name
NAMESPACE = "csi.gkm.io/namespace"  # its namespace (none: a ClusterGKMCache)
IMAGE = "csi.gkm.io/image"  # an image named by the volume itself, no cache
