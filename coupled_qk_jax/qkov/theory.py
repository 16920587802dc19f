"""Reduced gradient-flow model of QK/OV learning (spec §3), integrated with RK4 in float64.

Two scalars summarise the circuits: ``mu_ov`` (OV strength) and ``mu_qk`` (QK strength). With constants
``m = 5`` informative tokens, ``n = 50`` common tokens, ``b = 50`` and ``M = 20`` classes::

    alpha      = m e^{mu_qk} / (m e^{mu_qk} + n)
    loss       = log(1 + (M - 1) e^{-alpha mu_ov})
    d mu_ov/dt = eta_ov alpha / (b [e^{alpha mu_ov} + M - 1])
    d mu_qk/dt = eta_qk (M - 1) alpha (1 - alpha) mu_ov / (M b^2 [e^{alpha mu_ov} + M - 1])

The integrator follows the reference notebook: classical RK4 in the normalised time ``tau = t * min(eta_qk,
eta_ov)`` with step ``dtau = 10``; exponent arguments are clipped to [-60, 60]; a 1e-12 guard is added to both
denominators; both mu are clamped to [0, 1e6] after every step; the horizon starts at ``tau = 2e5`` and doubles until
the loss reaches the target (1e-4), up to ``tau = 5e7``. Doubling the horizon and integrating on from the current
state is identical to restarting with the longer horizon (the trajectory is deterministic), so we only ever extend.

All ratios are integrated as one vectorised state. Each ratio stops (its state is frozen) once it has crossed the
target loss. For each of 50 log-spaced thresholds L from 1 to 1e-4 the state at the first step with ``loss <= L`` is
recorded.

Float64: the module uses the public context manager ``jax.enable_x64(True)`` (available on jax >= 0.8; verified on
jax 0.10.2), so importing this module never flips the global x64 flag of the calling program.

CLI::

    python -m coupled_qk_jax.qkov.theory --ratios 0.01,0.1,1,10,100 --out FILE.csv [--plot FILE.png]

writes one row per (ratio, threshold) with columns ``ratio,loss,t,mu_ov,mu_qk,alpha`` where ``t`` is physical time
and ``loss`` is the threshold; unreached thresholds are written as ``nan``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

CSV_COLUMNS = ("ratio", "loss", "t", "mu_ov", "mu_qk", "alpha")


@dataclasses.dataclass(frozen=True)
class ODEConstants:
    """Constants of the reduced model (spec §3)."""

    m: float = 5.0
    n: float = 50.0
    b: float = 50.0
    M: float = 20.0
    exp_clip: float = 60.0
    guard: float = 1e-12
    mu_max: float = 1e6


DEFAULT = ODEConstants()


def _exp(x, c: ODEConstants):
    # Clipping the argument reproduces the notebook's overflow guard; with mu clamped >= 0 it only ever bites at +60.
    return jnp.exp(jnp.clip(x, -c.exp_clip, c.exp_clip))


def alpha_of(mu_qk, c: ODEConstants = DEFAULT):
    """Attention mass on informative tokens, alpha = m e^{mu_qk} / (m e^{mu_qk} + n). Any shape."""
    e = c.m * _exp(mu_qk, c)
    return e / (e + c.n)


def loss_of(mu_ov, mu_qk, c: ODEConstants = DEFAULT):
    """Reduced loss log(1 + (M-1) e^{-alpha mu_ov}). Any (broadcastable) shapes."""
    a = alpha_of(mu_qk, c)
    return jnp.log1p((c.M - 1.0) * _exp(-a * mu_ov, c))


def rhs(mu_ov, mu_qk, eta_ov, eta_qk, c: ODEConstants = DEFAULT):
    """Time derivatives (d mu_ov/dt, d mu_qk/dt) in physical time t. All arguments broadcast; returns a pair."""
    a = alpha_of(mu_qk, c)
    denom = _exp(a * mu_ov, c) + c.M - 1.0
    d_ov = eta_ov * a / (c.b * denom + c.guard)
    d_qk = eta_qk * (c.M - 1.0) * a * (1.0 - a) * mu_ov / (c.M * c.b**2 * denom + c.guard)
    return d_ov, d_qk


def rk4_step(y, eta_ov, eta_qk, dtau: float, c: ODEConstants = DEFAULT):
    """One classical RK4 step in normalised time followed by the clamp.

    Args:
      y: array [..., 2] holding (mu_ov, mu_qk).
      eta_ov, eta_qk: arrays broadcastable to y[..., 0].
      dtau: step in tau = t * min(eta_ov, eta_qk).
    Returns:
      array [..., 2], the clamped next state.
    """
    inv_min = 1.0 / jnp.minimum(eta_ov, eta_qk)

    def f(z):
        d_ov, d_qk = rhs(z[..., 0], z[..., 1], eta_ov, eta_qk, c)
        return jnp.stack([d_ov * inv_min, d_qk * inv_min], axis=-1)

    k1 = f(y)
    k2 = f(y + 0.5 * dtau * k1)
    k3 = f(y + 0.5 * dtau * k2)
    k4 = f(y + dtau * k3)
    y_next = y + (dtau / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)
    return jnp.clip(y_next, 0.0, c.mu_max)


def thresholds(n: int = 50, hi: float = 1.0, lo: float = 1e-4) -> np.ndarray:
    """n log-spaced loss thresholds from hi down to lo; the last is exactly lo."""
    th = np.logspace(math.log10(hi), math.log10(lo), n)
    th[0], th[-1] = hi, lo  # logspace can be off by an ulp at the ends; the spec wants them exact
    return th


@dataclasses.dataclass
class Readout:
    """Result of :func:`integrate`.

    Attributes (R = number of ratios, L = number of thresholds, S = number of trajectory samples):
      ratios [R], thresholds [L];
      t, mu_ov, mu_qk, alpha: [R, L] state at the first crossing of each threshold (nan if never crossed);
      traj_tau [S], traj_mu [S, R, 2]: the state every sample_tau, starting at tau = 0 (for plots);
      final_tau: tau at which integration stopped; reached [R]: whether each ratio hit the target loss.
    """

    ratios: np.ndarray
    thresholds: np.ndarray
    t: np.ndarray
    mu_ov: np.ndarray
    mu_qk: np.ndarray
    alpha: np.ndarray
    traj_tau: np.ndarray
    traj_mu: np.ndarray
    final_tau: float
    reached: np.ndarray


def _make_chunk(n_steps: int, sample_every: int, dtau: float, c: ODEConstants):
    """A jitted function advancing n_steps RK4 steps, recording first threshold crossings and the state every
    `sample_every` steps (returned as ys [n_steps // sample_every, R, 2] for plotting)."""

    def chunk(carry, eta_ov, eta_qk, th):
        def body(carry, _):
            y, step, rec_step, rec_y, done = carry
            y_new = rk4_step(y, eta_ov, eta_qk, dtau, c)
            # Ratios that already crossed the target are frozen: "stop each ratio at its own crossing".
            y_new = jnp.where(done[:, None], y, y_new)
            step = step + 1
            loss = loss_of(y_new[:, 0], y_new[:, 1], c)  # [R]
            newly = (loss[:, None] <= th[None, :]) & (rec_step < 0) & (~done[:, None])  # [R, L]
            rec_step = jnp.where(newly, step, rec_step)
            rec_y = jnp.where(newly[..., None], y_new[:, None, :], rec_y)
            done = done | (loss <= th[-1])
            return (y_new, step, rec_step, rec_y, done), None

        def outer(carry, _):
            carry, _ = jax.lax.scan(body, carry, None, length=sample_every, unroll=8)
            return carry, carry[0]

        return jax.lax.scan(outer, carry, None, length=n_steps // sample_every)

    return jax.jit(chunk)


def integrate(
    ratios: Sequence[float],
    *,
    eta_ov: float = 1.0,
    dtau: float = 10.0,
    tau_start: float = 2e5,
    tau_cap: float = 5e7,
    n_thresholds: int = 50,
    target: float = 1e-4,
    chunk_tau: float = 1e5,
    sample_tau: float = 1e3,
    c: ODEConstants = DEFAULT,
) -> Readout:
    """Integrate the reduced ODE for every QK/OV ratio r (eta_qk = r * eta_ov) from mu = 0.

    The horizon starts at tau_start and doubles (capped at tau_cap) while any ratio has not reached `target`.
    Integration proceeds in chunks of chunk_tau; chunk_tau must divide tau_start so horizons are whole chunks. The
    state is sampled every sample_tau (which must divide chunk_tau) for plots.
    """
    ratios_np = np.asarray(ratios, dtype=np.float64)
    if ratios_np.ndim != 1 or ratios_np.size == 0:
        raise ValueError("ratios: expected a non-empty 1-D list of positive numbers")
    if not np.all(np.isfinite(ratios_np)) or np.any(ratios_np <= 0):
        raise ValueError(f"ratios: every ratio must be finite and > 0, got {ratios_np.tolist()}")
    if not eta_ov > 0:
        raise ValueError(f"eta_ov: must be > 0, got {eta_ov}")
    if not dtau > 0:
        raise ValueError(f"dtau: must be > 0, got {dtau}")
    if not 0 < tau_start <= tau_cap:
        raise ValueError(f"tau_start: must satisfy 0 < tau_start <= tau_cap, got {tau_start}, {tau_cap}")
    steps_per_chunk = int(round(chunk_tau / dtau))
    if steps_per_chunk < 1 or abs(steps_per_chunk * dtau - chunk_tau) > 1e-9 * chunk_tau:
        raise ValueError(f"chunk_tau: must be a positive multiple of dtau, got {chunk_tau} with dtau {dtau}")
    sample_every = int(round(sample_tau / dtau))
    if sample_every < 1 or steps_per_chunk % sample_every:
        raise ValueError(f"sample_tau: must be a multiple of dtau dividing chunk_tau, got {sample_tau}")
    if abs(round(tau_start / chunk_tau) * chunk_tau - tau_start) > 1e-9 * tau_start:
        raise ValueError(f"chunk_tau: must divide tau_start={tau_start}, got {chunk_tau}")
    th_np = thresholds(n_thresholds, 1.0, target)
    R, L = ratios_np.size, th_np.size

    with jax.enable_x64(True):
        eta_ov_a = jnp.full((R,), eta_ov, jnp.float64)
        eta_qk_a = jnp.asarray(ratios_np * eta_ov, jnp.float64)
        th = jnp.asarray(th_np, jnp.float64)
        chunk = _make_chunk(steps_per_chunk, sample_every, dtau, c)
        carry = (
            jnp.zeros((R, 2), jnp.float64),
            jnp.asarray(0, jnp.int64),
            jnp.full((R, L), -1, jnp.int64),
            jnp.full((R, L, 2), jnp.nan, jnp.float64),
            jnp.zeros((R,), bool),
        )
        horizon, tau = tau_start, 0.0
        traj_tau, traj_mu = [0.0], [np.zeros((R, 2))]
        while True:
            while tau < horizon - 0.5 * dtau:
                carry, ys = chunk(carry, eta_ov_a, eta_qk_a, th)
                traj_tau.extend(tau + sample_every * dtau * np.arange(1, ys.shape[0] + 1))
                traj_mu.extend(np.asarray(ys))
                tau += chunk_tau
            if bool(np.all(np.asarray(carry[4]))) or horizon >= tau_cap:
                break
            horizon = min(2.0 * horizon, tau_cap)
        _, _, rec_step, rec_y, done = (np.asarray(x) for x in carry)

    rec_tau = np.where(rec_step >= 0, rec_step * dtau, np.nan)
    min_eta = np.minimum(eta_ov, ratios_np * eta_ov)
    t = rec_tau / min_eta[:, None]
    mu_ov, mu_qk = rec_y[..., 0], rec_y[..., 1]
    alpha = c.m * np.exp(np.clip(mu_qk, -c.exp_clip, c.exp_clip))
    alpha = alpha / (alpha + c.n)
    return Readout(
        ratios=ratios_np, thresholds=th_np, t=t, mu_ov=mu_ov, mu_qk=mu_qk, alpha=alpha,
        traj_tau=np.asarray(traj_tau), traj_mu=np.stack(traj_mu), final_tau=tau, reached=done,
    )


def write_csv(readout: Readout, path: str) -> None:
    """One row per (ratio, threshold) with columns ratio,loss,t,mu_ov,mu_qk,alpha."""
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for i, r in enumerate(readout.ratios):
            for j, L in enumerate(readout.thresholds):
                w.writerow([repr(float(r)), repr(float(L)), repr(float(readout.t[i, j])),
                            repr(float(readout.mu_ov[i, j])), repr(float(readout.mu_qk[i, j])),
                            repr(float(readout.alpha[i, j]))])


def plot(readout: Readout, path: str, eta_ov: float = 1.0) -> None:
    """mu_OV against log10 t and mu_QK against (log10 t)^2, one curve per ratio, from the sampled trajectory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(readout.ratios):
        t = readout.traj_tau[1:] / min(eta_ov, r * eta_ov)
        lt = np.log10(t)
        mu = readout.traj_mu[1:, i]
        # Drop the frozen tail after the ratio stopped, so each curve ends at its own target crossing.
        keep = np.ones(len(t), bool)
        keep[1:] = np.any(np.diff(mu, axis=0) != 0, axis=1)
        axes[0].plot(lt[keep], mu[keep, 0], label=f"r={r:g}")
        axes[1].plot(lt[keep] ** 2, mu[keep, 1], label=f"r={r:g}")
    axes[0].set_xlabel("log10 t")
    axes[0].set_ylabel("mu_OV")
    axes[1].set_xlabel("(log10 t)^2")
    axes[1].set_ylabel("mu_QK")
    axes[0].legend()
    axes[0].set_title("OV strength")
    axes[1].set_title("QK strength")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse_ratios(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--ratios: expected comma-separated numbers, got {text!r}") from None
    if not vals:
        raise ValueError("--ratios: empty list")
    return vals


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Integrate the reduced QK/OV gradient-flow ODE (spec §3).")
    p.add_argument("--ratios", default="0.01,0.1,1,10,100", help="comma-separated eta_QK/eta_OV ratios")
    p.add_argument("--out", required=True, help="CSV path: ratio,loss,t,mu_ov,mu_qk,alpha")
    p.add_argument("--plot", default=None, help="optional PNG path for the mu_OV / mu_QK plot")
    p.add_argument("--dtau", type=float, default=10.0)
    args = p.parse_args(argv)
    try:
        ratios = _parse_ratios(args.ratios)
        ro = integrate(ratios, dtau=args.dtau)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_csv(ro, args.out)
    if args.plot:
        plot(ro, args.plot)
    for i, r in enumerate(ro.ratios):
        j = -1
        print(f"ratio={r:g} reached={bool(ro.reached[i])} t={ro.t[i, j]:.4g} mu_ov={ro.mu_ov[i, j]:.4g} "
              f"mu_qk={ro.mu_qk[i, j]:.4g} alpha={ro.alpha[i, j]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
