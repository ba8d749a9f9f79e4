"""The admission webhook server every capability's webhooks are served by (docs/webhook-certificates.md).

* :mod:`.server` — the HTTPS AdmissionReview server and its routes.
* :mod:`.certs` — the self-managed CA and serving certificate in one Secret, renewed and reloaded.
* :mod:`.cabundle` — the reconciler that keeps our webhook configurations' ``caBundle`` equal to it.
"""
