"""The cluster controller: leader election, the reconciler core, the admission server (docs/controller.md)."""
