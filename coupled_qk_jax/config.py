"""The model's configuration: one frozen dataclass, validated up front, and the variant-name grammar.

A variant name is `QK_TRANSFORM` or `QK_TRANSFORM+differential`, where the QK transform is what q and k pass through
before scoring and `differential` swaps softmax scoring for Differential Attention:

    standard                  no transform, softmax scoring
    coupled_euler             Euler coupled dynamics        (dynamics.euler_step)
    coupled_leapfrog          leapfrog coupled dynamics     (dynamics.leapfrog_step)
    mlp_only                  uncoupled MLP ablation        (dynamics.uncoupled_step)
    affine                    RealNVP-style invertible affine coupling (invertible.py)
    differential              no transform, Differential Attention scoring
    coupled_euler+differential, affine+differential, ...   any transform with differential scoring

Two blocks, because they answer two questions. `ModelConfig` (`model.*`) is the function: shapes, variant, integrator,
f's width, positions, init, dtype; a run keeps it for life. `RuntimeConfig` (`runtime.*`) is how that function is
computed: rematerialisation, the attention kernel and its query blocks, the dynamics scan's unroll and backward pass,
and whether the layers run as one scanned stack. None of them changes what is learnt, so a run may resume, be
evaluated, sampled or exported under other runtime values (each change is noted once).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from coupled_qk_jax.errors import did_you_mean

QK_TRANSFORMS = ("none", "coupled_euler", "coupled_leapfrog", "mlp_only", "affine")
SCORINGS = ("softmax", "differential")
# Dynamics method used by each dynamics-based transform.
DYNAMICS_METHOD = {"coupled_euler": "euler", "coupled_leapfrog": "leapfrog", "mlp_only": "uncoupled"}

ALL_VARIANTS = tuple(
    ["standard", "coupled_euler", "coupled_leapfrog", "mlp_only", "affine", "differential"]
    + [f"{t}+differential" for t in QK_TRANSFORMS if t != "none"]
)


def parse_variant(variant: str) -> tuple[str, str]:
    """'coupled_euler+differential' -> ('coupled_euler', 'differential'); 'standard' -> ('none', 'softmax')."""
    if variant == "standard":
        return "none", "softmax"
    if variant == "differential":
        return "none", "differential"
    transform, plus, scoring = variant.partition("+")
    if transform not in QK_TRANSFORMS[1:] or (plus and scoring != "differential"):
        raise ValueError(f"model.variant: unknown variant {variant!r}; expected one of {', '.join(ALL_VARIANTS)}")
    return transform, "differential" if plus else "softmax"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every shape and switch of the decoder-only LM. Field names match `configs/lm.py`'s `model` block."""

    variant: str = "standard"
    vocab_size: int = 256
    max_len: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4  # the *baseline* head count; differential scoring uses n_heads // 2 heads of twice the width
    d_ff: int = 256  # 0 removes the block MLP (attention-only models, e.g. MQAR)
    # Coupled dynamics (coupled_euler / coupled_leapfrog / mlp_only).
    n_steps: int = 1  # the paper: 1..7 steps perform the same; one suffices
    # Δt starts at 0.1: the layer starts close to standard attention (exactly standard at 0) while the gradient
    # reaching f (∝ Δt) is already non-negligible.
    dt_init: float = 0.1
    coupling_hidden: int = 24
    coupling_scope: str = "layer"  # "layer": one f per layer; "shared": one f for every layer
    per_head_params: bool = False  # one f per head (stacked on a leading H axis) instead of one shared by all heads
    # Affine invertible coupling.
    affine_hidden: int = 24
    affine_pairs: int = 1
    # Architecture.
    positions: str = "learned"  # "learned" | "rope" | "none"
    rope_base: float = 10000.0
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    dropout: float = 0.0
    dtype: str = "float32"  # compute dtype, "float32" | "bfloat16"; params are always float32 (precision.py)
    init_std: float = 0.02
    # Biases on the q/k/v and output projections (GPT-2 has them; checkpoints imported from it need them).
    attn_bias: bool = False
    # > 0: a classification head (1 = regression) on the final hidden state of each sequence's last real token, for
    # fine-tuning on sentence tasks (GLUE); 0 = none, the language model alone.
    num_labels: int = 0

    def __post_init__(self):
        parse_variant(self.variant)
        _positive = ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "coupling_hidden", "affine_hidden",
                     "affine_pairs")
        for name in _positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.n_steps, int) or self.n_steps < 1:
            raise ValueError(f"model.n_steps must be an integer >= 1, got {self.n_steps!r}")
        if not isinstance(self.num_labels, int) or isinstance(self.num_labels, bool) or self.num_labels < 0:
            raise ValueError(f"model.num_labels must be an integer >= 0 (0 = no classification head), got "
                             f"{self.num_labels!r}")
        if self.d_ff < 0:
            raise ValueError(f"model.d_ff must be >= 0 (0 = no MLP), got {self.d_ff}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        _, scoring = parse_variant(self.variant)
        if scoring == "differential" and self.n_heads % 2:
            raise ValueError(
                f"model.n_heads={self.n_heads} must be even for differential scoring "
                "(each differential head splits into two half-heads of the baseline head dim)")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"model.positions='rope' needs an even head dim, got head_dim={self.head_dim}")
        if self.dtype == "float16":
            raise ValueError("model.dtype='float16' is not supported: it needs loss scaling, which is not implemented "
                             "(coupled_qk_jax/precision.py); use model.dtype='bfloat16'")
        choices = {"coupling_scope": ("layer", "shared"), "positions": ("learned", "rope", "none"),
                   "norm": ("rmsnorm", "layernorm"), "dtype": ("float32", "bfloat16")}
        _check_choices("model", self, choices)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.per_head_params and self.coupling_scope == "shared":
            raise ValueError("model.per_head_params=True is not supported with model.coupling_scope='shared'")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def qk_transform(self) -> str:
        return parse_variant(self.variant)[0]

    @property
    def scoring(self) -> str:
        return parse_variant(self.variant)[1]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Build from a ConfigDict/dict, refusing unknown fields by name."""
        return _from_dict(cls, "model", values)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How the model's function is computed: every field may differ between the run that trained a model and the
    programs that resume, evaluate, sample or export it. Field names match the configs' `runtime` block."""

    # "none" | "full" | "dots" (save matmul outputs) | "nothing_saveable"; under scan_layers "none" runs as "dots"
    # (faster and smaller there: model.TransformerLM._through_layers)
    remat: str = "none"
    # Layers as one stacked block run by jax.lax.scan (params carry a leading "layers" axis): compile time and HLO
    # size stop growing with depth, and FSDP gathers one layer's weights at a time. False: a Python loop of blocks.
    # The checkpoint layout follows it; a restore converts a checkpoint saved in the other layout.
    scan_layers: bool = False
    # "auto": cuDNN on GPU (bf16/fp16, no mix), else the Pallas kernel on GPU (a mix or float32) and on TPU, else
    # explicit | "explicit" | "xla" | "cudnn" | "pallas" (kernels.choose_implementation)
    attention_impl: str = "auto"
    attention_chunks: int = 0  # query blocks of the explicit causal path; 0 = auto (about T/64, at most 8)
    scan_unroll: int = 1  # lax.scan unroll over the n dynamics steps
    # Backward pass of the dynamics (dynamics.integrate): "reversible" keeps no per-step residuals (leapfrog
    # integrates backwards, the others recompute their steps), "autodiff" keeps the plain scan's. Same gradients.
    dynamics_backward: str = "reversible"

    def __post_init__(self):
        if not isinstance(self.scan_unroll, int) or isinstance(self.scan_unroll, bool) or self.scan_unroll < 1:
            raise ValueError(f"runtime.scan_unroll must be an integer >= 1, got {self.scan_unroll!r}")
        chunks = self.attention_chunks
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 0:
            raise ValueError(f"runtime.attention_chunks must be an integer >= 0 (0 = auto), got {chunks!r}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"runtime.scan_layers must be True or False, got {self.scan_layers!r}")
        _check_choices("runtime", self, {"remat": ("none", "full", "dots", "nothing_saveable"),
                                         "dynamics_backward": ("reversible", "autodiff"),
                                         "attention_impl": ("auto", "explicit", "xla", "cudnn", "pallas")})

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RuntimeConfig":
        """Build from a ConfigDict/dict, refusing unknown fields by name."""
        return _from_dict(cls, "runtime", values)


# The fields that moved from the model block to the runtime block (config.json's schema 3): how older run
# directories, exports and config dicts are read.
RUNTIME_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(RuntimeConfig))


def _check_choices(block: str, instance: Any, choices: Mapping[str, tuple]) -> None:
    for name, allowed in choices.items():
        if getattr(instance, name) not in allowed:
            raise ValueError(f"{block}.{name} must be one of {allowed}, got {getattr(instance, name)!r}")


def _from_dict(cls: type, block: str, values: Mapping[str, Any]) -> Any:
    known = [f.name for f in dataclasses.fields(cls)]
    values = values.to_dict() if hasattr(values, "to_dict") else dict(values)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{block}: unknown field(s) {unknown}{did_you_mean(unknown[0], known)}; known fields are "
                         f"{sorted(known)}")
    return cls(**values)
