"""kubelet plugin registration, served by the driver itself (no node-driver-registrar sidecar).

kubelet's plugin watcher finds ``<registry dir>/csi.gkm.io-reg.sock``, calls GetInfo, checks the
type, name and versions, dials ``endpoint`` and reports the outcome through
NotifyRegistrationStatus.
"""

from __future__ import annotations

import logging
from pathlib import Path

from accelnode.log import kv

from .api import reg, reg_grpc
from .identity import DRIVER_NAME

log = logging.getLogger("accelnode.csi")
PLUGIN_TYPE = "CSIPlugin"
SUPPORTED_VERSIONS = ["1.0.0"]  # CSI spec versions kubelet may speak to us


def socket_path(registry_dir: str | Path) -> Path:
    return Path(registry_dir) / f"{DRIVER_NAME}-reg.sock"


class RegistrationServer(reg_grpc.RegistrationServicer):
    def __init__(self, endpoint: str, on_status):
        self.endpoint = endpoint  # the CSI socket as kubelet sees it (host path)
        self.on_status = on_status  # called with (registered: bool)

    def GetInfo(self, request, context):  # noqa: N802 (gRPC naming)
        return reg.PluginInfo(type=PLUGIN_TYPE, name=DRIVER_NAME, endpoint=self.endpoint,
                              supported_versions=SUPPORTED_VERSIONS)

    def NotifyRegistrationStatus(self, request, context):  # noqa: N802
        if request.plugin_registered:
            log.info("registered with kubelet", extra=kv(driver=DRIVER_NAME, endpoint=self.endpoint))
        else:
            log.error("kubelet refused the registration", extra=kv(driver=DRIVER_NAME, error=request.error))
        self.on_status(request.plugin_registered)
        return reg.RegistrationStatusResponse()
