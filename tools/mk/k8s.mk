# A real Kubernetes control plane for the tests: etcd, kube-apiserver, kube-controller-manager, a
# kubectl of the same minor, and the node side (kubelet; kubeadm for token discovery and joins),
# built from the Go modules pinned in tools/k8s/go.mod (Kubernetes 1.37, etcd 3.7). Rebuilt only
# when one is missing or when that go.mod/go.sum change. `make cluster` runs one in the foreground
# for a person (tests/rigs/devcluster.py, docs/local-cluster.md).
K8S_NAMES := etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kubeadm
K8S_TOOLS := $(addprefix $(TOOLS_BIN)/,$(K8S_NAMES))
TOOLS += $(K8S_TOOLS)

K8S_PKGS := go.etcd.io/etcd/server/v3 $(addprefix k8s.io/kubernetes/cmd/,kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kubeadm)

# Stamp the release into /version and `kubectl version` as the release build does (a plain
# `go build` reports v0.0.0-master).
K8S_VERSION := $(shell sed -n 's|^[[:space:]]*k8s.io/kubernetes \(v[0-9][0-9.]*\).*|\1|p' tools/k8s/go.mod)
K8S_MINOR := $(word 2,$(subst ., ,$(K8S_VERSION)))
K8S_LDFLAGS := -s -w $(foreach p,k8s.io/component-base/version k8s.io/client-go/pkg/version,\
  -X $(p).gitVersion=$(K8S_VERSION) -X $(p).gitMajor=1 -X $(p).gitMinor=$(K8S_MINOR) -X $(p).gitTreeState=clean)

# One `go build` for all of them (a grouped target: the recipe runs once for the lot), so the
# packages they share (client-go, the apiserver library, the API types) compile once. `go build
# -o DIR/` names each binary after its package path, which for etcd's `server/v3` is `server`.
# Built into a scratch directory and moved into place only when the whole build succeeded.
K8S_BUILD := $(TOOLS_DIR)/build/k8s

$(K8S_TOOLS) &: tools/k8s/go.mod tools/k8s/go.sum
	@echo "tools: building $(K8S_NAMES) from tools/k8s/go.mod (once; about 7 minutes on 2 idle cores, 15 on busy ones)"
	rm -rf $(K8S_BUILD) && mkdir -p $(K8S_BUILD) $(TOOLS_BIN)
	t=$$(date +%s) && cd tools/k8s && CGO_ENABLED=0 nice go build -trimpath -ldflags='$(K8S_LDFLAGS)' -o $(K8S_BUILD)/ $(K8S_PKGS) && \
	  echo "tools: kubernetes $(K8S_VERSION) built in $$(( $$(date +%s) - t ))s"
	mv $(K8S_BUILD)/server $(K8S_BUILD)/etcd
	cd $(K8S_BUILD) && mv -f $(K8S_NAMES) $(TOOLS_BIN)/
	rm -rf $(K8S_BUILD)

.PHONY: cluster
cluster: deps $(K8S_TOOLS)
	$(PY) -m tests.rigs.devcluster --tools-bin $(TOOLS_BIN)
