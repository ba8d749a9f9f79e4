# A real Kubernetes control plane for the tests: etcd, kube-apiserver and a kubectl of the same
# minor, built from the Go modules pinned in tools/k8s/go.mod (Kubernetes 1.35, etcd 3.6).
# Rebuilt only when missing or when that go.mod/go.sum change. `make cluster` runs one in the
# foreground for a person (accelnode/testing/devcluster.py, docs/local-cluster.md).
K8S_TOOLS := $(TOOLS_BIN)/etcd $(TOOLS_BIN)/kube-apiserver $(TOOLS_BIN)/kubectl
TOOLS += $(K8S_TOOLS)

K8S_PKG_etcd := go.etcd.io/etcd/server/v3
K8S_PKG_kube-apiserver := k8s.io/kubernetes/cmd/kube-apiserver
K8S_PKG_kubectl := k8s.io/kubernetes/cmd/kubectl

# Stamp the release into /version and `kubectl version` as the release build does (a plain
# `go build` reports v0.0.0-master).
K8S_VERSION := $(shell sed -n 's|^[[:space:]]*k8s.io/kubernetes \(v[0-9][0-9.]*\).*|\1|p' tools/k8s/go.mod)
K8S_MINOR := $(word 2,$(subst ., ,$(K8S_VERSION)))
K8S_LDFLAGS := -s -w $(foreach p,k8s.io/component-base/version k8s.io/client-go/pkg/version,\
  -X $(p).gitVersion=$(K8S_VERSION) -X $(p).gitMajor=1 -X $(p).gitMinor=$(K8S_MINOR) -X $(p).gitTreeState=clean)

$(K8S_TOOLS): $(TOOLS_BIN)/%: tools/k8s/go.mod tools/k8s/go.sum
	@mkdir -p $(TOOLS_BIN)
	cd tools/k8s && CGO_ENABLED=0 nice go build -trimpath -ldflags='$(K8S_LDFLAGS)' -o $@ $(K8S_PKG_$*)

.PHONY: cluster
cluster: deps $(K8S_TOOLS)
	$(PY) -m accelnode.testing.devcluster --tools-bin $(TOOLS_BIN)
