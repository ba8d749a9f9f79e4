"""The generated protobuf code of the agent's own API (``proto/agent.proto``), in one place:
``agent`` holds the messages and ``agent_grpc`` the servicer and stub. Only the gRPC adapter
(:mod:`agent.service`) and tests import these; the core never does."""

from accelnode.pb import agent_pb2 as agent
from accelnode.pb import agent_pb2_grpc as agent_grpc

__all__ = ["agent", "agent_grpc"]
