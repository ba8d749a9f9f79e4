# kro (Kube Resource Orchestrator) controller: the real peer that accepts our example
# ResourceGraphDefinition (examples/kro/) and expands its instances into our kinds
# (tests/e2e/test_kro.py). Built from its Go module through a throwaway wrapper module like
# cosign; the CRDs it needs come from the same module version (helm/crds/) and are copied next
# to the binary so a test never reaches into the Go module cache.
KRO_VERSION := v0.9.4
KRO_CRDS := $(TOOLS_DIR)/kro/crds
TOOLS += $(TOOLS_BIN)/kro-controller

$(TOOLS_BIN)/kro-controller:
	@echo "tools: building kro $(KRO_VERSION) controller (once; about 2 minutes on 2 cores)"
	mkdir -p $(TOOLS_BIN) $(TOOLS_DIR)/src/kro
	cd $(TOOLS_DIR)/src/kro && rm -f go.mod go.sum && go mod init accelnode-tools/kro >/dev/null 2>&1 \
	  && nice go get github.com/kubernetes-sigs/kro/cmd/controller@$(KRO_VERSION) \
	  && rm -rf $(KRO_CRDS) && mkdir -p $(KRO_CRDS) \
	  && cp "$$(go list -m -f '{{.Dir}}' github.com/kubernetes-sigs/kro)"/helm/crds/*.yaml $(KRO_CRDS)/ \
	  && chmod u+w $(KRO_CRDS)/*.yaml \
	  && CGO_ENABLED=0 nice go build -trimpath -ldflags='-s -w' -o $@.tmp github.com/kubernetes-sigs/kro/cmd/controller \
	  && mv $@.tmp $@
