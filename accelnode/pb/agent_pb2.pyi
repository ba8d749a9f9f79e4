from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnsureCacheRequest(_message.Message):
    __slots__ = ("image", "wait_seconds", "anonymous", "cache")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ANONYMOUS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    image: str
    wait_seconds: float
    anonymous: bool
    cache: CacheRef
    def __init__(self, image: _Optional[str] = ..., wait_seconds: _Optional[float] = ..., anonymous: _Optional[bool] = ..., cache: _Optional[_Union[CacheRef, _Mapping]] = ...) -> None: ...

class EnsureCacheResponse(_message.Message):
    __slots__ = ("state", "digest", "path", "message", "failure", "expected", "found", "size_bytes", "kind")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[EnsureCacheResponse.State]
        READY: _ClassVar[EnsureCacheResponse.State]
        PULLING: _ClassVar[EnsureCacheResponse.State]
        FAILED: _ClassVar[EnsureCacheResponse.State]
        INCOMPATIBLE: _ClassVar[EnsureCacheResponse.State]
    STATE_UNSPECIFIED: EnsureCacheResponse.State
    READY: EnsureCacheResponse.State
    PULLING: EnsureCacheResponse.State
    FAILED: EnsureCacheResponse.State
    INCOMPATIBLE: EnsureCacheResponse.State
    class Failure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FAILURE_UNSPECIFIED: _ClassVar[EnsureCacheResponse.Failure]
        NOT_FOUND: _ClassVar[EnsureCacheResponse.Failure]
        REGISTRY_UNAVAILABLE: _ClassVar[EnsureCacheResponse.Failure]
        DENIED: _ClassVar[EnsureCacheResponse.Failure]
        INVALID_REFERENCE: _ClassVar[EnsureCacheResponse.Failure]
        BAD_CONTENT: _ClassVar[EnsureCacheResponse.Failure]
        INTERNAL: _ClassVar[EnsureCacheResponse.Failure]
        NO_SPACE: _ClassVar[EnsureCacheResponse.Failure]
    FAILURE_UNSPECIFIED: EnsureCacheResponse.Failure
    NOT_FOUND: EnsureCacheResponse.Failure
    REGISTRY_UNAVAILABLE: EnsureCacheResponse.Failure
    DENIED: EnsureCacheResponse.Failure
    INVALID_REFERENCE: EnsureCacheResponse.Failure
    BAD_CONTENT: EnsureCacheResponse.Failure
    INTERNAL: EnsureCacheResponse.Failure
    NO_SPACE: EnsureCacheResponse.Failure
    STATE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    state: EnsureCacheResponse.State
    digest: str
    path: str
    message: str
    failure: EnsureCacheResponse.Failure
    expected: str
    found: str
    size_bytes: int
    kind: str
    def __init__(self, state: _Optional[_Union[EnsureCacheResponse.State, str]] = ..., digest: _Optional[str] = ..., path: _Optional[str] = ..., message: _Optional[str] = ..., failure: _Optional[_Union[EnsureCacheResponse.Failure, str]] = ..., expected: _Optional[str] = ..., found: _Optional[str] = ..., size_bytes: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class PodRef(_message.Message):
    __slots__ = ("namespace", "name", "uid")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    uid: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ...) -> None: ...

class CacheRef(_message.Message):
    __slots__ = ("namespace", "name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class AcquireReferenceRequest(_message.Message):
    __slots__ = ("volume_id", "digest", "pod", "target_path", "exclusive", "cache")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    digest: str
    pod: PodRef
    target_path: str
    exclusive: bool
    cache: CacheRef
    def __init__(self, volume_id: _Optional[str] = ..., digest: _Optional[str] = ..., pod: _Optional[_Union[PodRef, _Mapping]] = ..., target_path: _Optional[str] = ..., exclusive: _Optional[bool] = ..., cache: _Optional[_Union[CacheRef, _Mapping]] = ...) -> None: ...

class AcquireReferenceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseReferenceRequest(_message.Message):
    __slots__ = ("volume_id", "target_path")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    target_path: str
    def __init__(self, volume_id: _Optional[str] = ..., target_path: _Optional[str] = ...) -> None: ...

class ReleaseReferenceResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ListCachesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Reference(_message.Message):
    __slots__ = ("volume_id", "pod", "target_path", "cache")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    pod: PodRef
    target_path: str
    cache: CacheRef
    def __init__(self, volume_id: _Optional[str] = ..., pod: _Optional[_Union[PodRef, _Mapping]] = ..., target_path: _Optional[str] = ..., cache: _Optional[_Union[CacheRef, _Mapping]] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("image", "digest", "state", "path", "kind", "size_bytes", "references", "message", "compatible")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[CacheInfo.State]
        INSTALLED: _ClassVar[CacheInfo.State]
        PULLING: _ClassVar[CacheInfo.State]
        FAILED: _ClassVar[CacheInfo.State]
    STATE_UNSPECIFIED: CacheInfo.State
    INSTALLED: CacheInfo.State
    PULLING: CacheInfo.State
    FAILED: CacheInfo.State
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    COMPATIBLE_FIELD_NUMBER: _ClassVar[int]
    image: str
    digest: str
    state: CacheInfo.State
    path: str
    kind: str
    size_bytes: int
    references: _containers.RepeatedCompositeFieldContainer[Reference]
    message: str
    compatible: bool
    def __init__(self, image: _Optional[str] = ..., digest: _Optional[str] = ..., state: _Optional[_Union[CacheInfo.State, str]] = ..., path: _Optional[str] = ..., kind: _Optional[str] = ..., size_bytes: _Optional[int] = ..., references: _Optional[_Iterable[_Union[Reference, _Mapping]]] = ..., message: _Optional[str] = ..., compatible: _Optional[bool] = ...) -> None: ...

class ListCachesResponse(_message.Message):
    __slots__ = ("caches", "accelerators")
    CACHES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATORS_FIELD_NUMBER: _ClassVar[int]
    caches: _containers.RepeatedCompositeFieldContainer[CacheInfo]
    accelerators: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, caches: _Optional[_Iterable[_Union[CacheInfo, _Mapping]]] = ..., accelerators: _Optional[_Iterable[str]] = ...) -> None: ...

class GetTargetRequest(_message.Message):
    __slots__ = ("target_paths", "mount_root")
    TARGET_PATHS_FIELD_NUMBER: _ClassVar[int]
    MOUNT_ROOT_FIELD_NUMBER: _ClassVar[int]
    target_paths: _containers.RepeatedScalarFieldContainer[str]
    mount_root: FileIdentity
    def __init__(self, target_paths: _Optional[_Iterable[str]] = ..., mount_root: _Optional[_Union[FileIdentity, _Mapping]] = ...) -> None: ...

class FileIdentity(_message.Message):
    __slots__ = ("device", "inode")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    device: int
    inode: int
    def __init__(self, device: _Optional[int] = ..., inode: _Optional[int] = ...) -> None: ...

class HeldCache(_message.Message):
    __slots__ = ("reference", "digest", "path", "size_bytes")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    reference: Reference
    digest: str
    path: str
    size_bytes: int
    def __init__(self, reference: _Optional[_Union[Reference, _Mapping]] = ..., digest: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class GetTargetResponse(_message.Message):
    __slots__ = ("held", "shown")
    HELD_FIELD_NUMBER: _ClassVar[int]
    SHOWN_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedCompositeFieldContainer[HeldCache]
    shown: str
    def __init__(self, held: _Optional[_Iterable[_Union[HeldCache, _Mapping]]] = ..., shown: _Optional[str] = ...) -> None: ...

class CaptureViewRequest(_message.Message):
    __slots__ = ("upper_dir", "digest", "cache", "pod", "repository", "push_secret")
    UPPER_DIR_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_FIELD_NUMBER: _ClassVar[int]
    PUSH_SECRET_FIELD_NUMBER: _ClassVar[int]
    upper_dir: str
    digest: str
    cache: CacheRef
    pod: PodRef
    repository: str
    push_secret: str
    def __init__(self, upper_dir: _Optional[str] = ..., digest: _Optional[str] = ..., cache: _Optional[_Union[CacheRef, _Mapping]] = ..., pod: _Optional[_Union[PodRef, _Mapping]] = ..., repository: _Optional[str] = ..., push_secret: _Optional[str] = ...) -> None: ...

class CaptureViewResponse(_message.Message):
    __slots__ = ("state", "message", "entries", "layer_digest")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[CaptureViewResponse.State]
        QUEUED: _ClassVar[CaptureViewResponse.State]
        NOTHING: _ClassVar[CaptureViewResponse.State]
        REFUSED: _ClassVar[CaptureViewResponse.State]
        BUSY: _ClassVar[CaptureViewResponse.State]
    STATE_UNSPECIFIED: CaptureViewResponse.State
    QUEUED: CaptureViewResponse.State
    NOTHING: CaptureViewResponse.State
    REFUSED: CaptureViewResponse.State
    BUSY: CaptureViewResponse.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LAYER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    state: CaptureViewResponse.State
    message: str
    entries: int
    layer_digest: str
    def __init__(self, state: _Optional[_Union[CaptureViewResponse.State, str]] = ..., message: _Optional[str] = ..., entries: _Optional[int] = ..., layer_digest: _Optional[str] = ...) -> None: ...
