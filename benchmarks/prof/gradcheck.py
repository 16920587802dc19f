import sys, numpy as np, jax, jax.numpy as jnp
from coupled_qk_jax.config import ModelConfig
from coupled_qk_jax.model import TransformerLM
from coupled_qk_jax.training.steps import make_loss_fn, split_model
out = {}
for variant in ["coupled_euler", "coupled_leapfrog", "mlp_only", "coupled_euler+differential" if False else "coupled_euler"]:
    for n in (1, 3):
        cfg = ModelConfig.from_dict(dict(variant=variant, vocab_size=64, max_len=128, d_model=32, n_layers=2, n_heads=4,
                                         d_ff=64, n_steps=n, coupling_hidden=16, norm="layernorm"))
        gd, params = split_model(TransformerLM(cfg, 0))
        loss_fn = make_loss_fn(gd)
        toks = np.random.default_rng(0).integers(0, 64, size=(2, 129)).astype(np.int32)
        batch = {"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:])}
        (l, _), g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
        out[f"{variant}_n{n}_loss"] = np.asarray(l)
        for p, v in jax.tree_util.tree_leaves_with_path(g):
            out[f"{variant}_n{n}_{jax.tree_util.keystr(p)}"] = np.asarray(v)
np.savez(sys.argv[1], **out)
