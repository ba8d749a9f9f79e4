"""The node agent: owner of the node's content-addressed kernel-cache store."""
