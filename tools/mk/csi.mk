# csi-sanity v5.4.0: the CSI conformance suite the csi_driver tests run against our socket.
CSI_SANITY_VERSION := v5.4.0
TOOLS += $(TOOLS_BIN)/csi-sanity

$(TOOLS_BIN)/csi-sanity:
	mkdir -p $(TOOLS_BIN)
	GOBIN=$(TOOLS_BIN) nice go install github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$(CSI_SANITY_VERSION)
