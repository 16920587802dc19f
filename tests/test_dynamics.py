"""dynamics.py and invertible.py against numpy float64 references and known identities."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coupled_qk_jax import dynamics, invertible

D, H_HIDDEN = 5, 7


def random_params(seed, d=D, h=H_HIDDEN, lead=()):
    rng = np.random.default_rng(seed)
    return {"w1": rng.normal(size=lead + (d, h)) / np.sqrt(d), "b1": 0.3 * rng.normal(size=lead + (h,)),
            "w2": rng.normal(size=lead + (h, d)) / np.sqrt(h), "b2": 0.3 * rng.normal(size=lead + (d,))}


def vmap_over_heads(q, k, dt, params, n_steps, method, per_head_params=False, backward="reversible"):
    """A second lowering of dynamics.evolve_heads_batched, the reference it is checked against: `integrate` per
    head, mapped over the head axis with jax.vmap (params with a leading H axis when per_head_params)."""
    def one_head(q_h, k_h, dt_h, params_h):
        f = functools.partial(dynamics.coupling_mlp, params_h)
        return dynamics.integrate(q_h, k_h, dt_h, f, n_steps, method, backward=backward)

    return jax.vmap(one_head, in_axes=(-2, -2, 0, 0 if per_head_params else None), out_axes=(-2, -2))(q, k, dt, params)


def np_f(p, x):  # float64 reference of the coupling MLP
    z = x @ p["w1"] + p["b1"]
    return (z / (1 + np.exp(-z))) @ p["w2"] + p["b2"]


def np_step(method, p, q, k, dt):
    if method == "euler":
        return q + dt * k, k + dt * np_f(p, q)
    if method == "leapfrog":
        kh = k + dt / 2 * np_f(p, q)
        qn = q + dt * kh
        return qn, kh + dt / 2 * np_f(p, qn)
    return q + dt * np_f(p, q), k + dt * np_f(p, k)


def f32(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


@pytest.mark.parametrize("method", dynamics.METHODS)
@pytest.mark.parametrize("n_steps", [1, 3, 7])
def test_integrate_matches_float64_reference(method, n_steps):
    rng = np.random.default_rng(n_steps)
    p = random_params(1)
    q, k = rng.normal(size=(2, 3, D)), rng.normal(size=(2, 3, D))
    dt = 0.17
    qr, kr = q, k
    for _ in range(n_steps):
        qr, kr = np_step(method, p, qr, kr, dt)
    f = functools.partial(dynamics.coupling_mlp, f32(p))
    qj, kj = dynamics.integrate(f32(q), f32(k), jnp.float32(dt), f, n_steps, method)
    np.testing.assert_allclose(qj, qr, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kj, kr, rtol=1e-5, atol=1e-5)
    # integrate == n manual applications of the step function
    qm, km = f32(q), f32(k)
    for _ in range(n_steps):
        qm, km = dynamics.STEP_FUNCTIONS[method](qm, km, jnp.float32(dt), f)
    np.testing.assert_allclose(qj, qm, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(kj, km, rtol=1e-6, atol=1e-6)


def test_step_functions_read_the_old_state():
    f = lambda x: 2.0 * x
    q, k = jnp.array([1.0]), jnp.array([3.0])
    np.testing.assert_allclose(dynamics.euler_step(q, k, 0.5, f), ([2.5], [4.0]))  # k uses old q=1: 3+0.5*2
    np.testing.assert_allclose(dynamics.uncoupled_step(q, k, 0.5, f), ([2.0], [6.0]))
    # leapfrog by hand: kh = 3 + .25*2 = 3.5; q' = 1 + .5*3.5 = 2.75; k' = 3.5 + .25*5.5 = 4.875
    np.testing.assert_allclose(dynamics.leapfrog_step(q, k, 0.5, f), ([2.75], [4.875]))


def _flow_jacobian_det(method, dt, n_steps=3, d=3):
    p = f32(random_params(3, d=d, h=6))
    f = functools.partial(dynamics.coupling_mlp, p)

    def flow(z):
        q, k = dynamics.integrate(z[:d], z[d:], dt, f, n_steps, method)
        return jnp.concatenate([q, k])

    z0 = jnp.asarray(np.random.default_rng(0).normal(size=2 * d), jnp.float32)
    return float(jnp.linalg.det(jax.jacrev(flow)(z0)))


def test_leapfrog_preserves_volume_and_euler_does_not():
    assert abs(abs(_flow_jacobian_det("leapfrog", 0.3)) - 1.0) < 1e-5
    assert abs(abs(_flow_jacobian_det("euler", 0.3)) - 1.0) > 1e-3


def test_leapfrog_is_time_reversible():
    p = f32(random_params(4))
    f = functools.partial(dynamics.coupling_mlp, p)
    rng = np.random.default_rng(5)
    q, k = f32(rng.normal(size=(4, D))), f32(rng.normal(size=(4, D)))
    q1, k1 = dynamics.integrate(q, k, 0.2, f, 5, "leapfrog")
    q2, k2 = dynamics.integrate(q1, k1, -0.2, f, 5, "leapfrog")
    np.testing.assert_allclose(q2, q, atol=1e-5)
    np.testing.assert_allclose(k2, k, atol=1e-5)
    # Euler is not: running it backwards does not return to the start
    q3, k3 = dynamics.integrate(*dynamics.integrate(q, k, 0.2, f, 5, "euler"), -0.2, f, 5, "euler")
    assert float(jnp.max(jnp.abs(k3 - k))) > 1e-3


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("method", dynamics.METHODS)
def test_evolve_heads_batched_equals_loop_over_heads(method, per_head):
    b, t, h = 2, 3, 4
    rng = np.random.default_rng(7)
    q, k = f32(rng.normal(size=(b, t, h, D))), f32(rng.normal(size=(b, t, h, D)))
    dt = f32(rng.uniform(0.05, 0.3, size=h))
    p = f32(random_params(8, lead=(h,) if per_head else ()))
    qe, ke = dynamics.evolve_heads_batched(q, k, dt, p, 2, method, per_head_params=per_head)
    for head in range(h):
        ph = jax.tree.map(lambda a: a[head], p) if per_head else p
        qh, kh = dynamics.integrate(q[:, :, head], k[:, :, head], dt[head],
                                    functools.partial(dynamics.coupling_mlp, ph), 2, method)
        np.testing.assert_allclose(qe[:, :, head], qh, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ke[:, :, head], kh, rtol=1e-6, atol=1e-6)
    qv, kv = vmap_over_heads(q, k, dt, p, 2, method, per_head_params=per_head)  # the vmap lowering agrees
    np.testing.assert_allclose(qv, qe, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kv, ke, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------- the reversible backward pass
B_, T_, H_ = 2, 3, 4
# (lowering, n_steps, per_head_params) cases compared in one compiled program per backward mode
GRAD_CASES = [("batched", 1, True), ("batched", 3, False), ("batched", 7, True), ("vmap", 3, True)]
LOWERINGS = {"batched": dynamics.evolve_heads_batched, "vmap": vmap_over_heads}


def _grad_case(seed, per_head):
    rng = np.random.default_rng(seed)
    q, k = f32(rng.normal(size=(B_, T_, H_, D))), f32(rng.normal(size=(B_, T_, H_, D)))
    dt = f32(rng.uniform(0.05, 0.3, size=H_))
    p = f32(random_params(seed + 1, lead=(H_,) if per_head else ()))
    rq, rk = f32(rng.normal(size=(B_, T_, H_, D))), f32(rng.normal(size=(B_, T_, H_, D)))  # a linear loss
    return q, k, dt, p, rq, rk


def _grad_fn(lowering, n_steps, method, backward, per_head=False):
    """grad of sum(q_n·rq + k_n·rk) with respect to (q, k, Δt, f params)."""
    def loss(q, k, dt, p, rq, rk):
        qn, kn = LOWERINGS[lowering](q, k, dt, p, n_steps, method, per_head_params=per_head, backward=backward)
        return jnp.sum(qn * rq) + jnp.sum(kn * rk)

    return jax.grad(loss, argnums=(0, 1, 2, 3))


def _assert_trees_close(got, want, rtol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        # atol scaled to the leaf: an element that is a sum of cancelling terms cannot hold rtol on its own
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.max(np.abs(w)))


@pytest.mark.parametrize("method", dynamics.METHODS)
def test_reversible_backward_matches_autodiff(method):
    """Gradients of q, k, Δt and every f param (shared or per head, both lowerings) at n = 1, 3, 7: the custom VJP
    against autodiff of the plain scan, fp32, rtol 1e-5."""
    inputs = [_grad_case(n + 10 * per_head, per_head) for _, n, per_head in GRAD_CASES]

    def all_grads(backward, inputs):
        return [_grad_fn(low, n, method, backward, per_head)(*args)
                for (low, n, per_head), args in zip(GRAD_CASES, inputs)]

    want = jax.jit(functools.partial(all_grads, "autodiff"))(inputs)
    got = jax.jit(functools.partial(all_grads, "reversible"))(inputs)
    for case, g, w in zip(GRAD_CASES, got, want):
        try:
            _assert_trees_close(g, w, rtol=1e-5)
        except AssertionError as err:
            raise AssertionError(f"case {case}: {err}") from None


def _np_loss(method, p, q, k, dt, rq, rk, n_steps):
    for _ in range(n_steps):
        q, k = np_step(method, p, q, k, dt)
    return float(np.sum(q * rq) + np.sum(k * rk))


@pytest.mark.parametrize("method", dynamics.METHODS)
def test_reversible_backward_matches_float64_finite_differences(method):
    """Δt, every f param leaf, q and k: central differences of a float64 numpy forward, at n = 3."""
    n_steps = 3
    q, k, dt, p, rq, rk = _grad_case(11, per_head=False)
    gq, gk, gdt, gp = jax.jit(_grad_fn("batched", n_steps, method, "reversible"))(q, k, dt, p, rq, rk)
    rq, rk = np.asarray(rq, np.float64), np.asarray(rk, np.float64)
    q64, k64, dt64 = (np.asarray(a, np.float64) for a in (q, k, dt))
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), p)

    def fd(perturb, eps=1e-6):
        up, down = perturb(eps), perturb(-eps)
        return (_np_loss(method, *up, rq, rk, n_steps) - _np_loss(method, *down, rq, rk, n_steps)) / (2 * eps)

    def bump(a, idx, e):
        a = a.copy()
        a[idx] += e
        return a

    for h in range(H_):
        want = fd(lambda e: (p64, q64, k64, bump(dt64, h, e)[:, None], ))
        np.testing.assert_allclose(gdt[h], want, rtol=1e-4)
    for name in ("w1", "b1", "w2", "b2"):
        idx = (1,) * p64[name].ndim
        want = fd(lambda e: ({**p64, name: bump(p64[name], idx, e)}, q64, k64, dt64[:, None]))
        np.testing.assert_allclose(gp[name][idx], want, rtol=1e-4)
    for g, which in ((gq, 0), (gk, 1)):
        idx = (1, 2, 3, 4)
        want = fd(lambda e: (p64, bump(q64, idx, e) if which == 0 else q64, bump(k64, idx, e) if which else k64,
                             dt64[:, None]))
        np.testing.assert_allclose(g[idx], want, rtol=1e-4)


@pytest.mark.parametrize("method", ["euler", "leapfrog"])
def test_dt_gradient_under_bf16_is_a_float32_sum(method):
    """On the op alone (B8 T256 H4 d32, bf16 q, k and f params), Δt's gradient is within 2% of float64.
    With Δt·k formed in bf16 this case gave [512, -217, -72, 302] for float64's [475, -223, -58, 299] (euler)."""
    b, t, h, d, hidden = 8, 256, 4, 32, 24
    rng = np.random.default_rng(0)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    q, k = bf(rng.normal(size=(b, t, h, d))), bf(rng.normal(size=(b, t, h, d)))
    p = jax.tree.map(bf, random_params(2, d=d, h=hidden))
    dt = jnp.asarray([0.1, 0.2, 0.05, 0.15], jnp.float32)
    rq, rk = rng.normal(size=(b, t, h, d)), rng.normal(size=(b, t, h, d))

    got = np.asarray(jax.jit(_grad_fn("batched", 1, method, "reversible"))(q, k, dt, p, f32(rq), f32(rk))[2])
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    dt64 = np.asarray(dt, np.float64)
    want = []
    for head in range(h):
        e = np.zeros(h)
        e[head] = 1e-6
        up = _np_loss(method, p64, q64, k64, (dt64 + e)[:, None], rq, rk, 1)
        down = _np_loss(method, p64, q64, k64, (dt64 - e)[:, None], rq, rk, 1)
        want.append((up - down) / 2e-6)
    # 2% per head, plus 1% of the largest head's gradient (a head whose products cancel keeps bf16's rounding of f)
    np.testing.assert_allclose(got, want, rtol=0.02, atol=0.01 * np.max(np.abs(want)))


def test_bad_arguments_raise_named_errors():
    q = jnp.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match="method"):
        dynamics.integrate(q, q, 0.1, lambda x: x, 1, "rk4")
    with pytest.raises(ValueError, match="n_steps"):
        dynamics.integrate(q, q, 0.1, lambda x: x, 0, "euler")
    with pytest.raises(ValueError, match="dt"):
        dynamics.evolve_heads_batched(q, q, jnp.zeros(2), random_params(0, d=4), 1, "euler")
    with pytest.raises(ValueError, match="backward"):
        dynamics.integrate(q, q, 0.1, lambda x: x, 1, "euler", backward="adjoint")


def test_affine_coupling_inverse_round_trips_and_starts_at_identity():
    rng = np.random.default_rng(9)
    q, k = f32(rng.normal(size=(2, 3, 4, 6))), f32(rng.normal(size=(2, 3, 4, 6)))
    ident = invertible.init_affine_params(jax.random.key(0), 6, 5, pairs=2)
    qi, ki = invertible.affine_forward(ident, q, k)
    np.testing.assert_array_equal(qi, q)
    np.testing.assert_array_equal(ki, k)
    params = invertible.init_affine_params(jax.random.key(1), 6, 5, pairs=2, zero_output=False)
    qf, kf = invertible.affine_forward(params, q, k)
    assert float(jnp.max(jnp.abs(qf - q))) > 1e-2  # a real, non-identity map
    qb, kb = invertible.affine_inverse(params, qf, kf)
    np.testing.assert_allclose(qb, q, atol=1e-5)
    np.testing.assert_allclose(kb, k, atol=1e-5)
    # hand check of one pair: q' = q*exp(s1(k)) + t1(k), k' = k*exp(s2(q')) + t2(q')
    one = jax.tree.map(lambda a: a[:1], params)
    s1, t1 = np.split(np.asarray(dynamics.coupling_mlp(jax.tree.map(lambda a: a[0], one["q_net"]), k)), 2, -1)
    q_hand = np.asarray(q) * np.exp(s1) + t1
    s2, t2 = np.split(np.asarray(dynamics.coupling_mlp(jax.tree.map(lambda a: a[0], one["k_net"]), f32(q_hand))), 2, -1)
    q1, k1 = invertible.affine_forward(one, q, k)
    np.testing.assert_allclose(q1, q_hand, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k1, np.asarray(k) * np.exp(s2) + t2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant,remat", [("coupled_leapfrog", "none"), ("coupled_euler", "full")])
def test_reversible_backward_inside_the_model(variant, remat):
    """Every parameter gradient of a 2-layer LM at n = 3 with T = 128 (two attention blocks): reversible vs
    autodiff, fp32, rtol 1e-5; f's output layer and Δt set to non-trivial values so the dynamics act."""
    from flax import nnx

    from coupled_qk_jax.config import ModelConfig, RuntimeConfig
    from coupled_qk_jax.model import TransformerLM

    tokens = jax.random.randint(jax.random.key(0), (2, 128), 0, 61)
    grads = {}
    for backward in ("autodiff", "reversible"):
        cfg = ModelConfig(variant=variant, vocab_size=61, max_len=128, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                          coupling_hidden=8, n_steps=3)
        model = TransformerLM(cfg, seed=0, runtime=RuntimeConfig(remat=remat, dynamics_backward=backward))
        rng = np.random.default_rng(0)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            name = "/".join(map(str, path))
            if "coupling" in name and name.endswith(("w2", "b2")):
                var.set_value(jnp.asarray(0.3 * rng.normal(size=var.get_value().shape), jnp.float32))
            if name.endswith("dt"):
                var.set_value(jnp.asarray(rng.uniform(0.1, 0.4, size=var.get_value().shape), jnp.float32))

        def loss(model):
            logits = model(tokens[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

        grads[backward] = nnx.state(nnx.jit(nnx.grad(loss))(model), nnx.Param)
    _assert_trees_close(grads["reversible"], grads["autodiff"], rtol=1e-5)


def test_leapfrog_rebuild_falls_back_to_stored_states_when_it_drifts():
    """Δt = 1, n = 16: integrating backwards amplifies rounding far beyond dynamics.REBUILD_DRIFT_BOUND; the VJP
    must notice and still return autodiff's gradients (fp32, rtol 1e-5)."""
    n_steps = 16
    q, k, dt, p, rq, rk = _grad_case(3, per_head=False)
    dt = jnp.ones_like(dt)
    run = functools.partial(dynamics._scan, f=functools.partial(dynamics.coupling_mlp, p), n_steps=n_steps,
                            method="leapfrog", unroll=1)
    q_back, k_back = run(*run(q, k, dt[:, None]), -dt[:, None])
    drift = np.sqrt(float(jnp.sum((q_back - q) ** 2) + jnp.sum((k_back - k) ** 2))
                    / float(jnp.sum(q ** 2) + jnp.sum(k ** 2))) / np.finfo(np.float32).eps
    assert drift > 100 * dynamics.REBUILD_DRIFT_BOUND  # the rebuild alone would be wrong here
    want = jax.jit(_grad_fn("batched", n_steps, "leapfrog", "autodiff"))(q, k, dt, p, rq, rk)
    got = jax.jit(_grad_fn("batched", n_steps, "leapfrog", "reversible"))(q, k, dt, p, rq, rk)
    _assert_trees_close(got, want, rtol=1e-5)


# ------------------------------------------------------------- seed-parallel (vmapped) leapfrog: one backward path
def _sub_jaxprs(values):
    for v in values:
        if isinstance(v, (tuple, list)):
            yield from _sub_jaxprs(v)
        elif hasattr(v, "eqns"):
            yield v
        elif hasattr(getattr(v, "jaxpr", None), "eqns"):
            yield v.jaxpr


def _f_evaluations(jaxpr) -> set[int]:
    """Every count of f evaluations one execution of `jaxpr` can make: a host-side walk counting `logistic` (f's
    SiLU; the VJP reuses the forward's, so one per f evaluation), times a scan's length, one branch per `cond`."""
    paths = {0}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "logistic":
            inner = {1}
        elif eqn.primitive.name == "cond":
            inner = set().union(*(_f_evaluations(b.jaxpr) for b in eqn.params["branches"]))
        elif eqn.primitive.name == "scan":
            inner = {eqn.params["length"] * c for c in _f_evaluations(eqn.params["jaxpr"].jaxpr)}
        else:
            inner = {0}
            for sub in _sub_jaxprs(eqn.params.values()):  # pjit, custom_vjp_call, custom_vmap_call, ...
                inner = {a + b for a in inner for b in _f_evaluations(sub)}
        paths = {a + b for a in paths for b in inner}
    return paths


def _seed_parallel_grad(n_steps, backward, n_seeds=3, dts=None):
    """jit(vmap(grad)) over a leading seed axis (as training/loop.py vmaps the step) and its inputs."""
    cases = [_grad_case(20 + s, per_head=False) for s in range(n_seeds)]
    q, k, dt, p, rq, rk = jax.tree.map(lambda *xs: jnp.stack(xs), *cases)
    if dts is not None:
        dt = jnp.broadcast_to(jnp.asarray(dts, jnp.float32)[:, None], dt.shape)
    return jax.jit(jax.vmap(_grad_fn("batched", n_steps, "leapfrog", backward))), (q, k, dt, p, rq, rk)


def test_seed_parallel_leapfrog_runs_one_backward_path(monkeypatch):
    """Under vmap over 3 seeds the drift fallback stays a cond, so a step evaluates f 2n + 2 times
    (n + 1 forward, n + 1 rebuilding) or, falling back, 6n + 2 (+ 4n recomputing), never both paths at once. Positive
    control: a per-seed (batched) predicate, today's, turns the cond into a select that always pays 6n + 2."""
    n = 3
    fn, args = _seed_parallel_grad(n, "reversible")
    assert _f_evaluations(jax.make_jaxpr(fn)(*args).jaxpr) == {2 * n + 2, 6 * n + 2}
    assert fn.lower(*args).compile().as_text().count(" conditional(") == 1

    monkeypatch.setattr(dynamics, "_rebuild_trusted", lambda drift: drift <= dynamics.REBUILD_DRIFT_BOUND)
    fn, args = _seed_parallel_grad(n, "reversible")
    assert _f_evaluations(jax.make_jaxpr(fn)(*args).jaxpr) == {6 * n + 2}
    assert fn.lower(*args).compile().as_text().count(" conditional(") == 0


def test_seed_parallel_leapfrog_gradients_when_one_seed_drifts():
    """n = 16 with seed 1 at Δt = 1 (its rebuild drifts far past the bound, as in the single-seed fallback test) and
    seeds 0, 2 at Δt = 0.1: every seed's gradients equal autodiff's (fp32, rtol 1e-5), and so do they with no seed
    drifting (all Δt = 0.1, the rebuild path)."""
    for dts in ([0.1, 1.0, 0.1], [0.1, 0.1, 0.1]):
        fn, args = _seed_parallel_grad(16, "autodiff", dts=dts)
        want = fn(*args)
        fn, args = _seed_parallel_grad(16, "reversible", dts=dts)
        _assert_trees_close(fn(*args), want, rtol=1e-5)
