"""The training run's configuration: one frozen dataclass per block of the ConfigDict, validated once.

A run is configured by an ml_collections ConfigDict (configs/lm.py, configs/mqar.py, ``--config.x=y`` overrides, a run
directory's config.json). :meth:`RunConfig.from_configdict` turns it into typed blocks at the boundary
(``loop.train``, ``loop.setup``); the loop and the tasks read only these:

    train       TrainConfig       steps, batch, optimiser, schedule, logging, evaluation cadence, early_stop
    data        DataConfig        corpus, tokenizer, token cache, sequence length
    checkpoint  CheckpointConfig  save cadence (steps, seconds) and retention
    mesh        MeshConfig        (data, fsdp, tensor) sizes, -1 = fill
    model       ModelConfig       the function: shapes, variant, dynamics (coupled_qk_jax/config.py)
    runtime     RuntimeConfig     how it is computed: remat, layer layout, attention kernel (same module)
    mqar        MQARConfig        the MQAR task's level and segment sizes (task = "mqar" only)

The dataclasses hold every default; the config files set only what differs (``configdict`` makes the ConfigDict
block of a dataclass). A block given as a dict may omit fields (they take the default: e.g. a run's config.json from
before a field existed) but may not name unknown ones (a one-line error with the closest known name). The
ConfigDict itself stays the record of the run: config.json is written from it, not from these classes.

Nothing here imports JAX: the command line checks a config without starting a backend.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from typing import Any, Mapping

import ml_collections

from coupled_qk_jax.config import ModelConfig, RuntimeConfig
from coupled_qk_jax.errors import UserError, did_you_mean

TASKS = ("lm", "mqar", "glue")
EARLY_STOP_MODES = ("max", "min")
KEEP_BEST = ("", "validation_loss")


def _optional(kind: Any) -> Any:
    """``float`` for ``float | None``; None for a plain type."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(k for k in typing.get_args(kind) if k is not type(None))
    return None


def _typed(block: str, name: str, value: Any, kind: Any) -> Any:
    """``value`` as the field's type, or a UserError naming ``block.name``. Integer fields accept numpy integers;
    float fields accept integers (a config file's ``600`` means 600.0); ``float | None`` fields accept None."""
    if _optional(kind) is not None:
        if value is None:
            return None
        kind = _optional(kind)
    ok = {bool: isinstance(value, bool),
          int: isinstance(value, numbers.Integral) and not isinstance(value, bool),
          float: isinstance(value, numbers.Real) and not isinstance(value, bool),
          str: isinstance(value, str)}[kind]
    if not ok:
        raise UserError(f"{block}.{name} must be {'a' if kind is not int else 'an'} {kind.__name__}, got {value!r}")
    return kind(value)


def _from_dict(cls: type, block: str, values: Mapping[str, Any]) -> Any:
    """Build dataclass ``cls`` from a dict/ConfigDict: unknown fields refused by name, missing ones defaulted, each
    value checked against the field's type; nested dataclass fields built the same way."""
    if hasattr(values, "to_dict"):
        values = values.to_dict()  # resolves FieldReferences (configs/mqar.py's derived fields)
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for name in values:
        if name not in known:
            raise UserError(f"{block}: unknown field {name!r}{did_you_mean(name, known)}; known fields are "
                            f"{', '.join(known)}")
    kwargs = {}
    for name, value in values.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            kwargs[name] = _from_dict(kind, f"{block}.{name}", value)
        else:
            kwargs[name] = _typed(block, name, value, kind)
    return cls(**kwargs)


class _Block:
    """``from_dict`` for a block dataclass whose ConfigDict name is ``BLOCK``."""

    BLOCK: typing.ClassVar[str]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Any:
        """The block from its dict / ConfigDict form (see :func:`_from_dict`); mistakes are UserErrors."""
        return _from_dict(cls, cls.BLOCK, values)


def configdict(instance: Any) -> ml_collections.ConfigDict:
    """A dataclass instance as a ConfigDict block, nested blocks included. Optional float fields become
    ``placeholder(float)`` so that ``--config.x=0.5`` can set a field whose default is None."""
    hints = typing.get_type_hints(type(instance))
    out = ml_collections.ConfigDict()
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = configdict(value)
        elif value is None and _optional(hints[f.name]) is not None:
            out[f.name] = ml_collections.config_dict.placeholder(_optional(hints[f.name]))
        else:
            out[f.name] = value
    return out


def _at_least(block: str, instance: Any, minimum: int, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(instance, name)
        if value < minimum:
            raise UserError(f"{block}.{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class EarlyStopConfig(_Block):
    """``train.early_stop`` (training/early_stop.py): stop at a plateau or a threshold of a validation metric."""

    BLOCK = "train.early_stop"

    metric: str = ""  # "" = off; "val_loss" / "val_ppl" (LM), "valid/accuracy" / "valid/loss" (MQAR)
    mode: str = "max"  # "max" for accuracy, "min" for a loss
    patience: int = 0  # evaluations in a row without an improvement beyond min_delta (0 = off)
    min_delta: float = 0.0
    threshold: float | None = None  # stop once the metric reaches this (None = off)

    def __post_init__(self) -> None:
        if not self.metric:
            return
        if self.mode not in EARLY_STOP_MODES:
            raise UserError(f"train.early_stop.mode must be 'max' or 'min', got {self.mode!r}")
        if self.patience < 0 or self.min_delta < 0:
            raise UserError(f"train.early_stop.patience and min_delta must be >= 0, got {self.patience} and "
                            f"{self.min_delta}")
        if self.patience == 0 and self.threshold is None:
            raise UserError(f"train.early_stop.metric={self.metric!r} needs a rule: set train.early_stop.patience "
                            f"> 0 or train.early_stop.threshold")


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Block):
    """``train``: what one optimiser step is, the schedule, and the logging / evaluation cadence."""

    BLOCK = "train"

    steps: int = 2000
    batch_size: int = 16  # global sequences per optimiser step (split over hosts, devices and grad_accum)
    grad_accum: int = 1  # micro-batches per step: each is batch_size / grad_accum sequences
    seed: int = 0  # model init, data order and per-step dropout keys (fold_in(seed, step))
    num_seeds: int = 1  # S > 1: seeds seed..seed+S-1 trained together as one vmapped program (docs/experiments.md)
    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    # The lr is the schedule's value at the last multiple of this many steps: 1 = a new value every step; N =
    # constant over blocks of N steps (configs/mqar.py's zoology protocol: once an epoch, as torch's
    # CosineAnnealingLR stepped per epoch).
    schedule_every: int = 1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping threshold; 0 = no clipping
    qk_lr_mult: float = 1.0  # multiplies the learning rate of W_Q and W_K (second seed paper's intervention)
    ov_lr_mult: float = 1.0  # multiplies the learning rate of W_V and W_O
    qk_mult_coupling: bool = False  # also apply qk_lr_mult to the coupling parameters (f and Δt)
    log_every: int = 25  # 0 = no periodic log lines
    eval_every: int = 500  # 0 = only at the end
    eval_batches: int = 0  # 0 = the whole validation split (every token once); N = the first N batches
    eval_batch_size: int = 0  # global sequences per eval batch (0 = train.batch_size)
    stop_after: int = 0  # stop (with a checkpoint) once this many steps are done in total; 0 = train.steps. For tests.
    # A fresh run's parameters from an export folder (export.py, or a GPT-2 imported by convert.py) or a run
    # directory (its newest checkpoint, replica 0), matched by name and shape; parameters the source lacks (a coupled
    # variant's f and Δt on a standard source) keep their initialisation. Read only at the first start.
    init_from: str = ""
    # Observability (training/observe.py). MFU is logged when the per-device peak is given, e.g. 989 for an
    # H100 SXM in bf16 dense (the vendor's figure for the dtype you train in); 0 = not logged (CPU).
    peak_tflops: float = 0.0
    profile_steps: int = 0  # N > 0: a jax.profiler trace of steps 2..N+1 into WORKDIR/profile
    # Stop at the end of learning (training/early_stop.py); with several seeds, once every seed has.
    early_stop: EarlyStopConfig = dataclasses.field(default_factory=EarlyStopConfig)

    def __post_init__(self) -> None:
        _at_least("train", self, 1, ("steps", "num_seeds", "schedule_every"))
        if self.batch_size < 1 or self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise UserError(f"train.batch_size={self.batch_size} must be a positive multiple of "
                            f"train.grad_accum={self.grad_accum}")
        _at_least("train", self, 0, ("log_every", "eval_every", "eval_batches", "eval_batch_size", "stop_after",
                                     "warmup_steps", "profile_steps"))
        for name in ("qk_lr_mult", "ov_lr_mult", "grad_clip"):
            if getattr(self, name) < 0:
                raise UserError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.early_stop.metric and self.eval_every <= 0:
            raise UserError("train.early_stop needs periodic evaluations: set train.eval_every > 0")

    @property
    def seeds(self) -> list[int]:
        """The run's seeds: ``seed, ..., seed + num_seeds - 1`` (replica i = the single run with the i-th)."""
        return [self.seed + i for i in range(self.num_seeds)]

    @property
    def stop_at(self) -> int:
        """The step this start trains to: train.stop_after when set (and sooner), else train.steps."""
        return min(self.steps, self.stop_after or self.steps)


@dataclasses.dataclass(frozen=True)
class DataConfig(_Block):
    """``data``: the corpus and its tokenisation (docs/data.md); the MQAR task generates its data and reads only
    seq_len and num_threads."""

    BLOCK = "data"

    # The data layer's corpus string: stdlib | text_dir:DIR | wikitext103:DIR | hf:NAME[:CONFIG[:FIELD]] |
    # mixture:SPEC@W;SPEC@W (docs/data.md), or the JSON of a CorpusSpec dict.
    corpus: str = "stdlib"
    split_fractions: str = ""  # "train,validation,test" fractions for file corpora, e.g. "0.8,0.1,0.1"; "" = default
    max_bytes: int = 0  # cap on the UTF-8 text read per split (0 = no cap)
    cache_dir: str = "~/.cache/coupled_qk_jax"  # token cache root (tokenised once, reused across runs)
    tokenizer: str = "bpe"  # bpe (trained on the train split, vocab = model.vocab_size) | byte (vocab 257)
    tokenizer_path: str = ""  # an existing BPE tokenizer.json to use instead of training one
    seq_len: int = 128  # ModelConfig.max_len's default
    num_threads: int = 2  # grain read threads for the training iterator

    def __post_init__(self) -> None:
        _at_least("data", self, 1, ("seq_len",))
        _at_least("data", self, 0, ("max_bytes", "num_threads"))
        _ = self.fractions  # parses (so validates) split_fractions now

    @property
    def fractions(self) -> tuple[float, ...] | None:
        """data.split_fractions as numbers, None when unset (the corpus's default split)."""
        if not self.split_fractions.strip():
            return None
        try:
            return tuple(float(x) for x in self.split_fractions.split(","))
        except ValueError:
            raise UserError(f"data.split_fractions must be 'train,validation,test' numbers, "
                            f"got {self.split_fractions!r}") from None

    def corpus_spec(self) -> Any:
        """The data layer's CorpusSpec: data.corpus plus the split_fractions / max_bytes overrides."""
        import json  # noqa: PLC0415

        from coupled_qk_jax.data.corpora import CorpusSpec  # noqa: PLC0415

        text = self.corpus.strip()
        spec = CorpusSpec.coerce(json.loads(text) if text.startswith("{") else text)
        changes: dict[str, Any] = {}
        if self.fractions is not None:
            changes["split_fractions"] = self.fractions
        if self.max_bytes:
            changes["max_bytes"] = self.max_bytes
        return dataclasses.replace(spec, **changes) if changes else spec


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(_Block):
    """``checkpoint``: when to save (training/loop.py's SavePolicy) and what to keep (training/checkpoint.py)."""

    BLOCK = "checkpoint"

    every: int = 250  # save every N steps (and always at the end, on SIGINT/SIGTERM)
    # Also save when this many seconds passed since the last save (0 = off). Judged at the steps that already wait
    # for the device (log lines; every 100 steps without them), so several processes agree with one broadcast.
    every_seconds: float = 600.0
    keep_last: int = 2  # keep the latest k checkpoints
    keep_every: int = 0  # also keep every N-th step permanently (0 = off)
    # "validation_loss": also keep the checkpoint with the lowest periodic validation loss (orbax's BestN); "" = off
    keep_best: str = ""
    async_save: bool = True

    def __post_init__(self) -> None:
        _at_least("checkpoint", self, 1, ("every",))
        if self.every_seconds < 0:
            raise UserError(f"checkpoint.every_seconds must be >= 0 (0 = off), got {self.every_seconds}")
        _at_least("checkpoint", self, 1, ("keep_last",))
        _at_least("checkpoint", self, 0, ("keep_every",))
        if self.keep_best not in KEEP_BEST:
            raise UserError(f"checkpoint.keep_best must be one of {', '.join(map(repr, KEEP_BEST))}, got "
                            f"{self.keep_best!r}")


@dataclasses.dataclass(frozen=True)
class MeshConfig(_Block):
    """``mesh``: the (data, fsdp, tensor) device mesh, -1 = all remaining devices (sharding.mesh_shape checks the
    sizes against the devices). A multi-slice TPU run sets ``dcn_data`` / ``dcn_fsdp``, the slices that the data /
    fsdp axis spans over the data-centre network; data, fsdp and tensor are then the sizes within one slice, and
    the mesh's data axis is dcn_data * data (sharding.make_mesh)."""

    BLOCK = "mesh"

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    dcn_data: int = 1
    dcn_fsdp: int = 1

    def __post_init__(self) -> None:
        _at_least("mesh", self, 1, ("dcn_data", "dcn_fsdp"))

    def sizes(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MQARConfig(_Block):
    """``mqar`` (configs/mqar.py): the protocol and the level fix L, N, the vocabulary and the segment sizes
    (data.mqar.PROTOCOLS)."""

    BLOCK = "mqar"

    level: str = "easy"
    protocol: str = "cpu"  # "cpu" (data.mqar.LEVELS) or "zoology" (ICLR'24 Figure 2's sizes, ZOOLOGY_LEVELS)
    epochs: int = 16
    num_train: int = 0  # training examples (one zoology segment); 0 = the level's
    num_valid: int = 0  # validation examples (periodic evaluations, early stopping, selection); 0 = the level's
    num_test: int = 0  # test examples (scored once, at the selected checkpoint); 0 = the level's
    eval_every_epochs: int = 2
    steps_per_epoch: int = 0  # derived by configs/mqar.py (ceil(num_train / batch_size)); 0 = not checked
    shuffle: bool = True  # the seed sets the order of the training examples, reshuffled every epoch; False = zoology's

    def __post_init__(self) -> None:
        _at_least("mqar", self, 0, ("epochs", "num_train", "num_valid", "num_test", "eval_every_epochs",
                                    "steps_per_epoch"))


BLOCKS = {"data": DataConfig, "train": TrainConfig, "checkpoint": CheckpointConfig, "mesh": MeshConfig,
          "mqar": MQARConfig}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every block of a run's config, typed and checked against each other (no device is needed for any check
    here; the mesh-dependent ones are layout.validate_on_mesh's)."""

    task: str = "lm"
    scale: str = ""  # configs/lm.py's scale name, reported in summary.json
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    mqar: MQARConfig | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise UserError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.task == "mqar" and self.mqar is None:
            raise UserError("task='mqar' needs the mqar block: use configs/mqar.py:VARIANT,LEVEL")
        if self.task == "glue" and not self.data.corpus.startswith("glue:"):
            raise UserError(f"task='glue' reads data.corpus='glue:TASK[:DIR]', got {self.data.corpus!r}; use "
                            "configs/glue.py:VARIANT,SCALE,TASK")
        if self.data.seq_len > self.model.max_len:
            raise UserError(f"data.seq_len={self.data.seq_len} exceeds model.max_len={self.model.max_len}")

    @classmethod
    def from_configdict(cls, cfg: Mapping[str, Any]) -> "RunConfig":
        """The typed config of a ConfigDict (or its dict form); every mistake is a one-line UserError."""
        values = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        known = ["task", "scale", "model", "runtime", *BLOCKS]
        for name in values:
            if name not in known:
                raise UserError(f"config: unknown block {name!r}{did_you_mean(name, known)}; known blocks are "
                                f"{', '.join(known)}")
        try:
            model = ModelConfig.from_dict(values.get("model", {}))
            runtime = RuntimeConfig.from_dict(values.get("runtime", {}))
        except ValueError as e:  # raised only by the field checks of coupled_qk_jax/config.py
            raise UserError(str(e)) from None
        blocks = {name: kind.from_dict(values[name]) for name, kind in BLOCKS.items() if name in values}
        return cls(task=_typed("config", "task", values.get("task", "lm"), str),
                   scale=_typed("config", "scale", values.get("scale", ""), str), model=model, runtime=runtime,
                   **blocks)
