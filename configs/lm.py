"""Language-model experiments: `--config=configs/lm.py:VARIANT,SCALE`, e.g. `coupled_euler,tiny`.

Every field is an ordinary ConfigDict entry that can be overridden on the command line
(`--config.model.n_steps=3 --config.train.steps=200`). Variants: see coupled_qk_jax/config.py.

Scales. `tiny` and `small` are ours, sized for 2 CPU cores. The paper's 60M/150M/350M shapes are not published;
ours are GPT-2-style assumptions with vocab 50304 and context 1024 (parameter counts include the tied embedding):

    scale   d_model layers heads d_ff   vocab  ctx   params (standard)
    tiny    128     4      4     512    2048   256   ≈1.1M
    small   256     8      4     1024   16384  256   ≈10.6M
    60m     512     10     8     2048   50304  1024  ≈57.8M
    150m    768     16     12    3072   50304  1024  ≈153M
    350m    1024    24     16    4096   50304  1024  ≈355M

Coupling MLP width: hidden = 3/4 · d_head. At 60m (d_head 64, hidden 48, one f per layer shared by its heads)
the coupled variants add 10 · (2·64·48 + 48 + 64 + 8 Δt) = 62,640 parameters = 0.108% — the paper's 0.11%.
"""

from __future__ import annotations

import ml_collections

from coupled_qk_jax.config import ALL_VARIANTS
from coupled_qk_jax.errors import UserError, did_you_mean

SCALES = {
    #         d_model layers heads d_ff  vocab  max_len batch lr
    "tiny": (128, 4, 4, 512, 2048, 256, 16, 3e-3),
    "small": (256, 8, 4, 1024, 16384, 256, 16, 1e-3),
    "60m": (512, 10, 8, 2048, 50304, 1024, 64, 6e-4),
    "150m": (768, 16, 12, 3072, 50304, 1024, 64, 3e-4),
    "350m": (1024, 24, 16, 4096, 50304, 1024, 64, 3e-4),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant, _, scale = (arg or "standard,tiny").partition(",")
    scale = scale or "tiny"
    if scale not in SCALES:
        raise UserError(f"configs/lm.py: unknown scale {scale!r}{did_you_mean(scale, SCALES)}; expected one of "
                        f"{', '.join(SCALES)}")
    if variant not in ALL_VARIANTS:
        raise UserError(f"configs/lm.py: unknown variant {variant!r}{did_you_mean(variant, ALL_VARIANTS)}; expected "
                        f"one of {', '.join(ALL_VARIANTS)}")
    d_model, n_layers, n_heads, d_ff, vocab, max_len, batch, lr = SCALES[scale]
    head_dim = d_model // n_heads

    cfg = ml_collections.ConfigDict()
    cfg.task = "lm"  # the loop's data + metric plug-in (training/tasks.py): "lm" or "mqar" (configs/mqar.py)
    cfg.scale = scale

    cfg.model = ml_collections.ConfigDict(dict(
        variant=variant,
        vocab_size=vocab,
        max_len=max_len,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=d_ff,
        n_steps=1,  # the paper: 1..7 steps perform the same; one suffices
        # Δt starts at 0.1: the layer starts close to standard attention (exactly standard at 0) while the
        # gradient reaching f (∝ Δt) is already non-negligible.
        dt_init=0.1,
        coupling_hidden=3 * head_dim // 4,
        coupling_scope="layer",
        per_head_params=False,
        scan_unroll=1,
        dynamics_backward="reversible",  # "reversible" (no per-step residuals) | "autodiff"; same gradients
        affine_hidden=3 * head_dim // 4,
        affine_pairs=1,
        positions="learned",
        rope_base=10000.0,
        norm="rmsnorm",
        dropout=0.0,
        dtype="float32",
        remat="none",
        scan_layers=scale not in ("tiny", "small"),  # scanned layers from 60m up (docs/scaling.md)
        attention_impl="auto",  # cuDNN on GPU, Pallas flash on TPU, else the explicit causal-block path
        attention_chunks=0,  # query blocks of the explicit path; 0 = auto
        init_std=0.02,
    ))

    cfg.data = ml_collections.ConfigDict(dict(
        # The data layer's corpus string: stdlib | text_dir:DIR | wikitext103:DIR | hf:NAME[:CONFIG[:FIELD]] |
        # mixture:SPEC@W;SPEC@W (docs/data.md).
        corpus="stdlib",
        split_fractions="",  # "train,validation,test" fractions for file corpora, e.g. "0.8,0.1,0.1"; "" = default
        max_bytes=0,  # cap on the UTF-8 text read per split (0 = no cap)
        cache_dir="~/.cache/coupled_qk_jax",  # token cache root (tokenised once, reused across runs)
        tokenizer="bpe",  # bpe (trained on the train split, vocab = model.vocab_size) | byte (vocab 257)
        tokenizer_path="",  # an existing BPE tokenizer.json to use instead of training one
        seq_len=max_len if scale in ("tiny", "small") else 1024,
        num_threads=2,  # grain read threads for the training iterator
    ))

    cfg.train = ml_collections.ConfigDict(dict(
        steps=2000 if scale in ("tiny", "small") else 20000,
        batch_size=batch,  # global sequences per optimiser step (split over hosts, devices and grad_accum)
        grad_accum=1,  # micro-batches per step: each is batch_size / grad_accum sequences
        seed=0,  # model init, data order and per-step dropout keys (fold_in(seed, step))
        num_seeds=1,  # S > 1: seeds seed..seed+S-1 trained together as one vmapped program (docs/experiments.md)
        lr=lr,
        warmup_steps=100,
        min_lr_ratio=0.1,
        weight_decay=0.1,
        b1=0.9, b2=0.95, eps=1e-8,
        grad_clip=1.0,
        qk_lr_mult=1.0,  # multiplies the learning rate of W_Q and W_K (second seed paper's intervention)
        ov_lr_mult=1.0,  # multiplies the learning rate of W_V and W_O
        qk_mult_coupling=False,  # also apply qk_lr_mult to the coupling parameters (f and Δt)
        log_every=25,
        eval_every=500,  # 0 = only at the end
        eval_batches=0,  # 0 = the whole validation split (every token once); N = the first N batches
        eval_batch_size=0,  # global sequences per eval batch (0 = train.batch_size)
        stop_after=0,  # stop (with a checkpoint) once this many steps are done in total; 0 = train.steps. For tests.
        # Observability (training/observe.py). MFU is logged when the per-device peak is given, e.g. 989 for an
        # H100 SXM in bf16 dense (the vendor's figure for the dtype you train in); 0 = not logged (CPU).
        peak_tflops=0.0,
        profile_steps=0,  # N > 0: a jax.profiler trace of steps 2..N+1 into WORKDIR/profile
        # Stop at the end of learning (training/early_stop.py): a plateau of `metric` for `patience` evaluations
        # (no change beyond min_delta), or `threshold` reached; with several seeds, once every seed has.
        early_stop=ml_collections.ConfigDict(dict(
            metric="",  # "" = off; "val_loss" / "val_ppl" (LM), "valid/accuracy" / "valid/loss" (MQAR)
            mode="max",  # "max" for accuracy, "min" for a loss
            patience=0,
            min_delta=0.0,
            threshold=ml_collections.config_dict.placeholder(float),
        )),
    ))

    cfg.checkpoint = ml_collections.ConfigDict(dict(
        every=250,  # save every N steps (and always at the end, on SIGINT/SIGTERM)
        every_seconds=600,  # also save when this many seconds passed since the last save (0 = off)
        keep_last=2,  # keep the latest k checkpoints
        keep_every=0,  # also keep every N-th step permanently (0 = off)
        # "validation_loss": also keep the checkpoint with the lowest periodic validation loss (orbax's BestN);
        # "" = off
        keep_best="",
        async_save=True,
    ))

    cfg.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    return cfg
