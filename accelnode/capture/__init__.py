"""Capture: what pods compiled into their copy-on-write views becomes a signed delta cache image
(docs/capture.md).

* :mod:`.settings`  — a cache's ``accelnode.io/capture*`` annotations and the operator's rules.
* :mod:`.reader`    — reads a view's writable layer as hostile input (no symlink is followed).
* :mod:`.entries`   — keeps only valid cache entries of the cache's kind; refuses poisoned ones.
* :mod:`.layer`     — the deterministic contribution layer, and reading one back as hostile input.
* :mod:`.publish`   — merges contributions, pushes the delta image, signs it, judges promotion.
"""
