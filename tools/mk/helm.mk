# Helm 3, the client the chart tests drive (tests/helm/: lint, template against the kustomize
# base, install/upgrade/rollback/uninstall on the real kubelet lane, push to the test registry and
# install from oci://). One `go build` of helm.sh/helm/v3/cmd/helm from the module pinned in
# tools/helm/go.mod, stamped as Helm's own Makefile does: its version (a plain build says v3.22
# only) and the Kubernetes minor of its client-go as the default of `helm template` and
# `helm lint` (a plain build says 1.20, which the chart's kubeVersion refuses). Rebuilt only
# when the binary is missing or when that go.mod/go.sum change.
HELM_VERSION := $(shell sed -n 's|^[[:space:]]*helm.sh/helm/v3 \(v[0-9][0-9.]*\).*|\1|p' tools/helm/go.mod)
HELM_K8S_MINOR := $(shell sed -n 's|^[[:space:]]*k8s.io/client-go v0\.\([0-9]*\)\..*|\1|p' tools/helm/go.mod)
HELM_LDFLAGS := -s -w -X helm.sh/helm/v3/internal/version.version=$(HELM_VERSION) -X helm.sh/helm/v3/internal/version.gitTreeState=clean \
  $(foreach p,pkg/lint/rules pkg/chartutil,-X helm.sh/helm/v3/$(p).k8sVersionMajor=1 -X helm.sh/helm/v3/$(p).k8sVersionMinor=$(HELM_K8S_MINOR))
TOOLS += $(TOOLS_BIN)/helm

$(TOOLS_BIN)/helm: tools/helm/go.mod tools/helm/go.sum
	@echo "tools: building helm $(HELM_VERSION) from tools/helm/go.mod (once; about 3 minutes on 2 busy cores)"
	mkdir -p $(TOOLS_BIN)
	t=$$(date +%s) && cd tools/helm && CGO_ENABLED=0 nice go build -trimpath -ldflags='$(HELM_LDFLAGS)' -o $@.tmp helm.sh/helm/v3/cmd/helm && \
	  echo "tools: helm $(HELM_VERSION) built in $$(( $$(date +%s) - t ))s"
	mv $@.tmp $@
