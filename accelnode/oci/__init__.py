"""OCI images and registries: references, the registry client with blob streaming, credentials,
manifests and their validation, the kernel-cache image format, building and pushing images."""
