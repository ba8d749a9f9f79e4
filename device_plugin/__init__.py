"""kubelet device plugin offering TPU chips as ``google.com/tpu``."""
