"""Test rigs, outside the product (neither the wheel nor the image carries them): a simulated TPU
host, a kubelet-faithful device-plugin harness, a local control plane, the GCE Compute and
metadata emulators, the image builder and the demos. Used by tests, benchmarks and the make
targets (`make demo`, `make demo-plugin`, `make image`, `make cluster`, `make gce-emulator`)."""
