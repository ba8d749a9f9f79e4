"""The Kubernetes API: a small client (JSON over HTTPS, kubeconfig or in-cluster) and reflectors
(watch-backed local copies) for every component that talks to the API server."""
