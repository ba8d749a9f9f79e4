"""The fixtures capture's tests share with the CSI and agent tests (real driver and agent
processes, the real API server, the local registry)."""

from tests.agent.conftest import agent_rbac, cluster  # noqa: F401
from tests.csi.conftest import node  # noqa: F401
from tests.csi.test_by_name import csi_rbac  # noqa: F401
from tests.controller.test_caches import caches_rbac  # noqa: F401
