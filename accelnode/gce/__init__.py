"""Google Compute Engine: what runs on a VM and what talks to GCE's APIs (``metadata.py``: the
VM's metadata server, long polls included)."""
