"""Accelerator hardware as sysfs and /dev show it: TPU chips (discovery, PCI attributes) and
the node's accelerators summarised as cache images describe their targets."""
