"""Wire schemas shared by the coordinator, its typed client, rollout workers and the trainer.

Torch-free and numpy-free by design (a test proves that importing this package pulls in neither
torch, numpy nor vllm): every process, including a bare status reader, can import it.

Modules:

* :mod:`.common` — error body, health.
* :mod:`.versions` — weight versions (anchors and deltas) and the version event stream.
* :mod:`.workers` — worker registration, heartbeats, worker state.
* :mod:`.trajectories` — trajectory groups and their compact binary (msgpack) wire format.
* :mod:`.batches` — submission results, leased batches, acks, admission control.
* :mod:`.status` — the ``GET /v1/status`` summary.
* version manifests are the weight-sync library's own torch-free records
  (:class:`VersionManifest`, :class:`ObjectRef`), re-exported here for ``POST /v1/versions``.
"""

from deltarl.services.coordinator.schemas.batches import (
    AckRequest,
    AckResult,
    AdmissionRequest,
    AdmissionResponse,
    BatchItem,
    BatchLease,
    DeadLetterInfo,
    DeadLetterList,
    GroupRejection,
    LeasedBatch,
    LeaseExtension,
    SubmitResult,
    decode_leased_batch,
    encode_leased_batch,
)
from deltarl.services.coordinator.schemas.common import ErrorBody, ErrorResponse, Health
from deltarl.services.coordinator.schemas.status import (
    QueueStats,
    RewardPoint,
    StatusSummary,
    VersionPoint,
)
from deltarl.services.coordinator.schemas.trajectories import (
    TRAJECTORY_FORMAT,
    TRAJECTORY_FORMAT_TEACHER,
    ModelLimits,
    RoutedExperts,
    RoutingShape,
    TeacherLogprobs,
    Trajectory,
    TrajectoryGroup,
    check_model_limits,
    decode_group,
    encode_group,
)
from deltarl.services.coordinator.schemas.versions import (
    ChallengePair,
    ChallengePool,
    ChallengePoolResult,
    ChallengePoolStatus,
    ObjectRef,
    VersionKind,
    VersionManifest,
    VersionPublish,
    VersionRecord,
    manifest_digest,
)
from deltarl.services.coordinator.schemas.workers import (
    HeartbeatAck,
    ProofAnswer,
    ProofResult,
    WeightChallenge,
    WorkerHeartbeat,
    WorkerInfo,
    WorkerRegistration,
    WorkerState,
)

__all__ = [
    "TRAJECTORY_FORMAT",
    "TRAJECTORY_FORMAT_TEACHER",
    "AckRequest",
    "AckResult",
    "AdmissionRequest",
    "AdmissionResponse",
    "BatchItem",
    "BatchLease",
    "ChallengePair",
    "ChallengePool",
    "ChallengePoolResult",
    "ChallengePoolStatus",
    "DeadLetterInfo",
    "DeadLetterList",
    "ErrorBody",
    "ErrorResponse",
    "GroupRejection",
    "Health",
    "HeartbeatAck",
    "LeaseExtension",
    "LeasedBatch",
    "ModelLimits",
    "ObjectRef",
    "ProofAnswer",
    "ProofResult",
    "QueueStats",
    "RewardPoint",
    "RoutedExperts",
    "RoutingShape",
    "StatusSummary",
    "SubmitResult",
    "TeacherLogprobs",
    "Trajectory",
    "TrajectoryGroup",
    "VersionKind",
    "VersionManifest",
    "VersionPoint",
    "VersionPublish",
    "VersionRecord",
    "WeightChallenge",
    "WorkerHeartbeat",
    "WorkerInfo",
    "WorkerRegistration",
    "WorkerState",
    "check_model_limits",
    "decode_group",
    "decode_leased_batch",
    "encode_group",
    "encode_leased_batch",
    "manifest_digest",
]
