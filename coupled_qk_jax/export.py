"""Export a trained run to a portable folder (safetensors weights, config, tokenizer) and rebuild the model from it.

    python export.py --workdir=runs/ce_tiny --out=exported/ce_tiny

    from coupled_qk_jax.export import load_exported
    model, tokenizer, manifest = load_exported("exported/ce_tiny")     # model(tokens [B, T]) -> logits [B, T, V]

The folder needs nothing but this package to load: no checkpoint, no corpus, no token cache.

    DIR/model.safetensors   every parameter, float32, named by its dotted path in the model, e.g. ``embed``,
                            ``blocks.0.attn.wq`` [d_model, H, d_head], ``blocks.0.attn.coupling.w1``,
                            ``final_norm.scale`` (the names are the unscanned model's own attribute paths, so they
                            change only when model.py's structure does: a runtime.scan_layers run is written per
                            layer too, and stacked back on load when the runtime asks for scanned layers)
    DIR/config.json         the run's full config; the loader reads its ``model`` and ``runtime`` blocks
    DIR/tokenizer.json      the BPE tokenizer (absent for the byte tokenizer)
    DIR/export.json         written last: format, checkpoint step, replica and seed, tokenizer kind / size / end-of-text id, and the
                            SHA-256 of every other file, checked on load so a damaged file is refused by name

The folder is written under a temporary name and renamed into place, so an interrupted export never leaves a
folder that looks complete. DIR may be a gs:// URL: the folder is then written locally and uploaded file by file,
export.json last (Cloud Storage has no rename), and load_exported reads it back from there. The round trip is exact: the loaded model's parameters are bitwise the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from coupled_qk_jax import paths
from coupled_qk_jax import sharding as shd
from coupled_qk_jax.config import ModelConfig, RuntimeConfig
from coupled_qk_jax.data.token_cache import file_sha256
from coupled_qk_jax.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from coupled_qk_jax.errors import UserError

FORMAT = "coupled_qk_jax.export"
FORMAT_VERSION = 1
WEIGHTS, CONFIG, TOKENIZER, MANIFEST = "model.safetensors", "config.json", "tokenizer.json", "export.json"


class ExportError(UserError):
    """An export folder cannot be written or read as asked (missing, corrupt, mismatched). One-line message."""


# -- parameter names -------------------------------------------------------------------------------------------------
def param_name(path: tuple) -> str:
    """The dotted name of a pytree path (``blocks.0.attn.wq``): the export's tensor names."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flatten_params(params: Any) -> dict[str, np.ndarray]:
    """``{dotted name: host array}`` of a params pytree (``nnx.to_pure_dict`` of the model, as checkpoints hold it).

    The leaves may be host arrays, single-device or sharded arrays, or (multi-host) arrays with shards on other
    processes, which are all-gathered (sharding.to_host): every process must then call this, and each gets every
    tensor whole."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {param_name(p): shd.to_host(x) for p, x in leaves}


def per_layer_tensors(params: Any, mcfg: ModelConfig) -> dict[str, np.ndarray]:
    """The export's names: :func:`flatten_params`, with a scanned stack of layers (``runtime.scan_layers``: one
    ``blocks.attn.wq`` [L, ...], told apart from ``blocks.0.attn.wq`` by its name) split into the per-layer names of
    the unscanned model. A runtime setting does not change the names, only the model's structure does."""
    flat = flatten_params(params)
    out = {}
    for name, value in flat.items():
        if name.startswith("blocks.") and not name.split(".")[1].isdigit():
            assert value.shape[0] == mcfg.n_layers, (name, value.shape)
            out.update({f"blocks.{i}.{name[len('blocks.'):]}": value[i] for i in range(mcfg.n_layers)})
        else:
            out[name] = value
    return out


def _stack_layers(tensors: dict[str, np.ndarray], mcfg: ModelConfig, scanned: bool) -> dict[str, np.ndarray]:
    """Inverse of :func:`per_layer_tensors` for a model with scanned layers (``scanned``): ``blocks.<i>.X`` for every
    layer i -> ``blocks.X`` [L, ...]. Names that do not cover every layer stay as they are (and are reported as not
    fitting the model)."""
    if not scanned:
        return tensors
    out = {k: v for k, v in tensors.items() if not k.startswith("blocks.")}
    rests = sorted({k.split(".", 2)[2] for k in tensors if k.startswith("blocks.") and k.count(".") >= 2})
    for rest in rests:
        names = [f"blocks.{i}.{rest}" for i in range(mcfg.n_layers)]
        if all(n in tensors for n in names) and len({tensors[n].shape for n in names}) == 1:
            out[f"blocks.{rest}"] = np.stack([tensors[n] for n in names])
        else:
            out.update({n: tensors[n] for n in names if n in tensors})
    for k, v in tensors.items():  # anything left under blocks. that is not a layer's
        if k.startswith("blocks.") and k.count(".") < 2:
            out[k] = v
    return out


# -- writing ---------------------------------------------------------------------------------------------------------
def write_export(out: str | os.PathLike[str], params: Any, config: dict[str, Any], tokenizer: Tokenizer,
                 step: int | None = None, replica: dict[str, int] | None = None) -> Path | epath.Path:
    """Writes an export folder from one model's params pytree (no seed axis), the run's config dict and its
    tokenizer; ``replica`` ({"replica", "seed"}) says which seed of a seed-parallel run it is. Returns its path.

    ``out`` may be missing, empty, or an earlier export (replaced); any other existing path is refused. On several
    processes every one must call this (the params' shards are gathered); process 0 writes, and all return once the
    folder is in place.
    """
    remote = paths.is_remote(out)
    out = paths.as_path(paths.resolve(out))
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / MANIFEST).is_file())):
        raise ExportError(f"--out {out} exists and is not an export folder; choose a new or empty directory")
    mcfg = ModelConfig.from_dict(config["model"])  # the loader must be able to read what we write
    if not isinstance(tokenizer, (BPETokenizer, ByteTokenizer)):  # refused on every process, before any collective
        raise ExportError(f"cannot export a {type(tokenizer).__name__}; expected a BPE or byte tokenizer")
    # Every process gathers (a collective where shards are on other processes); process 0 alone writes the folder.
    tensors = {k: np.ascontiguousarray(v) for k, v in per_layer_tensors(params, mcfg).items()}
    if jax.process_index() == 0 and remote:
        _upload_folder(out, tensors, config, tokenizer, step, replica)
    elif jax.process_index() == 0:
        try:
            _write_folder(out, tensors, config, tokenizer, step, replica)
        except OSError as e:  # a read-only or full disk: one line naming the folder
            raise ExportError(f"cannot write the export to {out}: {paths.cause(e)}") from None
    if jax.process_count() > 1:  # no process returns before the folder is in place
        from jax.experimental import multihost_utils  # noqa: PLC0415

        multihost_utils.sync_global_devices("coupled_qk_jax.export.write_export")
    return out


def _write_folder(out: Path, tensors: dict[str, np.ndarray], config: dict[str, Any], tokenizer: Tokenizer,
                  step: int | None, replica: dict[str, int] | None) -> None:
    """Writes :func:`write_export`'s folder from its tensors (name -> host array), under a temporary name renamed
    into place."""
    from safetensors.numpy import save_file  # noqa: PLC0415 - only exporting needs it

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
    (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    files = [WEIGHTS, CONFIG]
    if isinstance(tokenizer, BPETokenizer):
        tokenizer.save(tmp / TOKENIZER)
        files.append(TOKENIZER)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step, **(replica or {}),
        "tokenizer": {"kind": tokenizer.kind, "vocab_size": int(tokenizer.vocab_size), "eot_id": int(tokenizer.eot_id),
                      "file": TOKENIZER if TOKENIZER in files else None},
        "parameters": {"count": int(sum(v.size for v in tensors.values())), "tensors": len(tensors)},
        "sha256": {f: file_sha256(tmp / f) for f in files},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def _upload_folder(out: epath.Path, tensors: dict[str, np.ndarray], config: dict[str, Any], tokenizer: Tokenizer,
                   step: int | None, replica: dict[str, int] | None) -> None:
    """:func:`_write_folder` for a gs:// ``out``: the folder is written in a local temporary directory, then each
    file is uploaded, the manifest last; an earlier export there loses its manifest first, so that a folder whose
    upload was interrupted never reads as complete."""
    with tempfile.TemporaryDirectory(prefix="export_") as local:
        folder = Path(local) / "export"
        _write_folder(folder, tensors, config, tokenizer, step, replica)
        if (out / MANIFEST).exists():
            paths.remove_tree(str(out))
        try:
            paths.upload_dir(str(folder), str(out), last=MANIFEST)
        except paths.io_errors(str(out)) as e:  # a missing bucket, no permission
            raise ExportError(f"cannot write the export to {out}: {paths.cause(e)}") from None


def _local_folder(d: epath.Path, into: str) -> Path:
    """A gs:// export folder downloaded into the local directory ``into`` (the safetensors and tokenizers
    libraries read local files)."""
    if not d.is_dir():
        raise ExportError(f"export folder {d} does not exist")
    for f in d.iterdir():
        if f.is_file():
            (Path(into) / f.name).write_bytes(f.read_bytes())
    return Path(into)


def export_run(workdir: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None,
               replica: int = 0, mesh: Any = None, runtime: Mapping[str, Any] | None = None) -> Path | epath.Path:
    """Exports one replica (default 0) of checkpoint ``step`` (default: the newest intact one) of the train.py run in
    ``workdir``, with its own config and tokenizer (training.run.Run, restored on one device or ``mesh``).
    ``runtime``: ``runtime.*`` fields to restore with (``Run.open(runtime=...)``, e.g. ``{"scan_layers": True}``);
    the weights and the exported config, the run's own runtime block included, are the same whatever they are."""
    from coupled_qk_jax.training import rundir
    from coupled_qk_jax.training.run import Run  # noqa: PLC0415 - the loader side needs none of the training stack

    run = Run.open(str(workdir), mesh=mesh, runtime=runtime)
    run.check_replica(replica)
    if run.tokenizer is None:
        raise ExportError(f"{workdir} is a {run.cfg.task} run: it has no tokenizer, export handles language models")
    at, _ = run.state(step)
    config = run.cfg.to_dict()
    if runtime:  # how this export was read is not the run's: record the run's own runtime block
        config["runtime"] = rundir.upgrade_config(rundir.run_config(run.workdir))[0]["runtime"]
    return write_export(out, run.params(at, replica), config, run.tokenizer, step=at,
                        replica={"replica": replica, "seed": run.seeds[replica]})


# -- loading ---------------------------------------------------------------------------------------------------------
def _read_manifest(d: Path) -> dict[str, Any]:
    if not d.is_dir():
        raise ExportError(f"export folder {d} does not exist")
    mp = d / MANIFEST
    if not mp.is_file():
        raise ExportError(f"{d} is not an export folder (no {MANIFEST}); write one with "
                          f"python export.py --workdir=RUN --out={d}")
    try:
        manifest = json.loads(mp.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{mp} is not valid JSON ({e}); export again") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{mp} is format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
                          f"this code reads {FORMAT!r} version {FORMAT_VERSION}")
    for f, digest in manifest.get("sha256", {}).items():
        if not (d / f).is_file():
            raise ExportError(f"{d / f} is missing; export again")
        if file_sha256(d / f) != digest:
            raise ExportError(f"{d / f} is corrupt (its SHA-256 differs from {MANIFEST}); export again")
    return manifest


def load_exported(directory: str | os.PathLike[str], runtime: RuntimeConfig | Mapping[str, Any] | None = None,
                  ) -> tuple[nnx.Module, Tokenizer, dict[str, Any]]:
    """Rebuilds ``(model, tokenizer, manifest)`` from an export folder alone.

    The model is a ``TransformerLM`` with the exported float32 parameters (host arrays on the default device), computed
    as ``runtime`` says: a RuntimeConfig, or a mapping of ``runtime.*`` fields over the run's own block (e.g.
    ``{"attention_impl": "explicit"}``; what ``sample.py --exported --runtime=...`` passes); default: the run's own
    ``runtime`` block. ``manifest["config"]`` is the run's full config.
    Raises :class:`ExportError` (one line) when the folder is missing, a file is damaged, or the weights do not fit
    the config's model (names or shapes differ).
    """
    if not paths.is_remote(directory):
        return _load_folder(Path(directory), runtime)
    with tempfile.TemporaryDirectory(prefix="export_") as local:
        try:
            return _load_folder(_local_folder(paths.as_path(directory), local), runtime)
        except ExportError as e:  # name the folder the user gave, not the local copy
            raise ExportError(str(e).replace(local, str(directory).rstrip("/"))) from None


def _load_folder(d: Path, runtime: RuntimeConfig | Mapping[str, Any] | None,
                 ) -> tuple[nnx.Module, Tokenizer, dict[str, Any]]:
    """:func:`load_exported` of a local folder."""
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.numpy import load_file  # noqa: PLC0415

    from coupled_qk_jax.model import TransformerLM  # noqa: PLC0415
    from coupled_qk_jax.training.steps import split_model  # noqa: PLC0415

    manifest = _read_manifest(d)
    from coupled_qk_jax.training.rundir import upgrade_config  # noqa: PLC0415

    config, _ = upgrade_config(json.loads((d / CONFIG).read_text(encoding="utf-8")))
    try:
        mcfg = ModelConfig.from_dict(config.get("model", {}))
        own = None if isinstance(runtime, RuntimeConfig) else RuntimeConfig.from_dict(config.get("runtime", {}))
    except (TypeError, ValueError) as e:
        raise ExportError(f"{d / CONFIG} has no valid model block: {str(e).splitlines()[0]}") from None
    if own is not None:  # the run's own block, with the fields given over it (a ValueError names a bad one)
        runtime = RuntimeConfig.from_dict({**dataclasses.asdict(own), **runtime}) if runtime else own
    try:  # the runtime's layout of the layers
        tensors = _stack_layers(load_file(str(d / WEIGHTS)), mcfg, runtime.scan_layers)
    except SafetensorError as e:
        raise ExportError(f"{d / WEIGHTS} cannot be read ({e}); export again") from None

    graphdef, abstract = split_model(nnx.eval_shape(lambda: TransformerLM(mcfg, 0, runtime)))
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    expected = {param_name(p): x for p, x in paths}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k} {tuple(tensors[k].shape)}/{tensors[k].dtype} vs {tuple(v.shape)}/{v.dtype}"
             for k, v in expected.items() if k in tensors
             and (tuple(tensors[k].shape) != tuple(v.shape) or tensors[k].dtype != v.dtype)]
    if missing or unexpected or wrong:
        parts = [f"missing {', '.join(missing[:3])}" if missing else "",
                 f"unexpected {', '.join(unexpected[:3])}" if unexpected else "",
                 f"shape/dtype {'; '.join(wrong[:3])}" if wrong else ""]
        raise ExportError(f"{d / WEIGHTS} does not match the model in {CONFIG} ({'; '.join(p for p in parts if p)})")
    params = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(tensors[param_name(p)]) for p, _ in paths])
    model = nnx.merge(graphdef, params)

    tok_info = manifest["tokenizer"]
    tokenizer: Tokenizer = (ByteTokenizer() if tok_info["kind"] == "byte"
                            else BPETokenizer.load(d / tok_info["file"], int(tok_info["vocab_size"])))
    if tokenizer.vocab_size > mcfg.vocab_size:
        raise ExportError(f"{d}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                          f"{mcfg.vocab_size}; export again")
    return model, tokenizer, {**manifest, "config": config}


# -- parameters to start a run from ----------------------------------------------------------------------------------
def initial_tensors(source: str | os.PathLike[str], mcfg: ModelConfig,
                    runtime: RuntimeConfig = RuntimeConfig()) -> dict[str, np.ndarray]:
    """``{name: host array}`` to start a model of ``mcfg`` from (``train.init_from``): the weights of an export folder
    (verified against its checksums) or of a run directory's newest intact checkpoint (replica 0), named as the
    export names them and stacked per :func:`_stack_layers` when ``runtime`` scans the layers. Raises ExportError when
    ``source`` is neither."""
    from safetensors.numpy import load_file  # noqa: PLC0415

    d = paths.as_path(paths.resolve(source))
    if (d / MANIFEST).is_file():
        with tempfile.TemporaryDirectory(prefix="export_") as tmp:
            folder = _local_folder(d, tmp) if paths.is_remote(source) else Path(d)
            _read_manifest(folder)
            tensors = load_file(str(folder / WEIGHTS))
    elif (d / CONFIG).is_file():
        from coupled_qk_jax.training.run import Run  # noqa: PLC0415

        run = Run.open(str(source), report=False)
        tensors = per_layer_tensors(run.params(replica=0), run.mcfg)
    else:
        raise ExportError(f"train.init_from={source}: neither an export folder ({MANIFEST}) nor a run directory "
                          f"({CONFIG})")
    return _stack_layers(tensors, mcfg, runtime.scan_layers)
