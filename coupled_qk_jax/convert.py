"""Hugging Face GPT-2 checkpoints in and out: import one as an export folder of any variant, write a standard
model back in GPT-2's layout.

    python -m coupled_qk_jax.convert --from_hf=gpt2_dir --out=exported/gpt2_coupled --variant=coupled_euler
    python -m coupled_qk_jax.convert --to_hf=gpt2_again --exported=exported/gpt2_standard

`--from_hf` reads what `GPT2LMHeadModel.save_pretrained` writes (config.json + model.safetensors; never a pickle)
and the tokenizer beside it (tokenizer.json, or vocab.json + merges.txt), and writes an export folder
(coupled_qk_jax/export.py) that `load_exported`, `sample.py --exported` and `to_hf` read.

Our `standard` model is GPT-2's shape once `model.attn_bias` adds the projections' biases: pre-LayerNorm (eps 1e-5)
blocks, tanh-GELU MLP with biases, learned positions, tied head, scores scaled by d_head**-0.5. GPT-2's Conv1D
weights are [in, out], as our x @ W; its fused c_attn [d, 3d] splits into W_Q, W_K, W_V, each read as
[d, H, d_head] (head h is columns h*d_head..(h+1)*d_head, GPT-2's split_heads).

A coupled variant adds its parameters at their initial values: f's output layer is zero (f ≡ 0), and Δt starts at
`--dt_init` (default 0), where q <- q + Δt·k and k <- k + Δt·f(q) are the identity: the imported model's function
is unchanged, which the import checks on a batch against the standard import (max |Δlogit|, printed). With Δt > 0
the coupling is on from the first step, as in a model trained from scratch. Differential scoring reads the heads as
pairs with another value layout, so it cannot start from GPT-2's function and is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from coupled_qk_jax.config import ModelConfig, parse_variant
from coupled_qk_jax.errors import UserError

HF_CONFIG, HF_WEIGHTS = "config.json", "model.safetensors"
# GPT-2's activation names for the tanh approximation of GELU (jax.nn.gelu's default).
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
LAYER_NORM_EPS = 1e-5  # model.Norm's


# ---------------------------------------------------------------------------------------------------- reading HF
def read_hf_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """GPT-2's config.json, checked for what our model can reproduce; one-line UserError otherwise."""
    path = Path(directory) / HF_CONFIG
    if not path.is_file():
        raise UserError(f"{path} is missing: --from_hf takes a folder written by GPT2LMHeadModel.save_pretrained")
    hf = json.loads(path.read_text(encoding="utf-8"))
    if hf.get("model_type") != "gpt2":
        raise UserError(f"{path}: model_type {hf.get('model_type')!r}; only GPT-2 checkpoints are imported")
    checks = {
        "activation_function": (hf.get("activation_function", "gelu_new") in TANH_GELU, "a tanh-approximated GELU"),
        "layer_norm_epsilon": (abs(hf.get("layer_norm_epsilon", 1e-5) - LAYER_NORM_EPS) < 1e-12, "1e-5"),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), "true"),
        "scale_attn_by_inverse_layer_idx": (not hf.get("scale_attn_by_inverse_layer_idx", False), "false"),
        "add_cross_attention": (not hf.get("add_cross_attention", False), "false"),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", True), "true"),
    }
    for name, (ok, want) in checks.items():
        if not ok:
            raise UserError(f"{path}: {name}={hf.get(name)!r}; the import reproduces GPT-2 with {name} {want}")
    return hf


def model_config_from_hf(hf: dict[str, Any], variant: str = "standard", dt_init: float = 0.0,
                         **overrides: Any) -> ModelConfig:
    """The ModelConfig of a GPT-2 config (one of our variants; coupled parameters at their initial values)."""
    if parse_variant(variant)[1] == "differential":
        raise UserError(f"--variant={variant}: differential scoring pairs the heads and widens the values, so it "
                        f"cannot start from GPT-2's function; import a softmax variant")
    d = int(hf["n_embd"])
    return ModelConfig(variant=variant, vocab_size=int(hf["vocab_size"]), max_len=int(hf["n_positions"]),
                       d_model=d, n_layers=int(hf["n_layer"]), n_heads=int(hf["n_head"]),
                       d_ff=int(hf.get("n_inner") or 4 * d), positions="learned", norm="layernorm", dropout=0.0,
                       attn_bias=True, dt_init=float(dt_init), init_std=float(hf.get("initializer_range", 0.02)),
                       **overrides)


def read_hf_weights(directory: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """model.safetensors as {name: float32 array}, names without the `transformer.` prefix; the head is checked to
    be the tied embedding (save_pretrained drops it; a copy must be equal)."""
    from safetensors.numpy import load_file

    path = Path(directory) / HF_WEIGHTS
    if not path.is_file():
        raise UserError(f"{path} is missing (pickled pytorch_model.bin is never read: re-save the model with "
                        f"save_pretrained(..., safe_serialization=True))")
    raw = load_file(str(path))
    tensors = {k.removeprefix("transformer."): np.asarray(v, dtype=np.float32) for k, v in raw.items()}
    head = tensors.pop("lm_head.weight", None)
    if head is not None and not np.array_equal(head, tensors.get("wte.weight")):
        raise UserError(f"{path}: lm_head.weight differs from wte.weight; only tied-head GPT-2 models are imported")
    # Older GPT-2 checkpoints store the causal mask as buffers; it is not a parameter.
    return {k: v for k, v in tensors.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}


def hf_to_flat(tensors: dict[str, np.ndarray], mcfg: ModelConfig) -> dict[str, np.ndarray]:
    """GPT-2's tensors -> our export names (per layer, as coupled_qk_jax.export writes them)."""
    d, h, dh = mcfg.d_model, mcfg.n_heads, mcfg.head_dim
    want = {"wte.weight": (mcfg.vocab_size, d), "wpe.weight": (mcfg.max_len, d)}
    out = {"embed": tensors["wte.weight"], "pos_embed": tensors["wpe.weight"],
           "final_norm.scale": tensors["ln_f.weight"], "final_norm.bias": tensors["ln_f.bias"]}
    for i in range(mcfg.n_layers):
        g, o = f"h.{i}.", f"blocks.{i}."
        want[g + "attn.c_attn.weight"] = (d, 3 * d)
        w, b = tensors[g + "attn.c_attn.weight"], tensors[g + "attn.c_attn.bias"]
        for j, name in enumerate("qkv"):
            out[o + f"attn.w{name}"] = w[:, j * d:(j + 1) * d].reshape(d, h, dh)
            out[o + f"attn.b{name}"] = b[j * d:(j + 1) * d].reshape(h, dh)
        out[o + "attn.wo"] = tensors[g + "attn.c_proj.weight"].reshape(h, dh, d)
        out[o + "attn.bo"] = tensors[g + "attn.c_proj.bias"]
        out[o + "attn_norm.scale"], out[o + "attn_norm.bias"] = tensors[g + "ln_1.weight"], tensors[g + "ln_1.bias"]
        out[o + "mlp_norm.scale"], out[o + "mlp_norm.bias"] = tensors[g + "ln_2.weight"], tensors[g + "ln_2.bias"]
        out[o + "mlp.w_in"], out[o + "mlp.b_in"] = tensors[g + "mlp.c_fc.weight"], tensors[g + "mlp.c_fc.bias"]
        out[o + "mlp.w_out"], out[o + "mlp.b_out"] = tensors[g + "mlp.c_proj.weight"], tensors[g + "mlp.c_proj.bias"]
    for name, shape in want.items():
        if tensors[name].shape != shape:
            raise UserError(f"{name} has shape {tensors[name].shape}, the config says {shape}")
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def flat_to_hf(flat: dict[str, np.ndarray], mcfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of :func:`hf_to_flat`, for a standard model with attn_bias: GPT-2's tensor names and shapes."""
    d = mcfg.d_model
    out = {"wte.weight": flat["embed"], "wpe.weight": flat["pos_embed"], "ln_f.weight": flat["final_norm.scale"],
           "ln_f.bias": flat["final_norm.bias"]}
    for i in range(mcfg.n_layers):
        g, o = f"h.{i}.", f"blocks.{i}."
        out[g + "attn.c_attn.weight"] = np.concatenate([flat[o + f"attn.w{n}"].reshape(d, d) for n in "qkv"], axis=1)
        out[g + "attn.c_attn.bias"] = np.concatenate([flat[o + f"attn.b{n}"].reshape(d) for n in "qkv"])
        out[g + "attn.c_proj.weight"] = flat[o + "attn.wo"].reshape(d, d)
        out[g + "attn.c_proj.bias"] = flat[o + "attn.bo"]
        out[g + "ln_1.weight"], out[g + "ln_1.bias"] = flat[o + "attn_norm.scale"], flat[o + "attn_norm.bias"]
        out[g + "ln_2.weight"], out[g + "ln_2.bias"] = flat[o + "mlp_norm.scale"], flat[o + "mlp_norm.bias"]
        out[g + "mlp.c_fc.weight"], out[g + "mlp.c_fc.bias"] = flat[o + "mlp.w_in"], flat[o + "mlp.b_in"]
        out[g + "mlp.c_proj.weight"], out[g + "mlp.c_proj.bias"] = flat[o + "mlp.w_out"], flat[o + "mlp.b_out"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def read_hf_tokenizer(directory: str | os.PathLike[str]):
    """The folder's GPT-2 tokenizer as our BPETokenizer: tokenizer.json, else vocab.json + merges.txt (byte-level
    BPE, no prefix space: GPT-2's own pre-tokenisation)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from coupled_qk_jax.data.tokenizer import EOT, BPETokenizer

    d = Path(directory)
    if (d / "tokenizer.json").is_file():
        tk = Tokenizer.from_file(str(d / "tokenizer.json"))
    elif (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        tk = Tokenizer(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([EOT])  # already in GPT-2's vocab.json: keeps its id, now never split
    else:
        raise UserError(f"{d} has no tokenizer (tokenizer.json, or vocab.json and merges.txt); copy GPT-2's "
                        f"tokenizer files beside the weights")
    return BPETokenizer(tk)


# ------------------------------------------------------------------------------------------------------ the import
def import_hf(directory: str | os.PathLike[str], variant: str = "standard", dt_init: float = 0.0,
              seed: int = 0) -> tuple[ModelConfig, dict[str, Any]]:
    """(model config, params pytree) of the GPT-2 folder as ``variant``: GPT-2's weights, and the variant's own
    parameters at their initialisation from ``seed`` (f's output layer zero, Δt = dt_init)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from coupled_qk_jax.export import flatten_params, param_name
    from coupled_qk_jax.model import TransformerLM

    mcfg = model_config_from_hf(read_hf_config(directory), variant, dt_init)
    flat = hf_to_flat(read_hf_weights(directory), mcfg)
    params = nnx.to_pure_dict(nnx.state(TransformerLM(mcfg, seed), nnx.Param))
    ours = flatten_params(params)
    missing = sorted(set(flat) - set(ours))
    if missing:  # the mapping names a parameter the model does not have: a bug here, not a user's mistake
        raise AssertionError(f"GPT-2 tensors without a parameter: {missing}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    values = [jnp.asarray(flat[param_name(p)]) if param_name(p) in flat else x for p, x in leaves]
    return mcfg, jax.tree_util.tree_unflatten(treedef, values)


def logits_of(mcfg: ModelConfig, params: Any, tokens: np.ndarray) -> np.ndarray:
    """float32 logits [B, T, V] of the model with ``params`` on ``tokens`` [B, T]."""
    from flax import nnx

    from coupled_qk_jax.model import TransformerLM

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: TransformerLM(mcfg, 0)))
    return np.asarray(nnx.merge(graphdef, params)(tokens))


def run_config(mcfg: ModelConfig) -> dict[str, Any]:
    """A full run config around the imported model, as an export folder records it."""
    from coupled_qk_jax.training import rundir
    from coupled_qk_jax.training.config import DataConfig, RunConfig, configdict

    cfg = RunConfig(model=mcfg, data=DataConfig(seq_len=mcfg.max_len), scale="gpt2-import")
    config = rundir.jsonable(configdict(cfg).to_dict())
    config.pop("mqar")  # an LM run's config has no MQAR block
    return rundir.config_with_schema(config)


def convert_from_hf(directory: str, out: str, variant: str = "standard", dt_init: float = 0.0,
                    seed: int = 0) -> float:
    """Writes the export folder ``out`` of the GPT-2 folder as ``variant``; returns the max |logit difference| of
    the variant from the standard import on a fixed batch (0 up to float32 rounding when dt_init = 0)."""
    from coupled_qk_jax.export import write_export

    mcfg, params = import_hf(directory, variant, dt_init, seed)
    tokenizer = read_hf_tokenizer(directory)
    if tokenizer.vocab_size > mcfg.vocab_size:
        raise UserError(f"{directory}: the tokenizer has {tokenizer.vocab_size} tokens, the model {mcfg.vocab_size}")
    batch = np.random.default_rng(0).integers(0, mcfg.vocab_size, (2, min(16, mcfg.max_len)))
    gap = 0.0
    if variant != "standard":
        ref_cfg, ref_params = import_hf(directory, "standard", 0.0, seed)
        gap = float(np.max(np.abs(logits_of(mcfg, params, batch) - logits_of(ref_cfg, ref_params, batch))))
        scale = float(np.max(np.abs(logits_of(ref_cfg, ref_params, batch))))
        if dt_init == 0.0 and gap > 1e-4 * max(scale, 1.0):  # the identity at Δt = 0 failed: a bug, not the input
            raise AssertionError(f"{variant} at dt_init=0 changed the logits by {gap} (scale {scale})")
    write_export(out, params, run_config(mcfg), tokenizer, step=0)
    return gap


def convert_to_hf(exported: str, out: str) -> None:
    """Writes a standard export folder (an imported GPT-2, or a standard run with model.attn_bias and GPT-2's
    architecture) as a Hugging Face GPT-2 folder: config.json, model.safetensors, tokenizer.json."""
    from safetensors.numpy import load_file, save_file

    from coupled_qk_jax.export import CONFIG, TOKENIZER, WEIGHTS, _read_manifest
    from coupled_qk_jax.training.rundir import upgrade_config

    src = Path(exported)
    manifest = _read_manifest(src)
    config, _ = upgrade_config(json.loads((src / CONFIG).read_text(encoding="utf-8")))
    mcfg = ModelConfig.from_dict(config["model"])
    unlike = {"variant": ("standard", mcfg.variant), "norm": ("layernorm", mcfg.norm),
              "positions": ("learned", mcfg.positions), "attn_bias": (True, mcfg.attn_bias)}
    unlike = {k: v for k, v in unlike.items() if v[0] != v[1]}
    if unlike or mcfg.d_ff == 0:
        what = ", ".join(f"model.{k}={got!r} (GPT-2: {want!r})" for k, (want, got) in unlike.items()) or "model.d_ff=0"
        raise UserError(f"{src} is not GPT-2's architecture: {what}")
    if manifest["tokenizer"]["kind"] != "bpe":
        raise UserError(f"{src} has a {manifest['tokenizer']['kind']} tokenizer; GPT-2's folder needs a BPE one")
    flat = load_file(str(src / WEIGHTS))
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(flat_to_hf(flat, mcfg), str(dest / HF_WEIGHTS), metadata={"format": "pt"})
    eot = int(manifest["tokenizer"]["eot_id"])
    hf = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": mcfg.vocab_size,
          "n_positions": mcfg.max_len, "n_embd": mcfg.d_model, "n_layer": mcfg.n_layers, "n_head": mcfg.n_heads,
          "n_inner": mcfg.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": LAYER_NORM_EPS,
          "initializer_range": mcfg.init_std, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
          "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": True}
    (dest / HF_CONFIG).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (dest / "tokenizer.json").write_bytes((src / TOKENIZER).read_bytes())


# ---------------------------------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coupled_qk_jax.convert", description=__doc__.splitlines()[0])
    p.add_argument("--from_hf", help="a Hugging Face GPT-2 folder (config.json + model.safetensors + tokenizer)")
    p.add_argument("--out", help="with --from_hf: the export folder to write")
    p.add_argument("--variant", default="standard", help="the imported model's variant (softmax scoring)")
    p.add_argument("--dt_init", type=float, default=0.0, help="Δt of a coupled variant (0: GPT-2's function)")
    p.add_argument("--seed", type=int, default=0, help="initialisation of the variant's own parameters")
    p.add_argument("--to_hf", help="a Hugging Face GPT-2 folder to write from --exported")
    p.add_argument("--exported", help="with --to_hf: a standard export folder with GPT-2's architecture")
    args = p.parse_args(argv)
    from coupled_qk_jax.training import cli

    def go() -> None:
        if bool(args.from_hf) == bool(args.to_hf):
            raise UserError("give either --from_hf=DIR --out=EXPORT or --to_hf=DIR --exported=EXPORT")
        if args.from_hf:
            if not args.out:
                raise UserError("--from_hf needs --out=EXPORT_FOLDER")
            gap = convert_from_hf(args.from_hf, args.out, args.variant, args.dt_init, args.seed)
            print(f"imported {args.from_hf} as {args.variant} -> {args.out} (max |logit - GPT-2's logit| on a "
                  f"check batch: {gap:.3g})", flush=True)
        else:
            if not args.exported:
                raise UserError("--to_hf needs --exported=EXPORT_FOLDER")
            convert_to_hf(args.exported, args.to_hf)
            print(f"wrote {args.to_hf} (Hugging Face GPT-2) from {args.exported}", flush=True)

    return cli.run_guarded(go)


if __name__ == "__main__":
    from coupled_qk_jax.startup import configure_process

    configure_process()
    sys.exit(main())
