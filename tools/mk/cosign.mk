# cosign CLI: signs test images in the local registry and is the reference verifier for the cache
# signature tests (tests/cache/test_signatures*.py). One build, v3: it verifies both formats and
# still writes the legacy `.sig` simple-signing tag with `--new-bundle-format=false`.
# Built through a throwaway wrapper module like oras (the proxy here refuses the version list
# `go install pkg@version` wants).
COSIGN_VERSION := v3.1.3
TOOLS += $(TOOLS_BIN)/cosign

$(TOOLS_BIN)/cosign:
	mkdir -p $(TOOLS_BIN) $(TOOLS_DIR)/src/cosign
	cd $(TOOLS_DIR)/src/cosign && rm -f go.mod go.sum && go mod init accelnode-tools/cosign >/dev/null 2>&1 \
	  && nice go get github.com/sigstore/cosign/v3/cmd/cosign@$(COSIGN_VERSION) \
	  && nice go build -trimpath -o $@ github.com/sigstore/cosign/v3/cmd/cosign
