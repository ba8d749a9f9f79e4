"""Test rigs: a simulated TPU host, a kubelet-faithful device-plugin harness, a local control
plane (etcd + kube-apiserver) and the device-plugin demo. Used by tests, benchmarks, `make demo`
and `make cluster`; no runtime module imports this package."""
