# oras CLI: the Go reference client the cache benchmark compares our pull against.
# Built through a throwaway wrapper module: `go install oras.land/oras/cmd/oras@VERSION` needs the
# module's version list (for its deprecation check), which the module proxy here refuses.
ORAS_VERSION := v1.2.3
TOOLS += $(TOOLS_BIN)/oras

$(TOOLS_BIN)/oras:
	mkdir -p $(TOOLS_BIN) $(TOOLS_DIR)/src/oras
	cd $(TOOLS_DIR)/src/oras && rm -f go.mod go.sum && go mod init accelnode-tools/oras >/dev/null 2>&1 \
	  && nice go get oras.land/oras/cmd/oras@$(ORAS_VERSION) \
	  && nice go build -o $@ oras.land/oras/cmd/oras
